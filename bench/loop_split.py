"""T1's worker-side parts in process (issue 14, target T1): the worker's interceptor and
MatmulStream handler over the real Engine on a no-op NumPy backend (bench/stream_overhead.py's
``_inproc`` "engine" variant: no gRPC, no kernel), one request in flight, T1's request (K=18944
f16 x, a 3584-row f32 y). Each reply's own timing splits the call as bench/service.py does:

  decode   the message taken by the interceptor -> the engine's call decoded (server_decode)
  device   the direct job (device_other here: the kernel is a no-op)
  other    the rest of the handler up to the reply's handler stamp (server_other)
  handler  their sum; outside: the call's round trip here minus the handler (the interceptor's
           reading and writing, the reply's last copy, this harness)

Medians over ``--calls`` calls after ``--warmup``. A/B two trees by running this file with
PYTHONPATH pointing at each in turn (alternated pairs, medians: the VM is shared), e.g.

    mkdir -p /tmp/base/q6serve && git archive main | tar x -C /tmp/base/q6serve
    PYTHONPATH=/tmp/base .venv/bin/python bench/loop_split.py; .venv/bin/python bench/loop_split.py
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import namedtuple
from typing import Any

import numpy as np
import stream_overhead as so  # bench/ is sys.path[0]

K, ROWS = 18944, 3584


async def split(calls: int, warmup: int, k: int = K, rows: int = ROWS) -> dict[str, float]:
    """Median us of each part (see the module docstring) over ``calls`` calls."""
    import grpc
    from prometheus_client import CollectorRegistry

    from q6serve.service import wire, wire_requests
    from q6serve.service.interceptor import ErrorInterceptor
    from q6serve.service.metrics import Metrics
    from q6serve.service.servicer import Q6ServeServicer
    from q6serve.v1 import q6serve_pb2 as pb

    req = so._request(k, 4)  # f32 y, as bench/service.py's T1
    worker = await so._noop_worker(rows, k)
    inner = grpc.stream_stream_rpc_method_handler(
        Q6ServeServicer(worker.engine).MatmulStream,
        request_deserializer=wire_requests.read_matmul_request,
        response_serializer=wire._bytes_or(pb.MatmulStreamResponse.SerializeToString))
    details = namedtuple("Details", "method invocation_metadata")(so.METHOD, ())

    async def continuation(_: Any) -> Any:
        return inner

    metrics = Metrics(CollectorRegistry(), version="bench", backend="numpy", device="cpu")
    handler = await ErrorInterceptor(metrics).intercept_service(continuation, details)
    incoming: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def requests() -> Any:
        while (raw := await incoming.get()) is not None:
            yield raw

    ctx = so._Context()

    async def run() -> None:
        async for item in handler.stream_stream(requests(), ctx):
            await ctx.write(item)

    runner = asyncio.get_running_loop().create_task(run())
    serialize = handler.response_serializer
    got = []
    for i in range(warmup + calls):
        t0 = time.perf_counter()
        incoming.put_nowait(req)
        raw = serialize(await ctx.written.get())
        t1 = time.perf_counter()
        if i >= warmup:
            tm = pb.MatmulStreamResponse.FromString(raw).result.timing
            got.append((t1 - t0, tm.decode_seconds, tm.device_seconds, tm.handler_seconds))
    incoming.put_nowait(None)
    await runner
    await worker.stop()
    e2e, dec, dev, hdl = (np.array(got) * 1e6).T
    return {"e2e": float(np.median(e2e)), "decode": float(np.median(dec)),
            "device": float(np.median(dev)), "other": float(np.median(hdl - dec - dev)),
            "handler": float(np.median(hdl)), "outside": float(np.median(e2e - hdl))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=500)
    a = ap.parse_args(argv)
    r = asyncio.run(split(a.calls, a.warmup))
    print("  ".join(f"{name} {v:.1f}" for name, v in r.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
