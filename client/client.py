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
from typing import Any, TypeVar

import grpc
import numpy as np

from q6serve.v1 import q6serve_pb2 as pb

from . import core
from .channel import MAX_MESSAGE_BYTES, sync_channel
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
from .lane import Lane
from .retry import RetryPolicy, call_with_retry
from .session import MatmulSession
from .shm import CudaRegion, Region, RegionArg, ShmRegion

T = TypeVar("T")


def channel_for(target: str, *, root_certificates: bytes | None = None,
                private_key: bytes | None = None, certificate_chain: bytes | None = None,
                tls: bool = False, max_message_bytes: int = MAX_MESSAGE_BYTES) -> grpc.Channel:
    """The sync client's channel (:func:`.channel.make_channel`)."""
    return sync_channel(target, root_certificates=root_certificates, private_key=private_key,
                        certificate_chain=certificate_chain, tls=tls,
                        max_message_bytes=max_message_bytes)


class Client(core.Transport):
    """Blocking client. Every method raises :class:`Q6ServeError` on failure.

    ``timeout``: each call's deadline in seconds unless the call gives its own, retries
    included; ``retry``: the :class:`~.retry.RetryPolicy` (UNAVAILABLE only); ``token``: sent
    as a bearer token. ``channel_kw`` go to :func:`.channel.make_channel`: ``tls``,
    ``root_certificates``, ``private_key`` + ``certificate_chain`` (mutual TLS),
    ``credentials``, ``max_message_bytes``, ``round_robin``."""

    def __init__(self, target: str, *, token: str | None = None, timeout: float | None = 60.0,
                 retry: RetryPolicy | None = None, channel: grpc.Channel | None = None,
                 **channel_kw: Any) -> None:
        super().__init__(token=token, timeout=timeout, retry=retry)
        self.target = target
        self._channel_kw = channel_kw
        self._channel = channel or sync_channel(target, **channel_kw)
        self._stubs = core.stubs(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, call: core.Call[T], timeout: float | None) -> T:
        """Make ``call`` under this client's deadline, retry policy and metadata."""
        fn = getattr(self._stubs[call.service], call.method)

        def attempt(left: float | None) -> Any:
            return fn(call.fresh_request(), timeout=left, metadata=self._metadata)

        with core.rpc_errors():
            reply = call_with_retry(attempt, self._policy(call), self._deadline(timeout))
        return call.decode(reply)

    # -- weights ----------------------------------------------------------------------------
    def load(self, gguf_path: str, tensors: Iterable[str] = (), prefix: str = "",
             timeout: float | None = None, *, rows: tuple[int, int] | None = None,
             shard: tuple[int, int] | None = None,
             placement: str | None = None) -> list[Weight]:
        """Load tensors; ``rows=(begin, end)`` or ``shard=(index, count)`` loads only that row
        range of each tensor (row sharding, see docs/SCALEOUT.md); ``placement`` ("shard" or
        "replicate") places it on a multi-device worker."""
        return self._run(core.load_call(gguf_path, tensors, prefix, rows=rows, shard=shard,
                                        placement=placement), timeout)

    def upload(self, name: str, data: np.ndarray | bytes | memoryview, rows: int, k: int,
               fmt: str = "q6_k", timeout: float | None = None,
               sha256: str | None = None,
               progress: Callable[[int], None] | None = None) -> Weight:
        """Upload AoS Q6_K bytes (``fmt="q6_k"``) or f32/f16 rows quantized by the worker,
        in 1 MiB chunks; ``progress(nbytes)`` is called after each chunk is handed to gRPC."""
        return self._run(core.upload_call(name, data, rows, k, fmt, sha256, progress), timeout)

    def list(self, timeout: float | None = None) -> list[Weight]:
        return self._run(core.list_call(), timeout)

    def get(self, name: str, timeout: float | None = None) -> Weight:
        return self._run(core.get_call(name), timeout)

    def unload(self, name: str, timeout: float | None = None) -> Weight:
        return self._run(core.unload_call(name), timeout)

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
        return self._run(core.matmul_call(weight, x, precision, out_dtype, x_region=x_region,
                                          y_region=y_region, topk=topk), timeout)

    def matmul(self, weight: str, x: np.ndarray, *, precision: str = "auto",
               out_dtype: str = "f32", timeout: float | None = None,
               x_region: RegionArg | None = None,
               y_region: RegionArg | None = None) -> np.ndarray:
        """y = x · Wᵀ of one weight (see :meth:`matmul_multi`, :meth:`matmul_topk`)."""
        return self._run(core.matmul_y_call(weight, x, precision, out_dtype, x_region=x_region,
                                            y_region=y_region), timeout)

    def matmul_multi(self, weights: Sequence[str], x: np.ndarray, *,
                     precision: str = "auto", out_dtype: str = "f32",
                     timeout: float | None = None) -> list[np.ndarray]:
        """One x through several weights of the same K (q/k/v, gate/up) in one request:
        one y per weight, in order."""
        return core.ys_of(self.matmul_full(core.weight_list(weights), x, precision=precision,
                                           out_dtype=out_dtype, timeout=timeout))

    def matmul_topk(self, weight: str, x: np.ndarray, k: int, *, precision: str = "auto",
                    timeout: float | None = None) -> TopK:
        """Per row of y = x · Wᵀ (computed on the worker's device), the top ``k`` values
        (f32 [N, k], descending), their column indices (int32 [N, k]) and the row's
        log-sum-exp (f32 [N]): what a sampler needs from an lm-head, without the logits."""
        return core.topk_of(self.matmul_full(weight, x, precision=precision, timeout=timeout,
                                             topk=k))

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
        msgs = core.stream_requests(requests, precision, out_dtype, y_regions, topk)
        call = self._stubs["bytes"].MatmulStream(msgs, metadata=self._metadata,
                                                   timeout=self._deadline(timeout))
        with core.rpc_errors():
            try:
                for r in call:
                    yield core.stream_outcome(r, y_regions)
            finally:
                call.cancel()  # no-op once finished; stops the stream if the caller broke out

    def session(self, *, timeout: float | None = None, thread: bool = False,
                spin_us: float | None = None, **channel_kw: Any) -> MatmulSession:
        """A closed-loop session (:mod:`.session`): one MatmulStream, each ``matmul*`` call of
        it one request and its reply, on a grpc.aio channel and event loop of the session's
        own (run by the calling thread during each call; ``thread``: by a thread of its own)
        -- a decode host's sequence of dependent calls, faster than this client's unary
        calls (docs/SERVICE.md "The caller's gRPC"). Its channel takes this client's channel
        arguments, or ``channel_kw`` (e.g. for a client made with ``channel=``); ``timeout``
        bounds the whole session (default: none); ``spin_us``: its loop polls that long for
        a reply before it sleeps (a core busy meanwhile; None: 2000 us on a host of 8 cores
        or more, else 0, or ``$Q6SERVE_SESSION_SPIN_US``; with ``thread``: 0). Close it
        (``with``) when done."""
        return MatmulSession(self.target, channel_kw or self._channel_kw, self._metadata,
                             timeout, thread=thread, spin_us=spin_us)

    # -- shared-memory regions (client/shm.py; the worker needs --allow-shm) -----------------
    def register_shm(self, name: str, size: int, *, key: str | None = None,
                     timeout: float | None = None) -> ShmRegion:
        """Create a POSIX shared-memory object of ``size`` bytes and register it as region
        ``name``. Closing the region (or leaving its ``with``) unregisters and unlinks it."""
        with core.closed_on_error(ShmRegion.create(name, size, key)) as region:
            self.register_region(region, timeout=timeout)
        region.on_close = lambda: self._unregister_quietly(name)
        return region

    def register_cuda_ipc(self, name: str, size: int | None = None, *, array: Any = None,
                          device: int = 0, timeout: float | None = None) -> CudaRegion:
        """Register device memory of this process on the worker's GPU as region ``name`` (CUDA
        IPC; a CUDA worker with --allow-shm; needs CuPy): a fresh allocation of ``size``
        bytes on ``device``, or the memory of the contiguous CuPy ``array``. Matmuls naming
        it read x / write y there on the device (y comes back as a CuPy view). Closing the
        region (or leaving its ``with``) unregisters it; the memory is this process's."""
        region = core.cuda_region(name, size, array, device)
        self.register_region(region, timeout=timeout)
        region.on_close = lambda: self._unregister_quietly(name)
        return region

    def open_lane(self, region: Region, timeout: float | None = None,
                  ring: bool | None = None) -> Lane:
        """A fast lane on ``region`` (one of this caller's registered regions): matmuls over
        the worker's Unix socket without RPCs, x and y in the region (client/lane.py).
        ``ring``: requests and replies through a 2 KiB shared-memory ring of the lane's own,
        the socket kept for doorbells (x86-64 workers take it unless started with
        ``Q6SERVE_LANE_RING=0``). None: the ring unless this process's ``Q6SERVE_LANE_RING``
        is off, a socket lane where the worker refuses it; True: a refusal raises; False:
        the socket."""
        path, ticket = self._run(core.open_lane_call(region.name), timeout)
        return Lane(region, path, ticket, ring=ring)

    def register_region(self, region: Region, timeout: float | None = None) -> RegionInfo:
        """Register an already mapped region (e.g. ``ShmRegion.attach``, a CudaRegion)."""
        return self._run(core.register_region_call(region), timeout)

    def unregister_region(self, name: str, timeout: float | None = None) -> RegionInfo:
        return self._run(core.unregister_region_call(name), timeout)

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
        return self._run(core.list_regions_call(), timeout)

    # -- worker -----------------------------------------------------------------------------
    def status(self, timeout: float | None = None) -> pb.GetStatusResponse:
        return self._run(core.status_call(), timeout)

    def status_dict(self, timeout: float | None = None) -> dict[str, object]:
        """GetStatus as JSON-ready types (byte counts as ints)."""
        return self._run(core.status_call().then(status_to_dict), timeout)

    def flags(self, changes: Mapping[str, bool] | None = None,
              timeout: float | None = None) -> dict[str, bool]:
        """Set ``changes`` (if any) and return every flag's state."""
        return self._run(core.flags_call(changes), timeout)

    def health(self, service: str = "", timeout: float | None = 5.0) -> bool:
        """True when the worker reports SERVING (one attempt: health is a probe)."""
        return self._run(core.health_call(service), timeout)
