"""Where a MatmulStream round trip's time goes beyond gRPC's own (issue 14, target T1).

One caller, one request in flight on one stream, closed loop, N=1 f16 activations of K
columns and a y of ROWS f16 values (the T1 shape: ffn_down K=18944; ROWS small so NumPy's
kernel is a few µs and is subtracted anyway). Each variant is a server in its own spawned
process; this process is the client (raw bytes both ways, nothing decoded in the timed part):

  bare    bytes echo, generic handler, ``async for req in it: yield reply``: gRPC's floor
  proto   + the MatmulRequest decoded (wire_requests.read_matmul_request) and a MatmulStreamResponse
          built and serialized per reply
  struct  proto + the servicer's structure: a reader task, the reply made a loop trip later
          (the batcher's sink) and put on an asyncio.Queue, a response generator yielding
          from the queue
  icpt    proto + the worker's ErrorInterceptor (auth, metrics, per-message decoding)
  servicer the worker's own server (service/worker.py build_server: options, interceptor,
          health, reflection) and Q6ServeServicer.MatmulStream, over an engine whose
          start_matmul answers a loop trip later with a ready reply (no batcher, no kernel)
  direct  servicer, the engine answering on the direct path (run_now: a ready reply at once,
          written by the stream's coroutine, as the worker's lone requests are)
  engine  the real worker (service/worker.py Worker: server, interceptor, servicer, Engine,
          batcher, metrics) in process over a no-op NumPy backend (y zeros, kernel 0): all of
          the service's per-request Python and none of a kernel's
  worker  the real worker (``q6serve worker --backend numpy``): servicer, batcher, NumPy
          kernel, interceptor, server options; its figure is p50 of (round trip - the
          kernel_seconds its reply reports)
  worker0 the same worker with its loop's busy polling off (Q6SERVE_BUSY_POLL_US=0)
  workerpoll the same worker with gRPC's poll(2) poller (GRPC_POLL_STRATEGY=poll) instead of
          its default epoll1
  workeree, bareee  the worker, the bare echo, with gRPC's EventEngine experiments off
          (GRPC_EXPERIMENTS=EE_OFF in the server's process: gRPC's older iomgr path; this
          process, the caller, runs as importing q6serve.client leaves it: EE_OFF where
          nothing was set; bare itself runs on gRPC's defaults). ``q6serve worker`` sets EE_OFF
          itself where nothing is set (client/grpc_env.py): worker is workeree then, and
  workerdef the worker on gRPC's defaults (GRPC_EXPERIMENTS empty)

On grpc's synchronous server (``grpc.server`` + a thread pool; the stream's handler is a
generator on a pool thread that blocks in the request iterator; no event loop):

  sbare   bytes echo, ``for req in it: yield reply``: the sync server's floor
  sync    a MatmulStream prototype: each request decoded (wire_requests.read_matmul_request,
          wire_requests.matmul_call), the worker's direct job run on the handler thread (what
          Engine._make_batcher's ``run`` does: ``launch_ieee`` on the backend + the wait, the
          weight loaded as the worker loads it, the worker's kernel flags), the reply encoded
          by wire_replies.stream_reply (stamped); none of the worker's admission, batcher
          bookkeeping,
          metrics or interceptor. Figure: p50 of (round trip - kernel_seconds), as worker's

``bare+FEATURE[+FEATURE...]`` (the ladder, a bisection of what the worker's server has beyond
the bare echo): the bare echo with each FEATURE of FEATURES added (the worker's server options,
health and reflection, the interceptor, decoding, the coroutine handler shape, the worker's
idle threads and background tasks, its heap threshold, logging and imports), e.g.
``--variants bare,bare+wopts,bare+wopts+icpt``.

``--out f32`` (T1's: bench/service.py asks for f32 y) sets the reply's dtype (default f16);
``--rows 3584 --out f32`` gives T1's message sizes.

``--keepers N``: every run again with N spinning processes of the lowest priority beside
(LABEL~keep, alternated with the plain run): what idle CPUs cost a round trip's wake-ups.

``ZERO_COPY_MIN=BYTES`` (env): the servicer variants read x as a view of the request from that
size up (wire_requests.read_matmul_request's walker; 0: always).

``--trips``: every server counts its event-loop trips and the callbacks they run
(bench/loop_trips.py); the table then gives loop trips per round trip and the callbacks that
run more than once per 10 round trips (the loop thread's CPU in each), and for stamped servers
the loop step that took a request and submitted its reply, split at the request taken and the
reply encoded. ``--backend cuda``: the worker variant on the GPU.

``--inproc``: the worker's interceptor and MatmulStream handler driven in this process with
no gRPC (a stub engine; a request handed in, its serialized reply taken), next to the proto
echo handler: the Python our handler adds per request, a figure far steadier than a round trip;
and the same handler over the real Engine on a no-op backend (``engine``: + the engine's
checks, the batcher, the inline device job, metrics).

Variants run in turn, ``--rounds`` times (the VM is noisy); the table gives each variant's
median over rounds of its per-round p50, the spread, and the server process's CPU time per
round trip (all its threads, /proc; 10 ms ticks, so use spans of a second or more).

  .venv/bin/python bench/stream_overhead.py --rounds 5 --seconds 2
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from q6serve.client import grpc_env

VARIANTS = ("bare", "proto", "struct", "icpt", "servicer", "direct", "engine", "worker",
            "worker0", "workerpoll", "sbare", "sync", "bareee", "workeree", "workerdef")
SYNC_VARIANTS = ("sbare", "sync")
# gRPC's EventEngine experiments off, as `q6serve worker` sets them (client/grpc_env.py says
# why; importing it does not import gRPC)
EE_OFF = grpc_env.EVENT_ENGINE_OFF
WORKERS = {"worker": {}, "worker0": {"Q6SERVE_BUSY_POLL_US": "0"},  # variant: its env
           "workerpoll": {"GRPC_POLL_STRATEGY": "poll"},
           "workeree": {"GRPC_EXPERIMENTS": EE_OFF},
           "workerdef": {"GRPC_EXPERIMENTS": ""}}  # gRPC's defaults (an empty value)
# an echo variant that is another one in its own environment: variant -> (as, env)
# (bare is gRPC's defaults, an empty value: importing q6serve.client above set EE_OFF in this
# process's environment where it was unset, and the echoes inherit it)
ECHOES = {"bare": ("bare", {"GRPC_EXPERIMENTS": ""}),
          "bareee": ("bare", {"GRPC_EXPERIMENTS": EE_OFF})}
METHOD = "/q6serve.v1.Q6Serve/MatmulStream"


# -- servers (each runs in a spawned process) -------------------------------------------------
def _reply_message(pb: Any, req: Any, y: bytes, rows: int, start: float | None = None,
                   ) -> Any:
    """A MatmulStreamResponse like the worker's for a result (y, shape, timing); ``start``:
    stamped (bench/reply_stamps.py) with this time as the request's and now as the reply's."""
    import reply_stamps

    msg = pb.MatmulStreamResponse(request_id=req.request_id if start is None
                                  else reply_stamps.stamp(start))
    r = msg.result
    r.y.dtype = pb.DTYPE_F16 if len(y) == 2 * rows else pb.DTYPE_F32
    r.y.shape.extend((1, rows))
    r.y.data = y
    r.kernel = "numpy"
    r.timing.queue_seconds = 1e-6
    r.timing.kernel_seconds = 1e-6
    r.timing.batch_rows = 1
    r.timing.batch_requests = 1
    return msg


def _echo_handler(variant: str, rows: int, itemsize: int = 2) -> Any:
    """The stream handler of an echo variant and its (de)serializers (y: ``rows`` values of
    ``itemsize`` bytes)."""
    import grpc

    from q6serve.service import wire_requests
    from q6serve.v1 import q6serve_pb2 as pb

    y = b"\0" * (itemsize * rows)
    if variant == "bare":
        async def bare(it: Any, ctx: Any) -> Any:
            async for _ in it:
                yield y
        return grpc.stream_stream_rpc_method_handler(bare)

    async def proto(it: Any, ctx: Any) -> Any:
        async for req in it:
            yield _reply_message(pb, req, y, rows)

    async def struct(it: Any, ctx: Any) -> Any:
        loop = asyncio.get_running_loop()
        out: asyncio.Queue[Any] = asyncio.Queue()

        async def read() -> None:
            async for req in it:  # the batcher answers a loop trip later, through the
                # request's sink (Engine.start_matmul) in the trip that resolves it
                loop.call_soon(lambda req=req: out.put_nowait(_reply_message(pb, req, y, rows)))
            out.put_nowait(None)

        reader = loop.create_task(read())
        while (item := await out.get()) is not None:
            yield item
        await reader

    handler = struct if variant == "struct" else proto
    return grpc.stream_stream_rpc_method_handler(
        handler, request_deserializer=wire_requests.read_matmul_request,
        response_serializer=pb.MatmulStreamResponse.SerializeToString)


class _StubEngine:
    """What Q6ServeServicer.MatmulStream asks of an engine, answering each call a loop trip
    later through its sink (as the batcher does) with a ready reply of ``rows`` f16 values."""

    takes_multi_weight = False
    serving = True

    def __init__(self, rows: int, direct: bool = False, itemsize: int = 2) -> None:
        from q6serve.kernels.api import Layout, Precision
        from q6serve.service.batcher import MatmulReply

        self.view = type("View", (), {"rows": rows})()
        self.reply = MatmulReply(np.zeros((1, rows), f"f{itemsize}"), "stub", Layout.SOA,
                                 Precision.F16, 1e-6, 1e-6, 1, 1, 1e-6)
        if direct:
            self.run_now = lambda call, own: self.reply

    def get(self, name: str) -> Any:
        return self.view

    def start_matmul(self, call: Any, sink: Any = None) -> Any:
        fut = asyncio.get_running_loop().create_future()

        def resolve() -> None:
            fut.set_result(self.reply)
            if sink is not None:
                sink(fut)

        asyncio.get_running_loop().call_soon(resolve)
        return fut


async def _servicer_server(rows: int, direct: bool = False, itemsize: int = 2) -> Any:
    """The worker's server around Q6ServeServicer over a _StubEngine; returns (server, port)."""
    import dataclasses

    from prometheus_client import CollectorRegistry

    from q6serve.service.admission import StreamBudget
    from q6serve.service.config import WorkerConfig
    from q6serve.service.interceptor import ErrorInterceptor
    from q6serve.service.metrics import Metrics
    from q6serve.service.servicer import Q6ServeServicer
    from q6serve.service.worker import build_server

    cfg = dataclasses.replace(WorkerConfig(), port=0)
    metrics = Metrics(CollectorRegistry(), version="bench", backend="numpy", device="cpu")
    servicer = Q6ServeServicer(_StubEngine(rows, direct, itemsize),  # type: ignore[arg-type]
                               max_stream_bytes=cfg.max_stream_bytes,
                               stream_budget=StreamBudget(cfg.max_stream_bytes_total,
                                                          cfg.max_stream_bytes_per_connection))
    server, _, port = build_server(cfg, servicer, ErrorInterceptor(metrics))
    return server, port


async def _noop_worker(rows: int, k: int, port: int = 0) -> Any:
    """The worker (service/worker.py) over a no-op NumPy backend with weight "w" of ``rows``
    x ``k`` loaded; returns the started Worker."""
    import dataclasses

    from batcher_overhead import _Noop, upload_random

    from q6serve.service.config import WorkerConfig
    from q6serve.service.worker import Worker

    worker = Worker(dataclasses.replace(WorkerConfig(), port=port), _Noop())
    await worker.start()
    await upload_random(worker.engine, "w", rows, k)
    return worker


# -- the ladder: the bare echo plus, one at a time, what the worker's process has -------------
FEATURES = {
    "wopts": "the worker's server options (service/worker.py build_server) instead of the "
             "client's channel options",
    "hr": "health and reflection services beside (wire_standard.add_health_and_reflection)",
    "icpt": "the worker's ErrorInterceptor as Worker.start builds it (metrics, auth, "
            "admission, read gate, stream slots)",
    "proto": "the request decoded (wire_requests.read_matmul_request), a MatmulStreamResponse "
             "built",
    "coro": "the handler a coroutine writing each reply with context.write (through the "
            "interceptor's send_reply with icpt), as MatmulStream's direct path does",
    "threads": "the worker's idle threads: a device thread (device_thread.Device) and the "
               "Prometheus HTTP server",
    "tasks": "the engine's background tasks: the 0.25 s metrics poll and the heap trim loop",
    "heap": "the worker's fixed mmap threshold (heap.fix_heap_thresholds, 32 MiB)",
    "log": "the worker's logging (root logger at INFO to stderr, warnings captured)",
    "work": "WORK_US (default 150) us of Python per request in the handler (objects made and "
            "dropped), the worker's handler time without its code: does gRPC's own path slow "
            "down after a handler's work (caches)?",
    "hold": "holdNNN: the handler holds each request NNN us (default 120) in a busy wait on "
            "the clock before its reply, as the worker's direct path waits on the kernel's "
            "event (no Python churn): a server window of that length and nothing else. Does "
            "the way up and down grow with the window alone (gRPC's threads idle longer)?",
    "job": "the request decoded and run as the worker's direct job on --backend (_direct_job: "
           "launch_ieee, x staged, the (weight, N)'s captured launch graph from its second "
           "call, the wait on its event), the reply written by wire_replies.stream_reply: the "
           "least "
           "Python a worker needs for T1's call (with spin: the floor probe of session 19); its "
           "figure is p50 of round trip - the kernel its reply reports",
    "spin": "the loop's busy polling as the worker has it (service/threads.busy_poll: "
            "Q6SERVE_BUSY_POLL_US, else 1000 us on 8+ cores), always allowed to spin",
    "imports": "the worker's imports (service.worker, engine, the NumPy backend; cupy and the "
               "CUDA backend with --backend cuda): a bigger heap for the cyclic GC",
}


def _features(variant: str) -> list[str]:
    """``bare+a+b`` -> ["a", "b"] (checked against FEATURES)."""
    got = ["hold" if f.startswith("hold") and f[4:].isdigit() else f
           for f in variant.split("+")[1:]]
    if bad := [f for f in got if f not in FEATURES]:
        raise ValueError(f"unknown feature(s) {bad} in {variant!r}; choose from "
                         + ", ".join(FEATURES))
    return got


def _churn(us: float) -> Any:
    """A function spending about ``us`` µs in Python making and dropping small objects."""
    def unit() -> None:
        junk = [{"i": i, "s": str(i), "t": (i, i)} for i in range(20)]
        del junk

    t0 = time.perf_counter()
    for _ in range(2000):
        unit()
    per = (time.perf_counter() - t0) / 2000
    n = max(1, round(us * 1e-6 / per))
    print(f"# work: {n} units of {per * 1e6:.1f} us", file=sys.stderr, flush=True)

    def work() -> None:
        for _ in range(n):
            unit()
    return work


async def _ladder_server(variant: str, rows: int, backend: str, itemsize: int = 2,
                         k: int = 0) -> Any:
    """The bare echo with ``variant``'s features (see FEATURES) added; returns (server, port,
    what must stay referenced)."""
    import grpc
    from prometheus_client import CollectorRegistry

    from q6serve.client.channel import channel_options
    from q6serve.service import wire, wire_replies, wire_requests, wire_standard
    from q6serve.service.config import WorkerConfig
    from q6serve.service.interceptor import RPC_START
    from q6serve.service.metrics import Metrics
    from q6serve.v1 import q6serve_pb2 as pb

    feats = set(_features(variant))
    cfg = WorkerConfig()
    keep: list[Any] = []
    if "log" in feats:
        import logging

        out = logging.StreamHandler(sys.stderr)
        out.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger().handlers[:] = [out]
        logging.getLogger().setLevel("INFO")
        logging.captureWarnings(True)
    if "imports" in feats:
        import q6serve.kernels.numpy_backend
        import q6serve.service.engine
        import q6serve.service.worker

        if backend == "cuda":
            import cupy  # noqa: F401

            import q6serve.kernels.cuda_backend  # noqa: F401
    if "heap" in feats:
        from q6serve.service.heap import MMAP_THRESHOLD, fix_heap_thresholds

        fix_heap_thresholds(MMAP_THRESHOLD)
    metrics = Metrics(CollectorRegistry(), version="bench", backend="numpy", device="cpu")
    if "threads" in feats:
        from q6serve.service.device_thread import Device

        keep += [Device("bench"), metrics.serve_http("127.0.0.1", 0)]
    if "tasks" in feats:
        from q6serve.service.engine import TRIM_EVERY_S
        from q6serve.service.heap import malloc_trim
        from q6serve.service.threads import run_in_thread

        async def poll() -> None:
            while True:
                await asyncio.sleep(0.25)
                metrics.poll()

        async def trim() -> None:
            while True:
                await asyncio.sleep(TRIM_EVERY_S)
                await run_in_thread(malloc_trim, 0)

        loop = asyncio.get_running_loop()
        keep += [loop.create_task(poll()), loop.create_task(trim())]
    interceptors = []
    if "icpt" in feats:
        from q6serve.service.admission import Admission, StreamSlots
        from q6serve.service.auth import TokenAuth
        from q6serve.service.interceptor import ErrorInterceptor

        interceptors.append(ErrorInterceptor(
            metrics, TokenAuth(cfg.token, cfg.admin_token),
            Admission(cfg.max_inflight_rpcs, cfg.max_inflight_rpcs_per_connection,
                      cfg.min_inflight_rpcs_per_connection, cfg.reply_timeout_s),
            cfg.receive_limit,
            Admission(cfg.max_reading_rpcs, cfg.max_reading_rpcs, 1, cfg.read_timeout_s,
                      "requests not received"),
            StreamSlots(cfg.max_streams, cfg.max_streams_per_connection)))
    if "wopts" in feats:
        from q6serve.service.worker import PENDING_CALLS

        opts: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", cfg.receive_limit),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.max_concurrent_streams", cfg.max_concurrent_streams),
            ("grpc.so_reuseport", 0),
            ("grpc.server.max_pending_requests", PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", PENDING_CALLS)]
    else:
        opts = channel_options()
    if "spin" in feats:
        from q6serve.service.threads import busy_poll

        spin = busy_poll(asyncio.get_running_loop(), lambda: True)
        print(f"# spin: {spin.spin_s * 1e6 if spin else 0:.0f} us", file=sys.stderr, flush=True)
    server = grpc.aio.server(interceptors=interceptors, options=opts)
    y = b"\0" * (itemsize * rows)
    decode = "proto" in feats or "job" in feats
    job = _direct_job(rows, k, backend) if "job" in feats else None

    work = _churn(float(os.environ.get("WORK_US", "150"))) if "work" in feats else None
    hold = next((int(f[4:] or 120) * 1e-6 for f in variant.split("+")[1:]
                 if f.startswith("hold")), 0.0)

    def reply(req: Any, start: float) -> Any:
        if job is not None:  # (no error path: the bench's requests are all valid)
            call = wire_requests.matmul_call(req, None)
            return wire_replies.stream_reply(job(call), req.request_id,
                                     wire_replies.Took(start, time.perf_counter()))
        if work is not None:
            work()
        while time.perf_counter() - start < hold:  # (start: the raw request's time)
            pass
        return _reply_message(pb, req, y, rows, start) if decode else y

    def taken() -> float:  # the raw request's time (the interceptor's RPC_START), or now
        return RPC_START.get(None) or time.perf_counter()

    if "coro" in feats:
        async def handler(it: Any, ctx: Any) -> None:
            send = getattr(ctx, "send_reply", None) or ctx.write
            async for req in it:
                await send(reply(req, taken()))
    else:
        async def handler(it: Any, ctx: Any) -> Any:  # type: ignore[misc]
            async for req in it:
                yield reply(req, taken())
    method = grpc.stream_stream_rpc_method_handler(
        handler, request_deserializer=wire_requests.read_matmul_request if decode else None,
        response_serializer=(wire._bytes_or(pb.MatmulStreamResponse.SerializeToString)
                             if decode else None))
    service, _, name = METHOD.lstrip("/").rpartition("/")
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service,
                                                                          {name: method})])
    if "hr" in feats:
        wire_standard.add_health_and_reflection(server, wire_standard.health_servicer())
    port = server.add_insecure_port("127.0.0.1:0")
    return server, port, keep


def _stamped(variant: str) -> bool:
    """Whether ``variant``'s replies carry bench/reply_stamps.py's times."""
    return (variant in ("direct", "engine", "sync", *WORKERS)
            or bool({"proto", "job"} & set(_features(variant))))


def _echo_server(variant: str, rows: int, ports: Any, trips: str = "", k: int = 0,
                 backend: str = "numpy", itemsize: int = 2) -> None:
    import grpc
    import reply_stamps

    reply_stamps.install()  # direct, engine: their replies say when (servicer's own wire)
    if (zc := os.environ.get("ZERO_COPY_MIN")) is not None:  # x as a view of the request
        # from this size up (wire_requests.read_matmul_request)
        from q6serve.service import wire_requests

        wire_requests.read_matmul_request.__defaults__ = (int(zc),)

    if trips:
        import loop_trips

        loop_trips.install(trips, sigterm=True)

    from q6serve.client.channel import channel_options

    async def serve() -> None:
        if "+" in variant:
            server, port, _keep = await _ladder_server(variant, rows, backend, itemsize, k)
            ports.put(port)
            await server.start()
            await server.wait_for_termination()
            return
        if variant == "engine":
            worker = await _noop_worker(rows, k)
            ports.put(worker.port)
            await worker.server.wait_for_termination()
            return
        if variant in ("servicer", "direct"):
            server, port = await _servicer_server(rows, variant == "direct", itemsize)
            ports.put(port)
            await server.start()
            await server.wait_for_termination()
            return
        interceptors = []
        if variant == "icpt":
            from prometheus_client import CollectorRegistry

            from q6serve.service.interceptor import ErrorInterceptor
            from q6serve.service.metrics import Metrics

            metrics = Metrics(CollectorRegistry(), version="bench", backend="numpy",
                              device="cpu")
            interceptors.append(ErrorInterceptor(metrics))
        server = grpc.aio.server(interceptors=interceptors, options=channel_options())
        handler = _echo_handler("proto" if variant == "icpt" else variant, rows, itemsize)
        service, _, name = METHOD.lstrip("/").rpartition("/")
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(service, {name: handler})])
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


# -- grpc's synchronous server --------------------------------------------------------------------
def _direct_job(rows: int, k: int, backend: str) -> Any:
    """``job(call) -> MatmulReply``: the worker's direct job for weight "w" (``rows`` x ``k``,
    random Q6_K blocks as the worker variant's upload) on ``backend``: what the Batcher's
    ``run_now`` runs through Engine._make_batcher's ``run`` (``launch_ieee`` with the worker's
    kernel flags, then the wait), and the reply its ``run_now`` builds."""
    from q6serve.kernels import q6k
    from q6serve.kernels.api import iter_aos_chunks, launch_ieee
    from q6serve.kernels.backends import make_backend
    from q6serve.kernels.errors import InvalidArgument
    from q6serve.service.batcher import MatmulReply
    from q6serve.service.flags import FlagState

    be = make_backend(backend)
    flags = FlagState.from_env(os.environ).kernel_flags()
    chunk = 64 << 20
    blocks = q6k.random_blocks(rows, k, np.random.default_rng(0))
    w = be.load(iter_aos_chunks(blocks, rows, k, chunk), rows, k, flags.layout, chunk)

    def job(call: Any) -> Any:
        if call.weight != "w" or call.topk:
            raise InvalidArgument("this prototype serves weight 'w' without top-k only")
        t0 = time.perf_counter()
        res = launch_ieee(be, w, call.x, precision=call.precision, flags=flags,
                          out_dtype=call.out_dtype).wait()
        return MatmulReply(res.y, res.kernel, res.layout, res.precision, 0.0,
                           res.timing.seconds(), int(call.x.shape[0]), 1,
                           time.perf_counter() - t0, res.topk)
    return job


def _sync_server(variant: str, rows: int, ports: Any, k: int = 0, backend: str = "numpy",
                 itemsize: int = 2, threads: int = 4) -> None:
    """``sbare`` or ``sync`` (see the module's docstring) on ``grpc.server`` with a pool of
    ``threads``: the stream's handler is a generator on one pool thread, blocking in the
    request iterator between requests."""
    from concurrent import futures

    import grpc
    import reply_stamps

    from q6serve.client.channel import channel_options
    from q6serve.service import wire, wire_replies, wire_requests
    from q6serve.service.servicer import _stream_error

    reply_stamps.install()  # sync: its replies say when (wire_replies.stream_reply)
    if variant == "sbare":
        y = b"\0" * (itemsize * rows)

        def bare(it: Any, ctx: Any) -> Any:
            for _ in it:
                yield y
        method = grpc.stream_stream_rpc_method_handler(bare)
    else:
        job = _direct_job(rows, k, backend)

        def read(raw: bytes) -> Any:  # (the raw request's time, as the interceptor's RPC_START)
            return time.perf_counter(), wire_requests.read_matmul_request(raw)

        def matmul_stream(it: Any, ctx: Any) -> Any:
            for t0, req in it:
                rid = req.request_id
                try:
                    call = wire_requests.matmul_call(req, None)
                    took = wire_replies.Took(t0, time.perf_counter())
                    item = wire_replies.stream_reply(job(call), rid, took)
                except Exception as e:
                    item = _stream_error(rid, e)
                del req
                yield item
        method = grpc.stream_stream_rpc_method_handler(
            matmul_stream, request_deserializer=read,
            response_serializer=wire._bytes_or(wire.pb.MatmulStreamResponse.SerializeToString))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads),
                         options=channel_options())
    service, _, name = METHOD.lstrip("/").rpartition("/")
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service,
                                                                          {name: method})])
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


# -- in process: the handler alone, no gRPC ---------------------------------------------------
class _Context:
    """What the interceptor and MatmulStream ask of a grpc.aio.ServicerContext."""

    def __init__(self) -> None:
        self.callbacks: list[Any] = []
        self._code: Any = None
        self.written: asyncio.Queue[Any] = asyncio.Queue()  # replies, written or yielded

    async def write(self, msg: Any) -> None:
        self.written.put_nowait(msg)

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def time_remaining(self) -> None:
        return None

    def add_done_callback(self, fn: Any) -> None:
        self.callbacks.append(fn)

    def code(self) -> Any:
        return self._code

    def set_code(self, code: Any) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        pass

def start_stream(handler: Any) -> tuple[asyncio.Queue[bytes | None], _Context, asyncio.Task[None]]:
    """Runs ``handler``'s stream in process as gRPC iterates one: requests are the queue's
    (None ends the stream), what the handler yields is written to the context
    (``ctx.written``); returns (the queue, the context, the running task)."""
    incoming: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def requests() -> Any:
        while (raw := await incoming.get()) is not None:
            yield raw if handler.request_deserializer is None else \
                handler.request_deserializer(raw)

    ctx = _Context()

    async def run() -> None:  # as gRPC iterates a handler: what it yields is written
        async for item in handler.stream_stream(requests(), ctx):
            await ctx.write(item)

    return incoming, ctx, asyncio.get_running_loop().create_task(run())



async def stream_handler(servicer: Any) -> Any:
    """``servicer``'s MatmulStream behind the worker's ErrorInterceptor (its own metrics), as
    gRPC would call it: a handler to drive in process."""
    from collections import namedtuple

    import grpc
    from prometheus_client import CollectorRegistry

    from q6serve.service import wire, wire_requests
    from q6serve.service.interceptor import ErrorInterceptor
    from q6serve.service.metrics import Metrics

    inner = grpc.stream_stream_rpc_method_handler(
        servicer.MatmulStream, request_deserializer=wire_requests.read_matmul_request,
        response_serializer=wire._bytes_or(wire.pb.MatmulStreamResponse.SerializeToString))
    metrics = Metrics(CollectorRegistry(), version="bench", backend="numpy", device="cpu")
    details = namedtuple("Details", "method invocation_metadata")(METHOD, ())

    async def continuation(_: Any) -> Any:
        return inner

    return await ErrorInterceptor(metrics).intercept_service(continuation, details)


async def _inproc(variant: str, req: bytes, rows: int, calls: int, k: int,
                  cpu: list[float] | None = None) -> list[float]:
    """Seconds per request of one stream's handler driven directly (one request in flight:
    hand it a raw request, take its serialized reply): ``handler`` the worker's interceptor
    around Q6ServeServicer.MatmulStream over a _StubEngine (``direct``: one answering on the
    direct path, ``run_now``); ``echo`` the proto echo handler (the harness's own cost).
    ``cpu``: gets each request's CPU seconds of this thread, where everything runs (on the
    shared VM it tracked the wall time: the other agents slow the core, not only take it)."""


    from q6serve.service.servicer import Q6ServeServicer

    worker = None
    if variant == "echo":
        handler = _echo_handler("proto", rows)
    else:
        if variant == "engine":
            worker = await _noop_worker(rows, k)
            servicer = Q6ServeServicer(worker.engine)
        else:
            servicer = Q6ServeServicer(_StubEngine(rows, variant == "direct"))  # type: ignore[arg-type]
        handler = await stream_handler(servicer)
    incoming, ctx, runner = start_stream(handler)
    serialize = handler.response_serializer
    out = []
    clock = time.thread_time if cpu is not None else time.perf_counter  # (a syscall: py-spy
    for _ in range(calls):  # slows it down many times over, so only when asked)
        c0 = clock()
        t0 = time.perf_counter()
        incoming.put_nowait(req)
        serialize(await ctx.written.get())
        out.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(clock() - c0)
    incoming.put_nowait(None)
    await runner
    if worker is not None:
        await worker.stop()
    return out


# -- the client -------------------------------------------------------------------------------
async def _roundtrips(target: str, req: bytes, seconds: float, warmup: float,
                      worker: bool, pid: int, stamped: bool = False, think: float = 0.0,
                      ) -> tuple[list[float], dict[str, float], int]:
    """Closed-loop round trips on one stream for ``seconds`` after ``warmup``: seconds each
    (``worker``, the worker's replies: minus the kernel time each reports); per round trip
    ("cpu", "loop", "sleeps") the server process's CPU seconds (``pid``, all threads; the
    worker's include its kernel), its main thread's (the event loop) and its threads'
    voluntary context switches; with ``stamped`` replies (bench/reply_stamps.py) the p50
    seconds of the way "up" (the write's start here to the server taking the raw request),
    of the server's "window" (raw request taken to reply encoded, minus the kernel) and of
    the way "down" (reply encoded to read here); and how many round trips ran in all (warm-up
    too: what the server's loop-trip counts cover). ``think``: seconds this client sleeps
    between a reply and its next request (not timed), so that the server's work after a
    reply cannot delay the next request."""
    import grpc

    from q6serve.client.channel import channel_options

    out: list[tuple[float, float, Any]] = []
    total = 0
    keep_raw = stamped and os.environ.get("KEEP_RAW") == "1"
    async with grpc.aio.insecure_channel(target, options=channel_options()) as ch:
        call = ch.stream_stream(METHOD)()
        before: dict[str, float] = {}
        for phase, span in (("warm", warmup), ("timed", seconds)):
            before = thread_counters(pid)  # the timed phase's start is what counts
            end = time.perf_counter() + span
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                await call.write(req)
                raw = await call.read()
                t1 = time.perf_counter()
                total += 1
                if phase == "timed":
                    # a stamped reply read here, after the timed span: keeping every
                    # reply's bytes (KEEP_RAW=1, as before) grows this process by ~15 KB a
                    # round trip, fresh pages to fault in on the way down
                    out.append((t0, t1, raw if keep_raw else _reply_times(raw, worker)
                                if stamped else None))
                if think:
                    time.sleep(think)  # (blocks this loop: one call in flight, nothing else)
        after = thread_counters(pid)
        stats = {name: (v - before.get(name, 0.0)) / max(1, len(out))
                 for name, v in after.items()}
        await call.done_writing()
    if not stamped:
        return [t1 - t0 for t0, t1, _ in out], stats, total
    lat, parts = [], collections.defaultdict(list)
    for t0, t1, got in out:
        kernel, got = _reply_times(got, worker) if isinstance(got, bytes) else got
        lat.append(t1 - t0 - kernel)
        if got is not None:
            start, end = got
            parts["up"].append(start - t0)
            parts["window"].append(end - start - kernel)
            parts["down"].append(t1 - end)
    stats.update({name: float(np.median(v)) for name, v in parts.items()})
    return lat, stats, total


def _reply_times(raw: bytes, worker: bool) -> tuple[float, tuple[float, float] | None]:
    """(the kernel's seconds, the reply's stamps or None) of a stamped reply."""
    import reply_stamps

    from q6serve.v1 import q6serve_pb2 as pb

    msg = pb.MatmulStreamResponse.FromString(raw)
    if msg.WhichOneof("outcome") != "result":
        raise RuntimeError(f"worker error: {msg.error.code} {msg.error.message}")
    kernel = msg.result.timing.kernel_seconds if worker else 0.0
    return kernel, reply_stamps.parse(msg.request_id)


def _request(k: int, itemsize: int = 2) -> bytes:
    from q6serve.v1 import q6serve_pb2 as pb

    x = np.random.default_rng(0).standard_normal((1, k)).astype(np.float16)
    req = pb.MatmulRequest(weight="w", precision=pb.PRECISION_F16,
                           out_dtype=pb.DTYPE_F16 if itemsize == 2 else pb.DTYPE_F32)
    req.x.dtype = pb.DTYPE_F16
    req.x.shape.extend(x.shape)
    req.x.data = x.tobytes()
    return req.SerializeToString()


class _Servers:
    """One running server per variant (started once; rounds reuse them)."""

    def __init__(self, variants: list[str], rows: int, k: int, log_dir: Path,
                 backend: str = "numpy", trips: bool = False, itemsize: int = 2) -> None:
        self.targets: dict[str, str] = {}
        # where each server writes its loop-trip counts at exit (--trips; no loop: sync ones)
        self.trips = {v: str(log_dir / f"trips-{v}.json") for v in variants
                      if v not in SYNC_VARIANTS} if trips else {}
        self.pids: dict[str, int] = {}
        self._procs: list[Any] = []
        self._workers: list[Any] = []
        ctx = mp.get_context("spawn")
        for v in variants:
            if v in WORKERS:
                self.targets[v] = self._start_worker(v, rows, k, log_dir, backend)
                self.pids[v] = self._workers[-1].proc.pid
                continue
            ports = ctx.Queue()
            as_v, env = ECHOES.get(v, (v, {}))
            if v in SYNC_VARIANTS:
                p = ctx.Process(target=_sync_server,
                                args=(v, rows, ports, k, backend, itemsize), daemon=True)
            else:
                p = ctx.Process(target=_echo_server,
                                args=(as_v, rows, ports, self.trips.get(v, ""), k, backend,
                                      itemsize), daemon=True)
            saved = {name: os.environ.get(name) for name in env}
            os.environ.update(env)  # (a spawned process starts with this one's environment)
            try:
                p.start()
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
            self._procs.append(p)
            self.pids[v] = p.pid
            self.targets[v] = f"127.0.0.1:{ports.get(timeout=60)}"

    def _start_worker(self, variant: str, rows: int, k: int, log_dir: Path,
                      backend: str) -> str:
        from q6serve.client.client import Client
        from q6serve.client.worker_process import WorkerProcess
        from q6serve.kernels import q6k

        env = dict(os.environ)
        # bench/trips_site/sitecustomize.py installs the reply stamps and the trip counter
        site = str(Path(__file__).resolve().parent / "trips_site")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (site, env.get("PYTHONPATH", "")) if p)
        os.environ["Q6SERVE_REPLY_STAMPS"] = "1"
        os.environ.update(WORKERS[variant])
        if variant in self.trips:
            os.environ["Q6SERVE_LOOP_TRIPS"] = self.trips[variant]
        try:
            worker = WorkerProcess(["--backend", backend], log_dir / f"{variant}.log").start()
        finally:
            os.environ.clear()
            os.environ.update(env)
        self._workers.append(worker)
        with Client(worker.target, timeout=120.0) as c:
            c.upload("w", q6k.random_blocks(rows, k, np.random.default_rng(0)), rows, k)
        return worker.target

    def close(self) -> None:
        for p in self._procs:
            p.terminate()
            p.join(10)
        for worker in self._workers:
            worker.stop()

    def trip_counts(self) -> dict[str, dict[str, Any]]:
        """What each server's loop-trip counter wrote at exit (after close())."""
        out = {}
        for v, path in self.trips.items():
            with contextlib.suppress(OSError, ValueError):
                out[v] = json.loads(Path(path).read_text())
        return out


_KEEPER = """import os
os.nice(19)
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    print("SCHED_IDLE", flush=True)
except (OSError, AttributeError) as e:
    print(f"nice 19 (SCHED_IDLE refused: {e})", flush=True)
while True:
    pass
"""


class _Keepers:
    """``n`` processes spinning at the lowest priority, stopped (SIGSTOP) except inside
    ``on(True)``. Where the kernel places a woken thread on a CPU that runs only a SCHED_IDLE
    task as on an idle one, and preempts that task at once, those CPUs never halt: what a
    round trip's ~7 thread wake-ups cost beyond that is the threads' own."""

    def __init__(self, n: int) -> None:
        import subprocess

        self.procs = [subprocess.Popen([sys.executable, "-c", _KEEPER],
                                       stdout=subprocess.PIPE, text=True) for _ in range(n)]
        self.policy = [p.stdout.readline().strip() for p in self.procs]  # type: ignore[union-attr]
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: int) -> None:
        for p in self.procs:
            os.kill(p.pid, sig)

    @contextlib.contextmanager
    def on(self, keep: bool) -> Any:
        if not keep or not self.procs:
            yield
            return
        self._signal(signal.SIGCONT)
        try:
            yield
        finally:
            self._signal(signal.SIGSTOP)

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def thread_counters(pid: int) -> dict[str, float]:
    """Counters of process ``pid``'s threads alive now (Linux /proc): "cpu" (seconds on the
    CPU, all threads, in ns steps: schedstat), "loop" (the main thread's: the event loop),
    "sleeps" (voluntary context switches: a thread going to sleep; per round trip, the thread
    hand-offs), "faults" (minor page faults), and per thread name (comm; the main thread is
    "main") "cpu:NAME" and "sleeps:NAME" (threads of one name summed)."""
    out: dict[str, float] = collections.defaultdict(float)
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError, StopIteration):
            ns = int((task / "schedstat").read_text().split()[0])
            name = "main" if task.name == str(pid) else (task / "comm").read_text().strip()
            vol = next(int(line.split()[1])
                       for line in (task / "status").read_text().splitlines()
                       if line.startswith("voluntary_ctxt_switches"))
            minflt = int((task / "stat").read_text().rpartition(")")[2].split()[7])
            out["cpu"] += ns * 1e-9
            out["sleeps"] += vol
            out["faults"] += minflt
            out[f"cpu:{name}"] += ns * 1e-9
            out[f"sleeps:{name}"] += vol
    out["loop"] = out["cpu:main"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of {', '.join(VARIANTS)} (default all)")
    ap.add_argument("--rounds", type=int, default=5, help="alternations of all variants")
    ap.add_argument("--seconds", type=float, default=2.0, help="timed seconds per variant")
    ap.add_argument("--warmup", type=float, default=0.3, help="untimed seconds first")
    ap.add_argument("--k", type=int, default=18944, help="x columns (default ffn_down's)")
    ap.add_argument("--rows", type=int, default=7, help="y values (the weight's rows)")
    ap.add_argument("--out", default="f16", choices=("f16", "f32"),
                    help="y's dtype (T1's, bench/service.py's: f32)")
    ap.add_argument("--inproc", type=int, default=10000, metavar="CALLS",
                    help="also drive the handler in this process, no gRPC: CALLS requests per "
                         "round through the interceptor and MatmulStream over a stub engine, "
                         "and through the proto echo handler (0: skip; default 10000)")
    ap.add_argument("--trips", action="store_true",
                    help="count each server's event-loop trips per round trip and the "
                         "callbacks they run (bench/loop_trips.py)")
    ap.add_argument("--timeline", type=int, default=0, metavar="TRIPS",
                    help="with --trips: print this many consecutive loop trips of each "
                         "server (µs in the selector, each callback's µs)")
    ap.add_argument("--pin", default="", metavar="SERVER_CPUS:CLIENT_CPUS",
                    help="pin every server process (all its threads) to SERVER_CPUS and this "
                         "client to CLIENT_CPUS, e.g. 2,3:4,5 (is it the wake-ups' moves "
                         "between cores that make each request's Python slow?)")
    ap.add_argument("--think", default="0", metavar="US[,US...]",
                    help="the client sleeps this long between a reply and its next request "
                         "(does the server's work after a reply delay the next request?); "
                         "several: each variant runs under each (labels VARIANT@US)")
    ap.add_argument("--keepers", type=int, default=0, metavar="N",
                    help="also run every variant with N keeper processes spinning at the "
                         "lowest priority (SCHED_IDLE where allowed, else nice 19; labels "
                         "LABEL~keep, alternated with the plain runs): do the round trips "
                         "pay for idle CPUs going to sleep, whose wake-up a preemptible "
                         "spinner would save?")
    ap.add_argument("--backend", default="numpy", choices=("numpy", "cuda"),
                    help="the worker variant's backend")
    a = ap.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    if bad := [v for v in variants if v not in VARIANTS and not v.startswith("bare+")]:
        ap.error(f"unknown variant(s) {', '.join(bad)}; choose from {', '.join(VARIANTS)} "
                 "or bare+FEATURE[+FEATURE...]")
    try:
        for v in variants:
            _features(v)
    except ValueError as e:
        ap.error(str(e))
    if a.k % 256:
        ap.error("--k must be a multiple of 256 (Q6_K blocks)")
    itemsize = 2 if a.out == "f16" else 4
    req = _request(a.k, itemsize)
    thinks = [float(t) for t in a.think.split(",") if t]
    # (label, variant, think us, keepers on): each variant under each think time, and with
    # --keepers each of those again with the keepers running
    runs = [(v if len(thinks) == 1 and not t else f"{v}@{t:g}", v, t) for v in variants
            for t in thinks]
    runs4 = [(f"{label}~keep" if keep else label, v, t, keep) for label, v, t in runs
             for keep in ((False, True) if a.keepers else (False,))]
    p50: dict[str, list[float]] = {label: [] for label, *_ in runs4}
    p99: dict[str, list[float]] = {label: [] for label, *_ in runs4}
    stats: dict[str, dict[str, list[float]]] = {label: collections.defaultdict(list)
                                                for label, *_ in runs4}
    calls = dict.fromkeys(variants, 0)
    keepers = _Keepers(a.keepers)
    if a.keepers:
        print(f"# keepers: {a.keepers} processes, {', '.join(sorted(set(keepers.policy)))}",
              flush=True)
    with tempfile.TemporaryDirectory(prefix="q6stream-") as tmp, contextlib.closing(keepers):
        servers = _Servers(variants, a.rows, a.k, Path(tmp), a.backend, a.trips, itemsize)
        # (for a profiler attached from outside, e.g. py-spy record -p PID)
        print("# server pids: " + " ".join(f"{v}={pid}" for v, pid in servers.pids.items()),
              flush=True)
        if a.pin:
            from q6serve.service.affinity import parse_cpus, pin_process

            srv, cli = (parse_cpus(part) for part in a.pin.split(":"))
            for pid in servers.pids.values():
                pin_process(srv, pid)
            pin_process(cli)
        try:
            for r in range(a.rounds):
                # with keepers: without and with alternate, their order flipped every round
                step = 2 if a.keepers else 1
                order = runs4 if r % 2 == 0 else [
                    x for i in range(0, len(runs4), step) for x in reversed(runs4[i:i + step])]
                for label, v, think, keep in order:
                    with keepers.on(keep):
                        lat, got, n = asyncio.run(_roundtrips(
                            servers.targets[v], req, a.seconds, a.warmup,
                            v in WORKERS or v == "sync" or "job" in _features(v),
                            servers.pids[v], _stamped(v), think * 1e-6))
                    p50[label].append(float(np.median(lat)) * 1e6)
                    p99[label].append(float(np.percentile(lat, 99)) * 1e6)
                    for name, value in got.items():
                        stats[label][name].append(
                            value * (1 if name.startswith(("sleeps", "faults")) else 1e6))
                    calls[v] += n
                print(f"# round {r + 1}: " + "  ".join(f"{label} {p50[label][-1]:.0f}"
                                                       for label, *_ in runs4), flush=True)
        finally:
            servers.close()
        trips = servers.trip_counts()
    inproc: dict[str, list[float]] = {"echo": [], "handler": [], "engine": []}
    inproc_cpu: dict[str, list[float]] = {v: [] for v in inproc}
    for _ in range(a.rounds if a.inproc > 0 else 0):
        for v, got in inproc.items():
            cpu: list[float] = []
            got.append(float(np.median(asyncio.run(_inproc(v, req, a.rows, a.inproc,
                                                            a.k, cpu)))) * 1e6)
            inproc_cpu[v].append(float(np.median(cpu)) * 1e6)
    # each run against the bare echo under the same think time
    base = {(t, k): statistics.median(p50[label]) for label, v, t, k in runs4 if v == "bare"}
    sbase = {(t, k): statistics.median(p50[label]) for label, v, t, k in runs4
             if v == "sbare"}
    print(f"# K={a.k} rows={a.rows} y {a.out}, {a.rounds} rounds x {a.seconds} s; medians over "
          "rounds of: p50 (and p99) us per round trip (worker, sync: minus the kernel); server "
          "CPU us per round "
          "trip (worker: with its kernel), of which its loop thread's; its threads' sleeps "
          "(voluntary context switches) per round trip; servers with stamped replies "
          "(bench/reply_stamps.py): the way up (write here -> raw request taken there), the "
          "server's window (-> reply encoded, minus the kernel) and the way down (-> read here)")
    width = max([8, *(len(label) for label, *_ in runs4)])  # (no runs: --variants '')
    for v, variant, think, keep in runs4:
        med = statistics.median(p50[v])
        st = {name: statistics.median(got) for name, got in stats[v].items()}
        extra = (f"  +{med - base[think, keep]:5.0f} over bare"
                 if (think, keep) in base and variant != "bare" else "")
        extra += (f"  +{med - sbase[think, keep]:5.0f} over sbare"
                  if (think, keep) in sbase and variant not in ("bare", "sbare") else "")
        window = (f"  up {st['up']:4.0f} window {st['window']:4.0f} down {st['down']:4.0f}"
                  if "window" in st else "")
        print(f"{v:{width}s} median {med:6.0f}  range {min(p50[v]):6.0f}-{max(p50[v]):6.0f}"
              f"  p99 {statistics.median(p99[v]):6.0f}"
              f"  server cpu/trip {st['cpu']:5.0f} (loop {st['loop']:4.0f})"
              f"  sleeps/trip {st['sleeps']:4.2f}  faults/trip {st['faults']:5.1f}{window}{extra}")
        threads = sorted((n.partition(":")[2] for n in st if n.startswith("sleeps:")),
                         key=lambda n: -st[f"sleeps:{n}"])
        print(" " * width + "  threads (sleeps, cpu us per round trip): " + ", ".join(
            f"{n} {st[f'sleeps:{n}']:.2f} {st[f'cpu:{n}']:.0f}" for n in threads
            if st[f"sleeps:{n}"] >= 0.05 or st[f"cpu:{n}"] >= 5))
    for v, t in trips.items():
        n = max(1, calls[v])
        cpu = t.get("callback_cpu_us", {})
        cbs = ", ".join(f"{name} {c / n:.2f} ({cpu.get(name, 0.0) / max(1, c):.1f} us CPU each)"
                        for name, c in t["callbacks"].items()
                        if c / n >= 0.1)
        print(f"{v:{width}s} loop trips per round trip {t['trips'] / n:.2f} (slept first "
              f"{t['slept'] / n:.2f}); callbacks per round trip: {cbs}")
        if st := t.get("request_steps"):  # the loop steps that took a request and encoded
            post_cpu = "" if st["post_cpu_us"] is None else f" (CPU {st['post_cpu_us']:.1f})"
            print(f"{v:{width}s} request step (median of {st['n']}): taken after "  # its reply
                  f"{st['pre_us']:.1f} us, encoded {st['window_us']:.1f} us later, then "
                  f"{st['post_us']:.1f} us to the step's end{post_cpu}; step CPU "
                  f"{st['step_cpu_us']:.1f} us")
            if marks := st.get("marks_us"):  # Q6SERVE_STEP_MARKS=1: loop_trips.install_marks
                print(f"{v:{width}s} its marks (median us from the step's start): " + ", ".join(
                    f"{label} {us:.1f}" for label, us in marks.items()))
        if a.timeline:
            for tr in t.get("timeline", [])[: a.timeline]:
                cb = " ".join(f"{c[0]}:{c[1]}" + (f"/cpu {c[2]}" if len(c) > 2 else "")
                              + ("".join(f" [{m[0]} @{m[1]}]" for m in c[3])
                                 if len(c) > 3 else "") for c in tr["callbacks"])
                print(f"    {tr['t_us']:9.1f} {'sleep' if tr['slept'] else 'ready'} "
                      f"select {tr['select_us']:6.1f}  {cb}")
    if inproc["echo"]:
        echo, ours, eng = (statistics.median(inproc[v]) for v in ("echo", "handler", "engine"))
        print(f"in process, no gRPC (p50 us per request, decode + reply serialized): proto echo "
              f"{echo:.1f}, interceptor + MatmulStream over a stub engine {ours:.1f} "
              f"(+{ours - echo:.1f}), over the Engine on a no-op backend {eng:.1f} "
              f"(+{eng - echo:.1f}); per round: "
              + " ".join(f"{v}=" + "/".join(f"{x:.1f}" for x in got)
                         for v, got in inproc.items()))
        echo, ours, eng = (statistics.median(inproc_cpu[v])
                           for v in ("echo", "handler", "engine"))
        print(f"the same, this thread's CPU time (p50 us per request): proto echo {echo:.1f}, "
              f"stub engine {ours:.1f} (+{ours - echo:.1f}), Engine {eng:.1f} "
              f"(+{eng - echo:.1f}); per round: "
              + " ".join(f"{v}=" + "/".join(f"{x:.1f}" for x in got)
                         for v, got in inproc_cpu.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
