"""What a machine gives a Python process right now, in ~2 s (issue 14, T1's first run on a fresh
machine): the closing checks of sessions 21 and 22 read T1 at 780 / 748 us beyond the kernel on
a machine a minute old and 392-535 / 435 minutes later, every CPU part of the call slower at
once (the caller's encode too, the kernel not). Run at a script's start and again later, this
says which of the machine's resources was slower at first:

- ``cpu``: a pure-Python loop on each core in turn (the process pinned there), ns an iteration:
  the cores' speed (a host's other tenants, SMT siblings the guest cannot see, clocks);
- ``touch``: anonymous memory written one byte a 4 KiB page (us a page), first in a new mapping
  (the guest kernel zeroes each page: on a VM whose memory the host backs lazily, a page the
  guest never touched costs the host's fault as well), again in the same mapping (the TLB and
  caches only), in a second mapping of the same size after the first is unmapped (pages the
  guest just freed, likely backed), and the GB/s of a copy between touched buffers;
- ``wake``: a one-byte pipe ping-pong between two processes, p50 / p90 us a round trip (the
  sleeps and wake-ups a gRPC call makes on both sides).

    python3 bench/machine_probe.py --label start [--json out.json] [--touch-mib 256]

Prints one line per part and a summary line "probe LABEL: ..."; the JSON gets every figure.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

PAGE = 4096


def _spin(n: int) -> int:
    s = 0
    for i in range(n):
        s += i & 7
    return s


def cpu_ns(iters: int = 100_000, reps: int = 5) -> dict[str, Any]:
    """Per core this process may use: the best of ``reps`` runs of the loop, ns an iteration."""
    cores = sorted(os.sched_getaffinity(0))
    per: dict[int, float] = {}
    try:
        for c in cores:
            os.sched_setaffinity(0, {c})
            best = float("inf")
            for _ in range(reps):
                t = time.perf_counter()
                _spin(iters)
                best = min(best, time.perf_counter() - t)
            per[c] = best / iters * 1e9
    finally:
        os.sched_setaffinity(0, cores)
    v = np.array(list(per.values()))
    return {
        "per_core_ns": per,
        "min_ns": float(v.min()),
        "median_ns": float(np.median(v)),
        "max_ns": float(v.max()),
    }


def _touch(buf: Any, pages: int) -> float:
    """Seconds to write one byte of each page of ``buf``."""
    a = np.frombuffer(buf, np.uint8, pages * PAGE)
    t = time.perf_counter()
    a[::PAGE] = 1
    return time.perf_counter() - t


def touch_us(mib: int) -> dict[str, float]:
    """us a page: first touch of a new mapping, again, a second new mapping; copy GB/s."""
    size = mib << 20
    pages = size // PAGE
    m1 = mmap.mmap(-1, size)
    first = _touch(m1, pages)
    again = _touch(m1, pages)
    m1.close()
    m2 = mmap.mmap(-1, size)
    second = _touch(m2, pages)
    m2.close()
    src = np.ones(16 << 20, np.uint8)  # 16 MiB, touched; the copy's target touched first
    dst = np.zeros_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return {
        "first_us": first / pages * 1e6,
        "again_us": again / pages * 1e6,
        "second_map_us": second / pages * 1e6,
        "copy_gbs": src.nbytes / best / 1e9,
        "mib": float(mib),
    }


def wake_us(rounds: int = 3000) -> dict[str, float]:
    """A pipe ping-pong with a child process: p50 / p90 us a round trip."""
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: echo every byte back, then leave at once
        try:
            os.close(w1)
            os.close(r2)
            while os.read(r1, 1):
                os.write(w2, b"x")
        finally:
            os._exit(0)
    os.close(r1)
    os.close(w2)
    rt = np.empty(rounds)
    try:
        for i in range(rounds):
            t = time.perf_counter()
            os.write(w1, b"x")
            os.read(r2, 1)
            rt[i] = time.perf_counter() - t
    finally:
        os.close(w1)
        os.close(r2)
        os.waitpid(pid, 0)
    rt = rt[rounds // 10 :] * 1e6  # the first tenth: warm-up
    return {"p50_us": float(np.percentile(rt, 50)), "p90_us": float(np.percentile(rt, 90))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="probe")
    ap.add_argument("--touch-mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=100_000, help="the CPU loop's iterations")
    ap.add_argument("--rounds", type=int, default=3000, help="the ping-pong's round trips")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    doc: dict[str, Any] = {
        "label": a.label,
        "unix_time": time.time(),
        "uptime_s": float(Path("/proc/uptime").read_text().split()[0]),
        "load1": os.getloadavg()[0],
    }
    doc["cpu"] = cpu_ns(a.iters)
    doc["touch"] = touch_us(a.touch_mib)
    doc["wake"] = wake_us(a.rounds)
    doc["seconds"] = time.perf_counter() - t0
    c, m, w = doc["cpu"], doc["touch"], doc["wake"]
    slow = sorted(c["per_core_ns"].items(), key=lambda kv: -kv[1])[:3]
    print(
        f"# {a.label} cpu loop ns an iteration per core: "
        + " ".join(f"{k}:{v:.1f}" for k, v in c["per_core_ns"].items()),
        flush=True,
    )
    print(
        f"probe {a.label}: up {doc['uptime_s']:.0f} s load {doc['load1']:.2f} | cpu ns "
        f"{c['min_ns']:.1f}/{c['median_ns']:.1f}/{c['max_ns']:.1f} (slowest cores "
        + ",".join(f"{k}" for k, _ in slow)
        + f") | touch us/page first {m['first_us']:.2f} again {m['again_us']:.3f} "
        f"second map {m['second_map_us']:.2f} | copy {m['copy_gbs']:.1f} GB/s | wake p50 "
        f"{w['p50_us']:.1f} p90 {w['p90_us']:.1f} us | {doc['seconds']:.1f} s",
        flush=True,
    )
    if a.json is not None:
        a.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
