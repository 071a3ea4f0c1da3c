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

import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from q6serve.v1 import q6serve_pb2 as pb

from . import core
from .channel import aio_channel
from .core import MatmulOutput, Q6ServeError, RegionInfo, TopK, Weight, Weights
from .retry import RetryPolicy, acall_with_retry, core_race
from .session import AsyncMatmulSession
from .shm import CudaRegion, Region, RegionArg, ShmRegion

T = TypeVar("T")
# (request_id, weight, x) or (request_id, weight, x, x_region, y_region)
StreamItem = tuple[Any, ...]


class AsyncClient(core.Transport):
    """Asyncio client: every call of :class:`~q6serve.client.client.Client`, with the same
    arguments and results, as a coroutine (``matmul_stream``: an async iterator). Create it
    inside a running event loop; close with ``await close()`` or ``async with``."""

    def __init__(self, target: str, *, token: str | None = None, timeout: float | None = 60.0,
                 retry: RetryPolicy | None = None, channel: grpc.aio.Channel | None = None,
                 **channel_kw: Any) -> None:
        super().__init__(token=token, timeout=timeout, retry=retry)
        self.target = target
        self._channel = channel or aio_channel(target, **channel_kw)
        self._stubs = core.stubs(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run(self, call: core.Call[T], timeout: float | None) -> T:
        """Make ``call`` under this client's deadline, retry policy and metadata."""
        fn = getattr(self._stubs[call.service], call.method)

        async def attempt(left: float | None) -> Any:
            t0 = time.monotonic()
            try:
                return await fn(call.fresh_request(), timeout=left, metadata=self._metadata)
            except grpc.aio.AioRpcError as e:
                if not (callable(call.request) and core_race(e)):
                    raise
            # grpc.aio's race (grpc/grpc issue 36066, open in grpcio 1.84): when the worker
            # ends a client stream early (it refused the upload before reading it all), a
            # chunk's failed write can overwrite the worker's status with this INTERNAL. The
            # worker applied nothing then (a stream it accepts is read to its end before any
            # status), so the one more attempt is safe and returns the worker's own answer,
            # inside what is left of the same deadline.
            left = None if left is None else left - (time.monotonic() - t0)
            return await fn(call.fresh_request(), timeout=left, metadata=self._metadata)

        with core.rpc_errors():
            reply = await acall_with_retry(attempt, self._policy(call), self._deadline(timeout))
        return call.decode(reply)

    # -- weights ----------------------------------------------------------------------------
    async def load(self, gguf_path: str, tensors: Iterable[str] = (), prefix: str = "",
                   timeout: float | None = None, *, rows: tuple[int, int] | None = None,
                   shard: tuple[int, int] | None = None,
                   placement: str | None = None) -> list[Weight]:
        """As :meth:`Client.load`."""
        return await self._run(core.load_call(gguf_path, tensors, prefix, rows=rows,
                                              shard=shard, placement=placement), timeout)

    async def upload(self, name: str, data: np.ndarray | bytes | memoryview, rows: int, k: int,
                     fmt: str = "q6_k", timeout: float | None = None,
                     sha256: str | None = None,
                     progress: Callable[[int], None] | None = None) -> Weight:
        """As :meth:`Client.upload`."""
        return await self._run(core.upload_call(name, data, rows, k, fmt, sha256, progress),
                               timeout)

    async def list(self, timeout: float | None = None) -> list[Weight]:
        return await self._run(core.list_call(), timeout)

    async def get(self, name: str, timeout: float | None = None) -> Weight:
        return await self._run(core.get_call(name), timeout)

    async def unload(self, name: str, timeout: float | None = None) -> Weight:
        return await self._run(core.unload_call(name), timeout)

    # -- matmul -----------------------------------------------------------------------------
    async def matmul_full(self, weight: Weights, x: np.ndarray, *, precision: str = "auto",
                          out_dtype: str = "f32", timeout: float | None = None,
                          x_region: RegionArg | None = None, y_region: RegionArg | None = None,
                          topk: int | None = None) -> MatmulOutput:
        """As :meth:`Client.matmul_full`."""
        return await self._run(core.matmul_call(weight, x, precision, out_dtype,
                                                x_region=x_region, y_region=y_region,
                                                topk=topk), timeout)

    async def matmul(self, weight: str, x: np.ndarray, *, precision: str = "auto",
                     out_dtype: str = "f32", timeout: float | None = None,
                     x_region: RegionArg | None = None,
                     y_region: RegionArg | None = None) -> np.ndarray:
        """As :meth:`Client.matmul`."""
        return await self._run(core.matmul_y_call(weight, x, precision, out_dtype,
                                                  x_region=x_region, y_region=y_region),
                               timeout)

    async def matmul_multi(self, weights: Sequence[str], x: np.ndarray, *,
                           precision: str = "auto", out_dtype: str = "f32",
                           timeout: float | None = None) -> list[np.ndarray]:
        """As :meth:`Client.matmul_multi`."""
        return core.ys_of(await self.matmul_full(core.weight_list(weights), x,
                                                 precision=precision, out_dtype=out_dtype,
                                                 timeout=timeout))

    async def matmul_topk(self, weight: str, x: np.ndarray, k: int, *,
                          precision: str = "auto", timeout: float | None = None) -> TopK:
        """As :meth:`Client.matmul_topk`."""
        return core.topk_of(await self.matmul_full(weight, x, precision=precision,
                                                   timeout=timeout, topk=k))

    async def matmul_stream(self, requests: Iterable[StreamItem] | AsyncIterable[StreamItem],
                            *, precision: str = "auto", out_dtype: str = "f32",
                            timeout: float | None = None, topk: int | None = None,
                            ) -> AsyncIterator[MatmulOutput | Q6ServeError]:
        """As :meth:`Client.matmul_stream`; ``requests`` may also be an async iterable (an
        async generator may wait for replies before sending more)."""
        y_regions: dict[str, RegionArg] = {}

        async def messages() -> AsyncIterator[bytes]:
            if isinstance(requests, AsyncIterable):
                async for item in requests:
                    for m in core.stream_requests([item], precision, out_dtype, y_regions,
                                                  topk):
                        yield m
            else:
                for m in core.stream_requests(requests, precision, out_dtype, y_regions, topk):
                    yield m

        call = self._stubs["bytes"].MatmulStream(messages(), metadata=self._metadata,
                                                   timeout=self._deadline(timeout))
        with core.rpc_errors():
            try:
                async for r in call:
                    yield core.stream_outcome(r, y_regions)
            finally:
                call.cancel()  # no-op once finished; stops the stream if the caller broke out

    def session(self, *, timeout: float | None = None) -> AsyncMatmulSession:
        """A closed-loop session on this client's channel (:mod:`.session`): ``async with
        client.session() as s: y = await s.matmul(w, x)``, each call one request and its
        reply on one MatmulStream; ``timeout`` bounds the whole session (default: none)."""
        return AsyncMatmulSession(self._stubs["bytes"], self._metadata, timeout)

    # -- shared-memory regions (client/shm.py; the worker needs --allow-shm) -----------------
    async def register_shm(self, name: str, size: int, *, key: str | None = None,
                           timeout: float | None = None) -> ShmRegion:
        """Create and register a region as :meth:`Client.register_shm`; unregister it with
        :meth:`unregister_region` before ``region.close()`` (which then unlinks it)."""
        with core.closed_on_error(ShmRegion.create(name, size, key)) as region:
            await self.register_region(region, timeout=timeout)
        return region

    async def register_cuda_ipc(self, name: str, size: int | None = None, *,
                                array: Any = None, device: int = 0,
                                timeout: float | None = None) -> CudaRegion:
        """Register device memory as :meth:`Client.register_cuda_ipc`; unregister it with
        :meth:`unregister_region` before letting the memory go."""
        region = core.cuda_region(name, size, array, device)
        await self.register_region(region, timeout=timeout)
        return region

    async def register_region(self, region: Region,
                              timeout: float | None = None) -> RegionInfo:
        return await self._run(core.register_region_call(region), timeout)

    async def unregister_region(self, name: str, timeout: float | None = None) -> RegionInfo:
        return await self._run(core.unregister_region_call(name), timeout)

    async def list_regions(self, timeout: float | None = None) -> list[RegionInfo]:
        return await self._run(core.list_regions_call(), timeout)

    # -- worker -----------------------------------------------------------------------------
    async def status(self, timeout: float | None = None) -> pb.GetStatusResponse:
        return await self._run(core.status_call(), timeout)

    async def status_dict(self, timeout: float | None = None) -> dict[str, object]:
        """GetStatus as JSON-ready types (byte counts as ints)."""
        return await self._run(core.status_call().then(core.status_to_dict), timeout)

    async def flags(self, changes: Mapping[str, bool] | None = None,
                    timeout: float | None = None) -> dict[str, bool]:
        """Set ``changes`` (if any) and return every flag's state."""
        return await self._run(core.flags_call(changes), timeout)

    async def health(self, service: str = "", timeout: float | None = 5.0) -> bool:
        """True when the worker reports SERVING (one attempt: health is a probe)."""
        return await self._run(core.health_call(service), timeout)
