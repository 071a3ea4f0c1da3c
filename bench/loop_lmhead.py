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

``--grpc``: the same worker (the stub backend) served over real gRPC in a child process, the
``--streams`` callers in this one (one grpc.aio channel each, raw bytes both ways): calls/s, the
callers' p50/p99 and the worker's CPU per call by thread (/proc: the loop, gRPC's poller, the
device thread), over ``--seconds``; ``--rounds R`` alternates it with ``--base PATH`` (a tree
whose ``src`` or root is put first on the worker's PYTHONPATH: an A/B in one run). On a small
host the callers share the worker's cores: compare only within a run.

  .venv/bin/python bench/loop_lmhead.py --calls 2000 [--profile]
  .venv/bin/python bench/loop_lmhead.py --grpc --seconds 3 --rounds 3 [--base /tmp/base]
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

    worker = Worker(dataclasses.replace(WorkerConfig(), port=0,
                                        max_batch_rows=getattr(a, "max_batch_rows", 64)),
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


async def _serve(a: argparse.Namespace) -> None:
    """The worker of ``--grpc`` (in its own process): the stub backend behind the real server;
    prints its port, then serves until stdin closes."""
    import dataclasses

    from batcher_overhead import upload_random

    from q6serve.service.config import WorkerConfig
    from q6serve.service.worker import Worker

    worker = Worker(dataclasses.replace(WorkerConfig(), port=0),
                    _stub_backend(a.gpu_us * 1e-6, a.topk))
    await worker.start()
    await upload_random(worker.engine, "w", a.rows, 3584)
    print(worker.port, flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)
    await worker.stop()


async def _callers(a: argparse.Namespace, port: int, pid: int) -> dict[str, float]:
    """``--streams`` closed-loop MatmulStream callers on the worker at ``port`` (process
    ``pid``): warm-up, then ``--seconds`` timed."""
    import grpc
    from stream_overhead import thread_counters

    from q6serve.client.channel import channel_options

    req = _request(a.n, 3584, a.topk)
    lat: list[float] = []
    phase = {"timed": False, "stop": False}

    async def caller() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                             options=channel_options()) as ch:
            call = ch.stream_stream(METHOD)()
            while not phase["stop"]:
                t0 = time.perf_counter()
                await call.write(req)
                await call.read()
                if phase["timed"]:
                    lat.append(time.perf_counter() - t0)
            await call.done_writing()

    tasks = [asyncio.ensure_future(caller()) for _ in range(a.streams)]
    await asyncio.sleep(a.warmup_s)
    before = thread_counters(pid)
    phase["timed"] = True
    t0 = time.perf_counter()
    await asyncio.sleep(a.seconds)
    phase["timed"] = False
    wall = time.perf_counter() - t0
    after = thread_counters(pid)
    calls = len(lat)
    phase["stop"] = True
    await asyncio.gather(*tasks)
    per = {k: (after.get(k, 0.0) - before.get(k, 0.0)) / max(1, calls) * 1e6
           for k in ("cpu", "loop")}
    per.update({k.split(":", 1)[1]: (v - before.get(k, 0.0)) / max(1, calls) * 1e6
                for k, v in after.items() if k.startswith("cpu:") and k != "cpu:main"})
    lat.sort()
    return {"calls_s": calls / wall, "p50_ms": lat[len(lat) // 2] * 1e3 if lat else 0.0,
            "p99_ms": lat[int(len(lat) * 0.99)] * 1e3 if lat else 0.0,
            **{f"{k}_us": v for k, v in per.items() if v > 0.5}}


def _grpc_round(a: argparse.Namespace, tree: str | None) -> dict[str, float]:
    import os
    import subprocess

    env = dict(os.environ)
    if tree:
        src = Path(tree) / "src"
        env["PYTHONPATH"] = os.pathsep.join(
            [str(src if src.is_dir() else Path(tree)), str(Path(__file__).resolve().parent)])
    args = [sys.executable, __file__, "--serve", "--rows", str(a.rows), "--gpu-us",
            str(a.gpu_us), "--topk", str(a.topk)]
    with subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                          text=True) as proc:
        assert proc.stdout is not None and proc.stdin is not None
        port = int(proc.stdout.readline())
        try:
            return asyncio.run(_callers(a, port, proc.pid))
        finally:
            proc.stdin.close()
            proc.wait(30)


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
    ap.add_argument("--max-batch-rows", type=int, default=64, help="the worker's (64)")
    ap.add_argument("--grpc", action="store_true", help="over real gRPC (see the docstring)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=3.0, help="--grpc: timed seconds")
    ap.add_argument("--warmup-s", type=float, default=1.0, help="--grpc: warm-up seconds")
    ap.add_argument("--rounds", type=int, default=1, help="--grpc: rounds (A/B with --base)")
    ap.add_argument("--base", default=None, help="--grpc: a base tree alternated with this one")
    a = ap.parse_args(argv)
    if a.serve:
        asyncio.run(_serve(a))
        return 0
    if a.grpc:
        for r in range(a.rounds):
            for label, tree in ([("base", a.base)] if a.base else []) + [("this", None)]:
                out = _grpc_round(a, tree)
                print(f"round {r} {label:5s} " + "  ".join(
                    f"{k} {v:.1f}" for k, v in out.items()), flush=True)
        return 0
    out = asyncio.run(_run(a))
    print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
