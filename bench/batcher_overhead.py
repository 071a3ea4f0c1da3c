"""Cost of the service core per request without gRPC: one caller, sequential submits through
Engine-less Batcher + Device with a no-op kernel (issue 9: batching must add ~0 when idle).

    .venv/bin/python bench/batcher_overhead.py [--calls 3000] [--rounds 5] [--engine]
Prints p50 µs of submit -> result and of queue_seconds (enqueue -> device job start).
``--engine``: the worker's whole in-process path instead, as the servicer runs it: a
serialized MatmulRequest parsed and decoded (wire), Engine.start_matmul (checks, registry,
batcher, device thread, NumPy backend on a 4 x 256 weight), the reply encoded and serialized
(issue 14: the hot path from decoded request to kernel and back, gRPC excluded).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

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


async def _engine_round(calls: int, deadline: float | None = None) -> tuple[float, float]:
    from q6serve.kernels.backends import make_backend
    from q6serve.service import wire
    from q6serve.service.config import WorkerConfig
    from q6serve.service.engine import Engine, UploadSpec
    from q6serve.v1 import q6serve_pb2 as pb

    rows, k = 4, 256
    eng = Engine(make_backend("numpy"), WorkerConfig(max_batch_delay_us=0))
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(rows, 210), dtype=np.uint8)
    blocks[:, 208:210] = np.full((rows, 1), 1e-3, np.float16).view(np.uint8)
    data = blocks.tobytes()

    async def once() -> Any:
        yield data

    import hashlib

    await eng.upload(UploadSpec("w", rows, k, "q6_k", len(data),
                                hashlib.sha256(data).hexdigest()), once())
    req = pb.MatmulRequest(weight="w", out_dtype=pb.DTYPE_F32)
    req.x.dtype = pb.DTYPE_F16
    req.x.shape.extend((1, k))
    req.x.data = np.ones((1, k), np.float16).tobytes()
    raw = req.SerializeToString()
    lat, queue = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        msg = pb.MatmulRequest.FromString(raw)
        call = wire.matmul_call(msg, deadline)
        took = wire.Took(t0, time.perf_counter())
        reply = await eng.matmul(call)
        wire.matmul_response(reply, msg.request_id, took).SerializeToString()
        lat.append(time.perf_counter() - t0)
        queue.append(reply.queue_seconds)
    await eng.close()
    return statistics.median(lat) * 1e6, statistics.median(queue) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--deadline", type=float, default=None,
                    help="per-request timeout in seconds, as a gRPC deadline passes it")
    ap.add_argument("--engine", action="store_true",
                    help="time the worker's in-process path (wire + Engine + NumPy backend)")
    a = ap.parse_args()
    fn = _engine_round if a.engine else _round
    res = [asyncio.run(fn(a.calls, a.deadline)) for _ in range(a.rounds)]
    lat = statistics.median(r[0] for r in res)
    q = statistics.median(r[1] for r in res)
    print(f"submit->result p50 {lat:.1f} us, queue p50 {q:.1f} us "
          f"(median of {a.rounds} rounds x {a.calls} calls)")


if __name__ == "__main__":
    main()
