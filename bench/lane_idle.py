"""What idle lanes cost a worker: its CPU while LANES lanes are open and nobody calls.

Starts ``q6serve worker --allow-shm`` with ``Q6SERVE_LANE_RING=1`` (so both kinds of lane can
be opened on one worker), uploads a small weight, then per phase (alternated as --phases
says: ``none``, ``sock``, ``ring``) opens LANES lanes on fresh regions (``sock``: over the
lane's Unix socket; ``ring``: over a shared-memory ring, the worker polling it and capping its
sleeps at 5 ms while one is open), makes one call on each, lets the worker's busy poll wind
down (--settle s), and reads the worker process's CPU (utime + stime, all its threads) and
context switches (voluntary + not, all threads) over --seconds with nobody calling. Then the
lanes and regions are closed. ``none``: no lane open (the worker's own idle cost: its metrics
poll and so on). The ring's figure less none's is what the ring's wake-ups cost an idle worker.

    python bench/lane_idle.py --backend numpy --seconds 2 --phases none,sock,ring,ring,sock,none
    python bench/lane_idle.py --backend cuda --rows 3584 --k 18944 --json "$OUT/idle.json"
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from service import random_q6k, start_worker  # bench/ is sys.path[0]


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def switches(pid: int) -> int:
    """Context switches (voluntary + not) of every thread of ``pid`` so far."""
    n = 0
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (t / "status").read_text()
        except OSError:  # (a thread gone)
            continue
        for line in text.splitlines():
            if "ctxt_switches:" in line:
                n += int(line.split()[-1])
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numpy", choices=("numpy", "cuda"))
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--k", type=int, default=3584)
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=2.0, help="each phase's idle window")
    ap.add_argument("--settle", type=float, default=0.3,
                    help="s after the lanes' calls before the window (the busy poll's end)")
    ap.add_argument("--phases", default="none,sock,ring,ring,sock,none")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from q6serve.client.client import Client

    phases = [p for p in a.phases.split(",") if p]
    if any(p not in ("none", "sock", "ring") for p in phases):
        ap.error("--phases takes none, sock and ring")
    os.environ["Q6SERVE_LANE_RING"] = "1"  # (the worker, a child, takes ring lanes)
    out_dir = a.json.parent if a.json else Path("/tmp")
    out_dir.mkdir(parents=True, exist_ok=True)
    worker = start_worker(a.backend, out_dir / "worker_idle.log", ["--allow-shm"])
    pid = worker.proc.pid
    x = np.random.default_rng(0).standard_normal((1, a.k)).astype(np.float16)
    runs: list[dict[str, Any]] = []
    try:
        with Client(worker.target) as c:
            c.upload("w", random_q6k(a.rows, a.k, 1), a.rows, a.k)
            for i, phase in enumerate(phases):
                regions, lanes = [], []
                try:
                    if phase != "none":
                        for j in range(a.lanes):
                            r = c.register_shm(f"idle{i}_{j}", 1 << 20)
                            regions.append(r)
                            ln = c.open_lane(r, ring=phase == "ring")
                            lanes.append(ln)
                            assert ln.ring == (phase == "ring")
                            ln.matmul("w", x, y_offset=1 << 19)
                    time.sleep(a.settle)
                    c0, s0, t0 = cpu_seconds(pid), switches(pid), time.perf_counter()
                    time.sleep(a.seconds)
                    c1, s1, t1 = cpu_seconds(pid), switches(pid), time.perf_counter()
                finally:
                    for ln in lanes:
                        ln.close()
                    for r in regions:
                        r.close()
                span = t1 - t0
                run = {"phase": phase, "lanes": len(lanes), "seconds": span,
                       "cpu_share": (c1 - c0) / span, "switches_per_s": (s1 - s0) / span}
                runs.append(run)
                n = sum(r["phase"] == phase for r in runs)
                print(f"idle {phase:<4} #{n}  lanes {len(lanes):2d}  worker CPU "
                      f"{run['cpu_share'] * 100:6.2f}% of a core  switches "
                      f"{run['switches_per_s']:8.0f}/s  over {span:.2f} s", flush=True)
                time.sleep(0.2)  # (the worker lets the closed lanes go)
    finally:
        worker.stop()
    med = {p: {k: float(np.median([r[k] for r in runs if r["phase"] == p]))
               for k in ("cpu_share", "switches_per_s")}
           for p in dict.fromkeys(r["phase"] for r in runs)}
    print("idle medians: " + "  ".join(
        f"{p} {m['cpu_share'] * 100:.2f}% {m['switches_per_s']:.0f}/s" for p, m in med.items()),
        flush=True)
    if a.json:
        a.json.write_text(json.dumps({"runs": runs, "medians": med, "lanes": a.lanes}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
