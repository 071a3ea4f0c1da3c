"""The asyncio client: the same calls as :class:`~q6serve.client.client.Client` on grpc.aio.

    from q6serve.client import AsyncClient
    async with AsyncClient("127.0.0.1:50051") as c:
        y = await c.matmul("output.weight", x)     # x: [N, K] f32/f16/bf16 -> y: [N, rows]
        async for out in c.matmul_stream((f"r{i}", "output.weight", xi) for i, xi in ...):
            ...

Many concurrent ``matmul`` coroutines on one client share one HTTP/2 connection, which is
how a single inference host feeds the worker's dynamic batcher. Every method raises
:class:`~q6serve.client.client.Q6ServeError` on failure; unary calls retry UNAVAILABLE with
backoff inside the call's deadline (see :mod:`q6serve.client.retry`).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import grpc
import numpy as np

from q6serve.v1 import q6serve_pb2 as pb
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc

from .channel import aio_channel, token_metadata
from .client import (
    UPLOAD_FORMATS,
    MatmulOutput,
    Q6ServeError,
    Weight,
    _output,
    matmul_request,
    stream_outcome,
    upload_messages,
)
from .retry import RetryPolicy, acall_with_retry

StreamItem = tuple[str, str, np.ndarray]  # (request_id, weight, x)


def as_bytes_view(data: np.ndarray | bytes | memoryview) -> memoryview:
    """A flat byte view of ``data`` without copying it (uploads stream slices of it)."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data)
    return memoryview(data).cast("B")


class AsyncClient:
    """Asyncio client. Create it inside a running event loop; close with ``await close()``
    or ``async with``."""

    def __init__(self, target: str, *, token: str | None = None, timeout: float | None = 60.0,
                 retry: RetryPolicy | None = None, channel: grpc.aio.Channel | None = None,
                 **channel_kw: Any) -> None:
        self.target = target
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._channel = channel or aio_channel(target, **channel_kw)
        self._stub = pb_grpc.Q6ServeStub(self._channel)
        self._metadata = token_metadata(token)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """``request``: a message, or a zero-argument factory of a fresh request iterator
        (so a retried client stream starts again from its first message)."""
        fn = getattr(self._stub, method)

        async def attempt(left: float | None) -> Any:
            req = request() if callable(request) else request
            return await fn(req, timeout=left, metadata=self._metadata)

        try:
            return await acall_with_retry(attempt, self.retry,
                                          timeout if timeout is not None else self.timeout)
        except grpc.RpcError as e:
            raise Q6ServeError.from_rpc(e) from None

    # -- weights ----------------------------------------------------------------------------
    async def load(self, gguf_path: str, tensors: Iterable[str] = (), prefix: str = "",
                   timeout: float | None = None, *, rows: tuple[int, int] | None = None,
                   shard: tuple[int, int] | None = None) -> list[Weight]:
        """Load tensors; ``rows=(begin, end)`` or ``shard=(index, count)`` loads only that row
        range of each tensor (as :meth:`Client.load`)."""
        if rows is not None and shard is not None:
            raise ValueError("give rows or shard, not both")
        req = pb.LoadWeightsRequest(gguf_path=gguf_path, tensors=list(tensors), prefix=prefix)
        if rows is not None:
            req.row_range.CopyFrom(pb.RowRange(begin=rows[0], end=rows[1]))
        if shard is not None:
            req.shard.CopyFrom(pb.ShardSpec(index=shard[0], count=shard[1]))
        r = await self._call("LoadWeights", req, timeout)
        return [Weight.from_pb(w) for w in r.weights]

    async def upload(self, name: str, data: np.ndarray | bytes | memoryview, rows: int, k: int,
                     fmt: str = "q6_k", timeout: float | None = None,
                     sha256: str | None = None,
                     progress: Callable[[int], None] | None = None) -> Weight:
        """Upload AoS Q6_K bytes (``fmt="q6_k"``) or f32/f16 rows quantized by the worker,
        in 1 MiB chunks; ``progress(nbytes)`` is called after each chunk is handed to gRPC."""
        raw = as_bytes_view(data)
        digest = sha256 or hashlib.sha256(raw).hexdigest()
        header = pb.UploadHeader(name=name, rows=rows, k=k, format=UPLOAD_FORMATS[fmt],
                                 total_bytes=len(raw), sha256=digest)

        async def messages() -> AsyncIterator[pb.UploadWeightRequest]:
            for m in upload_messages(header, raw, progress):
                yield m

        r = await self._call("UploadWeight", messages, timeout)
        return Weight.from_pb(r.weight)

    async def list(self, timeout: float | None = None) -> list[Weight]:
        r = await self._call("ListWeights", pb.ListWeightsRequest(), timeout)
        return [Weight.from_pb(w) for w in r.weights]

    async def get(self, name: str, timeout: float | None = None) -> Weight:
        r = await self._call("GetWeight", pb.GetWeightRequest(name=name), timeout)
        return Weight.from_pb(r.weight)

    async def unload(self, name: str, timeout: float | None = None) -> Weight:
        r = await self._call("UnloadWeight", pb.UnloadWeightRequest(name=name), timeout)
        return Weight.from_pb(r.weight)

    # -- matmul -----------------------------------------------------------------------------
    async def matmul_full(self, weight: str, x: np.ndarray, *, precision: str = "auto",
                          out_dtype: str = "f32", timeout: float | None = None) -> MatmulOutput:
        req = matmul_request(weight, x, precision, out_dtype)
        return _output(await self._call("Matmul", req, timeout))

    async def matmul(self, weight: str, x: np.ndarray, *, precision: str = "auto",
                     out_dtype: str = "f32", timeout: float | None = None) -> np.ndarray:
        out = await self.matmul_full(weight, x, precision=precision, out_dtype=out_dtype,
                                     timeout=timeout)
        return out.y

    async def matmul_stream(self, requests: Iterable[StreamItem] | AsyncIterable[StreamItem],
                            *, precision: str = "auto", out_dtype: str = "f32",
                            timeout: float | None = None,
                            ) -> AsyncIterator[MatmulOutput | Q6ServeError]:
        """``(request_id, weight, x)`` in (a plain or async iterable; an async generator may
        wait for replies before sending more); per request a MatmulOutput or a Q6ServeError
        (with ``request_id`` set) out, in completion order. Not retried: requests already
        sent may have run. ``timeout`` bounds the whole stream."""

        async def messages() -> AsyncIterator[pb.MatmulRequest]:
            if isinstance(requests, AsyncIterable):
                async for rid, w, x in requests:
                    yield matmul_request(w, x, precision, out_dtype, rid)
            else:
                for rid, w, x in requests:
                    yield matmul_request(w, x, precision, out_dtype, rid)

        call = self._stub.MatmulStream(messages(), metadata=self._metadata,
                                       timeout=timeout if timeout is not None else self.timeout)
        try:
            async for r in call:
                yield stream_outcome(r)
        except grpc.RpcError as e:
            raise Q6ServeError.from_rpc(e) from None
        finally:
            call.cancel()  # no-op once finished; stops the stream if the caller broke out

    # -- worker -----------------------------------------------------------------------------
    async def status(self, timeout: float | None = None) -> pb.GetStatusResponse:
        return await self._call("GetStatus", pb.GetStatusRequest(), timeout)

    async def status_dict(self, timeout: float | None = None) -> dict[str, object]:
        from google.protobuf.json_format import MessageToDict

        return MessageToDict(await self.status(timeout), preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)

    async def flags(self, changes: Mapping[str, bool] | None = None,
                    timeout: float | None = None) -> dict[str, bool]:
        """Set ``changes`` (if any) and return every flag's state."""
        if changes:
            r = await self._call("SetFlags", pb.SetFlagsRequest(
                flags=[pb.Flag(name=n, enabled=bool(v)) for n, v in changes.items()]), timeout)
            return {f.name: f.enabled for f in r.flags}
        return {f.name: f.enabled for f in (await self.status(timeout)).flags}

    async def health(self, service: str = "", timeout: float | None = 5.0) -> bool:
        """True when the worker reports SERVING."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            r = await stub.Check(health_pb2.HealthCheckRequest(service=service),
                                 timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise Q6ServeError.from_rpc(e) from None
        return r.status == health_pb2.HealthCheckResponse.SERVING
