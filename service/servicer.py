"""The gRPC servicer, kept thin: validate, convert (wire), delegate (engine), convert back.

Errors are raised as ``q6serve.kernels.errors`` exceptions and mapped by the one interceptor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from q6serve.kernels.errors import InvalidArgument, Q6Error

from . import wire
from .engine import Engine
from .interceptor import RPC_START, status_code

log = logging.getLogger("q6serve.rpc")


def _timeout(context: grpc.aio.ServicerContext) -> float | None:
    return context.time_remaining()


class Q6ServeServicer:
    def __init__(self, engine: Engine, max_stream_inflight: int = 256) -> None:
        self.engine = engine
        self.max_stream_inflight = max_stream_inflight

    async def LoadWeights(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        views = await self.engine.load_gguf(request.gguf_path, list(request.tensors),
                                            request.prefix, wire.row_select(request),
                                            wire.placement(request))
        return wire.load_response(views)

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
        return wire.list_response(self.engine.list())

    async def GetWeight(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return wire.get_response(self.engine.get(request.name))

    async def UnloadWeight(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return wire.unload_response(await self.engine.unload(request.name))

    async def Matmul(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        t0 = RPC_START.get(None) or time.perf_counter()
        call = wire.matmul_call(request, _timeout(context))
        decoded = time.perf_counter()
        reply = await self.engine.matmul(call)
        return wire.matmul_response(reply, request.request_id, wire.Took(t0, decoded))

    async def MatmulStream(self, request_iterator: AsyncIterator[Any],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """Requests run concurrently (so they batch with each other and with other callers);
        replies go out as they finish, each tagged with its request id."""
        out: asyncio.Queue[Any] = asyncio.Queue()
        slots = asyncio.Semaphore(self.max_stream_inflight)
        running: set[asyncio.Task[None]] = set()

        async def one(req: Any) -> None:
            try:
                t0 = RPC_START.get(None) or time.perf_counter()
                call = wire.matmul_call(req, _timeout(context))
                took = wire.Took(t0, time.perf_counter())
                reply = await self.engine.matmul(call)
                await out.put(wire.stream_result(reply, req.request_id, took))
            except Q6Error as e:
                await out.put(wire.stream_error(req.request_id, status_code(e).value[0],
                                                str(e)))
            except Exception:
                log.exception("MatmulStream request %r failed", req.request_id[:64])
                await out.put(wire.stream_error(req.request_id,
                                                grpc.StatusCode.INTERNAL.value[0],
                                                "internal error (logged by the worker)"))
            finally:
                slots.release()

        async def read() -> None:
            try:
                async for req in request_iterator:
                    await slots.acquire()
                    task = asyncio.get_running_loop().create_task(one(req))
                    running.add(task)
                    task.add_done_callback(running.discard)
                if running:
                    await asyncio.gather(*running)
            finally:
                await out.put(None)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while (item := await out.get()) is not None:
                yield item
            await reader  # surfaces a failure of the request stream itself
        finally:
            for task in (reader, *running):
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(reader, *running, return_exceptions=True)

    async def GetStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return wire.status_response(self.engine.status())

    async def SetFlags(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return wire.set_flags_response(self.engine.set_flags(wire.flag_changes(request)))
