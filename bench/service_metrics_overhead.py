"""Service throughput with and without metrics (issue 5: metrics may cost <= 5%).

64 concurrent callers (--procs client processes x threads, so the clients do not share the
worker's GIL) send Matmul requests of N=1 to a worker for a fixed time; the two modes alternate
to even out drift. Prints one Markdown table row per weight shape with the overhead.

    .venv/bin/python bench/service_metrics_overhead.py [--backend numpy] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import threading
import time

import numpy as np
from prometheus_client import CollectorRegistry

from q6serve.client.client import Client
from q6serve.kernels import q6k
from q6serve.kernels.backends import make_backend
from q6serve.service.config import Budget, WorkerConfig
from q6serve.service.worker import Worker

CALLERS = 64


def _blocks(rows: int, k: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    b = rng.integers(0, 256, size=(rows * k // q6k.QK_K, q6k.BLOCK_BYTES), dtype=np.uint8)
    b[:, 208:210] = np.full(b.shape[0], 1e-3, np.float16).view(np.uint8).reshape(-1, 2)
    return b


def _callers(target: str, k: int, threads: int, seconds: float) -> float:
    """One client process: ``threads`` callers for ``seconds``; returns its requests/s."""
    clients = [Client(target) for _ in range(max(1, threads // 8))]
    x = np.ones((1, k), np.float32)
    clients[0].matmul("w", x)
    t0 = time.perf_counter()
    stop = t0 + seconds
    counts = [0] * threads

    def caller(i: int) -> None:
        c = clients[i % len(clients)]
        while time.perf_counter() < stop:
            c.matmul("w", x)
            counts[i] += 1

    ts = [threading.Thread(target=caller, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    rate = sum(counts) / (time.perf_counter() - t0)
    for c in clients:
        c.close()
    return rate


def run_once(backend_name: str, metrics: bool, rows: int, k: int, seconds: float,
             procs: int) -> float:
    """Requests per second of one mode."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cfg = WorkerConfig(port=0, vram_budget=Budget(fraction=0.5), metrics_enabled=metrics,
                       metrics_port=0 if metrics else None)
    worker = Worker(cfg, make_backend(backend_name), CollectorRegistry())
    asyncio.run_coroutine_threadsafe(worker.start(), loop).result(60)
    with Client(worker.target) as c:
        c.upload("w", _blocks(rows, k), rows, k)
        c.matmul("w", np.ones((1, k), np.float32))
    ctx = mp.get_context("spawn")  # no fork after gRPC started
    per = CALLERS // procs
    with ctx.Pool(procs) as pool:
        rate = sum(pool.starmap(_callers, [(worker.target, k, per, seconds)] * procs))
    asyncio.run_coroutine_threadsafe(worker.stop(1.0), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    return rate


def micro(n: int = 200_000) -> None:
    """The metrics' own cost per request, without gRPC noise: what the interceptor and the
    batcher call for every request (one batch of 8 requests per 8 requests here)."""
    from q6serve.kernels.api import KernelTiming, Layout, MatmulResult, Precision
    from q6serve.service.batcher import BatchStats
    from q6serve.service.metrics import Metrics

    m = Metrics(CollectorRegistry(), version="bench", backend="numpy", device="cpu")
    res = MatmulResult(np.zeros((8, 16), np.float32), "numpy.exact", Layout.SOA,
                       Precision.EXACT, KernelTiming(host_seconds=1e-4))
    stats = BatchStats(res, 8, 8, (1e-5,) * 8)
    t0 = time.perf_counter()
    for _ in range(n):
        m.observe_request("q6serve.v1.Q6Serve", "Matmul", "OK", 1e-3)
    t1 = time.perf_counter()
    for _ in range(n // 8):
        m.observe_batch(stats)
    t2 = time.perf_counter()
    per = ((t1 - t0) + (t2 - t1)) / n
    print(f"metrics cost per request: {per * 1e6:.2f} us "
          f"(request series {(t1 - t0) / n * 1e6:.2f} us, batch series {(t2 - t1) / n * 1e6:.2f}"
          " us)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shapes", default="256x256,4096x4096")
    ap.add_argument("--procs", type=int, default=4, help="client processes (64 callers total)")
    ap.add_argument("--micro", action="store_true", help="only the per-request metrics cost")
    args = ap.parse_args()
    if args.micro:
        micro()
        return
    print("| backend | weight | metrics off (req/s) | metrics on (req/s) | overhead |")
    print("|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        rows, k = (int(v) for v in shape.split("x"))
        rates: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for mode in (False, True):
                rates[mode].append(run_once(args.backend, mode, rows, k, args.seconds,
                                             args.procs))
        off, on = statistics.median(rates[False]), statistics.median(rates[True])
        print(f"| {args.backend} | {rows}x{k} | {off:.0f} | {on:.0f} | "
              f"{(off - on) / off * 100:+.1f}% |", flush=True)


if __name__ == "__main__":
    main()
