"""A multi-weight call's per-request Python on the worker's loop, in process (issue 14, the replay).

One MatmulStream caller, one request in flight, driven through the worker's interceptor,
Q6ServeServicer.MatmulStream and the real Engine over a no-op NumPy backend (y zeros, kernel 0:
bench/batcher_overhead.py's), no gRPC: a request of one f16 row of K=3584 on ``--weights`` (the
replay's q/k/v: 3584, 512 and 512 rows), each answered on the direct path once the first has
measured the parts' costs. Prints p50 us per request and this thread's CPU per request over
``--calls`` requests after ``--warmup``. Alternate trees through PYTHONPATH for an A/B
(bench/gpu_lib.sh's base_tree shows how to point it at another tree's q6serve).

  .venv/bin/python bench/loop_multi.py [--weights q,k,v] [--calls 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROWS = {"q": 3584, "k": 512, "v": 512, "gate": 18944, "up": 18944}


async def run(weights: list[str], calls: int, warmup: int, k: int = 3584) -> dict[str, float]:
    from batcher_overhead import _Noop, upload_random
    from stream_overhead import _Context, stream_handler

    from q6serve.service.config import WorkerConfig
    from q6serve.service.servicer import Q6ServeServicer
    from q6serve.service.worker import Worker
    from q6serve.v1 import q6serve_pb2 as pb

    w = Worker(dataclasses.replace(WorkerConfig(), port=0), _Noop())
    await w.start()
    for name in weights:
        await upload_random(w.engine, name, ROWS.get(name, 512), k)
    handler = await stream_handler(Q6ServeServicer(w.engine))
    req = pb.MatmulRequest(request_id="r1", out_dtype=pb.DTYPE_F16)
    if len(weights) > 1:
        req.weights.extend(weights)
    else:
        req.weight = weights[0]
    req.x.dtype = pb.DTYPE_F16
    req.x.shape.extend((1, k))
    req.x.data = np.ones((1, k), np.float16).tobytes()
    raw = req.SerializeToString()
    incoming: asyncio.Queue[bytes | None] = asyncio.Queue()
    ctx = _Context()

    async def requests() -> object:
        while (r := await incoming.get()) is not None:
            yield r

    async def stream() -> None:
        async for item in handler.stream_stream(requests(), ctx):
            await ctx.write(item)

    task = asyncio.ensure_future(stream())
    serialize = handler.response_serializer
    for _ in range(warmup):
        incoming.put_nowait(raw)
        serialize(await ctx.written.get())
    direct0 = w.engine.device.direct_jobs
    c0 = time.thread_time()
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        incoming.put_nowait(raw)
        serialize(await ctx.written.get())
        out.append(time.perf_counter() - t0)
    cpu = time.thread_time() - c0
    direct = w.engine.device.direct_jobs - direct0
    incoming.put_nowait(None)
    await task
    await w.stop()
    return {"p50_us": float(np.percentile(out, 50) * 1e6), "cpu_us": cpu / calls * 1e6,
            "direct_parts": direct}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", default="q,k,v")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=300)
    a = ap.parse_args(argv)
    r = asyncio.run(run(a.weights.split(","), a.calls, a.warmup))
    print(f"{a.weights}: p50 {r['p50_us']:.1f} us  cpu {r['cpu_us']:.1f} us a request  "
          f"direct parts {r['direct_parts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
