"""The device process's load under a run, from its ``Q6SERVE_DP_STATS`` file (service/frontends.py
``_DeviceStats``: one JSON line of cumulative counters a second): per file ``dpstats_TAG.jsonl`` in
DIR, the one-second window with the most calls (front-end messages and fast-lane requests: the timed
part of a short bench run), as one row: calls a second, the loop's busy share (1 - time blocked in
epoll), the process's CPU a call, loop iterations a call, socket reads a call, the share of calls
launched pipelined and as their place's graph (``place``), the full system-region calls' shares
(``sys``: launched through the pipeline, of them by their region's plan, and queued; only where
there were any), and each thread's cores. With --stages, a second line per file: each timed stage's
wall time a call (us) and how many times a call it ran (``st_*`` counters, ``_DeviceStats._stages``;
a stage's time includes the stages it calls), and the loop's busy time a call left outside the
top-level stages (asyncio's own share; a lane's record parsing and a trip's ``lane_flush`` run on
its own are in it too).

    python3 bench/device_stats_table.py DIR [--stages]
"""

from __future__ import annotations

import glob
import itertools
import json
import sys
from pathlib import Path
from typing import Any

# (a fast lane's request is a call too: ``lane_requests``, none before session 25)
CALLS = ("msg_rm", "msg_mm", "msg_call", "lane_requests")


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
             # (CUDA-region calls launched as their place's graph; 0 before session 21)
             "place": b.get("place_launches", 0) - a.get("place_launches", 0),
             # (merged batches on the direct path, and of them those whose x the backend took
             # from the calls' pinned slots; no column before session 22)
             "merged": b.get("merged_requests", 0) - a.get("merged_requests", 0),
             "gathered": b.get("gathered_batches", 0) - a.get("gathered_batches", 0),
             # (full system-region calls launched through the pipeline, of them by their
             # region's plan, and queued to the batcher; no column before session 25)
             **{k: b.get(f"sys_{k}", 0) - a.get(f"sys_{k}", 0)
                for k in ("launched", "planned", "queued")},
             "threads": {k.split(":", 1)[1]: (v - a["threads_cpu_s"].get(k, v)) / dt
                         for k, v in b["threads_cpu_s"].items()},
             "stages": {k: b[k] - a.get(k, 0.0) for k in b if k.startswith("st_")}}
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
            f"{w['pipelined'] / n:.2f} (wait {1e6 * w['wait_s'] / n:.1f} us/call)  place "
            f"{w.get('place', 0) / n:.2f}  "
            + (f"merged {w['merged'] / n:.2f} (gathered {w['gathered'] / n:.2f})  "
               if w.get("merged") else "")
            + (f"sys {w['launched'] / n:.2f} (planned {w['planned'] / n:.2f}, queued "
               f"{w['queued'] / n:.2f})  " if w.get("launched") or w.get("queued") else "")
            + f"cores: {threads}")


def stages_row(tag: str, w: dict[str, Any]) -> str:
    """The stages' us a call (and runs a call), largest first; ``other``: the loop's busy
    time a call outside the top-level stages a loop trip runs (read, flush_calls, tick): asyncio's
    own share, the scheduled answer flushes and the counters' own tick."""
    n = max(w["calls"], 1.0)
    st = w["stages"]
    names = [k[3:-2] for k in st if k.endswith("_s")]
    if not names:
        return f"# {tag:8} stages: none counted"
    busy = w["dt"] - w["select_s"]
    # (a top-level stage may also run inside another: out_flush inside flush_calls' flush_now)
    # (a lane's records are read by its own connection: lane_request is its top-level stage,
    # lane_flush runs inside it or on its own a trip later; lane_answer runs in a tick's or
    # flush_calls' settle, or in lane_flush)
    top = (st.get("st_read_s", 0.0) + st.get("st_flush_calls_s", 0.0) + st.get("st_tick_s", 0.0)
           + st.get("st_lane_request_s", 0.0))
    parts = sorted(names, key=lambda k: -st[f"st_{k}_s"])
    cells = "  ".join(f"{k} {1e6 * st[f'st_{k}_s'] / n:.1f} ({st.get(f'st_{k}_n', 0) / n:.2f})"
                      for k in parts)
    return (f"# {tag:8} stages us/call (runs/call): busy {1e6 * busy / n:.1f}  "
            f"other {1e6 * (busy - top) / n:.1f}  {cells}")


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    out, stages = args[0], "--stages" in args[1:]
    for path in sorted(glob.glob(f"{out}/dpstats_*.jsonl")):
        lines = [json.loads(s) for s in Path(path).read_text().splitlines() if s.strip()]
        w = busiest(lines)
        tag = Path(path).stem[len("dpstats_"):]
        print(row(tag, w) if w else f"# {tag:8} fewer than two lines")
        if w and stages:
            print(stages_row(tag, w))
    return 0


if __name__ == "__main__":
    sys.exit(main())
