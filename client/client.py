"""A synchronous q6serve client: numpy in, numpy out, one exception type.

    from q6serve.client.client import Client
    with Client("127.0.0.1:50051") as c:
        c.load("model.gguf", tensors=["output.weight"])
        y = c.matmul("output.weight", x)          # x: [N, K] f32/f16/bf16 -> y: [N, rows] f32

Requests, replies and errors come from the client core (:mod:`.core`), the channel from
:mod:`.channel`, retries from :mod:`.retry`; :class:`~.async_client.AsyncClient` and
:class:`~.sharded.ShardedClient` share all three and take the same arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from q6serve.v1 import q6serve_pb2 as pb
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc

from . import shm
from .channel import MAX_MESSAGE_BYTES, sync_channel, token_metadata
from .core import (  # noqa: F401  (re-exported: the public names of this module)
    DTYPES,
    PLACEMENTS,
    PRECISIONS,
    UPLOAD_CHUNK,
    UPLOAD_FORMATS,
    MatmulOutput,
    Q6ServeError,
    RegionInfo,
    TopK,
    Weight,
    Weights,
    as_bytes_view,
    decode_tensor,
    encode_tensor,
    fill_tensor,
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
from .retry import RetryPolicy, call_with_retry
from .shm import RegionArg, ShmRegion

_output = output_of  # the name earlier code imported


def channel_for(target: str, *, root_certificates: bytes | None = None,
                private_key: bytes | None = None, certificate_chain: bytes | None = None,
                tls: bool = False, max_message_bytes: int = MAX_MESSAGE_BYTES) -> grpc.Channel:
    """The sync client's channel (:func:`.channel.make_channel`)."""
    return sync_channel(target, root_certificates=root_certificates, private_key=private_key,
                        certificate_chain=certificate_chain, tls=tls,
                        max_message_bytes=max_message_bytes)


class Client:
    """Blocking client. Every method raises :class:`Q6ServeError` on failure.

    ``channel_kw`` go to :func:`.channel.make_channel`: ``tls``, ``root_certificates``,
    ``private_key`` + ``certificate_chain`` (mutual TLS), ``credentials``,
    ``max_message_bytes``, ``round_robin``."""

    def __init__(self, target: str, *, token: str | None = None, timeout: float | None = 60.0,
                 retry: RetryPolicy | None = None, channel: grpc.Channel | None = None,
                 **channel_kw: Any) -> None:
        self.target = target
        self.timeout = timeout
        self.retry = retry or RetryPolicy()  # UNAVAILABLE only, inside the call's deadline
        self._channel = channel or sync_channel(target, **channel_kw)
        self._stub = pb_grpc.Q6ServeStub(self._channel)
        self._metadata = token_metadata(token)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: object, timeout: float | None = None,
              stub: Any = None) -> Any:
        """``request``: a message, or a factory of a fresh request iterator (retries of a
        client stream start again from its first message)."""
        fn = getattr(stub or self._stub, method)

        def attempt(left: float | None) -> Any:
            return fn(request() if callable(request) else request, timeout=left,
                      metadata=self._metadata)

        try:
            return call_with_retry(attempt, self.retry,
                                   timeout if timeout is not None else self.timeout)
        except grpc.RpcError as e:
            raise Q6ServeError.from_rpc(e) from None

    # -- weights ----------------------------------------------------------------------------
    def load(self, gguf_path: str, tensors: Iterable[str] = (), prefix: str = "",
             timeout: float | None = None, *, rows: tuple[int, int] | None = None,
             shard: tuple[int, int] | None = None,
             placement: str | None = None) -> list[Weight]:
        """Load tensors; ``rows=(begin, end)`` or ``shard=(index, count)`` loads only that row
        range of each tensor (row sharding, see docs/SCALEOUT.md); ``placement`` ("shard" or
        "replicate") places it on a multi-device worker."""
        req = load_request(gguf_path, tensors, prefix, rows=rows, shard=shard,
                           placement=placement)
        return weights_of(self._call("LoadWeights", req, timeout))

    def upload(self, name: str, data: np.ndarray | bytes | memoryview, rows: int, k: int,
               fmt: str = "q6_k", timeout: float | None = None,
               sha256: str | None = None,
               progress: Callable[[int], None] | None = None) -> Weight:
        """Upload AoS Q6_K bytes (``fmt="q6_k"``) or f32/f16 rows quantized by the worker,
        in 1 MiB chunks; ``progress(nbytes)`` is called after each chunk is handed to gRPC."""
        raw = as_bytes_view(data)  # a flat view, not a copy: chunks are sliced from it
        header = upload_header(name, raw, rows, k, fmt, sha256)
        r = self._call("UploadWeight", lambda: upload_messages(header, raw, progress), timeout)
        return Weight.from_pb(r.weight)

    def list(self, timeout: float | None = None) -> list[Weight]:
        return weights_of(self._call("ListWeights", pb.ListWeightsRequest(), timeout))

    def get(self, name: str, timeout: float | None = None) -> Weight:
        r = self._call("GetWeight", pb.GetWeightRequest(name=name), timeout)
        return Weight.from_pb(r.weight)

    def unload(self, name: str, timeout: float | None = None) -> Weight:
        r = self._call("UnloadWeight", pb.UnloadWeightRequest(name=name), timeout)
        return Weight.from_pb(r.weight)

    # -- matmul -----------------------------------------------------------------------------
    def matmul_full(self, weight: Weights, x: np.ndarray, *, precision: str = "auto",
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
        return output_of(self._call("Matmul", req, timeout), y_region)

    def matmul(self, weight: str, x: np.ndarray, *, precision: str = "auto",
               out_dtype: str = "f32", timeout: float | None = None,
               x_region: RegionArg | None = None,
               y_region: RegionArg | None = None) -> np.ndarray:
        """y = x · Wᵀ of one weight (see :meth:`matmul_multi`, :meth:`matmul_topk`)."""
        if not isinstance(weight, str):
            raise ValueError("matmul takes one weight name; use matmul_multi for several")
        out = self.matmul_full(weight, x, precision=precision, out_dtype=out_dtype,
                               timeout=timeout, x_region=x_region, y_region=y_region)
        assert out.y is not None
        return out.y

    def matmul_multi(self, weights: Sequence[str], x: np.ndarray, *,
                     precision: str = "auto", out_dtype: str = "f32",
                     timeout: float | None = None) -> list[np.ndarray]:
        """One x through several weights of the same K (q/k/v, gate/up) in one request:
        one y per weight, in order."""
        if isinstance(weights, str):
            raise ValueError("matmul_multi takes a list of weight names")
        out = self.matmul_full(list(weights), x, precision=precision, out_dtype=out_dtype,
                               timeout=timeout)
        return [o.y for o in out.outputs]  # type: ignore[misc]

    def matmul_topk(self, weight: str, x: np.ndarray, k: int, *, precision: str = "auto",
                    timeout: float | None = None) -> TopK:
        """Per row of y = x · Wᵀ (computed on the worker's device), the top ``k`` values
        (f32 [N, k], descending), their column indices (int32 [N, k]) and the row's
        log-sum-exp (f32 [N]): what a sampler needs from an lm-head, without the logits."""
        out = self.matmul_full(weight, x, precision=precision, timeout=timeout, topk=k)
        assert out.topk is not None
        return out.topk

    def matmul_stream(self, requests: Iterable[tuple[Any, ...]], *,
                      precision: str = "auto", out_dtype: str = "f32",
                      timeout: float | None = None, topk: int | None = None,
                      ) -> Iterator[MatmulOutput | Q6ServeError]:
        """``(request_id, weight, x)`` or ``(request_id, weight, x, x_region, y_region)``
        (``weight`` a name or a list of names, regions and ``topk`` (for every request) as
        for :meth:`matmul_full`, None for bytes) in; per request a MatmulOutput or a
        Q6ServeError (with ``request_id`` set) out, in completion order. Not retried: requests
        already sent may have run. ``timeout`` bounds the whole stream."""
        y_regions: dict[str, RegionArg] = {}
        msgs = stream_requests(requests, precision, out_dtype, y_regions, topk)
        call = self._stub.MatmulStream(msgs, metadata=self._metadata,
                                       timeout=timeout if timeout is not None else self.timeout)
        try:
            for r in call:
                yield stream_outcome(r, y_regions.pop(r.request_id, None))
        except grpc.RpcError as e:
            raise Q6ServeError.from_rpc(e) from None
        finally:
            call.cancel()  # no-op once finished; stops the stream if the caller broke out

    # -- shared-memory regions (client/shm.py; the worker needs --allow-shm) -----------------
    def register_shm(self, name: str, size: int, *, key: str | None = None,
                     timeout: float | None = None) -> ShmRegion:
        """Create a POSIX shared-memory object of ``size`` bytes and register it as region
        ``name``. Closing the region (or leaving its ``with``) unregisters and unlinks it."""
        region = ShmRegion.create(name, size, key)
        try:
            self.register_region(region, timeout=timeout)
        except BaseException:
            region.close()
            raise
        region.on_close = lambda: self._unregister_quietly(name)
        return region

    def register_region(self, region: ShmRegion, timeout: float | None = None) -> RegionInfo:
        """Register an already mapped region (e.g. ``ShmRegion.attach``)."""
        r = self._call("RegisterRegion", shm.register_request(region), timeout)
        return RegionInfo.from_pb(r.region)

    def unregister_region(self, name: str, timeout: float | None = None) -> RegionInfo:
        r = self._call("UnregisterRegion", pb.UnregisterRegionRequest(name=name), timeout)
        return RegionInfo.from_pb(r.region)

    def _unregister_quietly(self, name: str) -> None:
        """On region close: the worker may be gone or draining (it closes regions then)."""
        try:
            self.unregister_region(name, timeout=5.0)
        except Q6ServeError as e:
            if e.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND,
                              grpc.StatusCode.CANCELLED):
                raise
        except ValueError:  # this client's channel is closed already
            pass

    def list_regions(self, timeout: float | None = None) -> list[RegionInfo]:
        r = self._call("ListRegions", pb.ListRegionsRequest(), timeout)
        return [RegionInfo.from_pb(x) for x in r.regions]

    # -- worker -----------------------------------------------------------------------------
    def status(self, timeout: float | None = None) -> pb.GetStatusResponse:
        return self._call("GetStatus", pb.GetStatusRequest(), timeout)

    def status_dict(self, timeout: float | None = None) -> dict[str, object]:
        """GetStatus as JSON-ready types (byte counts as ints)."""
        return status_to_dict(self.status(timeout))

    def flags(self, changes: Mapping[str, bool] | None = None,
              timeout: float | None = None) -> dict[str, bool]:
        """Set ``changes`` (if any) and return every flag's state."""
        if changes:
            return flag_states(self._call("SetFlags", flags_request(changes), timeout).flags)
        return flag_states(self.status(timeout).flags)

    def health(self, service: str = "", timeout: float | None = 5.0) -> bool:
        """True when the worker reports SERVING (one attempt: health is a probe)."""
        try:
            r = health_stub(self._channel).Check(health_request(service), timeout=timeout,
                                                 metadata=self._metadata)
        except grpc.RpcError as e:
            raise Q6ServeError.from_rpc(e) from None
        return is_serving(r)
