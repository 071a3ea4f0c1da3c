"""The fast lane caller's own CPU a call (client/lane.py ``Lane.matmul``), with no worker.

The lane's stretch figure (one caller N=1, p50 - kernel) counts the caller's own part: x put
into its region, the record packed and written, the reply read and unpacked, y's view
(bench/lane_latency.py --stamps: "client pre" and "client post"). This times ``Lane.matmul``
alone: a lane on a socketpair whose reply is sent before each call (the read returns at once),
x an f16 array of 1 x K (the stretch's ffn_down) copied into a real shm region each call.

    python bench/lane_client_cpu.py                 # 3 runs of 20,000 calls, medians
    python bench/lane_client_cpu.py --k 3584 --calls 5000
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import numpy as np

from q6serve.client import lane as lane_mod
from q6serve.client.shm import ShmRegion


def fake_lane(region: ShmRegion, sock: socket.socket) -> lane_mod.Lane:
    """A Lane on ``sock`` without a worker's ticket (the attributes __init__ sets)."""
    lane = object.__new__(lane_mod.Lane)
    lane.region, lane.path, lane.spin_us = region, "", 1000.0
    lane.spun = lane.slept = 0
    lane._codes, lane._views = {}, {}
    lane.sock = sock
    sock.settimeout(5.0)
    lane._seq = 0
    lane._head = bytearray(lane_mod.REPLY.size)
    for attr, v in (("_last", None), ("_xs", {})):  # (a client of either kind)
        setattr(lane, attr, v)
    if not isinstance(getattr(lane_mod.Lane, "last", None), property):
        lane.last = None  # type: ignore[misc]
    return lane


def run(calls: int, k: int) -> float:
    region = ShmRegion.create(f"lanecpu{time.monotonic_ns()}", 1 << 22)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        lane = fake_lane(region, a)
        x = np.random.default_rng(0).standard_normal((1, k)).astype(np.float16)
        rep, now, ts = lane_mod.REPLY.pack, time.perf_counter, []
        for i in range(calls):
            b.send(rep(i + 1, 0, 0, 3584, 1, 1, 0, 0.0, 2e-5, 4e-5))
            t0 = now()
            lane.matmul("w", x, y_offset=1 << 21)
            ts.append(now() - t0)
            b.recv(4096)
        lane.close()
    finally:
        a.close()
        b.close()
        region.close()
    return statistics.median(ts[calls // 5:]) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--k", type=int, default=18944)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    meds = [run(a.calls, a.k) for _ in range(a.runs)]
    print("lane.matmul, the caller's own part (reply pre-sent), median us a call: "
          + " / ".join(f"{m:.2f}" for m in meds))


if __name__ == "__main__":
    main()
