"""A synchronous q6serve client: numpy in, numpy out, one exception type.

    from q6serve.client.client import Client
    with Client("127.0.0.1:50051") as c:
        c.load("model.gguf", tensors=["output.weight"])
        y = c.matmul("output.weight", x)          # x: [N, K] f32/f16/bf16 -> y: [N, rows] f32
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import ml_dtypes
import numpy as np

from q6serve.v1 import q6serve_pb2 as pb
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc

from .retry import RetryPolicy, call_with_retry

DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16),
          "bf16": np.dtype(ml_dtypes.bfloat16)}
_DTYPE_TO_PB = {"f32": pb.DTYPE_F32, "f16": pb.DTYPE_F16, "bf16": pb.DTYPE_BF16}
_DTYPE_FROM_PB = {pb.DTYPE_F32: "f32", pb.DTYPE_F16: "f16", pb.DTYPE_BF16: "bf16"}
PRECISIONS = {"auto": pb.PRECISION_AUTO, "exact": pb.PRECISION_EXACT, "f16": pb.PRECISION_F16,
              "q8_1": pb.PRECISION_Q8_1}
_PRECISION_NAME = {v: k for k, v in PRECISIONS.items()}
_LAYOUT_NAME = {pb.LAYOUT_SOA: "soa", pb.LAYOUT_AOS: "aos", pb.LAYOUT_UNSPECIFIED: ""}
UPLOAD_FORMATS = {"q6_k": pb.UPLOAD_FORMAT_Q6_K, "f32": pb.UPLOAD_FORMAT_F32,
                  "f16": pb.UPLOAD_FORMAT_F16}
PLACEMENTS = {None: pb.PLACEMENT_UNSPECIFIED, "shard": pb.PLACEMENT_SHARD,
              "replicate": pb.PLACEMENT_REPLICATE}
UPLOAD_CHUNK = 1 << 20
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class Q6ServeError(Exception):
    """Any failed call: ``code`` is the grpc.StatusCode, ``message`` the worker's details."""

    def __init__(self, code: grpc.StatusCode, message: str, request_id: str = "") -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id  # set for per-request failures of matmul_stream

    @classmethod
    def from_rpc(cls, e: grpc.RpcError) -> Q6ServeError:
        return cls(e.code(), e.details() or "")


@dataclass(frozen=True)
class Weight:
    name: str
    rows: int
    k: int
    nbytes: int
    layout: str
    sha256: str
    source: str
    in_flight: int
    row_begin: int = 0  # global rows [row_begin, row_end) of the source tensor held here
    row_end: int = 0
    tensor_rows: int = 0  # rows of the whole source tensor

    @classmethod
    def from_pb(cls, w: pb.WeightInfo) -> Weight:
        # a worker without row ranges (row_range unset) holds the whole tensor
        end = w.row_range.end if w.HasField("row_range") else w.rows
        return cls(w.name, w.rows, w.k, w.nbytes, _LAYOUT_NAME[w.layout], w.sha256, w.source,
                   w.in_flight, w.row_range.begin, end, w.tensor_rows or w.rows)


@dataclass(frozen=True)
class MatmulOutput:
    y: np.ndarray
    kernel: str
    layout: str
    precision: str
    queue_seconds: float
    kernel_seconds: float | None
    batch_rows: int
    batch_requests: int
    request_id: str = ""
    # the worker's own split of the request's time (None from workers that do not send it)
    decode_seconds: float | None = None
    device_seconds: float | None = None
    handler_seconds: float | None = None


def fill_tensor(t: pb.Tensor, a: np.ndarray) -> pb.Tensor:
    """Set ``t`` to ``a`` in place (dtype, shape, little-endian bytes)."""
    a = np.ascontiguousarray(a)
    name = next((n for n, d in DTYPES.items() if d == a.dtype), None)
    if name is None:
        raise ValueError(f"dtype {a.dtype} is not one of {', '.join(DTYPES)}")
    t.dtype = _DTYPE_TO_PB[name]
    t.shape.extend(a.shape)
    t.data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
    return t


def encode_tensor(a: np.ndarray) -> pb.Tensor:
    return fill_tensor(pb.Tensor(), a)


def decode_tensor(t: pb.Tensor) -> np.ndarray:
    dt = DTYPES[_DTYPE_FROM_PB[t.dtype]].newbyteorder("<")
    return np.frombuffer(t.data, dtype=dt).reshape(tuple(t.shape))


def _output(r: pb.MatmulResponse) -> MatmulOutput:
    t = r.timing

    def opt(name: str) -> float | None:
        return getattr(t, name) if t.HasField(name) else None

    return MatmulOutput(decode_tensor(r.y), r.kernel, _LAYOUT_NAME[r.layout],
                        _PRECISION_NAME[r.precision], t.queue_seconds, opt("kernel_seconds"),
                        t.batch_rows, t.batch_requests, r.request_id, opt("decode_seconds"),
                        opt("device_seconds"), opt("handler_seconds"))


def upload_messages(header: pb.UploadHeader, raw: memoryview | bytes,
                    progress: Callable[[int], None] | None) -> Iterator[pb.UploadWeightRequest]:
    """An UploadWeight stream: the header, then ``raw`` in UPLOAD_CHUNK slices (a retry calls
    this again and resends from the header)."""
    yield pb.UploadWeightRequest(header=header)
    for i in range(0, len(raw), UPLOAD_CHUNK):
        chunk = bytes(raw[i : i + UPLOAD_CHUNK])
        yield pb.UploadWeightRequest(chunk=chunk)
        if progress is not None:
            progress(len(chunk))


def stream_outcome(r: Any) -> MatmulOutput | Q6ServeError:
    """One MatmulStream reply as the caller sees it: its result, or that request's own error
    (the stream itself goes on)."""
    if r.WhichOneof("outcome") == "error":
        code = _CODES.get(r.error.code, grpc.StatusCode.UNKNOWN)
        return Q6ServeError(code, r.error.message, r.request_id)
    return _output(r.result)


def matmul_request(weight: str, x: np.ndarray, precision: str = "auto",
                   out_dtype: str = "f32", request_id: str = "") -> pb.MatmulRequest:
    req = pb.MatmulRequest(weight=weight, precision=PRECISIONS[precision],
                           out_dtype=_DTYPE_TO_PB[out_dtype], request_id=request_id)
    # x set in place: a big submessage passed to the constructor is copied the slow way in
    # upb (N=64 ffn_down activations: 489 -> 289 us with serialization; bench/RESULTS.md)
    fill_tensor(req.x, x)
    return req


def channel_for(target: str, *, root_certificates: bytes | None = None,
                private_key: bytes | None = None, certificate_chain: bytes | None = None,
                tls: bool = False, max_message_bytes: int = 256 << 20) -> grpc.Channel:
    opts = [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]
    if tls or root_certificates is not None:
        creds = grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
        return grpc.secure_channel(target, creds, options=opts)
    return grpc.insecure_channel(target, options=opts)


class Client:
    """Blocking client. Every method raises :class:`Q6ServeError` on failure."""

    def __init__(self, target: str, *, token: str | None = None, timeout: float | None = 60.0,
                 retry: RetryPolicy | None = None, channel: grpc.Channel | None = None,
                 **channel_kw: object) -> None:
        self.target = target
        self.timeout = timeout
        self.retry = retry or RetryPolicy()  # UNAVAILABLE only, inside the call's deadline
        self._channel = channel or channel_for(target, **channel_kw)  # type: ignore[arg-type]
        self._stub = pb_grpc.Q6ServeStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: object, timeout: float | None = None) -> Any:
        """``request``: a message, or a factory of a fresh request iterator (retries of a
        client stream start again from its first message)."""
        fn = getattr(self._stub, method)

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
        req = pb.LoadWeightsRequest(gguf_path=gguf_path, tensors=list(tensors), prefix=prefix,
                                    placement=PLACEMENTS[placement])
        if rows is not None and shard is not None:
            raise ValueError("give rows or shard, not both")
        if rows is not None:
            req.row_range.CopyFrom(pb.RowRange(begin=rows[0], end=rows[1]))
        if shard is not None:
            req.shard.CopyFrom(pb.ShardSpec(index=shard[0], count=shard[1]))
        r = self._call("LoadWeights", req, timeout)
        return [Weight.from_pb(w) for w in r.weights]

    def upload(self, name: str, data: np.ndarray | bytes | memoryview, rows: int, k: int,
               fmt: str = "q6_k", timeout: float | None = None,
               sha256: str | None = None,
               progress: Callable[[int], None] | None = None) -> Weight:
        """Upload AoS Q6_K bytes (``fmt="q6_k"``) or f32/f16 rows quantized by the worker;
        ``progress(nbytes)`` is called after each chunk is handed to gRPC."""
        # a flat view, not a copy: chunks are sliced from it (a memmap streams from disk)
        raw = memoryview(np.ascontiguousarray(data) if isinstance(data, np.ndarray)
                         else data).cast("B")
        digest = sha256 or hashlib.sha256(raw).hexdigest()
        header = pb.UploadHeader(name=name, rows=rows, k=k, format=UPLOAD_FORMATS[fmt],
                                 total_bytes=len(raw), sha256=digest)

        r = self._call("UploadWeight", lambda: upload_messages(header, raw, progress), timeout)
        return Weight.from_pb(r.weight)

    def list(self, timeout: float | None = None) -> list[Weight]:
        r = self._call("ListWeights", pb.ListWeightsRequest(), timeout)
        return [Weight.from_pb(w) for w in r.weights]

    def get(self, name: str, timeout: float | None = None) -> Weight:
        r = self._call("GetWeight", pb.GetWeightRequest(name=name), timeout)
        return Weight.from_pb(r.weight)

    def unload(self, name: str, timeout: float | None = None) -> Weight:
        r = self._call("UnloadWeight", pb.UnloadWeightRequest(name=name), timeout)
        return Weight.from_pb(r.weight)

    # -- matmul -----------------------------------------------------------------------------
    def matmul_full(self, weight: str, x: np.ndarray, *, precision: str = "auto",
                    out_dtype: str = "f32", timeout: float | None = None) -> MatmulOutput:
        r = self._call("Matmul", matmul_request(weight, x, precision, out_dtype), timeout)
        return _output(r)

    def matmul(self, weight: str, x: np.ndarray, *, precision: str = "auto",
               out_dtype: str = "f32", timeout: float | None = None) -> np.ndarray:
        return self.matmul_full(weight, x, precision=precision, out_dtype=out_dtype,
                                timeout=timeout).y

    def matmul_stream(self, requests: Iterable[tuple[str, str, np.ndarray]], *,
                      precision: str = "auto", out_dtype: str = "f32",
                      timeout: float | None = None,
                      ) -> Iterator[MatmulOutput | Q6ServeError]:
        """``(request_id, weight, x)`` in; per request a MatmulOutput or a Q6ServeError (with
        ``request_id`` set) out, in completion order."""
        msgs = (matmul_request(w, x, precision, out_dtype, rid) for rid, w, x in requests)
        try:
            for r in self._stub.MatmulStream(msgs, timeout=timeout or self.timeout,
                                             metadata=self._metadata):
                yield stream_outcome(r)
        except grpc.RpcError as e:
            raise Q6ServeError.from_rpc(e) from None

    # -- worker -----------------------------------------------------------------------------
    def status(self, timeout: float | None = None) -> pb.GetStatusResponse:
        return self._call("GetStatus", pb.GetStatusRequest(), timeout)

    def status_dict(self, timeout: float | None = None) -> dict[str, object]:
        from google.protobuf.json_format import MessageToDict

        return MessageToDict(self.status(timeout), preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)

    def flags(self, changes: Mapping[str, bool] | None = None,
              timeout: float | None = None) -> dict[str, bool]:
        """Set ``changes`` (if any) and return every flag's state."""
        if changes:
            r = self._call("SetFlags", pb.SetFlagsRequest(
                flags=[pb.Flag(name=n, enabled=bool(v)) for n, v in changes.items()]), timeout)
            return {f.name: f.enabled for f in r.flags}
        return {f.name: f.enabled for f in self.status(timeout).flags}

    def health(self, service: str = "", timeout: float | None = 5.0) -> bool:
        """True when the worker reports SERVING."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            r = health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout,
                metadata=self._metadata)
        except grpc.RpcError as e:
            raise Q6ServeError.from_rpc(e) from None
        return r.status == health_pb2.HealthCheckResponse.SERVING
