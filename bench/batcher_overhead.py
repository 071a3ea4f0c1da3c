"""Cost of the service core per request without gRPC: one caller, sequential submits through
Engine-less Batcher + Device with a no-op kernel (issue 9: batching must add ~0 when idle).

    .venv/bin/python bench/batcher_overhead.py [--calls 3000] [--rounds 5]
Prints p50 µs of submit -> result and of queue_seconds (enqueue -> device job start).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np

from q6serve.kernels.api import KernelTiming, Layout, MatmulResult, Precision
from q6serve.service.batcher import Batcher, BatchKey, BatchSettings, Device


def _run(x: np.ndarray, key: BatchKey) -> MatmulResult:
    return MatmulResult(x, "noop", Layout.SOA, Precision.EXACT, KernelTiming(host_seconds=0.0))


async def _round(calls: int, deadline: float | None = None) -> tuple[float, float]:
    dev = Device("bench")
    b = Batcher("w", dev, _run, BatchSettings(), lambda: True, lambda s: None)
    key = BatchKey("f32", Precision.EXACT, "f32")
    x = np.ones((1, 256), np.float32)
    lat, queue = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        out = await b.submit(x, key, deadline)
        lat.append(time.perf_counter() - t0)
        queue.append(out.queue_seconds)
    await b.close()
    dev.close()
    return statistics.median(lat) * 1e6, statistics.median(queue) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--deadline", type=float, default=None,
                    help="per-request timeout in seconds, as a gRPC deadline passes it")
    a = ap.parse_args()
    res = [asyncio.run(_round(a.calls, a.deadline)) for _ in range(a.rounds)]
    lat = statistics.median(r[0] for r in res)
    q = statistics.median(r[1] for r in res)
    print(f"submit->result p50 {lat:.1f} us, queue p50 {q:.1f} us "
          f"(median of {a.rounds} rounds x {a.calls} calls)")


if __name__ == "__main__":
    main()
