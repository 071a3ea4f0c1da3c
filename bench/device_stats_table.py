"""The device process's load under a run, from its ``Q6SERVE_DP_STATS`` file (service/frontends.py
``_DeviceStats``: one JSON line of cumulative counters a second): per file ``dpstats_TAG.jsonl``
in DIR, the one-second window with the most calls (the timed part of a short bench run), as one
row: calls a second, the loop's busy share (1 - time blocked in epoll), the process's CPU a call,
loop iterations a call, socket reads a call, and each thread's cores.

    python3 bench/device_stats_table.py DIR
"""

from __future__ import annotations

import glob
import itertools
import json
import sys
from pathlib import Path
from typing import Any

CALLS = ("msg_rm", "msg_mm", "msg_call")


def calls(d: dict[str, Any]) -> float:
    return float(sum(d.get(k, 0) for k in CALLS))


def busiest(lines: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The window between two consecutive lines with the most calls, as deltas (None: fewer
    than two lines)."""
    best: dict[str, Any] | None = None
    for a, b in itertools.pairwise(lines):
        dt = b["t"] - a["t"]
        if dt <= 0:
            continue
        w = {"dt": dt, "calls": calls(b) - calls(a),
             "cpu_s": b["cpu_s"] - a["cpu_s"], "select_s": b["select_s"] - a["select_s"],
             "loops": b["loop_iterations"] - a["loop_iterations"],
             "reads": b.get("socket_reads", 0) - a.get("socket_reads", 0),
             "pipelined": b["pipelined_batches"] - a["pipelined_batches"],
             "wait_s": b["pipelined_wait_s"] - a["pipelined_wait_s"],
             "threads": {k.split(":", 1)[1]: (v - a["threads_cpu_s"].get(k, v)) / dt
                         for k, v in b["threads_cpu_s"].items()}}
        if best is None or w["calls"] / dt > best["calls"] / best["dt"]:
            best = w
    return best


def row(tag: str, w: dict[str, Any]) -> str:
    n = max(w["calls"], 1.0)
    threads = ", ".join(f"{k} {v:.2f}" for k, v in sorted(w["threads"].items(),
                                                          key=lambda kv: -kv[1])[:3])
    return (f"# {tag:8} {w['calls'] / w['dt']:>9,.0f} calls/s  loop busy "
            f"{1 - w['select_s'] / w['dt']:.2f}  CPU {1e6 * w['cpu_s'] / n:6.1f} us/call  "
            f"loops/call {w['loops'] / n:.2f}  reads/call {w['reads'] / n:.2f}  pipelined "
            f"{w['pipelined'] / n:.2f} (wait {1e6 * w['wait_s'] / n:.1f} us/call)  "
            f"cores: {threads}")


def main(argv: list[str] | None = None) -> int:
    out = (argv or sys.argv[1:])[0]
    for path in sorted(glob.glob(f"{out}/dpstats_*.jsonl")):
        lines = [json.loads(s) for s in Path(path).read_text().splitlines() if s.strip()]
        w = busiest(lines)
        tag = Path(path).stem[len("dpstats_"):]
        print(row(tag, w) if w else f"# {tag:8} fewer than two lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
