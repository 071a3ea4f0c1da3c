"""Service throughput with and without metrics (issue 5: metrics may cost <= 5%).

64 concurrent callers (threads, 8 channels) send Matmul requests of N=1 to an in-process worker
for a fixed time; the two modes alternate to even out drift. Prints one Markdown table row per
(weight shape, mode) and the overhead.

    .venv/bin/python bench/service_metrics_overhead.py [--backend numpy] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
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


def run_once(backend_name: str, metrics: bool, rows: int, k: int, seconds: float) -> float:
    """Requests per second of one mode."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cfg = WorkerConfig(port=0, vram_budget=Budget(fraction=0.5), metrics_enabled=metrics,
                       metrics_port=0 if metrics else None)
    worker = Worker(cfg, make_backend(backend_name), CollectorRegistry())
    asyncio.run_coroutine_threadsafe(worker.start(), loop).result(60)
    clients = [Client(worker.target) for _ in range(8)]
    clients[0].upload("w", _blocks(rows, k), rows, k)
    x = np.ones((1, k), np.float32)
    for c in clients:
        c.matmul("w", x)
    stop = time.perf_counter() + seconds
    counts = [0] * CALLERS

    def caller(i: int) -> None:
        c = clients[i % len(clients)]
        while time.perf_counter() < stop:
            c.matmul("w", x)
            counts[i] += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=caller, args=(i,)) for i in range(CALLERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rate = sum(counts) / (time.perf_counter() - t0)
    for c in clients:
        c.close()
    asyncio.run_coroutine_threadsafe(worker.stop(1.0), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shapes", default="256x256,4096x4096")
    args = ap.parse_args()
    print("| backend | weight | metrics off (req/s) | metrics on (req/s) | overhead |")
    print("|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        rows, k = (int(v) for v in shape.split("x"))
        rates: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for mode in (False, True):
                rates[mode].append(run_once(args.backend, mode, rows, k, args.seconds))
        off, on = statistics.median(rates[False]), statistics.median(rates[True])
        print(f"| {args.backend} | {rows}x{k} | {off:.0f} | {on:.0f} | "
              f"{(off - on) / off * 100:+.1f}% |", flush=True)


if __name__ == "__main__":
    main()
