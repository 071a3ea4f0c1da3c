"""Cost of the service core per request without gRPC: one caller, sequential submits through
Engine-less Batcher + Device with a no-op kernel (issue 9: batching must add ~0 when idle).

    .venv/bin/python bench/batcher_overhead.py [--calls 3000] [--rounds 5] [--engine]
Prints p50 µs of submit -> result and of queue_seconds (enqueue -> device job start).
``--engine``: the worker's whole in-process path instead, as the servicer runs it: a
serialized MatmulRequest parsed and decoded (wire), Engine.start_matmul (checks, registry,
batcher, device thread, NumPy backend on a 4 x 256 weight), the reply encoded and serialized
(issue 14: the hot path from decoded request to kernel and back, gRPC excluded).
``--engine --noop-rows R``: the same with a no-op backend whose y is [N, R] zeros (f16 out),
p50 per stage (parse, wire call, start_matmul, device round trip, encode, serialize).
``--multi``: a q/k/v multi-weight call (3584/512/512 rows, no-op backend) through
service/multi.py, submit -> the call's sink.
``--job-py-us P --job-wait-us W --loop-us L``: a CUDA-shaped job (P us of Python holding the
GIL, then W us without it, as a device sync) and L us of loop work after each submit (the rest
of a handler's trip); with ``--handoff-yield`` (device_thread.Device) or ``--switch-us``
(sys.setswitchinterval) to compare how soon the device thread gets the GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import numpy as np

from q6serve.kernels.api import KernelTiming, Layout, MatmulResult, Precision
from q6serve.service.batcher import Batcher, BatchKey, BatchSettings
from q6serve.service.device_thread import Device


def _run(x: np.ndarray, key: BatchKey) -> MatmulResult:
    return MatmulResult(x, "noop", Layout.SOA, Precision.EXACT, KernelTiming(host_seconds=0.0))


def _spin(seconds: float) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        pass


async def _round(calls: int, deadline: float | None = None, job: tuple[float, float] = (0, 0),
                 loop_s: float = 0.0, handoff_yield: bool = False) -> tuple[float, float]:
    def run(x: np.ndarray, key: BatchKey) -> MatmulResult:
        if job[0]:
            _spin(job[0])  # the host path, holding the GIL
        if job[1]:
            time.sleep(job[1])  # a sync: the GIL released
        return _run(x, key)

    dev = Device("bench", handoff_yield)
    b = Batcher("w", dev, run, BatchSettings(), lambda: True, lambda s: None)
    key = BatchKey("f32", Precision.EXACT, "f32")
    x = np.ones((1, 256), np.float32)
    lat, queue = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        fut = b.enqueue(x, key, deadline)
        if loop_s:
            _spin(loop_s)  # the rest of the handler's loop trip
        out = await fut
        lat.append(time.perf_counter() - t0)
        queue.append(out.queue_seconds)
    await b.close()
    dev.close()
    return statistics.median(lat) * 1e6, statistics.median(queue) * 1e6


async def _engine_round(calls: int, deadline: float | None = None) -> tuple[float, float]:
    from q6serve.kernels.backends import make_backend
    from q6serve.service import wire_replies, wire_requests
    from q6serve.service.config import WorkerConfig
    from q6serve.service.engine import Engine
    from q6serve.service.engine_types import UploadSpec
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
        call = wire_requests.matmul_call(msg, deadline)
        took = wire_replies.Took(t0, time.perf_counter())
        reply = await eng.matmul(call)
        wire_replies.matmul_response(reply, msg.request_id, took).SerializeToString()
        lat.append(time.perf_counter() - t0)
        queue.append(reply.queue_seconds)
    await eng.close()
    return statistics.median(lat) * 1e6, statistics.median(queue) * 1e6


class _Noop:
    """A NumPy backend whose matmul returns zeros at once (the service's own cost only)."""

    def __new__(cls) -> Any:
        from q6serve.kernels.numpy_backend import NumpyBackend

        class Noop(NumpyBackend):
            def matmul(self, w: Any, x: np.ndarray, **kw: Any) -> MatmulResult:
                y = np.zeros((x.shape[0], w.rows), kw.get("out_dtype") or np.float32)
                return MatmulResult(y, "noop", w.layout, Precision.EXACT,
                                    KernelTiming(host_seconds=0.0))

        return Noop(threads=1)


async def upload_random(eng: Any, name: str, rows: int, k: int) -> None:
    """Upload random Q6_K blocks (scale 1e-3) as weight ``name`` of ``rows`` x ``k``."""
    import hashlib

    from q6serve.service.engine_types import UploadSpec

    blocks = np.random.default_rng(0).integers(0, 256, size=(rows * k // 256, 210),
                                               dtype=np.uint8)
    blocks[:, 208:210] = np.full((len(blocks), 1), 1e-3, np.float16).view(np.uint8)
    data = blocks.tobytes()

    async def once() -> Any:
        yield data

    await eng.upload(UploadSpec(name, rows, k, "q6_k", len(data),
                                hashlib.sha256(data).hexdigest()), once())


async def _engine_with(weights: dict[str, int], k: int) -> Any:
    from q6serve.service.config import WorkerConfig
    from q6serve.service.engine import Engine

    eng = Engine(_Noop(), WorkerConfig(max_batch_delay_us=0))
    for name, rows in weights.items():
        await upload_random(eng, name, rows, k)
    return eng


async def _stages_round(calls: int, rows: int) -> dict[str, float]:
    from q6serve.service import wire_replies, wire_requests
    from q6serve.v1 import q6serve_pb2 as pb

    k = 256
    eng = await _engine_with({"w": rows}, k)
    req = pb.MatmulRequest(weight="w", out_dtype=pb.DTYPE_F16)
    req.x.dtype = pb.DTYPE_F16
    req.x.shape.extend((1, k))
    req.x.data = np.ones((1, k), np.float16).tobytes()
    raw = req.SerializeToString()
    names = ("parse", "call", "start", "wait", "encode", "serialize", "total")
    st: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(calls):
        t = [time.perf_counter()]
        msg = pb.MatmulRequest.FromString(raw)
        t.append(time.perf_counter())
        call = wire_requests.matmul_call(msg, 60.0)
        t.append(time.perf_counter())
        fut = eng.start_matmul(call)
        t.append(time.perf_counter())
        reply = await fut
        t.append(time.perf_counter())
        out = wire_replies.stream_reply(reply, msg.request_id, wire_replies.Took(t[0], t[2]))
        t.append(time.perf_counter())
        if not isinstance(out, bytes):
            out.SerializeToString()
        t.append(time.perf_counter())
        for i, n in enumerate(names[:-1]):
            st[n].append(t[i + 1] - t[i])
        st["total"].append(t[-1] - t[0])
    await eng.close()
    return {n: statistics.median(v[calls // 10:]) * 1e6 for n, v in st.items()}


async def _multi_round(calls: int) -> float:
    from q6serve.service.engine_types import MatmulCall
    from q6serve.service.multi import start_matmul_weights

    eng = await _engine_with({"q": 3584, "k": 512, "v": 512}, 256)
    x = np.ones((1, 256), np.float16)
    loop = asyncio.get_running_loop()
    lat = []
    for _ in range(calls):
        t0 = time.perf_counter()
        heard: asyncio.Future[float] = loop.create_future()

        def sink(_: Any, heard: asyncio.Future[float] = heard) -> None:
            if not heard.done():
                heard.set_result(time.perf_counter())

        fut = start_matmul_weights(eng, MatmulCall("", x, weights=("q", "k", "v"),
                                                   timeout=60.0), sink)
        fut.add_done_callback(sink)  # (a failure would not call the sink)
        lat.append(await heard - t0)
    await eng.close()
    return statistics.median(lat[calls // 10:]) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--deadline", type=float, default=None,
                    help="per-request timeout in seconds, as a gRPC deadline passes it")
    ap.add_argument("--engine", action="store_true",
                    help="time the worker's in-process path (wire + Engine + NumPy backend)")
    ap.add_argument("--noop-rows", type=int, default=0,
                    help="--engine: a no-op backend with y of this many columns; per stage")
    ap.add_argument("--multi", action="store_true",
                    help="a q/k/v multi-weight call (no-op backend): submit -> its sink")
    ap.add_argument("--job-py-us", type=float, default=0.0,
                    help="the job's Python (GIL held) in us")
    ap.add_argument("--job-wait-us", type=float, default=0.0,
                    help="the job's GIL-free wait in us (a device sync)")
    ap.add_argument("--loop-us", type=float, default=0.0,
                    help="loop work after each submit in us")
    ap.add_argument("--handoff-yield", action="store_true",
                    help="the device yields the GIL on a hand-off (device_thread.Device)")
    ap.add_argument("--switch-us", type=float, default=0.0,
                    help="sys.setswitchinterval in us (0: Python's default)")
    a = ap.parse_args()
    if a.switch_us:
        import sys

        sys.setswitchinterval(a.switch_us * 1e-6)
    if a.multi:
        res = [asyncio.run(_multi_round(a.calls)) for _ in range(a.rounds)]
        print(f"q/k/v multi-weight call: submit -> sink p50 {statistics.median(res):.1f} us "
              f"(median of {a.rounds} rounds x {a.calls} calls)")
        return
    if a.engine and a.noop_rows:
        got = [asyncio.run(_stages_round(a.calls, a.noop_rows)) for _ in range(a.rounds)]
        print("p50 us per stage: " + "  ".join(
            f"{n} {statistics.median(g[n] for g in got):.1f}" for n in got[0])
            + f" (median of {a.rounds} rounds x {a.calls} calls)")
        return
    if a.engine:
        res = [asyncio.run(_engine_round(a.calls, a.deadline)) for _ in range(a.rounds)]
    else:
        res = [asyncio.run(_round(a.calls, a.deadline, (a.job_py_us * 1e-6, a.job_wait_us * 1e-6),
                                  a.loop_us * 1e-6, a.handoff_yield)) for _ in range(a.rounds)]
    lat = statistics.median(r[0] for r in res)
    q = statistics.median(r[1] for r in res)
    print(f"submit->result p50 {lat:.1f} us, queue p50 {q:.1f} us "
          f"(median of {a.rounds} rounds x {a.calls} calls)")


if __name__ == "__main__":
    main()
