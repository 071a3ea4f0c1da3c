"""The device thread's cost per batch without gRPC, front ends or IPC (issue 15's breakdown).

The H200 runs of issue 15 (bench/RESULTS.md) found the device thread to be the limit: a T2
batch (~23 rows of N=1 callers) held it ~4 ms of host time around a 55 µs kernel, a T3 batch
(N=64) ~0.55 ms around 80 µs. This probe runs the worker's Engine in-process with the same
load shapes and nothing else on the loop (C coroutines calling ``Engine.matmul`` closed-loop),
so its figures say how much of that is the device path itself and how much the contention
with the serving process's event loop:

``--callers 64 --n 1`` is T2's shape (batches of varying N: on CUDA a graph is bound and
captured per distinct N, one suspect for T2's cost), ``--callers 8 --n 64`` T3's.

Prints rows/s, batches/s and per-batch p50 of the device job, its kernel and the rest.

    python bench/device_path.py --backend numpy --rows 512 --k 3584 --seconds 2
    python bench/device_path.py --backend cuda --callers 64 --n 1 --json "$OUT/dev_t2.json"
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


async def run(a: argparse.Namespace) -> dict[str, Any]:
    from q6serve.kernels import q6k
    from q6serve.kernels.api import Precision
    from q6serve.kernels.backends import make_backend
    from q6serve.service.config import WorkerConfig
    from q6serve.service.engine import Engine
    from q6serve.service.engine_types import MatmulCall, UploadSpec

    cfg = WorkerConfig(max_batch_rows=64)
    if a.inline_us is not None:
        cfg = dataclasses.replace(cfg, inline_device_us=a.inline_us)
    eng = Engine(make_backend(a.backend), cfg)
    data = q6k.random_blocks(a.rows, a.k, np.random.default_rng(1)).tobytes()

    async def once() -> Any:
        yield data

    await eng.upload(UploadSpec("w", a.rows, a.k, "q6_k", len(data),
                                hashlib.sha256(data).hexdigest()), once())
    prec = Precision(a.precision)
    x = np.random.default_rng(0).standard_normal((a.n, a.k)).astype(np.float16)
    for m in (1, 2, 4, 8, 16, 32, 64):  # every launch-shape bucket bound before timing
        await eng.matmul(MatmulCall("w", np.ones((m, a.k), np.float16), prec))
    batches: set[tuple[float, float, int]] = set()  # a batch's requests share these figures
    stop = [time.perf_counter() + a.warmup]
    rows = [0]

    async def caller() -> None:
        while time.perf_counter() < stop[0]:
            r = await eng.matmul(MatmulCall("w", x, prec))
            if a.timed:
                rows[0] += a.n
                batches.add((r.device_seconds or 0.0, r.kernel_seconds or 0.0, r.batch_rows))

    a.timed = False
    await asyncio.gather(*(caller() for _ in range(a.callers)))
    a.timed = True
    stop[0] = time.perf_counter() + a.seconds
    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(a.callers)))
    wall = time.perf_counter() - t0
    await eng.close()
    dev = np.array([b[0] for b in batches])
    ker = np.array([b[1] for b in batches])
    br = np.array([b[2] for b in batches])
    return {"backend": a.backend, "rows": a.rows, "k": a.k, "callers": a.callers, "n": a.n,
            "inline_device_us": cfg.inline_device_us,
            "inline_jobs": eng.device.inline_jobs, "jobs": eng.device.jobs,
            "rows_per_s": rows[0] / wall, "batches_per_s": len(dev) / wall,
            "batch_rows_mean": float(br.mean()) if br.size else 0.0,
            "device_job_p50_us": float(np.median(dev) * 1e6) if dev.size else 0.0,
            "kernel_p50_us": float(np.median(ker) * 1e6) if ker.size else 0.0,
            "device_other_p50_us": float(np.median(dev - ker) * 1e6) if dev.size else 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numpy", choices=("numpy", "cuda"))
    ap.add_argument("--rows", type=int, default=3584)
    ap.add_argument("--k", type=int, default=18944)
    ap.add_argument("--callers", type=int, default=64)
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--precision", default="f16", choices=("auto", "exact", "f16", "q8_1"))
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--inline-us", type=int, default=None,
                    help="the worker's --inline-device-us (default: the worker's)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    r = asyncio.run(run(a))
    print(f"in-process {a.backend} {a.callers} callers N={a.n} inline<={r['inline_device_us']}us"
          f" ({r['inline_jobs']}/{r['jobs']} jobs): {r['rows_per_s']:,.0f} rows/s, "
          f"{r['batches_per_s']:,.0f} batches/s of {r['batch_rows_mean']:.1f} rows; per batch "
          f"p50: device job {r['device_job_p50_us']:.0f} us = kernel "
          f"{r['kernel_p50_us']:.0f} + other {r['device_other_p50_us']:.0f}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
