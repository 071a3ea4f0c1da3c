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

from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from q6serve.v1 import q6serve_pb2 as pb
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc

from . import shm
from .channel import aio_channel, token_metadata
from .core import (
    MatmulOutput,
    Q6ServeError,
    RegionInfo,
    TopK,
    Weight,
    Weights,
    as_bytes_view,
    flag_states,
    flags_request,
    health_request,
    health_stub,
    is_serving,
    load_request,
    matmul_request,
    output_of,
    status_to_dict,
    stream_outcome,
    stream_requests,
    upload_header,
    upload_messages,
    weights_of,
)
from .retry import RetryPolicy, acall_with_retry
from .shm import RegionArg, ShmRegion

# (request_id, weight, x) or (request_id, weight, x, x_region, y_region)
StreamItem = tuple[Any, ...]


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
                   shard: tuple[int, int] | None = None,
                   placement: str | None = None) -> list[Weight]:
        """Load tensors; ``rows=(begin, end)`` or ``shard=(index, count)`` loads only that row
        range of each tensor, ``placement`` places it on a multi-device worker (as
        :meth:`Client.load`)."""
        req = load_request(gguf_path, tensors, prefix, rows=rows, shard=shard,
                           placement=placement)
        return weights_of(await self._call("LoadWeights", req, timeout))

    async def upload(self, name: str, data: np.ndarray | bytes | memoryview, rows: int, k: int,
                     fmt: str = "q6_k", timeout: float | None = None,
                     sha256: str | None = None,
                     progress: Callable[[int], None] | None = None) -> Weight:
        """Upload AoS Q6_K bytes (``fmt="q6_k"``) or f32/f16 rows quantized by the worker,
        in 1 MiB chunks; ``progress(nbytes)`` is called after each chunk is handed to gRPC."""
        raw = as_bytes_view(data)
        header = upload_header(name, raw, rows, k, fmt, sha256)

        async def messages() -> AsyncIterator[pb.UploadWeightRequest]:
            for m in upload_messages(header, raw, progress):
                yield m

        r = await self._call("UploadWeight", messages, timeout)
        return Weight.from_pb(r.weight)

    async def list(self, timeout: float | None = None) -> list[Weight]:
        return weights_of(await self._call("ListWeights", pb.ListWeightsRequest(), timeout))

    async def get(self, name: str, timeout: float | None = None) -> Weight:
        r = await self._call("GetWeight", pb.GetWeightRequest(name=name), timeout)
        return Weight.from_pb(r.weight)

    async def unload(self, name: str, timeout: float | None = None) -> Weight:
        r = await self._call("UnloadWeight", pb.UnloadWeightRequest(name=name), timeout)
        return Weight.from_pb(r.weight)

    # -- matmul -----------------------------------------------------------------------------
    async def matmul_full(self, weight: Weights, x: np.ndarray, *, precision: str = "auto",
                    out_dtype: str = "f32", timeout: float | None = None,
                    x_region: RegionArg | None = None, y_region: RegionArg | None = None,
                    topk: int | None = None) -> MatmulOutput:
        """``weight``: a name, or a list of names of the same K (one request; each weight still
        batches with other callers' requests): the reply's ``outputs`` hold one MatmulOutput
        per weight, in order, and the whole call fails if one weight does (the message names
        it). ``topk=k`` (1..256): per row the top-k values, column indices and log-sum-exp
        (``.topk``) instead of y. ``x_region`` / ``y_region``: a registered ShmRegion or
        (region, byte offset) that carries x / y instead of the messages (``register_shm``;
        not with a list of weights or topk); y is then a view of the region, valid until
        the region is next written."""
        req = matmul_request(weight, x, precision, out_dtype, x_region=x_region,
                             y_region=y_region, topk=topk)
        return output_of(await self._call("Matmul", req, timeout), y_region)

    async def matmul(self, weight: str, x: np.ndarray, *, precision: str = "auto",
               out_dtype: str = "f32", timeout: float | None = None,
               x_region: RegionArg | None = None,
               y_region: RegionArg | None = None) -> np.ndarray:
        """y = x · Wᵀ of one weight (see :meth:`matmul_multi`, :meth:`matmul_topk`)."""
        if not isinstance(weight, str):
            raise ValueError("matmul takes one weight name; use matmul_multi for several")
        out = await self.matmul_full(weight, x, precision=precision, out_dtype=out_dtype,
                               timeout=timeout, x_region=x_region, y_region=y_region)
        assert out.y is not None
        return out.y

    async def matmul_multi(self, weights: Sequence[str], x: np.ndarray, *,
                     precision: str = "auto", out_dtype: str = "f32",
                     timeout: float | None = None) -> list[np.ndarray]:
        """One x through several weights of the same K (q/k/v, gate/up) in one request:
        one y per weight, in order."""
        if isinstance(weights, str):
            raise ValueError("matmul_multi takes a list of weight names")
        out = await self.matmul_full(list(weights), x, precision=precision, out_dtype=out_dtype,
                               timeout=timeout)
        return [o.y for o in out.outputs]  # type: ignore[misc]

    async def matmul_topk(self, weight: str, x: np.ndarray, k: int, *, precision: str = "auto",
                    timeout: float | None = None) -> TopK:
        """Per row of y = x · Wᵀ (computed on the worker's device), the top ``k`` values
        (f32 [N, k], descending), their column indices (int32 [N, k]) and the row's
        log-sum-exp (f32 [N]): what a sampler needs from an lm-head, without the logits."""
        out = await self.matmul_full(weight, x, precision=precision, timeout=timeout, topk=k)
        assert out.topk is not None
        return out.topk

    async def matmul_stream(self, requests: Iterable[StreamItem] | AsyncIterable[StreamItem],
                            *, precision: str = "auto", out_dtype: str = "f32",
                            timeout: float | None = None, topk: int | None = None,
                            ) -> AsyncIterator[MatmulOutput | Q6ServeError]:
        """``(request_id, weight, x)`` or ``(request_id, weight, x, x_region, y_region)``
        (``weight`` a name or a list of names, ``topk`` for every request, as in
        :meth:`matmul_full`) in (a plain or async iterable; an async generator may wait for
        replies before sending more); per request a MatmulOutput or a Q6ServeError (with
        ``request_id`` set) out, in completion order. Not retried: requests already sent may
        have run. ``timeout`` bounds the whole stream."""
        y_regions: dict[str, RegionArg] = {}

        async def messages() -> AsyncIterator[pb.MatmulRequest]:
            if isinstance(requests, AsyncIterable):
                async for item in requests:
                    for m in stream_requests([item], precision, out_dtype, y_regions,
                                                 topk):
                        yield m
            else:
                for m in stream_requests(requests, precision, out_dtype, y_regions, topk):
                    yield m

        call = self._stub.MatmulStream(messages(), metadata=self._metadata,
                                       timeout=timeout if timeout is not None else self.timeout)
        try:
            async for r in call:
                yield stream_outcome(r, y_regions.pop(r.request_id, None))
        except grpc.RpcError as e:
            raise Q6ServeError.from_rpc(e) from None
        finally:
            call.cancel()  # no-op once finished; stops the stream if the caller broke out

    # -- worker -----------------------------------------------------------------------------
    # -- shared-memory regions (client/shm.py; the worker needs --allow-shm) -----------------
    async def register_shm(self, name: str, size: int, *, key: str | None = None,
                           timeout: float | None = None) -> ShmRegion:
        """Create and register a region as :meth:`Client.register_shm`; unregister it with
        :meth:`unregister_region` before ``region.close()`` (which then unlinks it)."""
        region = ShmRegion.create(name, size, key)
        try:
            await self.register_region(region, timeout=timeout)
        except BaseException:
            region.close()
            raise
        return region

    async def register_region(self, region: ShmRegion,
                              timeout: float | None = None) -> RegionInfo:
        r = await self._call("RegisterRegion", shm.register_request(region), timeout)
        return RegionInfo.from_pb(r.region)

    async def unregister_region(self, name: str, timeout: float | None = None) -> RegionInfo:
        r = await self._call("UnregisterRegion", pb.UnregisterRegionRequest(name=name),
                             timeout)
        return RegionInfo.from_pb(r.region)

    async def list_regions(self, timeout: float | None = None) -> list[RegionInfo]:
        r = await self._call("ListRegions", pb.ListRegionsRequest(), timeout)
        return [RegionInfo.from_pb(x) for x in r.regions]

    async def status(self, timeout: float | None = None) -> pb.GetStatusResponse:
        return await self._call("GetStatus", pb.GetStatusRequest(), timeout)

    async def status_dict(self, timeout: float | None = None) -> dict[str, object]:
        """GetStatus as JSON-ready types (byte counts as ints)."""
        return status_to_dict(await self.status(timeout))

    async def flags(self, changes: Mapping[str, bool] | None = None,
                    timeout: float | None = None) -> dict[str, bool]:
        """Set ``changes`` (if any) and return every flag's state."""
        if changes:
            r = await self._call("SetFlags", flags_request(changes), timeout)
            return flag_states(r.flags)
        return flag_states((await self.status(timeout)).flags)

    async def health(self, service: str = "", timeout: float | None = 5.0) -> bool:
        """True when the worker reports SERVING (one attempt: health is a probe)."""
        try:
            r = await health_stub(self._channel).Check(health_request(service),
                                                       timeout=timeout,
                                                       metadata=self._metadata)
        except grpc.RpcError as e:
            raise Q6ServeError.from_rpc(e) from None
        return is_serving(r)
