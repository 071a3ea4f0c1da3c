"""The ONE interceptor: auth hooks, error mapping and request metrics for every RPC.

``q6serve.kernels.errors.Q6Error`` subclasses become their ``grpc_code`` with their message;
anything else becomes INTERNAL with a generic message and its traceback in the log.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from q6serve.kernels.errors import InvalidArgument, Q6Error

from .auth import TokenAuth
from .metrics import Metrics
from .wire import ADMIN_METHODS

log = logging.getLogger("q6serve.rpc")

# perf_counter() when this RPC (or stream message) was taken, before auth and decoding: the
# servicer reports the worker-side durations from it (MatmulTiming.decode/handler_seconds).
RPC_START: contextvars.ContextVar[float] = contextvars.ContextVar("q6serve_rpc_start")


def status_code(e: Q6Error) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, e.grpc_code, grpc.StatusCode.INTERNAL)


def code_name(e: BaseException) -> str:
    return status_code(e).name if isinstance(e, Q6Error) else "INTERNAL"


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: Metrics | None = None, auth: TokenAuth | None = None) -> None:
        self._metrics = metrics
        self._auth = auth or TokenAuth()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        path = details.method
        method = path.rsplit("/", 1)[-1]
        metadata = details.invocation_metadata
        admin = method in ADMIN_METHODS

        try:
            # Here, before gRPC has read the request message: a refused caller never gets a
            # (possibly 256 MiB) payload buffered in the worker.
            self._auth.check(path, method, admin, metadata)
        except Q6Error as e:
            return self._refusal(e, method, handler)

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

        async def decode_stream(raw_iter: AsyncIterator[Any]) -> AsyncIterator[Any]:
            async for raw in raw_iter:
                RPC_START.set(time.perf_counter())  # seen by tasks the reader spawns next
                yield decode(raw)

        def before(raw: Any) -> Any:
            """The request decoded (or a decoding iterator for streams)."""
            return decode_stream(raw) if streaming_request else decode(raw)

        if handler.unary_unary or handler.stream_unary:
            inner = handler.unary_unary or handler.stream_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                t0 = time.perf_counter()
                RPC_START.set(t0)
                try:
                    result = await inner(before(request), context)
                except BaseException as e:
                    self._failed(e, context, method, t0)
                    return None  # gRPC discards a reply when the status is not OK
                self._observe(method, "OK", t0)
                return result

            factory = (grpc.unary_unary_rpc_method_handler if handler.unary_unary
                       else grpc.stream_unary_rpc_method_handler)
            return factory(unary, request_deserializer=None,
                           response_serializer=handler.response_serializer)

        inner_stream = handler.unary_stream or handler.stream_stream

        async def streaming(request: Any, context: grpc.aio.ServicerContext,
                            ) -> AsyncIterator[Any]:
            t0 = time.perf_counter()
            try:
                async for item in inner_stream(before(request), context):
                    yield item
            except BaseException as e:
                self._failed(e, context, method, t0)
                return
            self._observe(method, "OK", t0)

        factory = (grpc.unary_stream_rpc_method_handler if handler.unary_stream
                   else grpc.stream_stream_rpc_method_handler)
        return factory(streaming, request_deserializer=None,
                       response_serializer=handler.response_serializer)

    def _refusal(self, e: Q6Error, method: str, handler: grpc.RpcMethodHandler) -> Any:
        """A handler answering ``e`` without reading the request: declared request-streaming
        (the wire format is the same), so gRPC does not receive the message before calling
        it; the unread bytes are dropped with the call."""
        t0 = time.perf_counter()
        code = status_code(e)

        def answer(context: grpc.aio.ServicerContext) -> None:
            self._observe(method, code.name, t0)
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

    def _failed(self, e: BaseException, context: grpc.aio.ServicerContext, method: str,
                t0: float) -> None:
        """Record a failed call (before its status reaches the client), then re-raise ``e``
        when it is not ours to map, or set the status for the handler to return with.

        Set, not ``context.abort()``: abort raises an AbortError that grpc keeps in a reference
        cycle with the handler's frames, and those frames hold the request -- refused 200 MB
        requests stayed in memory until the cyclic collector happened to run (issue 18)."""
        code, message = self._classify(e, context, method)
        self._observe(method, code, t0)
        if message is None:
            raise e
        context.set_code(getattr(grpc.StatusCode, code))
        context.set_details(message)

    @staticmethod
    def _classify(e: BaseException, context: grpc.aio.ServicerContext, method: str,
                  ) -> tuple[str, str | None]:
        """(status code name, message to abort with; None = re-raise as is)."""
        if isinstance(e, asyncio.CancelledError):
            return "CANCELLED", None
        if isinstance(e, grpc.aio.AbortError):  # the handler aborted on its own
            code = context.code()
            return (code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"), None
        if isinstance(e, Q6Error):
            return status_code(e).name, str(e)
        if not isinstance(e, Exception):
            return "CANCELLED", None
        log.error("%s failed", method, exc_info=e)
        return "INTERNAL", "internal error (logged by the worker)"

    def _observe(self, method: str, code: str | None, t0: float) -> None:
        if self._metrics is not None and code is not None:
            self._metrics.observe_request(method, code, time.perf_counter() - t0)
