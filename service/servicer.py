"""The gRPC servicer, kept thin: validate, convert (wire), delegate (engine), convert back.

Errors are raised as ``q6serve.kernels.errors`` exceptions and mapped by the one interceptor.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from q6serve.kernels.epilogue import MAX_K
from q6serve.kernels.errors import InvalidArgument, Q6Error, Unavailable

from . import gcfreeze, lane, regions, wire, wire_enums, wire_replies, wire_requests
from .admission import StreamBudget
from .auth import TokenAuth
from .engine import Engine
from .engine_types import MatmulCall
from .interceptor import RPC_BYTES, RPC_START, observe_stream_request, status_code
from .multi import MAX_REQUEST_WEIGHTS, run_weights_now, start_matmul_weights
from .regions import RegionIO, RegionTable
from .threads import run_in_thread

log = logging.getLogger("q6serve.rpc")


def _timeout(context: grpc.aio.ServicerContext) -> float | None:
    return context.time_remaining()


def _stream_error(request_id: str, e: BaseException) -> Any:
    """A failed stream request's reply: its status (INTERNAL for what is not ours, logged)."""
    if isinstance(e, Q6Error):
        return wire_replies.stream_error(request_id, status_code(e).value[0], str(e))
    log.error("MatmulStream request %r failed", request_id[:64], exc_info=e)
    return wire_replies.stream_error(request_id, grpc.StatusCode.INTERNAL.value[0],
                             "internal error (logged by the worker)")


class _Window:
    """One MatmulStream's credit: requests admitted whose replies are not written yet.

    A request is admitted while fewer than ``max_items`` are out and its bytes fit in
    ``max_bytes`` -- or when nothing is out, so one request larger than the window still
    runs (alone) -- and then fit the worker-wide budget of all streams (``budget``, per
    connection ``key``). Only the stream's reader waits on the stream's own event.
    """

    def __init__(self, max_items: int, max_bytes: int, budget: StreamBudget | None = None,
                 key: str = "") -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self.budget, self.key = budget, key
        self.items = 0
        self.nbytes = 0
        self.closed = False
        self._freed = asyncio.Event()

    def _fits(self, nbytes: int) -> bool:
        return self.items == 0 or (self.items < self.max_items
                                   and self.nbytes + nbytes <= self.max_bytes)

    def take(self, nbytes: int) -> bool:
        """:meth:`acquire` when it would not wait (no coroutine): True if taken."""
        if not self._fits(nbytes) or (self.budget is not None
                                      and not self.budget.take(self.key, nbytes)):
            return False
        self.items += 1
        self.nbytes += nbytes
        return True

    async def acquire(self, nbytes: int) -> None:
        while not self._fits(nbytes):
            self._freed.clear()
            await self._freed.wait()
        if self.budget is not None:
            await self.budget.acquire(self.key, nbytes)
        self.items += 1
        self.nbytes += nbytes

    def release(self, nbytes: int) -> None:
        if self.closed:
            return
        self.items -= 1
        self.nbytes -= nbytes
        if self.budget is not None:
            self.budget.release(self.key, nbytes)
        self._freed.set()

    def close(self) -> None:
        """The stream ended: give back what its unsent replies still held (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self.budget is not None and self.nbytes:
            self.budget.release(self.key, self.nbytes)
        self.items = self.nbytes = 0


class _Deadline:
    """A stream's deadline, read from gRPC once: the seconds left of it for each request."""

    __slots__ = ("at",)

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        left = context.time_remaining()
        self.at = None if left is None else time.monotonic() + left

    def left(self) -> float | None:
        return None if self.at is None else self.at - time.monotonic()


class _Replies:
    """One MatmulStream's replies, written one at a time (gRPC allows one write in flight):
    by the stream's own coroutine when nothing else is out (:meth:`idle`, :meth:`write`: the
    direct path), else queued (:meth:`put`) for one writer task, made on first use. Each
    reply's window share is released once it is written. ``open``: requests queued or
    running whose reply is not queued yet."""

    __slots__ = ("busy", "done", "error", "open", "out", "send", "task", "wake", "window")

    def __init__(self, send: Callable[[Any], Any], window: _Window) -> None:
        self.send = send
        self.window = window
        self.out: collections.deque[tuple[Any, int]] = collections.deque()
        self.open = 0
        self.busy = False  # a write in flight
        self.task: asyncio.Task[None] | None = None
        self.wake: asyncio.Future[None] | None = None  # the writer waits for a reply
        self.done: asyncio.Future[None] | None = None  # finish() waits for the last write
        self.error: BaseException | None = None  # a write that failed (the writer stops)

    def idle(self) -> bool:
        return self.open == 0 and not self.busy and not self.out and self.error is None

    async def write(self, item: Any, cost: int) -> None:
        """Write ``item`` from the stream's coroutine (only when :meth:`idle`). No frame
        here holds the reply while the write waits: a cancelled write's traceback keeps
        its frames (a non-reading client's replies stayed with its cancelled call)."""
        self.busy = True
        sending = self.send(item)
        del item
        try:
            await sending
        finally:
            self.busy = False
        self.window.release(cost)
        if self.out:  # (queued meanwhile: cannot happen while nothing was open)
            self._kick()

    def put(self, item: Any, cost: int) -> None:
        """Queue ``item`` for the writer (a request that was open, or a reply that found a
        write in flight)."""
        self.out.append((item, cost))
        self._kick()

    def _kick(self) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._writer())
        elif self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    async def _writer(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                while self.out and not self.busy:
                    item, cost = self.out.popleft()
                    self.busy = True
                    sending = self.send(item)
                    del item  # (see write)
                    try:
                        await sending
                    finally:
                        self.busy = False
                    self.window.release(cost)
                if self.done is not None and not self.out and self.open == 0:
                    if not self.done.done():
                        self.done.set_result(None)
                    return
                self.wake = loop.create_future()
                await self.wake
                self.wake = None
        except BaseException as e:
            self.error = e
            if self.done is not None and not self.done.done():
                self.done.set_exception(e)
            if not isinstance(e, Exception):
                raise

    async def finish(self) -> None:
        """Wait until every open request is answered and every reply written."""
        if self.error is not None:
            raise self.error
        if self.open == 0 and not self.out and not self.busy:
            return
        self.done = asyncio.get_running_loop().create_future()
        self._kick()
        await self.done

    def close(self) -> None:
        """The stream ended: stop the writer, drop unsent replies (idempotent)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self.out.clear()
        self.busy = False


class RegionPlane:
    """The servicer's shared-memory regions: a RegionTable next to the engine. A front-end
    process (frontends.py) puts a proxy of the device process's plane here instead."""

    def __init__(self, table: RegionTable, engine: Any) -> None:
        self.table = table
        self.engine = engine
        self.lanes: lane.LaneServer | None = None  # started by the first OpenLane

    async def register(self, owner: str, name: str, src: Any) -> Any:
        if not self.engine.serving:
            raise Unavailable("the worker is draining and takes no new regions")
        return self.table.register(owner, name, src)

    async def unregister(self, owner: str, name: str) -> Any:
        return self.table.unregister(owner, name)

    async def list(self, owner: str) -> Any:
        return self.table.list(owner)

    async def open_lane(self, owner: str, region: str) -> tuple[str, bytes]:
        """OpenLane (service/lane.py): the lane socket's path and a one-time ticket."""
        if not self.engine.serving:
            raise Unavailable("the worker is draining and opens no lanes")
        self.lanes, path, ticket = await lane.open_lane(self.lanes, self.table, self.engine,
                                                        owner, region)
        return path, ticket

    async def matmul(self, owner: str, io: RegionIO, req: Any, timeout: float | None,
                     t0: float) -> tuple[Any, wire_replies.Took]:
        """A Matmul whose x and/or y live in regions (regions.py): the regions are held open
        for the whole request, so this one is a coroutine."""
        decoded: list[float] = []

        def make_call(x: Any) -> Any:
            call = wire_requests.matmul_call(req, timeout, x)
            decoded.append(time.perf_counter())
            return call

        reply = await regions.matmul(self.table, self.engine, owner, io, make_call)
        return reply, wire_replies.Took(t0, decoded[0])


class Q6ServeServicer:
    def __init__(self, engine: Engine, max_stream_inflight: int = 256,
                 max_stream_bytes: int = 64 << 20, regions: RegionTable | None = None,
                 auth: TokenAuth | None = None, stream_budget: StreamBudget | None = None,
                 plane: Any = None) -> None:
        self.engine = engine
        self.max_stream_inflight = max_stream_inflight
        self.max_stream_bytes = max_stream_bytes
        self.stream_budget = stream_budget  # all streams together (service/admission.py)
        # no table: a worker built without one refuses regions like one without --allow-shm
        self.plane = plane or RegionPlane(
            regions if regions is not None else RegionTable(False, 0, 0), engine)
        self.auth = auth or TokenAuth()
        # a weight's rows, per stream request (_call_cost): the engine's, else from its view
        self._rows_of: Callable[[str], int] = (getattr(engine, "rows_of", None)
                                               or (lambda w: self.engine.get(w).rows))

    def _caller(self, context: grpc.aio.ServicerContext) -> str:
        return self.auth.identity(context.invocation_metadata())

    async def _region_matmul(self, req: Any, io: RegionIO, context: grpc.aio.ServicerContext,
                             t0: float) -> tuple[Any, wire_replies.Took]:
        return await self.plane.matmul(self._caller(context), io, req, _timeout(context), t0)

    async def LoadWeights(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        views = await self.engine.load_gguf(request.gguf_path, list(request.tensors),
                                            request.prefix, wire.row_select(request),
                                            wire.placement(request))
        return await run_in_thread(wire.load_response, views)  # 65536 weights: ~0.2 s

    async def UploadWeight(self, request_iterator: AsyncIterator[Any],
                           context: grpc.aio.ServicerContext) -> Any:
        it = request_iterator.__aiter__()
        first = await anext(it, None)
        if first is None or first.WhichOneof("part") != "header":
            raise InvalidArgument("UploadWeight must start with an UploadHeader message")
        spec = wire.upload_spec(first.header)

        async def chunks() -> AsyncIterator[bytes]:
            async for msg in it:
                if msg.WhichOneof("part") != "chunk":
                    raise InvalidArgument("UploadWeight: only data chunks may follow the header")
                yield msg.chunk

        return wire.upload_response(await self.engine.upload(spec, chunks()))

    async def ListWeights(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        # in a thread: 65536 weights are ~0.3 s of views and protobuf (the registry is read
        # through a copy of its values, made with the GIL held)
        return await run_in_thread(lambda: wire.list_response(self.engine.list()))

    async def GetWeight(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return wire.get_response(self.engine.get(request.name))

    async def UnloadWeight(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return wire.unload_response(await self.engine.unload(request.name))

    def _start(self, call: MatmulCall,
               sink: Callable[[asyncio.Future[Any]], None] | None = None,
               ) -> asyncio.Future[Any]:
        """Queue a decoded request: its weight's part, or every part of a multi-weight
        request (service/multi.py; a front end's engine proxy leaves that to the device
        process); the future's result is what wire_replies.Replies encodes.
        ``sink``: see ``Engine.start_matmul`` (and ``multi.start_matmul_weights``)."""
        if call.weights and not getattr(self.engine, "takes_multi_weight", False):
            return start_matmul_weights(self.engine, call, sink)
        return self.engine.start_matmul(call, sink)

    def _direct(self) -> Callable[[MatmulCall, object], Any] | None:
        """The direct path of this engine (``Engine.run_now``; a multi-weight call's:
        ``multi.run_weights_now``), or None where it has none (multi-device engines, a front
        end's proxy). Returns the reply, or None: queue the call (:meth:`_start`)."""
        run_now = getattr(self.engine, "run_now", None)
        if run_now is None:
            return None
        engine = self.engine

        def direct(call: MatmulCall, own: object) -> Any:
            if call.weights:
                return run_weights_now(engine, call, own)
            return run_now(call, own)

        return direct

    async def Matmul(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        t0 = RPC_START.get(None) or time.perf_counter()
        io = wire_requests.region_io(request)
        if io is not None:
            reply, took = await self._region_matmul(request, io, context, t0)
            if io.y is None:  # y comes back in the reply: the same encoder as without regions
                return wire_replies.matmul_reply(reply, request.request_id, took)
            return wire_replies.matmul_response(reply, request.request_id, took, y_bytes=False)
        call = wire_requests.matmul_call(request, _timeout(context))
        decoded = time.perf_counter()
        direct = self._direct()  # the direct path, as in MatmulStream
        reply = None if direct is None else direct(call, asyncio.current_task())
        if reply is None:
            reply = await self._start(call)
        return wire_replies.matmul_reply(reply, request.request_id, wire_replies.Took(t0, decoded))

    def _cost(self, req: Any, call: MatmulCall | None = None) -> int:
        """Bytes a stream request holds until its reply is written: the request message and
        the reply it will produce (N x the weight's rows x the output dtype's size). Requests
        that will fail count their own size only (their error reply is small). ``call``: the
        request decoded already (its fields are not read from the message again)."""
        size = RPC_BYTES.get(None)  # as read (the interceptor's decoding); else upb's count
        if size is None:
            size = req.ByteSize()
        if call is not None:
            return self._call_cost(call, size)
        # fields read once, from the message (this runs per request)
        msg = wire_requests.message(req)
        names = msg.weights or (msg.weight,)  # a multi-weight reply holds one y per weight
        if len(names) > MAX_REQUEST_WEIGHTS:
            return size
        try:
            shape = msg.x.shape
            n = shape[0] if len(shape) == 2 else 0
            if msg.HasField("topk"):  # f32 values + int32 indices per k, f32 lse
                return size + len(names) * n * (8 * min(msg.topk.k, MAX_K) + 4)
            rows_of = getattr(self.engine, "rows_of", None)
            rows = (sum(rows_of(name) for name in names) if rows_of is not None
                    else sum(self.engine.get(name).rows for name in names))
            return size + n * rows * wire_enums.dtype_from_pb(msg.out_dtype).itemsize
        except Q6Error:
            return size

    def _call_cost(self, call: MatmulCall, size: int) -> int:
        """:meth:`_cost` of a decoded request of ``size`` bytes."""
        n = call.x.shape[0]
        if call.topk:  # f32 values + int32 indices per k, f32 lse
            return size + len(call.weights or (call.weight,)) * n * (8 * call.topk + 4)
        rows_of = self._rows_of
        try:
            rows = (sum(rows_of(name) for name in call.weights) if call.weights
                    else rows_of(call.weight))
        except Q6Error:
            return size
        return size + n * rows * call.out_dtype.itemsize

    async def MatmulStream(self, request_iterator: AsyncIterator[Any],
                           context: grpc.aio.ServicerContext) -> None:
        """Requests are queued as they arrive (so they batch with each other and with other
        callers); replies go out as they finish, each tagged with its request id. No task per
        request: this coroutine (the RPC's task) reads and decodes each request and queues it
        (``Engine.start_matmul``); the request's sink hands its encoded reply to the stream's
        writer task. **The direct path** (``Engine.run_now``, ``multi.run_weights_now``): a
        request that would run at once as a lone inline job (each part of a multi-weight
        one), arriving while nothing of this stream is in flight or being written, runs here
        and its reply is written by this coroutine itself, as a bare echo handler would (no
        queue, future, sink, writer wake-up or loop trip between).

        Back-pressure: a request holds its share of the stream's window (one of
        ``max_stream_inflight`` slots and its :meth:`_cost` in bytes) until its reply has been
        *written* to the transport, not when it is computed. gRPC completes a write only as
        the client's HTTP/2 window allows, so a client that stops reading stops this stream
        from reading further requests: it stalls only itself, and holds at most
        max(``max_stream_bytes``, one request) of the worker's memory.
        """
        window = _Window(self.max_stream_inflight, self.max_stream_bytes, self.stream_budget,
                         context.peer())
        replies = _Replies(getattr(context, "send_reply", None) or context.write, window)
        pending: set[asyncio.Future[Any]] = set()
        direct = self._direct()
        rpc = asyncio.current_task()  # this coroutine's: it queues no request while running
        deadline = _Deadline(context)

        def answer(rid: str, took: wire_replies.Took | None, cost: int, answered: list[bool],
                   ctx: contextvars.Context, fut: asyncio.Future[Any]) -> None:
            """``took`` None: a region request, whose future gives (reply, took). Called as the
            request's sink (in the trip that resolves it) and again as its done callback (for
            cancellation and the futures that have no sink): the first call answers, in
            ``ctx``, the request's own context (its RPC_START and stream, for the metrics: a
            sink runs in whatever context resolved the future)."""
            if answered[0]:
                return
            answered[0] = True
            ctx.run(_answer, rid, took, cost, fut)

        def _answer(rid: str, took: wire_replies.Took | None, cost: int,
                    fut: asyncio.Future[Any]) -> None:
            pending.discard(fut)
            if fut.cancelled():  # only at the stream's end: nobody reads any more
                observe_stream_request(grpc.StatusCode.CANCELLED)
                return
            exc = fut.exception()
            try:
                if exc is not None:
                    item = _stream_error(rid, exc)
                elif took is None:
                    reply, region_took, y_bytes = fut.result()
                    item = (wire_replies.stream_reply(reply, rid, region_took) if y_bytes
                            else wire_replies.stream_result(reply, rid, region_took, y_bytes=False))
                else:
                    item = wire_replies.stream_reply(fut.result(), rid, took)
            except Exception as e:  # encoding failed: the request still gets an answer
                item = _stream_error(rid, e)
            observe_stream_request(wire_replies.stream_reply_code(item))  # as its caller sees it
            replies.open -= 1
            replies.put(item, cost)

        def ended(_: object = None) -> None:
            """On the RPC's end, however it ends (and from this coroutine's own end): a
            cancelled call may leave frames in reference cycles (finalized only when the
            cyclic GC collects them, with everything they hold), so what the stream holds is
            let go here: the futures, the window, the writer, and the replies computed but
            not sent (a non-reading client's: 252 MiB of them stayed until a collection
            after 8 such streams). Idempotent."""
            if pending or replies.out or replies.busy:  # abandoned: a collection is asked
                gcfreeze.collect_soon()
            for fut in list(pending):
                fut.cancel()
            pending.clear()
            replies.close()
            window.close()  # what unsent replies held goes back to the worker's budget

        context.add_done_callback(ended)
        try:
            async for req in request_iterator:
                t0 = RPC_START.get(None) or time.perf_counter()
                rid = req.request_id
                # decoded before its window share is taken, so that the share is counted
                # from the call (its fields read once); a refusal is answered below
                call = io = refused = None
                try:
                    io = wire_requests.region_io(req)
                    if io is None:
                        call = wire_requests.matmul_call(req, None)
                except Exception as e:
                    refused = e
                took = wire_replies.Took(t0, time.perf_counter())
                cost = self._cost(req, call)
                if not window.take(cost):
                    await window.acquire(cost)
                item = None
                try:
                    if refused is not None:
                        raise refused
                    if io is not None:  # rare path: a task holds the regions
                        replies.open += 1
                        fut = asyncio.ensure_future(self._stream_region(req, io, context, t0))
                        pending.add(fut)
                        fut.add_done_callback(functools.partial(
                            answer, rid, None, cost, [False], contextvars.copy_context()))
                        continue
                    assert call is not None  # (decoded: not refused, not a region request)
                    call.timeout = deadline.left()  # (after a wait for the window, if any)
                    if (direct is not None and replies.idle()
                            and (reply := direct(call, rpc)) is not None):
                        item = wire_replies.stream_reply(reply, rid, took)
                    else:
                        answered = [False]
                        done = functools.partial(answer, rid, took, cost, answered,
                                                 contextvars.copy_context())
                        replies.open += 1
                        try:
                            fut = self._start(call, done)
                        except BaseException:
                            replies.open -= 1
                            raise
                        if not answered[0]:  # (never answered yet: futures resolve later)
                            pending.add(fut)
                            fut.add_done_callback(done)
                        continue
                except Exception as e:
                    item = _stream_error(rid, e)
                    refused = None  # (its traceback's frames hold the request)
                finally:
                    del req  # the queued call holds what it needs (x); nothing else
                # answered here and now (the direct path, or refused): written by this
                # coroutine when nothing is out, else queued for the writer
                code = wire_replies.stream_reply_code(item)
                if replies.idle():
                    t_reply = time.perf_counter()
                    writing = replies.write(item, cost)
                    del item  # (see _Replies.write)
                    try:
                        await writing
                    finally:  # after the write (off the round trip's path), counted anyway
                        observe_stream_request(code, t_reply)
                else:
                    observe_stream_request(code)
                    replies.put(item, cost)
                    del item
        except Exception:
            # the request stream failed (e.g. a message that cannot be decoded): every request
            # read before it is answered first (its reply, or its own error; each runs under
            # the stream's deadline), then the failure ends the call. (Only the replies queued
            # already went out: behind front ends, where every request is still open at the
            # device process when the bad message comes, none of them.)
            with contextlib.suppress(Exception):
                await replies.finish()
            raise
        else:
            await replies.finish()  # every request answered and its reply written
        finally:
            ended()

    async def _stream_region(self, req: Any, io: RegionIO, context: grpc.aio.ServicerContext,
                             t0: float) -> tuple[Any, wire_replies.Took, bool]:
        reply, took = await self._region_matmul(req, io, context, t0)
        return reply, took, io.y is None

    async def GetStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return wire.status_response(self.engine.status())

    async def SetFlags(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return wire.set_flags_response(self.engine.set_flags(wire.flag_changes(request)))

    async def RegisterRegion(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        view = await self.plane.register(self._caller(context), request.name,
                                         wire.region_source(request))
        return wire.register_region_response(view)

    async def UnregisterRegion(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return wire.unregister_region_response(
            await self.plane.unregister(self._caller(context), request.name))

    async def ListRegions(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return wire.list_regions_response(await self.plane.list(self._caller(context)))

    async def OpenLane(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return wire.open_lane_response(
            *await self.plane.open_lane(self._caller(context), request.region))
