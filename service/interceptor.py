"""The ONE interceptor: auth hooks, error mapping and request metrics for every RPC.

``q6serve.kernels.errors.Q6Error`` subclasses become their ``grpc_code`` with their message;
anything else becomes INTERNAL with a generic message and its traceback in the log. A status the
handler set itself (``context.abort``, or ``context.set_code`` before returning or raising) is
kept as it is: the standard services (health, reflection) signal that way, e.g. health's List
is UNIMPLEMENTED.

Every handler shape is wrapped: unary or streaming requests and replies, async or plain
functions, replies returned, yielded or written with ``context.write()`` (health's Watch), and
requests iterated or read with ``context.read()``.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import functools
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from q6serve.kernels.errors import InvalidArgument, Q6Error, ResourceExhausted

from . import config_limits as lim
from .admission import READ_STALL_S, Admission, StreamSlots, Writers, writers
from .auth import TokenAuth
from .metrics import Metrics
from .wire import ADMIN_METHODS, SERVICE_NAME

log = logging.getLogger("q6serve.rpc")

# perf_counter() when this RPC (or stream message) was taken, before auth and decoding: the
# servicer reports the worker-side durations from it (MatmulTiming.decode/handler_seconds).
RPC_START: contextvars.ContextVar[float] = contextvars.ContextVar("q6serve_rpc_start")

# The size in bytes of the stream message being handled, as read (set with RPC_START by the
# request/reply stream's decoding): a MatmulStream request's window share without upb's
# ByteSize, which serializes the message to count it (~5 us for T1's 37 KB on the VM).
RPC_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar("q6serve_rpc_bytes")

# The metric labels (service, method) of the streaming call this code runs in, for the
# per-message accounting of request/reply streams (observe_stream_request).
_STREAM_CALL: contextvars.ContextVar[tuple[ErrorInterceptor, str, str]] = \
    contextvars.ContextVar("q6serve_stream_call")

# Method label of one request inside a request/reply stream: "MatmulStream/request". The
# stream's own lifetime is counted under the plain method name.
STREAM_REQUEST_SUFFIX = "/request"

_END = object()  # the end of a reply stream

# A request of this size marks its host (the peer address without its port) for BIG_HOST_S:
# that host's unary requests are read through the read gate (ErrorInterceptor._read). At most
# MAX_BIG_HOSTS hosts are remembered (the oldest marks go first).
BIG_REQUEST_BYTES = 1 << 20
BIG_HOST_S = 30.0
MAX_BIG_HOSTS = 4096
# A read-gate place whose big request was just read stays taken this long per MiB read, so the
# next big request's copy (grpcio copies a message into Python in one step of the loop, GIL
# held: ~1.3 ms per MiB on the CI VM alone, 2-4x that under load) does not follow it at once:
# the loop spends at most about half its time in such copies and a health check's few loop
# trips find it free between them, not behind a queue of copies.
GAP_S_PER_MIB = 2e-3

# Calls that stay open as long as their client wants (a gRFC A17 client holds one health Watch
# per connection): a drain does not wait for them (ErrorInterceptor.wait_idle).
LONG_LIVED = frozenset({"/grpc.health.v1.Health/Watch"})


def status_code(e: Q6Error) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, e.grpc_code, grpc.StatusCode.INTERNAL)


def code_name(e: BaseException) -> str:
    return status_code(e).name if isinstance(e, Q6Error) else "INTERNAL"


def observe_stream_request(code: grpc.StatusCode, end: float | None = None) -> None:
    """Count one request of a request/reply stream (MatmulStream) with the outcome its caller
    sees in the reply, timed from when the worker read it (RPC_START of the message) to its
    reply (``end``, a perf_counter() time; default now)."""
    call = _STREAM_CALL.get(None)
    if call is None:
        return
    interceptor, service, method = call
    t0 = RPC_START.get(None)
    if end is None:
        end = time.perf_counter()
    interceptor.observe(service, method + STREAM_REQUEST_SUFFIX, code.name,
                        end - t0 if t0 is not None else 0.0)


def _set_code(context: grpc.aio.ServicerContext) -> grpc.StatusCode | None:
    """The status the handler set on the context itself, if any (None or OK: none)."""
    code = context.code()
    return code if isinstance(code, grpc.StatusCode) and code != grpc.StatusCode.OK else None


class _DecodingContext:
    """The handler's view of the context when the interceptor took over deserialization:
    ``read()`` returns decoded messages (the reader API of streaming requests); everything
    else is the real context."""

    def __init__(self, context: grpc.aio.ServicerContext,
                 decode: Callable[[Any], Any]) -> None:
        self._context = context
        self._decode = decode
        # set by the stream wrapper for a request/reply stream: how the handler writes a
        # reply itself (context.write, marked for the stream budget, the stream touched)
        self.send_reply: Callable[[Any], Awaitable[None]] | None = None

    async def read(self) -> Any:
        raw = await self._context.read()
        if raw is grpc.aio.EOF:
            return raw
        RPC_START.set(time.perf_counter())
        if isinstance(raw, bytes):
            RPC_BYTES.set(len(raw))
        return self._decode(raw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: Metrics | None = None, auth: TokenAuth | None = None,
                 admission: Admission | None = None, receive_limit: int | None = None,
                 reads: Admission | None = None, streams: StreamSlots | None = None) -> None:
        self._metrics = metrics
        self._auth = auth or TokenAuth()
        self._admission = admission  # unary RPCs of our service queue here
        self._reads = reads  # ... and then for their request to be read (None: no limit)
        # connections whose last request was small (at most MAX_BIG_HOSTS): in the read gate
        # they go before those sending big ones, so a small call of a big-request host waits
        # for one big read, not for every connection's
        self._small: collections.OrderedDict[str, None] = collections.OrderedDict()
        if reads is not None:  # a big request read over a slow link is not a stall: only
            reads.stall = None  # the read timeout takes a read's place back
            reads.first = self._small.__contains__
        self._big_hosts: dict[str, float] = {}  # host -> until when its reads are gated
        # streaming calls open at once (--max-streams[-per-connection])
        self.streams = streams or StreamSlots(lim.MAX_STREAMS, lim.MAX_STREAMS_PER_CONNECTION)
        self._receive_limit = receive_limit  # gRPC's max_receive_message_length (messages)
        self._active = 0  # calls running, LONG_LIVED ones left out
        self._idle = asyncio.Event()
        self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until no call runs but the LONG_LIVED ones; True if so."""
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout))
        except TimeoutError:
            return False
        return True

    def _track(self, path: str) -> Callable[[], None]:
        """Count a call as running; returns the function that ends it."""
        if path in LONG_LIVED:
            return lambda: None
        self._active += 1
        self._idle.clear()

        def leave() -> None:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

        return leave

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        path = details.method
        service, _, method = path.lstrip("/").rpartition("/")
        metadata = details.invocation_metadata
        admin = method in ADMIN_METHODS

        try:
            # Here, before gRPC has read the request message: a refused caller never gets a
            # (possibly 256 MiB) payload buffered in the worker.
            self._auth.check(path, method, admin, metadata)
        except Q6Error as e:
            return self._refusal(e, service, method, handler)

        deserialize = handler.request_deserializer
        streaming_request = bool(handler.stream_unary or handler.stream_stream)

        def decode(raw: Any) -> Any:
            """Deserialize here (not in gRPC) so junk bytes are INVALID_ARGUMENT, not UNKNOWN."""
            if deserialize is None:
                return raw
            try:
                return deserialize(raw)
            except Exception as e:
                raise InvalidArgument(f"{method} request cannot be decoded: "
                                      f"{type(e).__name__}") from None

        async def decode_stream(raw_iter: AsyncIterator[Any],
                                touch: Callable[[], None]) -> AsyncIterator[Any]:
            async for raw in raw_iter:
                RPC_START.set(time.perf_counter())  # seen by tasks the reader spawns next
                if isinstance(raw, bytes):
                    RPC_BYTES.set(len(raw))
                touch()  # not idle (StreamSlots)
                yield decode(raw)

        def before(raw: Any, context: grpc.aio.ServicerContext) -> tuple[Any, Any]:
            """(request, context) for the handler: the request decoded, or for streams a
            decoding iterator and a context whose read() decodes."""
            if streaming_request:
                touch = functools.partial(self.streams.touch, context.peer(),
                                          asyncio.current_task())
                return decode_stream(raw, touch), _DecodingContext(context, decode)
            return decode(raw), context

        def open_stream(context: grpc.aio.ServicerContext) -> bool:
            """A place among the streams open at once (StreamSlots); False: refused, with
            RESOURCE_EXHAUSTED set and counted."""
            if self.streams.open(context.peer(), asyncio.current_task(),  # type: ignore[arg-type]
                                 context.time_remaining()):
                return True
            self._failed(ResourceExhausted(
                f"{method}: too many streams open ({self.streams.per_key} per "
                f"connection, {self.streams.total} in the worker); close idle ones"),
                context, service, method, time.perf_counter())
            return False

        if handler.unary_unary or handler.stream_unary:
            inner = handler.unary_unary or handler.stream_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                t0 = time.perf_counter()
                RPC_START.set(t0)
                counted = streaming_request  # an upload: a stream's place
                if counted and not open_stream(context):
                    return None
                leave = self._track(path)
                try:
                    result = inner(*before(request, context))
                    if inspect.isawaitable(result):
                        result = await result
                except BaseException as e:
                    self._failed(e, context, service, method, t0)
                    return None  # gRPC discards a reply when the status is not OK
                finally:
                    leave()
                    if counted:
                        self.streams.close(context.peer(), asyncio.current_task())  # type: ignore[arg-type]
                self._done(context, service, method, t0)
                return result

            gate = self._admission
            if handler.unary_unary and service == SERVICE_NAME and gate is not None:
                async def admitted(requests: AsyncIterator[Any],
                                   context: grpc.aio.ServicerContext) -> Any:
                    """Declared request-streaming (the wire format is a unary call's) so gRPC
                    calls this before it reads the request: the call waits for admission
                    first, and keeps its place until the RPC is over -- its reply written and
                    its status sent, or the reply dropped by the gate when the client does
                    not take it while others wait (service/admission.py)."""
                    key = context.peer()
                    await gate.enter(key)
                    token: list[int] = []

                    def over(_: object) -> None:
                        if token:
                            gate.unwatch(token[0], key)
                        gate.leave(key)

                    context.add_done_callback(over)
                    # a request that does not come is dropped like a reply not taken (its
                    # client sent nothing more: nothing lingers)
                    reading = gate.watch(asyncio.current_task(), key, 0.0,  # type: ignore[arg-type]
                                         READ_STALL_S)
                    try:
                        raw = await self._read(key, context)
                    finally:
                        gate.unwatch(reading, key)
                    if raw is grpc.aio.EOF:  # gRPC refused it (too large) or none came
                        self._failed(self._no_message(method), context, service, method,
                                     time.perf_counter())
                        return None
                    reply = await unary(raw, context)
                    if reply is not None:  # gRPC writes it in this task, after we return:
                        # the gate may cancel the task if the client never takes it
                        token.append(gate.watch(asyncio.current_task(),  # type: ignore[arg-type]
                                                key, context.time_remaining()))
                    return reply

                return grpc.stream_unary_rpc_method_handler(
                    admitted, request_deserializer=None,
                    response_serializer=handler.response_serializer)

            factory = (grpc.unary_unary_rpc_method_handler if handler.unary_unary
                       else grpc.stream_unary_rpc_method_handler)
            return factory(unary, request_deserializer=None,
                           response_serializer=handler.response_serializer)

        inner_stream = handler.unary_stream or handler.stream_stream
        bidi = bool(handler.stream_stream)

        async def streaming(request: Any, context: grpc.aio.ServicerContext,
                            ) -> AsyncIterator[Any]:
            t0 = time.perf_counter()
            RPC_START.set(t0)
            if bidi:
                _STREAM_CALL.set((self, service, method))
            if not open_stream(context):
                return
            leave = self._track(path)
            # MatmulStream's writes are marked while blocked, for the stream budget
            # (admission.StreamBudget cancels a stalled one a starved connection waits on)
            marks = writers() if bidi and service == SERVICE_NAME else None
            key, task = context.peer(), asyncio.current_task()
            try:
                args = before(request, context)
                if bidi and isinstance(args[1], _DecodingContext):
                    args[1].send_reply = functools.partial(self._send_reply, context, marks,
                                                           key, task)
                out = inner_stream(*args)
                if hasattr(out, "__aiter__"):  # an async generator: replies yielded
                    # not `async for item`: this frame would hold the last reply for as
                    # long as a call its client stopped reading stays uncollected
                    replies, box = out.__aiter__(), []
                    while box.append(await anext(replies, _END)) or box[0] is not _END:
                        if marks is not None:
                            marks.begin(key, task,  # type: ignore[arg-type]
                                        context.time_remaining())
                        yield box.pop()  # returns once gRPC has written it
                        if marks is not None:
                            marks.end(key, task)  # type: ignore[arg-type]
                        self.streams.touch(key, task)  # type: ignore[arg-type]
                elif inspect.isawaitable(out):  # a coroutine writing with context.write()
                    await out
                else:  # a plain generator
                    for item in out:
                        yield item
            except BaseException as e:
                self._failed(e, context, service, method, t0)
                return
            finally:
                if marks is not None:
                    marks.end(key, task)  # type: ignore[arg-type]
                self.streams.close(key, task)  # type: ignore[arg-type]
                leave()
            self._done(context, service, method, t0)

        factory = (grpc.unary_stream_rpc_method_handler if handler.unary_stream
                   else grpc.stream_stream_rpc_method_handler)
        return factory(streaming, request_deserializer=None,
                       response_serializer=handler.response_serializer)

    async def _send_reply(self, context: grpc.aio.ServicerContext, marks: Writers | None,
                          key: str, task: asyncio.Task[object], reply: Any) -> None:
        """A reply a request/reply stream's handler writes itself (MatmulStream: from its
        reader or its writer task), marked as the yielded ones are: blocked writes for the
        stream budget (``task`` is the RPC's, which a budget cancels), then the stream
        touched (not idle)."""
        if marks is not None:
            marks.begin(key, task, context.time_remaining())
        writing = context.write(reply)
        del reply  # a cancelled write's traceback keeps this frame: not the reply with it
        try:
            await writing
        finally:
            if marks is not None:
                marks.end(key, task)
        self.streams.touch(key, task)

    async def _read(self, key: str, context: grpc.aio.ServicerContext) -> Any:
        """The request of an admitted unary call. From a host that sent a big request lately
        (BIG_REQUEST_BYTES, within BIG_HOST_S) it is read through the read gate: at most its
        limit at once, and one still not arrived after its timeout while others wait is
        cancelled (service/admission.py). Other hosts' reads are not gated, so clients that
        send slowly hold no slot unless their host sends big requests too."""
        reads = self._reads
        host = key.rpartition(":")[0]  # "ipv4:1.2.3.4:5678" -> "ipv4:1.2.3.4"
        if reads is None or self._big_hosts.get(host, 0.0) < time.monotonic():
            raw = await context.read()  # not `async for`: an unfinished async generator
            # would keep the handler's frame, and so the request, alive
        else:
            await reads.enter(key)
            # (a read cancelled for its timeout holds no reply: its place is not kept)
            token = reads.watch(asyncio.current_task(), key, 0.0)  # type: ignore[arg-type]
            gap = 0.0
            try:
                raw = await context.read()
                if raw is not grpc.aio.EOF:
                    gap = GAP_S_PER_MIB * len(raw) / (1 << 20)
            finally:
                reads.unwatch(token, key)
                if gap > 1e-3:  # the next big copy waits for the gap (GAP_S_PER_MIB)
                    asyncio.get_running_loop().call_later(gap, reads.leave, key)
                else:
                    reads.leave(key)
        if reads is not None and raw is not grpc.aio.EOF:
            if len(raw) >= BIG_REQUEST_BYTES:
                self._mark_big(host)
                self._small.pop(key, None)
            else:
                self._small[key] = None
                self._small.move_to_end(key)
                if len(self._small) > MAX_BIG_HOSTS:
                    self._small.popitem(last=False)
        return raw

    def _mark_big(self, host: str) -> None:
        hosts = self._big_hosts
        hosts.pop(host, None)  # to the end: the dict stays ordered by expiry
        hosts[host] = time.monotonic() + BIG_HOST_S
        while len(hosts) > MAX_BIG_HOSTS:
            del hosts[next(iter(hosts))]

    def _no_message(self, method: str) -> Q6Error:
        """A unary call that ended without a request message. gRPC's core has then already
        answered RESOURCE_EXHAUSTED when the message was over the receive limit (its status
        reaches the client; this one counts the call in the metrics)."""
        limit = f" of {self._receive_limit} bytes" if self._receive_limit else ""
        return ResourceExhausted(f"{method}: no request message was read: larger than the "
                                 f"worker's receive limit{limit} (--max-request-bytes), "
                                 "or none was sent")

    def _refusal(self, e: Q6Error, service: str, method: str,
                 handler: grpc.RpcMethodHandler) -> Any:
        """A handler answering ``e`` without reading the request: declared request-streaming
        (the wire format is the same), so gRPC does not receive the message before calling
        it; the unread bytes are dropped with the call."""
        t0 = time.perf_counter()
        code = status_code(e)

        def answer(context: grpc.aio.ServicerContext) -> None:
            self.observe(service, method, code.name, time.perf_counter() - t0)
            context.set_code(code)
            context.set_details(str(e))

        if handler.unary_stream or handler.stream_stream:
            async def refuse_stream(requests: Any, context: grpc.aio.ServicerContext,
                                    ) -> AsyncIterator[Any]:
                answer(context)
                return
                yield  # an async generator that yields nothing

            return grpc.stream_stream_rpc_method_handler(
                refuse_stream, response_serializer=handler.response_serializer)

        async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            answer(context)
            return None

        return grpc.stream_unary_rpc_method_handler(
            refuse, response_serializer=handler.response_serializer)

    def _done(self, context: grpc.aio.ServicerContext, service: str, method: str,
              t0: float) -> None:
        """Record a call that returned: OK, or the status the handler set without raising."""
        code = _set_code(context)
        self.observe(service, method, code.name if code else "OK", time.perf_counter() - t0)

    def _failed(self, e: BaseException, context: grpc.aio.ServicerContext, service: str,
                method: str, t0: float) -> None:
        """Record a failed call (before its status reaches the client), then re-raise ``e``
        when it is not ours to map, or set the status for the handler to return with.

        Set, not ``context.abort()``: abort raises an AbortError that grpc keeps in a reference
        cycle with the handler's frames, and those frames hold the request -- refused 200 MB
        requests stayed in memory until the cyclic collector happened to run (issue 18)."""
        code, message = self._classify(e, context, method)
        self.observe(service, method, code.name, time.perf_counter() - t0)
        if message is None:
            raise e
        context.set_code(code)
        context.set_details(message)

    @staticmethod
    def _classify(e: BaseException, context: grpc.aio.ServicerContext, method: str,
                  ) -> tuple[grpc.StatusCode, str | None]:
        """(status code, message to end the call with; None = re-raise as is)."""
        if isinstance(e, asyncio.CancelledError):
            return grpc.StatusCode.CANCELLED, None
        set_code = _set_code(context)
        if isinstance(e, grpc.aio.AbortError):  # the handler aborted on its own
            return set_code or grpc.StatusCode.UNKNOWN, None
        if set_code is not None:
            # The handler chose its status and then raised (grpcio's generated base servicer
            # does that for unimplemented methods): keep it, no traceback.
            log.debug("%s ended with %s: %r", method, set_code.name, e)
            return set_code, context.details() or set_code.name
        if isinstance(e, Q6Error):
            return status_code(e), str(e)
        if not isinstance(e, Exception):
            return grpc.StatusCode.CANCELLED, None
        log.error("%s failed", method, exc_info=e)
        return grpc.StatusCode.INTERNAL, "internal error (logged by the worker)"

    def observe(self, service: str, method: str, code: str, seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.observe_request(service, method, code, seconds)
