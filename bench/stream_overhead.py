"""Where a MatmulStream round trip's time goes beyond gRPC's own (issue 14, target T1).

One caller, one request in flight on one stream, closed loop, N=1 f16 activations of K
columns and a y of ROWS f16 values (the T1 shape: ffn_down K=18944; ROWS small so NumPy's
kernel is a few µs and is subtracted anyway). Each variant is a server in its own spawned
process; this process is the client (raw bytes both ways, nothing decoded in the timed part):

  bare    bytes echo, generic handler, ``async for req in it: yield reply``: gRPC's floor
  proto   + the MatmulRequest decoded (wire.read_matmul_request) and a MatmulStreamResponse
          built and serialized per reply
  struct  proto + the servicer's structure: a reader task, the reply made a loop trip later
          (the batcher's sink) and put on an asyncio.Queue, a response generator yielding
          from the queue
  icpt    proto + the worker's ErrorInterceptor (auth, metrics, per-message decoding)
  servicer the worker's own server (service/worker.py build_server: options, interceptor,
          health, reflection) and Q6ServeServicer.MatmulStream, over an engine whose
          start_matmul answers a loop trip later with a ready reply (no batcher, no kernel)
  engine  the real worker (service/worker.py Worker: server, interceptor, servicer, Engine,
          batcher, metrics) in process over a no-op NumPy backend (y zeros, kernel 0): all of
          the service's per-request Python and none of a kernel's
  worker  the real worker (``q6serve worker --backend numpy``): servicer, batcher, NumPy
          kernel, interceptor, server options; its figure is p50 of (round trip - the
          kernel_seconds its reply reports)

``--trips``: every server counts its event-loop trips and the callbacks they run
(bench/loop_trips.py); the table then gives loop trips per round trip and the callbacks that
run more than once per 10 round trips. ``--backend cuda``: the worker variant on the GPU.

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
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

VARIANTS = ("bare", "proto", "struct", "icpt", "servicer", "engine", "worker")
METHOD = "/q6serve.v1.Q6Serve/MatmulStream"


# -- servers (each runs in a spawned process) -------------------------------------------------
def _reply_message(pb: Any, req: Any, y: bytes, rows: int) -> Any:
    """A MatmulStreamResponse like the worker's for a result (y, shape, timing)."""
    msg = pb.MatmulStreamResponse(request_id=req.request_id)
    r = msg.result
    r.y.dtype = pb.DTYPE_F16
    r.y.shape.extend((1, rows))
    r.y.data = y
    r.kernel = "numpy"
    r.timing.queue_seconds = 1e-6
    r.timing.kernel_seconds = 1e-6
    r.timing.batch_rows = 1
    r.timing.batch_requests = 1
    return msg


def _echo_handler(variant: str, rows: int) -> Any:
    """The stream handler of an echo variant and its (de)serializers."""
    import grpc

    from q6serve.service import wire
    from q6serve.v1 import q6serve_pb2 as pb

    y = b"\0" * (2 * rows)
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
        handler, request_deserializer=wire.read_matmul_request,
        response_serializer=pb.MatmulStreamResponse.SerializeToString)


class _StubEngine:
    """What Q6ServeServicer.MatmulStream asks of an engine, answering each call a loop trip
    later through its sink (as the batcher does) with a ready reply of ``rows`` f16 values."""

    takes_multi_weight = False
    serving = True

    def __init__(self, rows: int) -> None:
        from q6serve.kernels.api import Layout, Precision
        from q6serve.service.batcher import MatmulReply

        self.view = type("View", (), {"rows": rows})()
        self.reply = MatmulReply(np.zeros((1, rows), np.float16), "stub", Layout.SOA,
                                 Precision.F16, 1e-6, 1e-6, 1, 1, 1e-6)

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


async def _servicer_server(rows: int) -> Any:
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
    servicer = Q6ServeServicer(_StubEngine(rows),  # type: ignore[arg-type]
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


def _echo_server(variant: str, rows: int, ports: Any, trips: str = "", k: int = 0) -> None:
    import grpc

    if trips:
        import loop_trips

        loop_trips.install(trips, sigterm=True)

    from q6serve.client.channel import channel_options

    async def serve() -> None:
        if variant == "engine":
            worker = await _noop_worker(rows, k)
            ports.put(worker.port)
            await worker.server.wait_for_termination()
            return
        if variant == "servicer":
            server, port = await _servicer_server(rows)
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
        handler = _echo_handler("proto" if variant == "icpt" else variant, rows)
        service, _, name = METHOD.lstrip("/").rpartition("/")
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(service, {name: handler})])
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


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


async def _inproc(variant: str, req: bytes, rows: int, calls: int, k: int) -> list[float]:
    """Seconds per request of one stream's handler driven directly (one request in flight:
    hand it a raw request, take its serialized reply): ``handler`` the worker's interceptor
    around Q6ServeServicer.MatmulStream over a _StubEngine; ``echo`` the proto echo handler
    (the harness's own cost)."""
    from collections import namedtuple

    import grpc
    from prometheus_client import CollectorRegistry

    from q6serve.service import wire
    from q6serve.service.interceptor import ErrorInterceptor
    from q6serve.service.metrics import Metrics
    from q6serve.service.servicer import Q6ServeServicer

    worker = None
    if variant == "echo":
        handler = _echo_handler("proto", rows)
    else:
        if variant == "engine":
            worker = await _noop_worker(rows, k)
            servicer = Q6ServeServicer(worker.engine)
        else:
            servicer = Q6ServeServicer(_StubEngine(rows))  # type: ignore[arg-type]
        inner = grpc.stream_stream_rpc_method_handler(
            servicer.MatmulStream, request_deserializer=wire.read_matmul_request,
            response_serializer=wire._bytes_or(wire.pb.MatmulStreamResponse.SerializeToString))
        metrics = Metrics(CollectorRegistry(), version="bench", backend="numpy", device="cpu")
        details = namedtuple("Details", "method invocation_metadata")(METHOD, ())

        async def continuation(_: Any) -> Any:
            return inner

        handler = await ErrorInterceptor(metrics).intercept_service(continuation, details)
    incoming: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def requests() -> Any:
        while (raw := await incoming.get()) is not None:
            yield raw if handler.request_deserializer is None else \
                handler.request_deserializer(raw)

    ctx = _Context()

    async def run() -> None:  # as gRPC iterates a handler: what it yields is written
        async for item in handler.stream_stream(requests(), ctx):
            await ctx.write(item)

    runner = asyncio.get_running_loop().create_task(run())
    serialize = handler.response_serializer
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        incoming.put_nowait(req)
        serialize(await ctx.written.get())
        out.append(time.perf_counter() - t0)
    incoming.put_nowait(None)
    await runner
    if worker is not None:
        await worker.stop()
    return out


# -- the client -------------------------------------------------------------------------------
async def _roundtrips(target: str, req: bytes, seconds: float, warmup: float,
                      worker: bool, pid: int) -> tuple[list[float], float, int]:
    """Closed-loop round trips on one stream for ``seconds`` after ``warmup``: seconds each
    (the worker's: minus the kernel time its reply reports), the server process's CPU
    seconds per round trip (``pid``, all threads; the worker's include its kernel), and how
    many round trips ran in all (warm-up too: what the server's loop-trip counts cover)."""
    import grpc

    from q6serve.client.channel import channel_options
    from q6serve.v1 import q6serve_pb2 as pb

    out: list[tuple[float, bytes]] = []
    total = 0
    async with grpc.aio.insecure_channel(target, options=channel_options()) as ch:
        call = ch.stream_stream(METHOD)()
        cpu = 0.0
        for phase, span in (("warm", warmup), ("timed", seconds)):
            cpu = cpu_seconds(pid)  # the timed phase's start is what counts
            end = time.perf_counter() + span
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                await call.write(req)
                raw = await call.read()
                dt = time.perf_counter() - t0
                total += 1
                if phase == "timed":
                    out.append((dt, raw if worker else b""))
        cpu = (cpu_seconds(pid) - cpu) / max(1, len(out))
        await call.done_writing()
    if not worker:
        return [dt for dt, _ in out], cpu, total
    lat = []
    for dt, raw in out:
        msg = pb.MatmulStreamResponse.FromString(raw)
        if msg.WhichOneof("outcome") != "result":
            raise RuntimeError(f"worker error: {msg.error.code} {msg.error.message}")
        lat.append(dt - msg.result.timing.kernel_seconds)
    return lat, cpu, total


def _request(k: int) -> bytes:
    from q6serve.v1 import q6serve_pb2 as pb

    x = np.random.default_rng(0).standard_normal((1, k)).astype(np.float16)
    req = pb.MatmulRequest(weight="w", precision=pb.PRECISION_F16, out_dtype=pb.DTYPE_F16)
    req.x.dtype = pb.DTYPE_F16
    req.x.shape.extend(x.shape)
    req.x.data = x.tobytes()
    return req.SerializeToString()


class _Servers:
    """One running server per variant (started once; rounds reuse them)."""

    def __init__(self, variants: list[str], rows: int, k: int, log_dir: Path,
                 backend: str = "numpy", trips: bool = False) -> None:
        self.targets: dict[str, str] = {}
        # where each server writes its loop-trip counts at exit (--trips)
        self.trips = {v: str(log_dir / f"trips-{v}.json") for v in variants} if trips else {}
        self.pids: dict[str, int] = {}
        self._procs: list[Any] = []
        self._worker: Any = None
        ctx = mp.get_context("spawn")
        for v in variants:
            if v == "worker":
                self.targets[v] = self._start_worker(rows, k, log_dir, backend)
                self.pids[v] = self._worker.proc.pid
                continue
            ports = ctx.Queue()
            p = ctx.Process(target=_echo_server,
                            args=(v, rows, ports, self.trips.get(v, ""), k), daemon=True)
            p.start()
            self._procs.append(p)
            self.pids[v] = p.pid
            self.targets[v] = f"127.0.0.1:{ports.get(timeout=60)}"

    def _start_worker(self, rows: int, k: int, log_dir: Path, backend: str) -> str:
        from q6serve.client.client import Client
        from q6serve.client.worker_process import WorkerProcess
        from q6serve.kernels import q6k

        env = dict(os.environ)
        if "worker" in self.trips:  # bench/trips_site/sitecustomize.py installs the counter
            site = str(Path(__file__).resolve().parent / "trips_site")
            os.environ["PYTHONPATH"] = os.pathsep.join(
                p for p in (site, env.get("PYTHONPATH", "")) if p)
            os.environ["Q6SERVE_LOOP_TRIPS"] = self.trips["worker"]
        try:
            self._worker = WorkerProcess(["--backend", backend], log_dir / "worker.log").start()
        finally:
            os.environ.clear()
            os.environ.update(env)
        with Client(self._worker.target, timeout=120.0) as c:
            c.upload("w", q6k.random_blocks(rows, k, np.random.default_rng(0)), rows, k)
        return self._worker.target

    def close(self) -> None:
        for p in self._procs:
            p.terminate()
            p.join(10)
        if self._worker is not None:
            self._worker.stop()

    def trip_counts(self) -> dict[str, dict[str, Any]]:
        """What each server's loop-trip counter wrote at exit (after close())."""
        out = {}
        for v, path in self.trips.items():
            with contextlib.suppress(OSError, ValueError):
                out[v] = json.loads(Path(path).read_text())
        return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of {', '.join(VARIANTS)} (default all)")
    ap.add_argument("--rounds", type=int, default=5, help="alternations of all variants")
    ap.add_argument("--seconds", type=float, default=2.0, help="timed seconds per variant")
    ap.add_argument("--warmup", type=float, default=0.3, help="untimed seconds first")
    ap.add_argument("--k", type=int, default=18944, help="x columns (default ffn_down's)")
    ap.add_argument("--rows", type=int, default=7, help="y values (the weight's rows)")
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
    ap.add_argument("--backend", default="numpy", choices=("numpy", "cuda"),
                    help="the worker variant's backend")
    a = ap.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    if bad := [v for v in variants if v not in VARIANTS]:
        ap.error(f"unknown variant(s) {', '.join(bad)}; choose from {', '.join(VARIANTS)}")
    if a.k % 256:
        ap.error("--k must be a multiple of 256 (Q6_K blocks)")
    req = _request(a.k)
    p50: dict[str, list[float]] = {v: [] for v in variants}
    cpu_us: dict[str, list[float]] = {v: [] for v in variants}
    calls = dict.fromkeys(variants, 0)
    with tempfile.TemporaryDirectory(prefix="q6stream-") as tmp:
        servers = _Servers(variants, a.rows, a.k, Path(tmp), a.backend, a.trips)
        if a.pin:
            from q6serve.service.affinity import parse_cpus, pin_process

            srv, cli = (parse_cpus(part) for part in a.pin.split(":"))
            for pid in servers.pids.values():
                pin_process(srv, pid)
            pin_process(cli)
        try:
            for r in range(a.rounds):
                for v in variants:
                    lat, cpu, n = asyncio.run(_roundtrips(servers.targets[v], req, a.seconds,
                                                          a.warmup, v == "worker",
                                                          servers.pids[v]))
                    p50[v].append(float(np.median(lat)) * 1e6)
                    cpu_us[v].append(cpu * 1e6)
                    calls[v] += n
                print(f"# round {r + 1}: " + "  ".join(f"{v} {p50[v][-1]:.0f}"
                                                       for v in variants), flush=True)
        finally:
            servers.close()
        trips = servers.trip_counts()
    inproc: dict[str, list[float]] = {"echo": [], "handler": [], "engine": []}
    for _ in range(a.rounds if a.inproc > 0 else 0):
        for v, got in inproc.items():
            got.append(float(np.median(asyncio.run(_inproc(v, req, a.rows, a.inproc,
                                                            a.k)))) * 1e6)
    base = statistics.median(p50["bare"]) if "bare" in p50 else None
    print(f"# K={a.k} rows={a.rows}, {a.rounds} rounds x {a.seconds} s; p50 us per round trip "
          "(worker: minus its kernel); server CPU us per round trip (worker: with its kernel)")
    for v in variants:
        med = statistics.median(p50[v])
        extra = f"  +{med - base:5.0f} over bare" if base is not None and v != "bare" else ""
        print(f"{v:8s} median {med:6.0f}  range {min(p50[v]):6.0f}-{max(p50[v]):6.0f}"
              f"  server cpu/trip {statistics.median(cpu_us[v]):5.0f}{extra}")
    for v, t in trips.items():
        n = max(1, calls[v])
        cbs = ", ".join(f"{name} {c / n:.2f}" for name, c in t["callbacks"].items()
                        if c / n >= 0.1)
        print(f"{v:8s} loop trips per round trip {t['trips'] / n:.2f} (slept first "
              f"{t['slept'] / n:.2f}); callbacks per round trip: {cbs}")
        if a.timeline:
            for tr in t.get("timeline", [])[: a.timeline]:
                cb = " ".join(f"{name}:{us}" for name, us in tr["callbacks"])
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
