"""The load side of bench/service.py: host processes running closed-loop callers, and the
bare-gRPC floor (an echo server with the same message sizes).

Everything here runs in processes started with multiprocessing's spawn method; they import
this module by name (bench/ is on their sys.path, as it is on the parent's).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from q6serve.client import core, grpc_env
from q6serve.service.heap import MMAP_THRESHOLD, fix_heap_thresholds
from q6serve.v1 import q6serve_pb2 as pb

FIELDS = ("e2e", "encode", "rpc", "decode", "queue", "kernel", "device", "srv_decode",
          "handler", "batch_rows", "batch_requests", "reply_bytes")
MATMUL = "/q6serve.v1.Q6Serve/Matmul"
SERVER_CPUS: tuple[int, ...] = ()  # bench/service.py --pin: the echo floor's cores (worker's)
MATMUL_STREAM = "/q6serve.v1.Q6Serve/MatmulStream"
REGISTER = "/q6serve.v1.Q6Serve/RegisterRegion"
UNREGISTER = "/q6serve.v1.Q6Serve/UnregisterRegion"


# -- load generator (runs in spawned host processes) ------------------------------------------
@dataclass(frozen=True)
class LoadSpec:
    target: str
    weights: tuple[tuple[str, int], ...]  # (name, K) in step order
    callers: int  # per host
    n: int  # rows per call
    seconds: float
    warmup: float
    mode: str  # unary | stream
    dtype: str  # f32 | f16
    precision: int  # pb Precision value
    topk: int = 0  # > 0: the top-k epilogue instead of y (f32 values, int32 indices, lse)
    # issue 15: "system" / "cuda": each caller registers a region and passes x and y through
    # it (the request carries dtype and shape only; system: x copied in every call, as a
    # caller producing activations in host memory would; cuda: x written once, as if produced
    # on the GPU); "": bytes in the messages
    region: str = ""
    y_cols: int = 0  # the widest weight's rows: the y area of a caller's region
    own_channel: bool = False  # a connection per caller (spread over --frontends) or per host


def request_bytes(pb: Any, weights: tuple[str, ...], x: np.ndarray, precision: int,
                  out_dtype: str = "f32", topk: int = 0, rid: str = "") -> bytes:
    """A serialized MatmulRequest (one weight, or several: a multi-weight request) as the
    q6serve client writes it (client/core.matmul_request_bytes: x's bytes copied once);
    x's dtype is f16 or f32."""
    weight = weights[0] if len(weights) == 1 else list(weights)
    return core.matmul_request_bytes(weight, x, _precision_names()[precision], out_dtype, rid,
                                     topk=topk or None)


def reply_message(raw: bytes, stream: bool) -> Any:
    """The MatmulResponse of a raw reply (a stream's error reply raises)."""
    if not stream:
        return pb.MatmulResponse.FromString(raw)
    msg = pb.MatmulStreamResponse.FromString(raw)
    if msg.WhichOneof("outcome") != "result":
        raise RuntimeError(f"stream error: {msg.error.code} {msg.error.message}")
    return msg.result


def reply_arrays(r: Any, y_region: Any = None) -> Any:
    """What a host takes from a reply, as the q6serve client reads it: y (Client.matmul's
    response_y), each weight's y of a multi-weight reply, or the top-k arrays."""
    if r.HasField("topk"):
        return core.decode_topk(r.topk)
    if len(r.outputs):
        return [core.response_y(o) for o in r.outputs]
    return core.response_y(r, y_region)


@functools.cache
def _precision_names() -> dict[int, str]:
    return {v: k for k, v in core.PRECISIONS.items()}


def nan_if_none(v: float | None) -> float:
    return float("nan") if v is None else v


def _record(pb: Any, out: dict[str, list[float]], t: tuple[float, float, float],
            raw: bytes, stream: bool, region: Any = None) -> None:
    """Decode the reply (timed: client_decode) and append this call's figures. ``region``:
    the caller's region (y is a view of it there, as the client helper returns it)."""
    t0, t1, t2 = t
    r = reply_message(raw, stream)
    y_region = None if region is None else (region, region.y_offset)
    reply_arrays(r, y_region)
    t3 = time.perf_counter()
    # the timing, read after the timed decode (a host wanting y skips it); y in the region
    o = core.output_of(r, y_region)
    for key, v in (("e2e", t3 - t0), ("encode", t1 - t0), ("rpc", t2 - t1),
                   ("decode", t3 - t2), ("queue", o.queue_seconds),
                   ("kernel", nan_if_none(o.kernel_seconds)),
                   ("device", nan_if_none(o.device_seconds)),
                   ("srv_decode", nan_if_none(o.decode_seconds)),
                   ("handler", nan_if_none(o.handler_seconds)),
                   ("batch_rows", o.batch_rows), ("batch_requests", o.batch_requests),
                   ("reply_bytes", len(raw))):
        out[key].append(v)


class _Mux:
    """``--mode mux``: one MatmulStream per host shared by all its callers, replies matched
    to callers by request_id (how a host could multiplex many sequences over one stream)."""

    def __init__(self, channel: Any) -> None:
        import asyncio

        self.call = channel.stream_stream(MATMUL_STREAM)()
        self.waiting: dict[bytes, asyncio.Future[bytes]] = {}
        self.lock = asyncio.Lock()  # one write at a time on a stream
        self.reader = asyncio.get_running_loop().create_task(self._read())

    @staticmethod
    def request_id(raw: bytes) -> bytes:
        """Field 1 of a MatmulStreamResponse, serialised first: tag 0x0a, length, bytes."""
        return raw[2 : 2 + raw[1]] if raw[:1] == b"\x0a" else b""

    async def _read(self) -> None:
        import grpc

        while (raw := await self.call.read()) is not grpc.aio.EOF:
            fut = self.waiting.pop(self.request_id(raw), None)
            if fut is not None and not fut.done():
                fut.set_result(raw)

    async def roundtrip(self, req: bytes, rid: str) -> bytes:
        import asyncio

        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.waiting[rid.encode()] = fut
        async with self.lock:
            await self.call.write(req)
        return await fut

    async def close(self) -> None:
        await self.call.done_writing()
        await self.reader


async def _open_region(channel: Any, pb: Any, spec: LoadSpec, idx: int,
                       xs: dict[int, np.ndarray]) -> Any:
    """Create and register this caller's region: x of every K, then y's area. Its
    ``x_offset`` maps K -> offset; ``y_offset`` is where the worker writes y."""
    import os

    from q6serve.client.shm import ALIGN, CudaRegion, ShmRegion

    def up(n: int) -> int:
        return -(-n // ALIGN) * ALIGN

    offsets, at = {}, 0
    for k, x in xs.items():
        offsets[k] = at
        at += up(x.nbytes)
    name = f"load{os.getpid()}_{idx}"
    size = at + spec.n * max(spec.y_cols, 1) * 4
    region = (CudaRegion.create(name, size) if spec.region == "cuda"
              else ShmRegion.create(name, size))
    region.x_offset, region.y_offset = offsets, at
    for k, x in xs.items():
        region.put(offsets[k], x)
    await channel.unary_unary(REGISTER)(region.register_request().SerializeToString(),
                                        timeout=60.0)
    return region


async def _close_region(channel: Any, pb: Any, region: Any) -> None:
    req = pb.UnregisterRegionRequest(name=region.name).SerializeToString()
    await channel.unary_unary(UNREGISTER)(req, timeout=60.0)
    region.close()


def _region_request(pb: Any, spec: LoadSpec, name: str, x: np.ndarray, region: Any,
                    rid: str = "") -> bytes:
    """A request naming the caller's region for x and y (the same bytes every call)."""
    req = pb.MatmulRequest(weight=name, precision=spec.precision, out_dtype=pb.DTYPE_F32,
                           request_id=rid)
    req.x.dtype = pb.DTYPE_F16 if spec.dtype == "f16" else pb.DTYPE_F32
    req.x.shape.extend(x.shape)
    req.x_region.region = region.name
    req.x_region.offset = region.x_offset[x.shape[1]]
    req.y_region.region = region.name
    req.y_region.offset = region.y_offset
    return req.SerializeToString()


async def _caller(channel: Any, spec: LoadSpec, idx: int, until: list[float],
                  rec: dict[str, dict[str, list[float]]] | None, mux: _Mux | None = None,
                  ) -> None:
    import contextlib

    import grpc

    from q6serve.client.channel import channel_options
    from q6serve.v1 import q6serve_pb2 as pb

    async with contextlib.AsyncExitStack() as stack:
        if spec.own_channel:  # its own connection (a front end per connection, issue 15)
            opts = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
            channel = await stack.enter_async_context(
                grpc.aio.insecure_channel(spec.target, options=opts))
        await _calls(channel, pb, spec, idx, until, rec, mux)


async def _calls(channel: Any, pb: Any, spec: LoadSpec, idx: int, until: list[float],
                 rec: dict[str, dict[str, list[float]]] | None, mux: _Mux | None) -> None:
    rng = np.random.default_rng(idx)
    dt = np.float16 if spec.dtype == "f16" else np.float32
    xs = {k: rng.standard_normal((spec.n, k)).astype(dt) for k in {k for _, k in spec.weights}}
    region = await _open_region(channel, pb, spec, idx, xs) if spec.region else None
    fixed = {}
    if region is not None:
        fixed = {name: _region_request(pb, spec, name, xs[k], region)
                 for name, k in spec.weights}
        xviews = {k: region.ndarray(region.x_offset[k], x.dtype, x.shape)
                  for k, x in xs.items()}
    unary = channel.unary_unary(MATMUL)  # raw bytes both ways: we time (de)serialization
    stream = None
    if spec.mode == "stream":
        stream = channel.stream_stream(MATMUL_STREAM)()
    step = 0
    while time.perf_counter() < until[0]:
        name, k = spec.weights[step % len(spec.weights)]
        step += 1
        rid = f"{idx}.{step}" if mux is not None else ""
        t0 = time.perf_counter()
        if region is None:
            req = request_bytes(pb, (name,), xs[k], spec.precision, topk=spec.topk, rid=rid)
        else:
            if spec.region == "system":
                xviews[k][...] = xs[k]  # this call's activations into the region
            req = fixed[name] if mux is None else _region_request(pb, spec, name, xs[k],
                                                                  region, rid)
        t1 = time.perf_counter()
        if mux is not None:
            raw = await mux.roundtrip(req, rid)
        elif stream is None:
            raw = await unary(req, timeout=60.0)
        else:  # one request in flight per stream: write, then read its reply
            await stream.write(req)
            raw = await stream.read()
        t2 = time.perf_counter()
        streamed = stream is not None or mux is not None
        if rec is not None:
            _record(pb, rec.setdefault(name, {f: [] for f in FIELDS}), (t0, t1, t2), raw,
                    streamed, region)
        elif streamed:  # surfaces errors
            _record(pb, {f: [] for f in FIELDS}, (t0, t1, t2), raw, True, region)
    if stream is not None:
        await stream.done_writing()
    if region is not None:
        await _close_region(channel, pb, region)


async def _host_async(spec: LoadSpec, barrier: Any) -> dict[str, dict[str, list[float]]]:
    import asyncio

    import grpc

    from q6serve.client.channel import channel_options

    async with grpc.aio.insecure_channel(spec.target, options=channel_options()) as ch:
        await ch.channel_ready()
        mux = _Mux(ch) if spec.mode == "mux" else None
        until = [time.perf_counter() + spec.warmup]
        await asyncio.gather(*(_caller(ch, spec, i, until, None, mux)
                               for i in range(spec.callers)))
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait, 120)
        rec: dict[str, dict[str, list[float]]] = {}
        until[0] = time.perf_counter() + spec.seconds
        t0 = time.perf_counter()
        await asyncio.gather(*(_caller(ch, spec, 1000 + i, until, rec, mux)
                               for i in range(spec.callers)))
        if mux is not None:
            await mux.close()
        rec["_wall"] = {"seconds": [time.perf_counter() - t0]}
        return rec


# Every bench process that stands for a caller or for the worker's transport fixes its heap
# thresholds at start, as the worker does (service/engine.py): with glibc's moving threshold a
# replay host at S=64 paid 2.3x the client time for multi-weight replies (page faults of each
# MB-sized reply; bench/RESULTS.md, session 7). What callers are told to do (docs/SERVICE.md).
HOST_HEAP = (MMAP_THRESHOLD, 256 << 20)  # (mmap threshold, trim threshold) bytes


def _host_main(main: Any, spec: Any, barrier: Any, results: Any) -> None:
    import asyncio

    fix_heap_thresholds(*HOST_HEAP)
    try:
        results.put(asyncio.run(main(spec, barrier)))
    except BaseException as e:  # report, never hang the parent
        barrier.abort()
        results.put({"_error": repr(e)})


def spawn_hosts(main: Any, spec: Any, hosts: int, timeout: float,
                grpc_experiments: str | None = None) -> list[dict[str, Any]]:
    """Run ``asyncio.run(main(spec, barrier))`` in ``hosts`` spawned processes (a barrier
    starts their timed parts together); their results, or RuntimeError if one failed.
    ``grpc_experiments``: the hosts' GRPC_EXPERIMENTS (client/grpc_env.py; "" = gRPC's
    defaults), None: as this process's environment has it."""
    ctx = mp.get_context("spawn")  # never fork a process that may hold gRPC state
    barrier = ctx.Barrier(hosts)
    results = ctx.Queue()
    procs = [ctx.Process(target=_host_main, args=(main, spec, barrier, results), daemon=True)
             for _ in range(hosts)]
    with child_env(grpc_env.VAR, grpc_experiments):
        for p in procs:
            p.start()
    got = [results.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(30)
    for rec in got:
        if "_error" in rec:
            raise RuntimeError(f"host process failed: {rec['_error']}")
    return got


def run_load(spec: LoadSpec, hosts: int) -> tuple[dict[str, dict[str, np.ndarray]], float]:
    """Spawn ``hosts`` load processes; returns samples per weight (merged) and wall seconds."""
    merged: dict[str, dict[str, list[float]]] = {}
    wall = 0.0
    for rec in spawn_hosts(_host_async, spec, hosts, spec.warmup + spec.seconds + 150):
        wall = max(wall, rec.pop("_wall")["seconds"][0])
        for name, cols in rec.items():
            dst = merged.setdefault(name, {f: [] for f in FIELDS})
            for f in FIELDS:
                dst[f].extend(cols[f])
    return {n: {f: np.asarray(v, np.float64) for f, v in c.items()}
            for n, c in merged.items()}, wall


@contextlib.contextmanager
def child_env(var: str, value: str | None) -> Iterator[None]:
    """``var`` = ``value`` in this process's environment while processes are started (a
    spawned child gets the environment as it is at its start; gRPC reads GRPC_EXPERIMENTS when
    the child imports it, and this process's gRPC, already imported, never again), as it was
    after; None: nothing changed."""
    if value is None:
        yield
        return
    old = os.environ.get(var)
    os.environ[var] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old


# -- the floor: bare gRPC with the same message sizes ------------------------------------------
def _start_as_worker(proc: Any) -> None:
    """Start the spawned echo ``proc`` with gRPC set up as ``q6serve worker`` sets up its own
    (client/grpc_env.py: GRPC_EXPERIMENTS, read when the child imports gRPC) unless this
    environment says otherwise: the echo stands for the worker's transport, like for like (as
    its heap thresholds and busy polling are the worker's)."""
    had = grpc_env.VAR in os.environ
    os.environ.setdefault(grpc_env.VAR, grpc_env.EVENT_ENGINE_OFF)
    try:
        proc.start()
    finally:
        if not had:
            os.environ.pop(grpc_env.VAR, None)


def start_now(coro: Any) -> asyncio.Future[Any]:
    """Run ``coro`` here, now, up to its first wait, and on from there as what it waits for
    completes (each step in a done callback, as a task's steps; no task, no loop trip before
    its first step, unlike ``ensure_future``); returns the future of its outcome. For a
    stream's write: gRPC's send is started now and the caller goes on to read while it
    completes (the read posted before the write's completion comes back). Tried in the
    worker's MatmulStream in session 28 and lost on T1 (bundle C, 7 of 8 pairs, docs/SERVICE.md);
    kept here for the echo's and the replay host's variants."""
    done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def step(fut: Any = None, exc: BaseException | None = None) -> None:
        try:
            waited = coro.send(None) if exc is None else coro.throw(exc)
        except StopIteration as e:
            if not done.done():
                done.set_result(e.value)
            return
        except asyncio.CancelledError:
            done.cancel()
            return
        except BaseException as e:  # the outcome is the future's
            if not done.done():
                done.set_exception(e)
            return
        if getattr(waited, "_asyncio_future_blocking", None):  # an asyncio future
            waited._asyncio_future_blocking = False
            waited.add_done_callback(step)
        elif waited is None:  # a bare yield: go on in the next trip
            done.get_loop().call_soon(step)
        else:
            step(exc=RuntimeError(f"start_now: cannot wait for {waited!r}"))

    step()
    return done


def _sized_echo_server(ports: Any, cpus: tuple[int, ...] = (), spin: bool = False,
                       hold: bool = False, ahead: bool = False) -> None:
    """A grpc.aio echo (unary and stream): each message's first 8 bytes say how many bytes to
    answer with (replies cached per size); nothing else is done. ``cpus``: run there (as the
    worker does with --cpus); ``spin``: its loop busy-polls as the worker's does by default
    (service/threads.py: the same rule, so the same cores decide); ``hold``: the next 8 bytes
    say for how many ns the handler busy-waits on the loop, GIL held, before it answers (a
    worker's window: its inline job and Python; :func:`echo_sequence`); ``ahead``: the stream
    handler reads the next request before its reply's write has completed (the write started
    at once by :func:`start_now`, the next read posted behind it), not after it as a
    generator's yield does."""
    import asyncio
    import os

    fix_heap_thresholds(MMAP_THRESHOLD)  # as the worker (its trim loop aside)
    if cpus:
        os.sched_setaffinity(0, cpus)  # before grpc starts its threads: they inherit it

    import grpc

    replies: dict[int, bytes] = {}

    def reply(req: bytes) -> bytes:
        n = int.from_bytes(req[:8], "little")
        if hold and (ns := int.from_bytes(req[8:16], "little")):
            end = time.perf_counter_ns() + ns
            while time.perf_counter_ns() < end:
                pass
        if n not in replies:
            replies[n] = b"\0" * n
        return replies[n]

    async def unary(req: bytes, ctx: Any) -> bytes:
        return reply(req)

    async def stream(it: Any, ctx: Any) -> Any:
        async for req in it:
            yield reply(req)

    async def stream_ahead(it: Any, ctx: Any) -> None:
        writing = None
        while (req := await ctx.read()) is not grpc.aio.EOF:
            out = reply(req)
            if writing is not None and not writing.done():
                await writing  # (one write at a time)
            writing = start_now(ctx.write(out))
        if writing is not None:
            await writing

    async def serve() -> None:
        from q6serve.client.channel import channel_options

        server = grpc.aio.server(options=channel_options())
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("echo.Echo", {
            "U": grpc.unary_unary_rpc_method_handler(unary),
            "S": grpc.stream_stream_rpc_method_handler(stream_ahead if ahead else stream)})])
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        if spin:
            from q6serve.service.threads import busy_poll

            busy_poll(asyncio.get_running_loop(), lambda: True)
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


class _ClientWork:
    """What a T1 caller does around each round trip besides gRPC, done by the echo's caller
    for :func:`grpc_floor`'s ``client_work`` floor: x [1, K] f16 encoded into a real
    MatmulRequest (``request_bytes``, sent behind the echo's 8-byte size header), and a real
    MatmulStreamResponse of ``rows`` f32 outputs decoded (``reply_message``,
    ``reply_arrays``; the echo's own reply is zeros of that size). The work and the pause it
    puts between round trips are the caller's, not the worker's."""

    def __init__(self, k: int, rows: int) -> None:
        from q6serve.v1 import q6serve_pb2 as pb

        self.pb = pb
        self.x = np.ones((1, k), np.float16)
        y = pb.Tensor(dtype=pb.DTYPE_F32, shape=[1, rows], data=bytes(4 * rows))
        self.reply = pb.MatmulStreamResponse(
            request_id="r", result=pb.MatmulResponse(y=y, request_id="r")).SerializeToString()

    def request(self, header: bytes) -> bytes:
        return header + request_bytes(self.pb, ("ffn_down",), self.x, 0, rid="r")

    def decode(self) -> None:
        reply_arrays(reply_message(self.reply, True))


def _echo_client(port: int, sizes: list[tuple[int, int]], mode: str,
                 seconds: float, work: tuple[int, int] | None = None,
                 client_spin_us: float = 0.0, transport: str = "aio") -> list[float]:
    """p50 seconds of one closed-loop round trip per (request bytes, reply bytes); ``work``
    (K, rows): each round trip with a T1 caller's own encoding and decoding around it
    (:class:`_ClientWork`), timed from before the encoding to after the decoding, as T1's
    p50 is; ``client_spin_us``: this caller's loop busy-polls that long before it sleeps (as
    a replay host run with ``--replay-spin`` does: its like-for-like floor); ``transport``:
    the caller's gRPC, aio or sync (bench/svc_util_transport.py), as the replay host's."""
    import asyncio

    from svc_util_transport import Channel, floor_transport

    from q6serve.client.channel import channel_options

    fix_heap_thresholds(*HOST_HEAP)
    cw = _ClientWork(*work) if work else None
    transport = floor_transport(transport)

    async def go() -> list[float]:
        if client_spin_us > 0:
            from q6serve.service.threads import busy_poll

            busy_poll(asyncio.get_running_loop(), lambda: True, client_spin_us)
        out = []
        async with Channel(transport, f"127.0.0.1:{port}", channel_options()) as ch:
            unary = ch.unary("/echo.Echo/U")
            call = ch.stream("/echo.Echo/S") if mode != "unary" else None
            for req_bytes, reply_bytes in sizes:
                header = reply_bytes.to_bytes(8, "little")
                req = header + b"\1" * max(0, req_bytes - 8)
                lat: list[float] = []
                end = time.perf_counter() + seconds
                while time.perf_counter() < end or len(lat) < 10:
                    t0 = time.perf_counter()
                    if cw is not None:
                        req = cw.request(header)
                    if call is None:
                        await unary(req)
                    else:
                        await call.write(req)
                        await call.read()
                    if cw is not None:
                        cw.decode()
                    lat.append(time.perf_counter() - t0)
                out.append(float(np.median(lat[len(lat) // 5:])))  # first fifth: warm-up
            if call is not None:
                await call.done_writing()
        return out

    return asyncio.run(go())


def echo_p50(sizes: list[tuple[int, int]], modes: list[str], seconds: float,
             work: tuple[int, int] | None = None, spin: bool = False,
             client_spin_us: float = 0.0, transport: str = "aio") -> dict[str, list[float]]:
    """Bare gRPC round trips (server and caller in their own processes, as in the bench):
    p50 seconds per (request bytes, reply bytes), per mode; ``work``, ``client_spin_us``,
    ``transport``: see :func:`_echo_client`; ``spin``: see :func:`_sized_echo_server`."""
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=_sized_echo_server, args=(ports, SERVER_CPUS, spin),
                         daemon=True)  # (hold off: the first 8 bytes' size, then filler)
    _start_as_worker(server)
    try:
        port = ports.get(timeout=60)
        with ctx.Pool(1) as pool:
            return {m: pool.apply(_echo_client, (port, sizes, m, seconds, work, client_spin_us,
                                                 transport))
                    for m in modes}
    finally:
        server.terminate()
        server.join(10)


def grpc_floor(request_bytes: int, reply_bytes: int, modes: list[str], seconds: float,
               work: tuple[int, int] | None = None, spin: bool = False) -> dict[str, float]:
    """p50 µs of a bare gRPC round trip of these sizes, per mode (``work``: with a T1
    caller's own encoding and decoding, :class:`_ClientWork`; ``spin``: the echo's loop
    busy-polls as the worker's does)."""
    got = echo_p50([(request_bytes, reply_bytes)], modes, seconds, work, spin)
    return {m: v[0] * 1e6 for m, v in got.items()}


# -- the replay's calls in order against an echo (bench/service.py --replay-seq-echo) ---------
def _echo_sequence_client(port: int, seqs: list[list[tuple[int, int, int]]], mode: str,
                          seconds: float, client_spin_us: float,
                          transport: str = "aio") -> list[dict[str, Any]]:
    """Per sequence of ``seqs`` ((request bytes, reply bytes, hold ns) per call, a replay
    step's calls in order), closed-loop passes over it on one stream for ``seconds``: p50
    seconds of a pass and of each position's round trip (the first fifth of the passes:
    warm-up); ``transport``: the caller's gRPC (bench/svc_util_transport.py). A negative
    hold is the caller's: it busy-waits that long (GIL held) before it writes the call, whose
    round trip is timed after it, and the echo answers at once (the window on the other
    side of the wire: which side pays the surcharge a held call brings)."""
    import asyncio

    from svc_util_transport import Channel, floor_transport

    from q6serve.client.channel import channel_options

    fix_heap_thresholds(*HOST_HEAP)
    transport = floor_transport(transport)

    async def one(ch: Any, seq: list[tuple[int, int, int]]) -> dict[str, Any]:
        reqs = [reply.to_bytes(8, "little") + max(ns, 0).to_bytes(8, "little")
                + b"\1" * max(0, req - 16) for req, reply, ns in seq]
        # a negative hold: the caller's own, before it writes (the echo answers at once)
        before = [-ns if ns < 0 else 0 for _, _, ns in seq]
        passes: list[float] = []
        each: list[list[float]] = [[] for _ in seq]
        unary = ch.unary("/echo.Echo/U")
        call = ch.stream("/echo.Echo/S") if mode != "unary" else None
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or len(passes) < 5:
            t_pass = time.perf_counter()
            for i, req in enumerate(reqs):
                if before[i]:
                    until = time.perf_counter_ns() + before[i]
                    while time.perf_counter_ns() < until:
                        pass
                t0 = time.perf_counter()
                if call is None:
                    await unary(req)
                else:
                    await call.write(req)
                    await call.read()
                each[i].append(time.perf_counter() - t0)
            passes.append(time.perf_counter() - t_pass)
        if call is not None:
            await call.done_writing()
        skip = len(passes) // 5
        return {"pass": float(np.median(passes[skip:])), "passes": len(passes) - skip,
                "each": [float(np.median(v[skip:])) for v in each]}

    async def go() -> list[dict[str, Any]]:
        if client_spin_us > 0:
            from q6serve.service.threads import busy_poll

            busy_poll(asyncio.get_running_loop(), lambda: True, client_spin_us)
        async with Channel(transport, f"127.0.0.1:{port}", channel_options()) as ch:
            return [await one(ch, seq) for seq in seqs]

    return asyncio.run(go())


def echo_sequence(seqs: list[list[tuple[int, int, int]]], mode: str, seconds: float,
                  spin: bool = True, client_spin_us: float = 0.0,
                  transport: str = "aio", ahead: bool = False) -> list[dict[str, Any]]:
    """Replay steps' calls in order (one list per sequence, run one after the other by one
    caller against one echo) answered with each call's reply size after holding it its hold
    (ns; the worker's window of that call, or 0): how much of the replay's transport a bare
    server with the same sizes, order and windows pays too. The echo's loop busy-polls as the
    worker's does (``spin``); ``ahead``: see :func:`_sized_echo_server`."""
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=_sized_echo_server,
                         args=(ports, SERVER_CPUS, spin, True, ahead), daemon=True)
    _start_as_worker(server)
    try:
        port = ports.get(timeout=60)
        with ctx.Pool(1) as pool:
            return pool.apply(_echo_sequence_client, (port, seqs, mode, seconds,
                                                      client_spin_us, transport))
    finally:
        server.terminate()
        server.join(10)
