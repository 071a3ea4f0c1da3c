"""The client core shared by :class:`Client`, :class:`AsyncClient` and :class:`ShardedClient`.

One place for each rule the three transports have in common: the codec table (NumPy dtype <->
wire dtype, f32/f16/bf16 with ``ml_dtypes.bfloat16``), the request builders (every argument a
call takes is validated and encoded here), the reply decoders, the error type and the result
types. The transports only decide how a request travels (blocking, asyncio, fanned out over
shards); channels come from :mod:`.channel` and retries from :mod:`.retry`.

Each client method is a :class:`Call` built here (the request, and how the reply becomes the
method's result) that the transport runs under the rules of :class:`Transport` (deadline,
retry policy, call metadata). So a sync method and its asyncio twin differ only in ``await``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

import grpc
import ml_dtypes
import numpy as np

from q6serve.kernels.epilogue import TopK
from q6serve.v1 import q6serve_pb2 as pb
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc

from . import names, reply_bytes, shm
from .channel import token_metadata
from .matmul_bytes import splice_for
from .retry import NO_RETRY, RetryPolicy
from .shm import RegionArg, ShmRegion

# -- the codec table: one row per wire dtype --------------------------------------------------
# (keyed by the names of .names, in their order)
DTYPES = dict(zip(names.DTYPES, map(np.dtype, (np.float32, np.float16, ml_dtypes.bfloat16)),
                  strict=True))
_DTYPE_TO_PB = dict(zip(names.DTYPES, (pb.DTYPE_F32, pb.DTYPE_F16, pb.DTYPE_BF16), strict=True))
_DTYPE_FROM_PB = {v: k for k, v in _DTYPE_TO_PB.items()}
_RESPONSE = pb.MatmulResponse
_STREAM_RESPONSE = pb.MatmulStreamResponse
_NP_OF_PB = {v: DTYPES[k].newbyteorder("<") for k, v in _DTYPE_TO_PB.items()}
_WIRE_LE = frozenset(_NP_OF_PB.values())  # the wire's dtypes as they travel: little-endian
PRECISIONS = dict(zip(names.PRECISIONS, (pb.PRECISION_AUTO, pb.PRECISION_EXACT,
                                         pb.PRECISION_F16, pb.PRECISION_Q8_1), strict=True))
_PRECISION_NAME = {v: k for k, v in PRECISIONS.items()}
_LAYOUT_NAME = {pb.LAYOUT_SOA: "soa", pb.LAYOUT_AOS: "aos", pb.LAYOUT_UNSPECIFIED: ""}
UPLOAD_FORMATS = {"q6_k": pb.UPLOAD_FORMAT_Q6_K, "f32": pb.UPLOAD_FORMAT_F32,
                  "f16": pb.UPLOAD_FORMAT_F16}
PLACEMENTS = {None: pb.PLACEMENT_UNSPECIFIED, **dict(zip(
    names.PLACEMENTS, (pb.PLACEMENT_SHARD, pb.PLACEMENT_REPLICATE), strict=True))}
UPLOAD_CHUNK = 1 << 20
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def dtype_name(dtype: np.dtype[Any]) -> str | None:
    """The wire name ("f32", "f16", "bf16") of a NumPy dtype, or None if it has none."""
    return next((n for n, d in DTYPES.items() if d == dtype), None)


def wire_dtype(dtype: np.dtype[Any]) -> str:
    """:func:`dtype_name`, or a ValueError naming the dtypes the wire has."""
    name = dtype_name(dtype)
    if name is None:
        raise ValueError(f"dtype {dtype} is not one of {', '.join(DTYPES)} "
                         "(bf16 is ml_dtypes.bfloat16)")
    return name


def _choice(table: Mapping[Any, Any], key: Any, what: str) -> Any:
    """``table[key]``, or a ValueError naming the choices (not a bare KeyError)."""
    try:
        return table[key]
    except (KeyError, TypeError):
        choices = ", ".join(repr(k) for k in table)
        raise ValueError(f"{what}={key!r} is not one of {choices}") from None


# -- errors and results -----------------------------------------------------------------------
class Q6ServeError(Exception):
    """Any failed call: ``code`` is the grpc.StatusCode, ``message`` the worker's details."""

    def __init__(self, code: grpc.StatusCode, message: str, request_id: str = "") -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id  # set for per-request failures of matmul_stream

    @classmethod
    def from_rpc(cls, e: grpc.RpcError, prefix: str = "") -> Q6ServeError:
        """From a gRPC failure (``prefix``, e.g. the shard, goes before its message)."""
        if hasattr(e, "code") and hasattr(e, "details"):
            return cls(e.code(), prefix + (e.details() or ""))
        return cls(grpc.StatusCode.UNKNOWN, prefix + repr(e))


@contextmanager
def rpc_errors() -> Iterator[None]:
    """A gRPC failure inside becomes a :class:`Q6ServeError`: the one exception type every
    client raises (a sync and an asyncio body alike: no ``await`` is needed to convert)."""
    try:
        yield
    except grpc.RpcError as e:
        raise Q6ServeError.from_rpc(e) from None


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


@dataclass(slots=True)  # not frozen: its __init__ was 5.7 of a reply's 22 us decode (CI VM)
class MatmulOutput:
    """One matmul's result. ``y`` [N, rows]; with ``topk=k`` it is None and ``topk`` holds the
    per-row top-k values f32 [N, k], column indices int32 [N, k] and log-sum-exp f32 [N]. A
    multi-weight call (a list of weights) returns one of these whose ``outputs`` hold one per
    weight (each with ``weight`` set), in the order asked; its own y/topk/kernel are empty."""

    y: np.ndarray | None
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
    topk: TopK | None = None
    weight: str = ""  # set on the entries of ``outputs``
    outputs: tuple[MatmulOutput, ...] = ()


# -- tensors ----------------------------------------------------------------------------------
def fill_tensor(t: pb.Tensor, a: np.ndarray) -> pb.Tensor:
    """Set ``t`` to ``a`` in place (dtype, shape, little-endian bytes)."""
    a = np.ascontiguousarray(a)
    t.dtype = _DTYPE_TO_PB[wire_dtype(a.dtype)]
    t.shape.extend(a.shape)
    t.data = _little_rows(a).tobytes()
    return t


def _little_rows(a: np.ndarray) -> np.ndarray:
    """``a`` as the wire carries it: row-major, little-endian (``a`` itself if it is)."""
    return np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False)


def encode_tensor(a: np.ndarray) -> pb.Tensor:
    return fill_tensor(pb.Tensor(), a)


def decode_tensor(t: pb.Tensor, data: Any = None) -> np.ndarray:
    """``data``: t's data bytes where ``t`` was parsed without them (a view of the reply:
    :mod:`.reply_bytes`)."""
    a = np.frombuffer(t.data if data is None else data, dtype=_NP_OF_PB[t.dtype])
    shape = t.shape  # a matmul's y is 2-D: two reads, not a tuple of the container (1.4 us)
    return a.reshape(shape[0], shape[1]) if len(shape) == 2 else a.reshape(tuple(shape))


def as_bytes_view(data: np.ndarray | bytes | memoryview) -> memoryview:
    """A flat byte view of ``data`` without copying it (uploads stream slices of it; a memmap
    streams from disk)."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data)
    return memoryview(data).cast("B")


# -- requests: one builder per call, shared by the three transports ---------------------------
def load_request(gguf_path: str, tensors: Iterable[str] = (), prefix: str = "", *,
                 rows: tuple[int, int] | None = None, shard: tuple[int, int] | None = None,
                 placement: str | None = None) -> pb.LoadWeightsRequest:
    if rows is not None and shard is not None:
        raise ValueError("give rows or shard, not both")
    req = pb.LoadWeightsRequest(gguf_path=gguf_path, tensors=list(tensors), prefix=prefix,
                                placement=_choice(PLACEMENTS, placement, "placement"))
    if rows is not None:
        req.row_range.CopyFrom(pb.RowRange(begin=rows[0], end=rows[1]))
    if shard is not None:
        req.shard.CopyFrom(pb.ShardSpec(index=shard[0], count=shard[1]))
    return req


def upload_header(name: str, raw: memoryview, rows: int, k: int, fmt: str,
                  sha256: str | None) -> pb.UploadHeader:
    return pb.UploadHeader(name=name, rows=rows, k=k,
                           format=_choice(UPLOAD_FORMATS, fmt, "fmt"), total_bytes=len(raw),
                           sha256=sha256 or hashlib.sha256(raw).hexdigest())


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


Weights = str | Sequence[str]  # one weight, or several of the same K (a multi-weight call)


def request_head(weight: Weights, precision: str = "auto", out_dtype: str = "f32",
                 request_id: str = "", topk: int | None = None) -> pb.MatmulRequest:
    """A MatmulRequest with everything but x and the regions, each argument checked."""
    req = pb.MatmulRequest(precision=_choice(PRECISIONS, precision, "precision"),
                           out_dtype=_choice(_DTYPE_TO_PB, out_dtype, "out_dtype"),
                           request_id=request_id)
    if isinstance(weight, str):
        req.weight = weight
    else:
        names = list(weight)
        if not all(isinstance(n, str) for n in names):
            raise ValueError(f"weights must be names (str), got {names!r:.200}")
        req.weights.extend(names)
    if topk is not None:
        if isinstance(topk, bool) or not isinstance(topk, int | np.integer) or not (
                0 <= topk < 1 << 32):
            raise ValueError(f"topk={topk!r} must be an int (the worker takes 1..256)")
        req.topk.k = int(topk)
    return req


def matmul_request(weight: Weights, x: np.ndarray, precision: str = "auto",
                   out_dtype: str = "f32", request_id: str = "", *,
                   x_region: RegionArg | None = None, y_region: RegionArg | None = None,
                   topk: int | None = None) -> pb.MatmulRequest:
    """``weight``: a name, or a list of names (MatmulRequest.weights: one output per weight);
    ``topk``: the top-k epilogue's k (the worker checks 1..256 and <= the weight's rows);
    ``x_region``: x travels through that shared-memory region (copied there unless x is
    already its view at that offset); ``y_region``: the worker writes y there (.shm)."""
    req = request_head(weight, precision, out_dtype, request_id, topk)
    if x_region is not None:
        if not hasattr(x, "__cuda_array_interface__"):  # a CuPy x stays on the device
            x = np.asarray(x)
        shm.place_x(req, x, _DTYPE_TO_PB[wire_dtype(x.dtype)], x_region)
    else:
        # x set in place: a big submessage passed to the constructor is copied the slow way
        # in upb (N=64 ffn_down activations: 489 -> 289 us with serialization; RESULTS.md)
        fill_tensor(req.x, x)
    if y_region is not None:
        shm.place_y(req, y_region)
    return req


def matmul_request_bytes(weight: Weights, x: np.ndarray, precision: str = "auto",
                         out_dtype: str = "f32", request_id: str = "", *,
                         x_region: RegionArg | None = None, y_region: RegionArg | None = None,
                         topk: int | None = None) -> bytes:
    """``matmul_request(...).SerializeToString()``; without regions x's bytes are copied once
    (:mod:`.matmul_bytes`)."""
    if x_region is not None or y_region is not None or type(x) is not np.ndarray or (
            not x.size):
        return matmul_request(weight, x, precision, out_dtype, request_id, x_region=x_region,
                              y_region=y_region, topk=topk).SerializeToString()
    # x itself when it is the bytes to send (bytes.join takes its buffer; checked here without
    # _little_rows' calls, ~1 us), else that copy
    data = x if x.flags.c_contiguous and x.dtype in _WIRE_LE else _little_rows(x)
    # type(topk): True == 1 as a key, and only the builder refuses a bool
    key = (weight if type(weight) is str else tuple(weight), x.shape, x.dtype, precision,
           out_dtype, topk, type(topk))

    def shell() -> pb.MatmulRequest:
        req = request_head(weight, precision, out_dtype, "", topk)
        req.x.dtype = _DTYPE_TO_PB[wire_dtype(x.dtype)]
        req.x.shape.extend(x.shape)
        return req

    return splice_for(key, shell, x.nbytes).join(data, request_id)


def flags_request(changes: Mapping[str, bool]) -> pb.SetFlagsRequest:
    return pb.SetFlagsRequest(flags=[pb.Flag(name=n, enabled=bool(v))
                                     for n, v in changes.items()])


def health_request(service: str = "") -> Any:
    from grpc_health.v1 import health_pb2

    return health_pb2.HealthCheckRequest(service=service)


def health_stub(channel: grpc.Channel | grpc.aio.Channel) -> Any:
    from grpc_health.v1 import health_pb2_grpc

    return health_pb2_grpc.HealthStub(channel)


def is_serving(reply: Any) -> bool:
    from grpc_health.v1 import health_pb2

    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


# -- replies ----------------------------------------------------------------------------------
def decode_topk(t: pb.TopKResult, views: reply_bytes.Views | None = None,
                path: tuple[int, ...] = ()) -> TopK:
    """TopKResult's bytes as arrays (views of the reply): f32 [N, k], int32 [N, k], f32 [N];
    ``views``, ``path``: its bytes fields where ``t`` was parsed without them."""
    n, k = int(t.rows), int(t.k)
    if views is None:
        return TopK(np.frombuffer(t.values, "<f4").reshape(n, k),
                    np.frombuffer(t.indices, "<i4").reshape(n, k),
                    np.frombuffer(t.lse, "<f4").reshape(n))
    return TopK(np.frombuffer(views.get((*path, 3, 0), b""), "<f4").reshape(n, k),
                np.frombuffer(views.get((*path, 4, 0), b""), "<i4").reshape(n, k),
                np.frombuffer(views.get((*path, 5, 0), b""), "<f4").reshape(n))


def output_of(r: pb.MatmulResponse, y_region: RegionArg | None = None,
              views: reply_bytes.Views | None = None, path: tuple[int, ...] = ()) -> MatmulOutput:
    """``y_region``: the request's; y is then a view of that region (the reply has no bytes).
    ``views``, ``path``: the arrays' bytes where ``r`` (at ``path`` in the reply) was parsed
    without them (:func:`parse_response`). ``r`` is a MatmulResponse or one of its
    ``outputs`` (a WeightOutput): each field is read by the type's own name (a getattr of a
    field the type lacks costs ~0.7 us on the CI VM, raising inside)."""
    t = r.timing
    has = t.HasField
    if type(r) is _RESPONSE:
        outs = r.outputs
        outputs = (tuple([output_of(o, None, views, (*path, 8, i)) for i, o in enumerate(outs)])
                   if outs else ())  # (path is read only with views)
        f_y, f_topk, rid, weight = 1, 7, r.request_id, ""
    else:  # a WeightOutput
        outputs, f_y, f_topk, rid, weight = (), 2, 3, "", r.weight
    topk = (decode_topk(r.topk, views, (*path, f_topk, 0)) if r.HasField("topk")
            else None)
    if topk is not None or outputs:
        y = None
    elif views is None or y_region is not None:
        y = response_y(r, y_region)
    else:
        y = decode_tensor(r.y, views.get((*path, f_y, 0, 3, 0), b""))
    return MatmulOutput(y, r.kernel, _LAYOUT_NAME[r.layout],
                        _PRECISION_NAME[r.precision], t.queue_seconds,
                        t.kernel_seconds if has("kernel_seconds") else None,
                        t.batch_rows, t.batch_requests, rid,
                        t.decode_seconds if has("decode_seconds") else None,
                        t.device_seconds if has("device_seconds") else None,
                        t.handler_seconds if has("handler_seconds") else None,
                        topk, weight, outputs)


def response_y(r: pb.MatmulResponse, y_region: RegionArg | None = None) -> np.ndarray:
    """y of a one-weight reply without top-k, and nothing else of it (``Client.matmul``'s
    result: the reply's other fields cost 5-6 us to read on the CI VM)."""
    y = r.y
    return decode_tensor(y) if y_region is None else shm.read_y(y, y_region, _NP_OF_PB[y.dtype])


def stream_outcome(raw: bytes, y_regions: dict[str, RegionArg]) -> MatmulOutput | Q6ServeError:
    """One MatmulStream reply (its bytes) as the caller sees it: its result (y read from the
    y_region its request named, taken out of ``y_regions``), or that request's own error (the
    stream itself goes on)."""
    r, views = reply_bytes.parse(_STREAM_RESPONSE, raw, reply_bytes.STREAM)
    y_region = y_regions.pop(r.request_id, None)
    if r.WhichOneof("outcome") == "error":
        code = _CODES.get(r.error.code, grpc.StatusCode.UNKNOWN)
        return Q6ServeError(code, r.error.message, r.request_id)
    return output_of(r.result, y_region, views, (2, 0))


def parse_response(raw: bytes, y_region: RegionArg | None = None) -> MatmulOutput:
    """A Matmul reply's bytes as the caller sees it; its arrays are views of ``raw``
    (:mod:`.reply_bytes`)."""
    r, views = reply_bytes.parse(_RESPONSE, raw, reply_bytes.RESPONSE)
    return output_of(r, y_region, views)


def response_y_bytes(raw: bytes, y_region: RegionArg | None = None) -> np.ndarray:
    """y alone of a one-weight Matmul reply's bytes (:func:`response_y`), a view of ``raw``."""
    r, views = reply_bytes.parse(_RESPONSE, raw, reply_bytes.RESPONSE)
    if views is None or y_region is not None:
        return response_y(r, y_region)
    return decode_tensor(r.y, views.get((1, 0, 3, 0), b""))


def stream_requests(requests: Iterable[tuple[Any, ...]], precision: str, out_dtype: str,
                    y_regions: dict[str, RegionArg],
                    topk: int | None = None) -> Iterator[bytes]:
    """MatmulStream requests (serialized) from ``(request_id, weight, x)`` or ``(request_id,
    weight, x, x_region, y_region)`` tuples (``weight`` a name or a list of names); records each
    y_region by request id (for stream_outcome)."""
    for rid, w, x, *io in requests:
        xr, yr = [*io, None, None][:2]
        if yr is not None:
            y_regions[rid] = yr
        yield matmul_request_bytes(w, x, precision, out_dtype, rid, x_region=xr,
                                   y_region=yr, topk=topk)


@dataclass(frozen=True)
class RegionInfo:
    """A registered shared-memory region (ListRegions)."""

    name: str
    kind: str  # "system" or "cuda"
    key: str
    offset: int
    byte_size: int
    in_use: int

    @classmethod
    def from_pb(cls, r: pb.RegionInfo) -> RegionInfo:
        kind = {pb.REGION_KIND_SYSTEM: "system", pb.REGION_KIND_CUDA: "cuda"}.get(r.kind, "")
        return cls(r.name, kind, r.key, r.offset, r.byte_size, r.in_use)


def weights_of(r: Any) -> list[Weight]:
    return [Weight.from_pb(w) for w in r.weights]


def flag_states(flags: Iterable[pb.Flag]) -> dict[str, bool]:
    return {f.name: f.enabled for f in flags}


def status_to_dict(status: pb.GetStatusResponse) -> dict[str, object]:
    """GetStatus as plain JSON types; byte counts and other 64-bit integers as ints (protobuf's
    JSON mapping writes them as strings)."""
    from google.protobuf.json_format import MessageToDict

    d = MessageToDict(status, preserving_proto_field_name=True,
                      always_print_fields_with_no_presence=True)
    return _int64_as_int(status, d)


def _int64_as_int(msg: Any, d: dict[str, Any]) -> dict[str, Any]:
    from google.protobuf.descriptor import FieldDescriptor as F

    int64 = {F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_SINT64, F.TYPE_FIXED64, F.TYPE_SFIXED64}
    for field in msg.DESCRIPTOR.fields:
        name, value = field.name, d.get(field.name)
        if value is None:
            continue
        if field.type == F.TYPE_MESSAGE:
            if isinstance(value, list):  # repeated submessages
                d[name] = [_int64_as_int(m, x)
                           for m, x in zip(getattr(msg, name), value, strict=True)]
            elif not field.message_type.GetOptions().map_entry:
                d[name] = _int64_as_int(getattr(msg, name), value)
        elif field.type in int64:
            d[name] = [int(x) for x in value] if isinstance(value, list) else int(value)
    return d


# -- calls: each client method once, run by every transport -----------------------------------
T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True)
class Call(Generic[T]):
    """One call as every client makes it: ``method`` on the stub of ``service`` (a key of
    :func:`stubs`), ``request`` (a message, or a zero-argument factory of a fresh request
    iterator, so that a retried client stream starts again from its first message) and
    ``decode``, from the reply to what the client method returns. ``retry=False``: one
    attempt whatever the policy (health is a probe)."""

    method: str
    request: Any
    decode: Callable[[Any], T]
    service: str = "q6serve"
    retry: bool = True

    def fresh_request(self) -> Any:
        return self.request() if callable(self.request) else self.request

    def then(self, f: Callable[[T], U]) -> Call[U]:
        """The same call, its result passed on through ``f``."""
        decode = self.decode
        return replace(self, decode=lambda r: f(decode(r)))  # type: ignore[arg-type,return-value]


class BytesStub:
    """Matmul and MatmulStream with bytes both ways: the client writes requests and parses
    replies itself (:func:`matmul_request_bytes`, :func:`output_of`), without the generated
    stub's serializers."""

    def __init__(self, channel: grpc.Channel | grpc.aio.Channel) -> None:
        service = pb.DESCRIPTOR.services_by_name["Q6Serve"].full_name
        self.Matmul = channel.unary_unary(f"/{service}/Matmul")
        self.MatmulStream = channel.stream_stream(f"/{service}/MatmulStream")


def stubs(channel: grpc.Channel | grpc.aio.Channel) -> dict[str, Any]:
    """The stubs a :class:`Call` names by ``service``, over one (sync or aio) channel."""
    return {"q6serve": pb_grpc.Q6ServeStub(channel), "bytes": BytesStub(channel),
            "health": health_stub(channel)}


class Transport:
    """What every client applies to each call: the default deadline (``timeout`` seconds; a
    call's own ``timeout`` wins), the retry policy (UNAVAILABLE only, inside that deadline:
    :mod:`.retry`) and the call metadata (the bearer token, :func:`.channel.token_metadata`)."""

    def __init__(self, *, token: str | None, timeout: float | None,
                 retry: RetryPolicy | None) -> None:
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._metadata = token_metadata(token)

    def _deadline(self, timeout: float | None) -> float | None:
        """A call's time budget: its own ``timeout``, else the client's."""
        return self.timeout if timeout is None else timeout

    def _policy(self, call: Call[Any]) -> RetryPolicy:
        return self.retry if call.retry else NO_RETRY


def _reply(r: Any) -> Any:
    return r


def _weight(r: Any) -> Weight:
    return Weight.from_pb(r.weight)


def _region(r: Any) -> RegionInfo:
    return RegionInfo.from_pb(r.region)


def load_call(gguf_path: str, tensors: Iterable[str] = (), prefix: str = "", *,
              rows: tuple[int, int] | None = None, shard: tuple[int, int] | None = None,
              placement: str | None = None) -> Call[list[Weight]]:
    req = load_request(gguf_path, tensors, prefix, rows=rows, shard=shard, placement=placement)
    return Call("LoadWeights", req, weights_of)


def upload_call(name: str, data: np.ndarray | bytes | memoryview, rows: int, k: int,
                fmt: str = "q6_k", sha256: str | None = None,
                progress: Callable[[int], None] | None = None) -> Call[Weight]:
    raw = as_bytes_view(data)  # a flat view, not a copy: chunks are sliced from it
    header = upload_header(name, raw, rows, k, fmt, sha256)
    return Call("UploadWeight", lambda: upload_messages(header, raw, progress), _weight)


def list_call() -> Call[list[Weight]]:
    return Call("ListWeights", pb.ListWeightsRequest(), weights_of)


def get_call(name: str) -> Call[Weight]:
    return Call("GetWeight", pb.GetWeightRequest(name=name), _weight)


def unload_call(name: str) -> Call[Weight]:
    return Call("UnloadWeight", pb.UnloadWeightRequest(name=name), _weight)


def matmul_call(weight: Weights, x: np.ndarray, precision: str = "auto", out_dtype: str = "f32",
                *, x_region: RegionArg | None = None, y_region: RegionArg | None = None,
                topk: int | None = None) -> Call[MatmulOutput]:
    """Matmul (:func:`matmul_request` checks the arguments); y read from ``y_region`` if set."""
    req = matmul_request_bytes(weight, x, precision, out_dtype, x_region=x_region,
                               y_region=y_region, topk=topk)
    return Call("Matmul", req, lambda raw: parse_response(raw, y_region), service="bytes")


def matmul_y_call(weight: str, x: np.ndarray, precision: str = "auto", out_dtype: str = "f32",
                  *, x_region: RegionArg | None = None,
                  y_region: RegionArg | None = None) -> Call[np.ndarray]:
    """:func:`matmul_call` of one weight whose result is y alone (:func:`response_y`)."""
    req = matmul_request_bytes(one_weight(weight), x, precision, out_dtype, x_region=x_region,
                               y_region=y_region)
    return Call("Matmul", req, lambda raw: response_y_bytes(raw, y_region), service="bytes")


def one_weight(weight: Weights) -> str:
    """matmul's weight: one name (several of one K go through matmul_multi)."""
    if not isinstance(weight, str):
        raise ValueError("matmul takes one weight name; use matmul_multi for several")
    return weight


def weight_list(weights: Sequence[str]) -> list[str]:
    """matmul_multi's weights: a list of names, not one name (a str is a sequence too)."""
    if isinstance(weights, str):
        raise ValueError("matmul_multi takes a list of weight names")
    return list(weights)


def y_of(out: MatmulOutput) -> np.ndarray:
    """matmul's result: y of a one-weight call without topk."""
    assert out.y is not None, "a one-weight call without topk has y"
    return out.y


def ys_of(out: MatmulOutput) -> list[np.ndarray]:
    """matmul_multi's result: one y per weight, in the order asked."""
    return [y_of(o) for o in out.outputs]


def topk_of(out: MatmulOutput) -> TopK:
    """matmul_topk's result."""
    assert out.topk is not None, "a call with topk has topk"
    return out.topk


def register_region_call(region: shm.Region) -> Call[RegionInfo]:
    return Call("RegisterRegion", shm.register_request(region), _region)


def cuda_region(name: str, size: int | None, array: Any, device: int) -> shm.CudaRegion:
    """register_cuda_ipc's region: a fresh allocation of ``size`` bytes, or ``array``'s."""
    if (size is None) == (array is None):
        raise ValueError("register_cuda_ipc takes size or array, one of them")
    return (shm.CudaRegion.create(name, size, device) if array is None
            else shm.CudaRegion(name, array))


def unregister_region_call(name: str) -> Call[RegionInfo]:
    return Call("UnregisterRegion", pb.UnregisterRegionRequest(name=name), _region)


def open_lane_call(region: str) -> Call[tuple[str, bytes]]:
    """OpenLane: the lane socket's path and the one-time ticket (client/lane.py)."""
    return Call("OpenLane", pb.OpenLaneRequest(region=region),
                lambda r: (r.socket_path, bytes(r.ticket)))


def list_regions_call() -> Call[list[RegionInfo]]:
    return Call("ListRegions", pb.ListRegionsRequest(),
                lambda r: [RegionInfo.from_pb(x) for x in r.regions])


@contextmanager
def closed_on_error(region: ShmRegion) -> Iterator[ShmRegion]:
    """register_shm: a region the worker refused is closed (and unlinked) again."""
    try:
        yield region
    except BaseException:
        region.close()
        raise


def status_call() -> Call[pb.GetStatusResponse]:
    return Call("GetStatus", pb.GetStatusRequest(), _reply)


def flags_call(changes: Mapping[str, bool] | None = None) -> Call[dict[str, bool]]:
    """Set ``changes`` (if any) and return every flag's state (SetFlags answers with them;
    without changes, GetStatus carries them)."""
    if changes:
        return Call("SetFlags", flags_request(changes), lambda r: flag_states(r.flags))
    return status_call().then(lambda s: flag_states(s.flags))


def health_call(service: str = "") -> Call[bool]:
    """True when the worker reports SERVING; one attempt (health is a probe)."""
    return Call("Check", health_request(service), is_serving, service="health", retry=False)
