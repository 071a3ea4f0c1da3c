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
from typing import Any, NoReturn

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
            """Auth first, then the request decoded (or a decoding iterator for streams)."""
            self._auth.check(path, method, admin, metadata)
            return decode_stream(raw) if streaming_request else decode(raw)

        if handler.unary_unary or handler.stream_unary:
            inner = handler.unary_unary or handler.stream_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                t0 = time.perf_counter()
                RPC_START.set(t0)
                try:
                    result = await inner(before(request), context)
                except BaseException as e:
                    await self._fail(e, context, method, t0)
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
                await self._fail(e, context, method, t0)
            self._observe(method, "OK", t0)

        factory = (grpc.unary_stream_rpc_method_handler if handler.unary_stream
                   else grpc.stream_stream_rpc_method_handler)
        return factory(streaming, request_deserializer=None,
                       response_serializer=handler.response_serializer)

    async def _fail(self, e: BaseException, context: grpc.aio.ServicerContext, method: str,
                    t0: float) -> NoReturn:
        """Record a failed call, then re-raise ``e`` when it is not ours to map, or abort with
        its status (recorded first, so the metric exists before the status reaches the client)."""
        code, message = self._classify(e, context, method)
        self._observe(method, code, t0)
        if message is None:
            raise e
        await context.abort(getattr(grpc.StatusCode, code_name(e)), message)

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
