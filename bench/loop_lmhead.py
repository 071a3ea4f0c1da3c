"""The lm-head target's per-call Python on the worker's loop, in process (issue 14; no gRPC).

``--streams`` closed-loop MatmulStream callers (8) of N=``--n`` (64) f16 rows of K=3584 with the
top-k epilogue (k=64), driven through the worker's interceptor and Q6ServeServicer.MatmulStream
over the real Engine and batcher, on a stub backend shaped like the CUDA lm-head call: its
``launch`` copies x into a pinned-like staging buffer (as the CUDA launcher does) and returns a
wait that sleeps ``--gpu-us`` (330: the H200's kernel + top-k) off the GIL on the device thread,
reporting a kernel of that length (so batches defer: DEFER_KERNEL_US), and a top-k result of
the request's rows. The weight has ``--rows`` rows (any: the stub reads none of it).

Per call: wall, and the loop thread's CPU (``time.thread_time``), over ``--calls`` calls after a
warm-up; ``--profile`` adds cProfile of the loop thread (top functions by own time). What gRPC
itself costs around this (reading 458 KB, the write) is not here: bench/service.py --lm-head.

  .venv/bin/python bench/loop_lmhead.py --calls 2000 [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

METHOD = "/q6serve.v1.Q6Serve/MatmulStream"


def _stub_backend(gpu_s: float, topk_k: int) -> Any:
    from q6serve.kernels.api import KernelTiming, Launched, MatmulResult, Precision
    from q6serve.kernels.epilogue import TopK
    from q6serve.kernels.numpy_backend import NumpyBackend

    class LmStub(NumpyBackend):
        launch_slots = 2

        @property
        def now_slots(self) -> int:
            return 3

        def __init__(self) -> None:
            super().__init__(threads=1)
            self._stage = [np.empty((256, 3584), np.float16) for _ in range(3)]
            self._i = 0

        def launch(self, w: Any, x: np.ndarray, **kw: Any) -> Launched:
            k = kw.get("topk") or topk_k
            buf = self._stage[self._i % 3][: x.shape[0], : x.shape[1]]
            self._i += 1
            np.copyto(buf, x)  # the launcher's host copy of x into its pinned staging
            n = x.shape[0]

            def wait() -> MatmulResult:
                time.sleep(gpu_s)
                top = TopK(np.zeros((n, k), np.float32), np.zeros((n, k), np.int32),
                           np.zeros(n, np.float32))
                return MatmulResult(None, "stub", w.layout, Precision.F16,  # type: ignore[arg-type]
                                    KernelTiming(host_seconds=gpu_s), topk=top)

            return Launched(wait)

        def matmul(self, w: Any, x: np.ndarray, **kw: Any) -> MatmulResult:
            return self.launch(w, x, **kw).wait()

    return LmStub()


def _request(n: int, k: int, topk: int) -> bytes:
    from q6serve.v1 import q6serve_pb2 as pb

    req = pb.MatmulRequest(weight="w", request_id="r1")
    req.x.dtype = pb.DTYPE_F16
    req.x.shape.extend((n, k))
    req.x.data = np.ones((n, k), np.float16).tobytes()
    req.topk.k = topk
    return req.SerializeToString()


async def _run(a: argparse.Namespace) -> dict[str, float]:
    import dataclasses

    from batcher_overhead import upload_random
    from stream_overhead import _Context, stream_handler

    from q6serve.service.config import WorkerConfig
    from q6serve.service.servicer import Q6ServeServicer
    from q6serve.service.worker import Worker

    worker = Worker(dataclasses.replace(WorkerConfig(), port=0),
                    _stub_backend(a.gpu_us * 1e-6, a.topk))
    await worker.start()
    await upload_random(worker.engine, "w", a.rows, 3584)
    handler = await stream_handler(Q6ServeServicer(worker.engine))
    req = _request(a.n, 3584, a.topk)
    serialize = handler.response_serializer
    counts = {"calls": 0}
    stop = asyncio.Event()

    async def caller() -> None:
        incoming: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def requests() -> Any:
            while (raw := await incoming.get()) is not None:
                yield (raw if handler.request_deserializer is None
                       else handler.request_deserializer(raw))

        ctx = _Context()

        async def run() -> None:
            async for item in handler.stream_stream(requests(), ctx):
                await ctx.write(item)

        runner = asyncio.get_running_loop().create_task(run())
        while not stop.is_set():
            incoming.put_nowait(bytes(req))  # a fresh copy, as gRPC hands each message over
            serialize(await ctx.written.get())
            counts["calls"] += 1
        incoming.put_nowait(None)
        await runner

    async def timed(calls: int) -> tuple[float, float, int]:
        c0, t0, n0 = time.thread_time(), time.perf_counter(), counts["calls"]
        while counts["calls"] - n0 < calls:
            await asyncio.sleep(0.01)
        return time.thread_time() - c0, time.perf_counter() - t0, counts["calls"] - n0

    callers = [asyncio.ensure_future(caller()) for _ in range(a.streams)]
    await timed(a.warmup)
    prof = cProfile.Profile() if a.profile else None
    if prof:
        prof.enable()
    cpu, wall, calls = await timed(a.calls)
    if prof:
        prof.disable()
    stop.set()
    await asyncio.gather(*callers)
    await worker.stop()
    if prof:
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(a.top)
    return {"calls": calls, "wall_us_per_call": wall / calls * 1e6,
            "loop_cpu_us_per_call": cpu / calls * 1e6,
            "deferred_jobs": worker.engine.device.deferred_jobs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--gpu-us", type=float, default=330.0)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args(argv)
    out = asyncio.run(_run(a))
    print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
