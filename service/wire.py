"""Protobuf <-> core dataclasses and arrays: the ONLY module of the service importing *_pb2.

Activations decode without copying: ``np.frombuffer`` views the request's bytes (read-only),
after checking that dtype, shape and byte count agree. Matmul requests are read by
:func:`read_matmul_request`, which leaves ``x.data`` where gRPC put it (service/rawmsg.py).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import grpc
import numpy as np

from q6serve.kernels.api import DTYPES, Layout, Precision, dtype_name
from q6serve.kernels.epilogue import TopK, check_k
from q6serve.kernels.errors import InvalidArgument
from q6serve.v1 import q6serve_pb2 as pb
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc

from .engine import MatmulCall, MatmulReply, StatusView, UploadSpec, WeightView
from .flags import FlagState
from .rawmsg import Unusual, encode_varint, record, take_bytes_field
from .regions import CudaIpcSource, RegionIO, RegionRef, RegionView, ShmSource
from .shards import RowRange, RowSelect

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Q6Serve"].full_name
METHODS: tuple[str, ...] = tuple(
    m.name for m in pb.DESCRIPTOR.services_by_name["Q6Serve"].methods)
# Request/reply streams: each request in them is counted on its own (metrics).
BIDI_METHODS: tuple[str, ...] = tuple(
    m.name for m in pb.DESCRIPTOR.services_by_name["Q6Serve"].methods
    if m.client_streaming and m.server_streaming)
ADMIN_METHODS = frozenset({"LoadWeights", "UploadWeight", "UnloadWeight", "SetFlags"})

_DTYPE_FROM_PB = {pb.DTYPE_UNSPECIFIED: "f32", pb.DTYPE_F32: "f32", pb.DTYPE_F16: "f16",
                  pb.DTYPE_BF16: "bf16"}
_DTYPE_TO_PB = {"f32": pb.DTYPE_F32, "f16": pb.DTYPE_F16, "bf16": pb.DTYPE_BF16}
_PREC_FROM_PB = {pb.PRECISION_AUTO: Precision.AUTO, pb.PRECISION_EXACT: Precision.EXACT,
                 pb.PRECISION_F16: Precision.F16, pb.PRECISION_Q8_1: Precision.Q8_1}
_PREC_TO_PB = {v: k for k, v in _PREC_FROM_PB.items()}
_LAYOUT_TO_PB = {Layout.SOA: pb.LAYOUT_SOA, Layout.AOS: pb.LAYOUT_AOS}
_UPLOAD_FROM_PB = {pb.UPLOAD_FORMAT_UNSPECIFIED: "q6_k", pb.UPLOAD_FORMAT_Q6_K: "q6_k",
                   pb.UPLOAD_FORMAT_F32: "f32", pb.UPLOAD_FORMAT_F16: "f16"}
MAX_DIM = 1 << 31
# per request and reply on the event loop, by dict: each wire dtype's little-endian numpy
# dtype (made once) and the Tensor.dtype code of the native ones
_LITTLE = {dt: dt.newbyteorder("<") for dt in DTYPES.values()}
_PB_OF_DTYPE = {dt: _DTYPE_TO_PB[name] for name, dt in DTYPES.items()}
# Tensor.dtype code -> dtype (tensor_spec: one lookup per request for a known code; an unknown
# one goes to dtype_from_pb for its refusal)
_DT_OF_PB = {code: DTYPES[name] for code, name in _DTYPE_FROM_PB.items()}


def _enum(table: dict, value: int, what: str):  # type: ignore[no-untyped-def]
    try:
        return table[value]
    except KeyError:
        raise InvalidArgument(f"unknown {what} enum value {value}") from None


def dtype_from_pb(value: int) -> np.dtype:
    dt = _DT_OF_PB.get(value)  # (one lookup for a known code: per request)
    return dt if dt is not None else DTYPES[_enum(_DTYPE_FROM_PB, value, "dtype")]


def tensor_spec(t: pb.Tensor, what: str = "x") -> tuple[np.dtype, tuple[int, int]]:
    """dtype and 2-D shape of ``t``, checked."""
    dt = dtype_from_pb(t.dtype)
    shape = t.shape  # read once: upb makes a new container per access; Python ints (uint64)
    if len(shape) != 2:
        raise InvalidArgument(f"{what} must be 2-D [N, K], got shape {list(shape)}")
    n, k = shape[0], shape[1]  # (indexing: no tuple() of the container, ~1 us per request)
    if n >= MAX_DIM or k >= MAX_DIM:
        raise InvalidArgument(f"{what} shape {[n, k]} is too large")
    return dt, (n, k)


class _ReadRequest:
    """What the worker's two request readers share: the request's bytes as gRPC read them
    (``raw``: ``ByteSize`` and ``SerializeToString`` answer for the whole request) and a
    parsed message (``msg``) that any field not kept on the reader is read from."""

    __slots__ = ()
    raw: bytes
    msg: pb.MatmulRequest

    def __getattr__(self, name: str) -> Any:
        return getattr(self.msg, name)

    def ByteSize(self) -> int:
        return len(self.raw)

    def SerializeToString(self) -> bytes:
        return self.raw


class MatmulIn(_ReadRequest):
    """A MatmulRequest as the worker reads it (:func:`read_matmul_request`): the message
    without ``x.data`` (``msg``; every other field is read through this object) and
    ``x.data`` as a view of the bytes gRPC read (``x_data``)."""

    __slots__ = ("msg", "raw", "x_data")

    def __init__(self, msg: pb.MatmulRequest, x_data: memoryview, raw: bytes) -> None:
        self.msg, self.x_data, self.raw = msg, x_data, raw


_F_REQ_X = pb.MatmulRequest.DESCRIPTOR.fields_by_name["x"].number
_F_TENSOR_DATA = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number


# Requests smaller than this are parsed whole by upb: copying their x costs less than the
# Python walk that avoids the copy (VM, read + matmul_call: 38 KiB 36 vs 65 us, 57 KiB 36 vs
# 80; 296 KiB 85 vs 63; 2.3 MiB 996 vs 71; again in session 10, min of 7 x 2000: 4 KiB 6-8 vs
# 25, 37 KiB 12 vs 16-29, 128 KiB 18-21 vs 25-26: upb's parse of T1's 37 KB is ~2.8 us and
# reading x.data ~2.3, less than the walk)
ZERO_COPY_MIN = 128 << 10


# -- a request like one seen before: its bytes matched, not parsed ------------------------------
# A caller's requests differ from call to call in x's bytes and the request id only (the
# client's own encoder splices both into the same bytes: client/matmul_bytes.py). The first
# request of a kind (a weight name, or a multi-weight request's names) that upb parsed, whose
# checks (matmul_call) passed and whose bytes are exactly the canonical serialization (fields in
# number order, packed shape: what upb, protobuf C++ and our client write) leaves its
# skeleton: the bytes up to x's data, those between x and the request id's place and those
# after it, and the call it decodes to. A later request whose bytes are that skeleton with
# x's data (same length: it is in the head) and a request id (one field 5 record of valid
# UTF-8, or none) between is the same message with that x and id, as upb would read it; its
# call is the skeleton's with x a view of ``raw`` (T1's 37 KB request on the 2-core VM: read +
# region_io + matmul_call 6.6 -> ~1.5 us). Anything else goes to upb, as before.
SKELETONS = True  # False: every request parsed by upb (an A/B in process)
MAX_SKELETONS = 4  # per kind (x's N, dtype, options: the most recent first)
# After an attempt to keep a skeleton (kept or not), a kind's next this many requests that no
# skeleton reads are parsed without one: an attempt costs ~16 us (N=1) to ~30 (N=64) on the VM
# beside upb's 6-14, so a caller whose requests of one weight change shape every time, or whose
# bytes are not the canonical ones, pays ~1-2 us a request for it, not the whole attempt
LEARN_GAP = 16
MAX_KINDS = 1024  # kinds kept; the table starts over beyond
# a skeleton's bytes besides x's data (names, shape, options; a multi-weight request's names
# are in it): a larger one is not kept, so the table holds at most ~MAX_KINDS x MAX_SKELETONS
# x 1 KiB (made-up weight names pass matmul_call's checks: only the engine knows the names)
MAX_SKELETON_BYTES = 1024
_TAIL_KEY = 16  # a weightless (multi-weight) request's kind: its last bytes (weights' names)


class _Skeleton(NamedTuple):
    head: bytes  # up to x's data (its length in the x and data records)
    nbytes: int  # x's data
    before_id: bytes  # fields 3, 4 (out dtype, precision)
    after_id: bytes  # fields after the request id (weights, topk)
    fixed: int  # len(head) + nbytes + len(before_id) + len(after_id)
    dtype: np.dtype  # x's, little-endian
    shape: tuple[int, int]
    weight: str
    precision: Precision
    out_dtype: np.dtype
    topk: int
    weights: tuple[str, ...]


class MatmulSeen(_ReadRequest):
    """A request read through a skeleton (:func:`read_matmul_request`): its call's fields,
    x as an array (``x_array``, a view of ``raw``) and request id; any other field (``x``
    too) is read from ``raw`` parsed by upb on first use (nothing on the worker's path
    does)."""

    __slots__ = ("_msg", "raw", "request_id", "skel", "x_array")

    def __init__(self, skel: _Skeleton, x: np.ndarray, request_id: str, raw: bytes) -> None:
        self.skel, self.x_array, self.request_id, self.raw = skel, x, request_id, raw
        self._msg: pb.MatmulRequest | None = None

    @property
    def msg(self) -> pb.MatmulRequest:
        if self._msg is None:
            self._msg = pb.MatmulRequest.FromString(self.raw)
        return self._msg


_SKELETONS: dict[bytes, list[_Skeleton]] = {}
_HOLD: dict[bytes, int] = {}  # kind -> its requests still to parse before the next attempt
# weightless kinds seen once: such a kind (a request's last bytes) is tried on its second
# request only, as its last bytes hold x's data or the request id when the names are short
# (under _TAIL_KEY bytes with their tags), a kind that never comes again
_ONCE: dict[bytes, None] = {}
_F_REQ_ID = pb.MatmulRequest.DESCRIPTOR.fields_by_name["request_id"].number
_T_RID = bytes((_F_REQ_ID << 3 | 2,))


def clear_skeletons() -> None:
    """Forget every skeleton and attempt (tests; an A/B in process)."""
    _SKELETONS.clear()
    _HOLD.clear()
    _ONCE.clear()


def _kind(raw: bytes) -> bytes | None:
    """The skeleton table's key of ``raw``: its weight's record (a short name first), or the
    last bytes of a request that starts with x (a multi-weight one); None: neither."""
    if raw[:1] == b"\n":  # field 1 (weight), length-delimited
        n = raw[1] if len(raw) > 1 else 0x80
        return raw[:2 + n] if n < 0x80 else None
    if raw[:1] == b"\x12" and len(raw) > _TAIL_KEY:  # starts with x: no weight
        return raw[-_TAIL_KEY:]
    return None


def _seen(raw: bytes, kind: bytes) -> MatmulSeen | None:
    """``raw`` read through one of ``kind``'s skeletons, or None."""
    for s in _SKELETONS.get(kind, ()):
        rid_len = len(raw) - s.fixed
        if rid_len < 0 or not raw.startswith(s.head):
            continue
        h = len(s.head)
        mid = h + s.nbytes + len(s.before_id)
        if not raw.startswith(s.before_id, h + s.nbytes) or (
                s.after_id and not raw.endswith(s.after_id)):
            continue
        if rid_len:  # one request_id record: tag, a one-byte length, the id
            if not 2 <= rid_len < 2 + 0x80 or raw[mid] != _T_RID[0] or (
                    raw[mid + 1] != rid_len - 2):
                continue
            try:
                rid = raw[mid + 2:mid + rid_len].decode()
            except UnicodeDecodeError:
                return None  # upb refuses it, with its own message
        else:
            rid = ""
        # (x may lie unaligned for its dtype: NumPy reads it so; the backends copy it into
        # their staging as bytes at the same speed, 37 KB 1.2 us either way on the VM)
        return MatmulSeen(s, np.ndarray(s.shape, s.dtype, raw, h), rid, raw)
    return None


def _learn(raw: bytes, kind: bytes, req: pb.MatmulRequest | MatmulIn) -> None:
    """Keep ``req``'s skeleton under ``kind`` when its call passes the checks and ``raw`` is
    its canonical serialization (else nothing: it is parsed whole each time); not tried for
    LEARN_GAP of the kind's requests after an attempt."""
    hold = _HOLD.get(kind)
    if hold:
        _HOLD[kind] = hold - 1
        return
    if hold is None and raw[:1] != b"\n" and kind not in _ONCE:  # (weightless: see _ONCE)
        if len(_ONCE) >= MAX_KINDS:
            _ONCE.clear()
        _ONCE[kind] = None
        return
    if len(_HOLD) >= MAX_KINDS:
        _HOLD.clear()
    _HOLD[kind] = LEARN_GAP
    msg = message(req)
    if msg.HasField("x_region") or msg.HasField("y_region"):
        return
    try:
        call = matmul_call(req, None)
    except Exception:
        return
    x = call.x
    if not x.nbytes:
        return
    t = pb.Tensor(dtype=msg.x.dtype)
    t.shape.extend(x.shape)
    inner = t.SerializeToString() + record(_F_TENSOR_DATA, x.nbytes)
    head = record(_F_REQ_X, len(inner) + x.nbytes) + inner
    if call.weight:
        w = call.weight.encode()
        head = record(1, len(w)) + w + head
    before = pb.MatmulRequest(out_dtype=msg.out_dtype, precision=msg.precision)
    after = pb.MatmulRequest(weights=msg.weights)
    if msg.HasField("topk"):
        after.topk.CopyFrom(msg.topk)
    before_id, after_id = before.SerializeToString(), after.SerializeToString()
    rid = pb.MatmulRequest(request_id=msg.request_id).SerializeToString()
    tail = before_id + rid + after_id  # (x's data between: its length is in the head)
    if len(rid) > 2 + 0x7F or len(head) + len(before_id) + len(after_id) > MAX_SKELETON_BYTES \
            or len(raw) != len(head) + x.nbytes + len(tail) or not (
                raw.startswith(head) and raw.endswith(tail)):
        return
    s = _Skeleton(head, x.nbytes, before_id, after_id,
                  len(head) + x.nbytes + len(before_id) + len(after_id), x.dtype, x.shape,
                  call.weight, call.precision, call.out_dtype, call.topk, call.weights)
    if len(_SKELETONS) >= MAX_KINDS:
        _SKELETONS.clear()
    got = _SKELETONS.get(kind)
    _SKELETONS[kind] = [s, *(got or ())][:MAX_SKELETONS]


def read_matmul_request(raw: bytes, zero_copy_min: int = ZERO_COPY_MIN,
                        ) -> pb.MatmulRequest | MatmulIn | MatmulSeen:
    """The request deserializer of Matmul and MatmulStream. A request like one seen before
    (a skeleton's bytes, x's data and request id aside) is read through it, x a view of
    ``raw``; else from ``zero_copy_min`` bytes on, upb parses the message without ``x.data``,
    which stays a view of ``raw`` (no copy on the event loop); smaller ones, and a message the
    walker does not take apart, are parsed whole (the same fields; upb's errors either way)."""
    kind = _kind(raw) if SKELETONS else None
    if kind is not None:
        if (got := _seen(raw, kind)) is not None:
            return got
        if len(raw) < zero_copy_min:
            msg = pb.MatmulRequest.FromString(raw)
            _learn(raw, kind, msg)
            return msg
    if len(raw) < zero_copy_min:
        return pb.MatmulRequest.FromString(raw)
    try:
        rest, data = take_bytes_field(raw, _F_REQ_X, _F_TENSOR_DATA)
    except Unusual:
        return pb.MatmulRequest.FromString(raw)
    msg = pb.MatmulRequest.FromString(rest)
    if data is None:
        return msg
    got = MatmulIn(msg, data, raw)
    if kind is not None:
        _learn(raw, kind, got)
    return got


def message(req: pb.MatmulRequest | MatmulIn | MatmulSeen) -> pb.MatmulRequest:
    """The parsed message of a request (MatmulIn's lacks x.data; MatmulSeen's is parsed
    now): its fields read directly, not through the per-attribute fallback (~1 us each on a
    2-core VM)."""
    return req.msg if isinstance(req, MatmulIn | MatmulSeen) else req


def _x_data(req: pb.MatmulRequest | MatmulIn | MatmulSeen) -> bytes | memoryview:
    """x's bytes: read once (upb builds a fresh bytes copy on every access)."""
    if isinstance(req, MatmulSeen):
        return memoryview(req.x_array.reshape(-1).view(np.uint8))
    return req.x_data if isinstance(req, MatmulIn) else req.x.data




def decode_tensor(t: pb.Tensor, what: str = "x",
                  data: bytes | memoryview | None = None) -> np.ndarray:
    """A read-only zero-copy view of ``t.data`` (or ``data``, the same field read by
    :func:`read_matmul_request`) as ``t.shape`` of ``t.dtype``."""
    dt, shape = tensor_spec(t, what)
    le = _LITTLE[dt]
    want = shape[0] * shape[1] * le.itemsize
    if data is None:
        data = t.data  # read once: upb builds a fresh bytes copy on every access
    if len(data) != want:
        raise InvalidArgument(f"{what} {list(shape)} {dtype_name(le)} needs {want} bytes, "
                              f"got {len(data)}")
    # one constructor over the (read-only) bytes: frombuffer + reshape is two arrays
    return np.ndarray(shape, le, data)


def encode_tensor(a: np.ndarray) -> pb.Tensor:
    a = np.ascontiguousarray(a)
    le = a.astype(a.dtype.newbyteorder("<"), copy=False)
    return pb.Tensor(dtype=_DTYPE_TO_PB[dtype_name(a.dtype)], shape=list(a.shape),
                     data=le.tobytes())


def matmul_call(req: pb.MatmulRequest | MatmulIn | MatmulSeen, timeout: float | None,
                x: np.ndarray | None = None) -> MatmulCall:
    """The engine's call: ``weight``, or ``weights`` (a multi-weight request, checked by
    service/multi.py), and the optional top-k epilogue; ``x``: activations already read from
    a region (else decoded). Each field is read once, from the message itself (not through
    MatmulIn's attribute fallback): this runs on the event loop for every request."""
    if type(req) is MatmulSeen:  # its skeleton's call (checked when it was kept)
        s = req.skel
        return MatmulCall(s.weight, req.x_array if x is None else x, s.precision, s.out_dtype,
                          timeout, s.topk, s.weights)
    if type(req) is MatmulIn:
        msg, data = req.msg, req.x_data
    else:
        msg, data = req, None
    weight, weights = msg.weight, msg.weights
    weights = tuple(weights) if weights else ()  # (tuple() of an empty container: ~1 us)
    if weight and weights:
        raise InvalidArgument("MatmulRequest sets both weight and weights; set one of them")
    if not weight and not weights:
        raise InvalidArgument("MatmulRequest.weight is empty (set weight, or weights for a "
                              "multi-weight request)")
    if not msg.HasField("x"):
        raise InvalidArgument("MatmulRequest.x is missing")
    topk = check_k(msg.topk.k, what="MatmulRequest.topk.k") if msg.HasField("topk") else 0
    if x is None:
        x = decode_tensor(msg.x, data=data)  # (data None: read there, once)
    precision = _enum(_PREC_FROM_PB, msg.precision, "precision")
    out = dtype_from_pb(msg.out_dtype)
    return MatmulCall(weight, x, precision, out, timeout, topk, weights)


class Took(NamedTuple):
    """perf_counter() times of one request in the worker: RPC taken, activations decoded.
    (A tuple: made for every request on the event loop, 4x cheaper than a frozen dataclass.)"""

    start: float
    decoded: float


def _fill_topk(t: pb.TopKResult, top: TopK) -> None:
    t.rows, t.k = (int(d) for d in top.values.shape)
    t.values = np.ascontiguousarray(top.values, dtype="<f4").tobytes()
    t.indices = np.ascontiguousarray(top.indices, dtype="<i4").tobytes()
    t.lse = np.ascontiguousarray(top.lse, dtype="<f4").tobytes()


def _fill_result(m: Any, r: MatmulReply, y_bytes: bool = True) -> None:
    """The fields MatmulResponse and WeightOutput share: y or topk, kernel, timing.
    ``y_bytes=False``: y went to a region; the reply states its dtype and shape only."""
    if r.topk is not None:
        _fill_topk(m.topk, r.topk)
    else:
        y = np.ascontiguousarray(r.y) if y_bytes else r.y
        code = _PB_OF_DTYPE.get(y.dtype)  # by dict: no scan of DTYPES per reply
        m.y.dtype = code if code is not None else _DTYPE_TO_PB[dtype_name(y.dtype)]
        m.y.shape.extend(y.shape)
        if y_bytes:
            m.y.data = y.astype(_LITTLE.get(y.dtype) or y.dtype.newbyteorder("<"),
                                copy=False).tobytes()
    m.kernel = r.kernel
    m.layout = _LAYOUT_TO_PB[r.layout]
    m.precision = _PREC_TO_PB[r.precision]
    timing = m.timing
    timing.queue_seconds = r.queue_seconds
    timing.batch_rows = r.batch_rows
    timing.batch_requests = r.batch_requests
    if r.kernel_seconds is not None:
        timing.kernel_seconds = r.kernel_seconds
    if r.device_seconds is not None:
        timing.device_seconds = r.device_seconds


Replies = MatmulReply | Sequence[tuple[str, MatmulReply]]  # one, or (weight, reply) per weight


def fill_matmul_response(resp: pb.MatmulResponse, r: Replies, request_id: str = "",
                         took: Took | None = None, y_bytes: bool = True) -> pb.MatmulResponse:
    """Set ``resp``'s fields in place. Passing a big submessage to a constructor is far slower
    in upb (64x3584 f32: 2 ms, in place 0.07 ms; see bench/RESULTS.md, issue 9).
    ``y_bytes=False``: y went to a region; the reply states its dtype and shape only."""
    if isinstance(r, MatmulReply):
        _fill_result(resp, r, y_bytes)
    else:  # a multi-weight request: one WeightOutput per weight, in the request's order
        for name, part in r:
            out = resp.outputs.add()
            out.weight = name
            _fill_result(out, part, y_bytes)
    resp.request_id = request_id
    if took is not None:  # last, so handler time includes encoding y
        resp.timing.decode_seconds = took.decoded - took.start
        resp.timing.handler_seconds = time.perf_counter() - took.start
    return resp


def matmul_response(r: Replies, request_id: str = "",
                    took: Took | None = None, y_bytes: bool = True) -> pb.MatmulResponse:
    return fill_matmul_response(pb.MatmulResponse(), r, request_id, took, y_bytes)


def stream_result(r: Replies, request_id: str,
                  took: Took | None = None, y_bytes: bool = True) -> pb.MatmulStreamResponse:
    msg = pb.MatmulStreamResponse(request_id=request_id)
    fill_matmul_response(msg.result, r, request_id, took, y_bytes)
    return msg


# -- replies serialized here, y spliced in from the backend's buffer ---------------------------
# A Matmul / MatmulStream reply is written as the protobuf wire bytes of the message without
# y, followed by y's Tensor record written here: its dtype and shape, then the data field's tag
# and length, then the data. y occurs once: the spec says parsers merge repeated occurrences of
# a singular message field, but protobuf.js (@grpc/proto-loader) keeps only the last one, so a
# split y reached Node clients without its shape (tests/protocol caught it). y is
# then copied once, by the final join, straight from the batch's output array: no tobytes(),
# no copy into upb and none by upb's serializer (64 x 18944 f32: SerializeToString alone took
# 2.7 ms on the 2-core VM, the join 0.8 ms; 8 x 18944: 284 vs 14 us). Below SPLICE_MIN_BYTES
# of y the message is cheaper (its Python is less: 1 x 3584 f16, 3.8 vs 6.8 us; even at 64 KiB)
# and is returned as is. The handlers' serializer (add_to_server) passes bytes through.
SPLICE_MIN_BYTES = 64 << 10
_F_RESP_Y = pb.MatmulResponse.DESCRIPTOR.fields_by_name["y"].number
_F_RESP_OUTPUTS = pb.MatmulResponse.DESCRIPTOR.fields_by_name["outputs"].number
_F_OUT_Y = pb.WeightOutput.DESCRIPTOR.fields_by_name["y"].number
_F_STREAM_RESULT = pb.MatmulStreamResponse.DESCRIPTOR.fields_by_name["result"].number
Pieces = list[bytes | memoryview]


def _size(pieces: Pieces) -> int:
    return sum(map(len, pieces))


def _yrecord(field: int, m: Any, y: np.ndarray) -> Pieces:
    """``m``'s y (a Tensor in ``field`` whose dtype and shape are set) as one whole record with
    y's bytes as its data, viewed, not copied; ``m``'s own y is cleared."""
    head = m.y.SerializeToString()
    m.ClearField("y")
    le = np.ascontiguousarray(y).astype(y.dtype.newbyteorder("<"), copy=False)
    data = memoryview(le.reshape(-1).view(np.uint8))
    inner = record(_F_TENSOR_DATA, len(data))
    return [record(field, len(head) + len(inner) + len(data)), head, inner, data]


def _reply_pieces(r: Replies, request_id: str, took: Took | None) -> Pieces:
    """MatmulResponse wire bytes (see above), as pieces to join once."""
    resp = pb.MatmulResponse(request_id=request_id)
    tail: Pieces = []
    if isinstance(r, MatmulReply):  # (a y of one weight goes through _result_pieces)
        _fill_result(resp, r, y_bytes=False)  # dtype and shape; topk in full
        if r.topk is None:
            tail = _yrecord(_F_RESP_Y, resp, r.y)
    else:  # one WeightOutput record per weight, in order, each with its own y spliced in
        for name, part in r:
            out = pb.WeightOutput(weight=name)
            _fill_result(out, part, y_bytes=False)
            y_rec = [] if part.topk is not None else _yrecord(_F_OUT_Y, out, part.y)
            body: Pieces = [out.SerializeToString(), *y_rec]
            tail += [record(_F_RESP_OUTPUTS, _size(body)), *body]
    if took is not None:  # last, so handler time includes encoding all but y's copy
        resp.timing.decode_seconds = took.decoded - took.start
        resp.timing.handler_seconds = time.perf_counter() - took.start
    return [resp.SerializeToString(), *tail]


# -- one weight's y: the whole reply encoded here --------------------------------------------
# The reply every plain request gets (one weight, y, no top-k) is written field by field in
# the wire format upb itself writes (field-number order, proto3 defaults left out, the packed
# shape; tests/service/test_wire_replies.py compares the bytes with upb's): setting ~15 fields
# on upb messages and serializing them cost more Python than writing them (T1's reply, 1 x
# 3584 f32, on the 2-core VM: 14-15 -> 8-9.5 us, hot loop). y's bytes are copied once, by the
# final join. What depends on dtype, shape, kernel, layout and precision only is kept per
# combination (_HEADS, a bounded table).
def _tag(msg: Any, name: str, wire_type: int) -> bytes:
    return encode_varint(msg.DESCRIPTOR.fields_by_name[name].number << 3 | wire_type)


_DOUBLE = struct.Struct("<d").pack
_ZERO8 = bytes(8)
_T_REQ_ID = _tag(pb.MatmulResponse, "request_id", 2)
_T_TIMING = _tag(pb.MatmulResponse, "timing", 2)
_T_STREAM_ID = _tag(pb.MatmulStreamResponse, "request_id", 2)
_T_STREAM_RESULT = _tag(pb.MatmulStreamResponse, "result", 2)
_T_QUEUE, _T_KERNEL_S, _T_DECODE, _T_DEVICE, _T_HANDLER = (
    _tag(pb.MatmulTiming, name, 1) for name in ("queue_seconds", "kernel_seconds",
                                                "decode_seconds", "device_seconds",
                                                "handler_seconds"))
_T_ROWS, _T_REQUESTS = (_tag(pb.MatmulTiming, name, 0) for name in ("batch_rows",
                                                                    "batch_requests"))
# The timing of a reply that sets kernel, both batch counts (each below 128: one varint byte),
# decode, device and handler seconds -- every direct-path and batched reply of a finished
# kernel -- packed in one call (its fields in number order; the queue's record, when not zero,
# goes before it): 7 appends and 6 tag concatenations were ~1/4 of _result_pieces on the VM.
_TIMING6 = struct.Struct("<" + "".join(
    ("B" if len(t) == 1 else f"{len(t)}s") + f for t, f in (
        (_T_KERNEL_S, "d"), (_T_ROWS, "B"), (_T_REQUESTS, "B"), (_T_DECODE, "d"),
        (_T_DEVICE, "d"), (_T_HANDLER, "d"))))
_TIMING6_TAGS = tuple(t[0] if len(t) == 1 else t for t in (
    _T_KERNEL_S, _T_ROWS, _T_REQUESTS, _T_DECODE, _T_DEVICE, _T_HANDLER))
_HEADS: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}
MAX_HEADS = 4096  # combinations kept (the table starts over beyond)


# the last _head's (dtype, shape, kernel, layout, precision, result): a stream's replies are
# alike, and comparing them by identity is cheaper than the table's tuple hash (its enums hash
# in Python); one tuple, replaced whole (any thread reads a consistent one)
_HEAD_LAST: list[tuple[Any, ...]] = [(None,) * 6]


def _head(y: np.ndarray, r: MatmulReply) -> tuple[bytes, bytes]:
    """(y's record up to its data, the kernel/layout/precision fields) for ``r``'s y."""
    last = _HEAD_LAST[0]
    if (y.dtype is last[0] and r.kernel is last[2] and r.layout is last[3]
            and r.precision is last[4] and y.shape == last[1]):
        return last[5]  # type: ignore[no-any-return]
    got = _head_of(y, r)
    _HEAD_LAST[0] = (y.dtype, y.shape, r.kernel, r.layout, r.precision, got)
    return got


def _head_of(y: np.ndarray, r: MatmulReply, msg: Any = pb.MatmulResponse,
             field: int = _F_RESP_Y, table: dict[tuple[Any, ...], tuple[bytes, bytes]] = _HEADS,
             ) -> tuple[bytes, bytes]:
    """(y's record in ``msg``'s ``field`` up to its data, ``msg``'s kernel/layout/precision
    fields' bytes), kept in ``table`` (a MatmulResponse's by default; a WeightOutput's:
    _part_head)."""
    key = (y.dtype, y.shape, r.kernel, r.layout, r.precision)
    got = table.get(key)
    if got is None:
        t = msg(kernel=r.kernel, layout=_LAYOUT_TO_PB[r.layout],
                precision=_PREC_TO_PB[r.precision])
        code = _PB_OF_DTYPE.get(y.dtype)
        t.y.dtype = code if code is not None else _DTYPE_TO_PB[dtype_name(y.dtype)]
        t.y.shape.extend(y.shape)
        tensor = t.y.SerializeToString()  # dtype, shape: upb's own bytes
        if y.nbytes:
            tensor += record(_F_TENSOR_DATA, y.nbytes)
        t.ClearField("y")
        if len(table) >= MAX_HEADS:
            table.clear()
        got = table[key] = (record(field, len(tensor) + y.nbytes) + tensor,
                            t.SerializeToString())
    return got


def _wire_y(y: np.ndarray) -> np.ndarray:
    """``y`` as its wire bytes lie: C-contiguous, little-endian."""
    return np.ascontiguousarray(y).astype(_LITTLE.get(y.dtype) or y.dtype.newbyteorder("<"),
                                          copy=False)


def _y_data(y: np.ndarray) -> bytes | memoryview:
    """A wire ``y``'s bytes: a view when large (copied once, by the join); a small y is copied
    twice, cheaper than making the view (~0.4 vs 1.8 us for 14 KiB on the VM)."""
    return y.tobytes() if y.nbytes < SPLICE_MIN_BYTES else memoryview(y.reshape(-1).view(np.uint8))


def _packs(r: MatmulReply) -> bool:
    """Whether ``r``'s timing takes the packed form (_TIMING6, _PART_TIMING): kernel and
    device seconds known, both counts one varint byte (1..127)."""
    return (r.kernel_seconds is not None and r.device_seconds is not None
            and 0 < r.batch_rows < 0x80 and 0 < r.batch_requests < 0x80)


def _queue_field(r: MatmulReply) -> bytes:
    """The timing's queue field, or nothing for a zero (proto3 leaves it out; -0.0 is kept)."""
    queue = _DOUBLE(r.queue_seconds)
    return _T_QUEUE + queue if queue != _ZERO8 else b""


def _rid_records(rid: bytes) -> tuple[bytes, bytes]:
    """(the response's request_id record, the stream response's), both empty for no id."""
    if not rid:
        return b"", b""
    rid_len = encode_varint(len(rid))
    return _T_REQ_ID + rid_len + rid, _T_STREAM_ID + rid_len + rid


def _result_pieces(r: MatmulReply, request_id: bytes, took: Took | None) -> Pieces:
    """A MatmulResponse of one weight's y (``r.topk`` None) as wire bytes, in pieces."""
    assert r.y is not None
    y = _wire_y(r.y)
    head, fields = _head(y, r)
    t = [_queue_field(r)]
    if took is not None and _packs(r):
        k, rows, reqs, dec, dev, hdl = _TIMING6_TAGS
        t.append(_TIMING6.pack(k, r.kernel_seconds, rows, r.batch_rows, reqs,
                               r.batch_requests, dec, took.decoded - took.start, dev,
                               r.device_seconds,
                               hdl, time.perf_counter() - took.start))
        return _pieces(head, fields, y, b"".join(t), request_id)
    if r.kernel_seconds is not None:
        t.append(_T_KERNEL_S + _DOUBLE(r.kernel_seconds))
    if r.batch_rows:
        t.append(_T_ROWS + encode_varint(r.batch_rows))
    if r.batch_requests:
        t.append(_T_REQUESTS + encode_varint(r.batch_requests))
    if took is not None:
        t.append(_T_DECODE + _DOUBLE(took.decoded - took.start))
    if r.device_seconds is not None:
        t.append(_T_DEVICE + _DOUBLE(r.device_seconds))
    if took is not None:  # last, so handler time includes encoding all but y's copy
        t.append(_T_HANDLER + _DOUBLE(time.perf_counter() - took.start))
    return _pieces(head, fields, y, b"".join(t), request_id)


def _pieces(head: bytes, fields: bytes, y: np.ndarray, timing: bytes,
            request_id: bytes) -> Pieces:
    """_result_pieces' list: y's record, the other fields, the timing, the request id."""
    out: Pieces = [head, _y_data(y), fields, _T_TIMING + encode_varint(len(timing)), timing]
    if request_id:
        out += (_T_REQ_ID + encode_varint(len(request_id)), request_id)
    return out


def _y_nbytes(r: Replies) -> int:
    parts = [r] if isinstance(r, MatmulReply) else [p for _, p in r]
    return sum(p.y.nbytes for p in parts if p.y is not None)


def matmul_reply(r: Replies, request_id: str = "",
                 took: Took | None = None) -> pb.MatmulResponse | bytes:
    """What Matmul returns: one weight's y as bytes written here (see above); else
    ``matmul_response(...)``, or its serialized bytes with y copied once when y is large."""
    if isinstance(r, MatmulReply) and r.topk is None:
        return b"".join(_result_pieces(r, request_id.encode(), took))
    if _y_nbytes(r) < SPLICE_MIN_BYTES:
        return matmul_response(r, request_id, took)
    return b"".join(_reply_pieces(r, request_id, took))


_T_TIMING6 = _T_TIMING + encode_varint(_TIMING6.size)  # a timing of _TIMING6 alone


def _stream_bytes(r: MatmulReply, rid: bytes, took: Took) -> bytes | None:
    """:func:`stream_reply` of one weight's y with a full timing (every direct-path and
    batched reply of a finished kernel: ``_result_pieces``' packed case), the same bytes in
    one join, its sizes added as it goes; None: not that case."""
    if not _packs(r):
        return None
    y = r.y
    assert y is not None
    # _wire_y, _head, _queue_field, _rid_records and _y_data written out for a reply like the
    # last one (every reply of a stream of like calls): ~5 calls fewer per reply on the loop
    last = _HEAD_LAST[0]
    if (y.dtype is last[0] and r.kernel is last[2] and r.layout is last[3]
            and r.precision is last[4] and y.shape == last[1] and y.flags.c_contiguous):
        head, fields = last[5]  # (y is its own wire form: the kept dtype is little-endian)
    else:
        y = _wire_y(y)
        head, fields = _head(y, r)
    q = _DOUBLE(r.queue_seconds)
    queue = _T_QUEUE + q if q != _ZERO8 else b""  # (-0.0 kept, as upb keeps it)
    t_head = _T_TIMING + encode_varint(len(queue) + _TIMING6.size) if queue else _T_TIMING6
    if rid:
        rid_len = encode_varint(len(rid))
        rec, sid = _T_REQ_ID + rid_len + rid, _T_STREAM_ID + rid_len + rid
    else:
        rec = sid = b""
    nbytes = y.nbytes
    size = (len(head) + nbytes + len(fields) + len(t_head) + len(queue) + _TIMING6.size
            + len(rec))
    k, rows, reqs, dec, dev, hdl = _TIMING6_TAGS
    timing = _TIMING6.pack(k, r.kernel_seconds, rows, r.batch_rows, reqs, r.batch_requests,
                           dec, took.decoded - took.start, dev, r.device_seconds,
                           hdl, time.perf_counter() - took.start)  # (as _result_pieces)
    data = y.tobytes() if nbytes < SPLICE_MIN_BYTES else memoryview(y.reshape(-1).view(np.uint8))
    return b"".join((sid, _T_STREAM_RESULT, encode_varint(size), head, data, fields, t_head,
                     queue, timing, rec))


# -- a multi-weight reply of y parts, written here too ------------------------------------------
# One WeightOutput record per weight (weight, y, kernel, layout, precision, timing: its field
# numbers, in order), then the response's timing and request id before them (field-number
# order: timing 5, request_id 6, outputs 8), byte for byte upb's (tests/service/
# test_wire_replies.py compares): upb's fill of three small parts and its serialization took
# ~35 us on the 2-core VM (a plain reply's writer ~5).
_T_OUT_WEIGHT = _tag(pb.WeightOutput, "weight", 2)
_T_OUTPUTS = _tag(pb.MatmulResponse, "outputs", 2)
_T_OUT_TIMING = _tag(pb.WeightOutput, "timing", 2)
# a part's timing with kernel, both counts (each below 128) and device seconds set
_PART_TIMING = struct.Struct("<BdBBBBBd")
_PT_TAGS = tuple(t[0] for t in (_T_KERNEL_S, _T_ROWS, _T_REQUESTS, _T_DEVICE))
_T_PART_TIMING = _T_OUT_TIMING + encode_varint(_PART_TIMING.size)
# the response's own timing: decode and handler seconds
_RESP_TIMING = struct.Struct("<BdBd")
_T_RESP_TIMING = _T_TIMING + encode_varint(_RESP_TIMING.size)
_PART_HEADS: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}


def _part_head(y: np.ndarray, r: MatmulReply) -> tuple[bytes, bytes]:
    """(y's WeightOutput record up to its data, the kernel/layout/precision fields)."""
    return _head_of(y, r, pb.WeightOutput, _F_OUT_Y, _PART_HEADS)


class _PartRecord(NamedTuple):
    """One weight name's multi-weight part record, kept while its y's dtype and shape and its
    kernel, layout and precision stay (``_PART_LAST``)."""

    dtype: np.dtype
    shape: tuple[int, ...]
    kernel: str
    layout: Any
    precision: Any
    wrec: bytes  # the weight's name field
    head: bytes  # y's WeightOutput record up to its data
    fields: bytes  # the kernel/layout/precision fields
    # a part with no queue time (every direct-path part): the record's bytes before y's data
    # (outputs tag and length, wrec, head) and after it up to the timing's values (fields, the
    # timing's tag and length)
    before: bytes
    after: bytes


# per weight name, its last part record: a replay's q+k+v reply on the 2-core VM, in process,
# 6.3 -> ~4 us; one entry per name, replaced whole
_PART_LAST: dict[str, _PartRecord] = {}


def _part_record(name: str, y: np.ndarray, r: MatmulReply) -> _PartRecord:
    """``name``'s part record for ``r``'s wire ``y``: the one kept, else made and kept."""
    c = _PART_LAST.get(name)
    if c is not None and y.dtype is c.dtype and r.kernel == c.kernel and \
            r.layout is c.layout and r.precision is c.precision and y.shape == c.shape:
        return c
    head, fields = _part_head(y, r)
    w = name.encode()
    wrec = _T_OUT_WEIGHT + encode_varint(len(w)) + w if w else b""
    size = len(wrec) + len(head) + y.nbytes + len(fields) + len(_T_PART_TIMING) + \
        _PART_TIMING.size
    c = _PartRecord(y.dtype, y.shape, r.kernel, r.layout, r.precision, wrec, head, fields,
                    _T_OUTPUTS + encode_varint(size) + wrec + head, fields + _T_PART_TIMING)
    if len(_PART_LAST) >= MAX_HEADS:
        _PART_LAST.clear()
    _PART_LAST[name] = c
    return c


def _multi_stream_bytes(r: Sequence[tuple[str, MatmulReply]], rid: bytes,
                        took: Took) -> bytes | None:
    """:func:`stream_reply` of a multi-weight reply whose every part is a y with a full
    timing (kernel and device seconds, counts below 128), its bytes in one join; None: not
    that case (a top-k part, a timing not known)."""
    pieces: list[bytes | memoryview] = []
    k, rows, reqs, dev = _PT_TAGS
    for name, part in r:
        if part.y is None or not _packs(part):
            return None
        y = _wire_y(part.y)
        c = _part_record(name, y, part)
        timing = _PART_TIMING.pack(k, part.kernel_seconds, rows, part.batch_rows, reqs,
                                   part.batch_requests, dev, part.device_seconds)
        if _DOUBLE(part.queue_seconds) == _ZERO8:  # (every direct-path part's: no queue)
            pieces += (c.before, _y_data(y), c.after, timing)
            continue
        queue = _queue_field(part)
        t_head = (_T_OUT_TIMING + encode_varint(len(queue) + len(timing)) if queue
                  else _T_PART_TIMING)
        size = (len(c.wrec) + len(c.head) + y.nbytes + len(c.fields) + len(t_head)
                + len(queue) + len(timing))
        pieces += (_T_OUTPUTS, encode_varint(size), c.wrec, c.head, _y_data(y), c.fields,
                   t_head, queue, timing)
    rec, sid = _rid_records(rid)
    d, h = _TIMING6_TAGS[3], _TIMING6_TAGS[5]
    t = _T_RESP_TIMING + _RESP_TIMING.pack(d, took.decoded - took.start,
                                           h, time.perf_counter() - took.start)
    size = len(t) + len(rec) + _size(pieces)
    return b"".join((sid, _T_STREAM_RESULT, encode_varint(size), t, rec, *pieces))


def stream_reply(r: Replies, request_id: str,
                 took: Took | None = None) -> pb.MatmulStreamResponse | bytes:
    """What MatmulStream yields for a result: one weight's y as bytes written here (see
    above); else ``stream_result(...)``, or its serialized bytes with y copied once when y is
    large."""
    if isinstance(r, MatmulReply) and r.topk is None:
        rid = request_id.encode()
        if took is not None and (got := _stream_bytes(r, rid, took)) is not None:
            return got
        body = _result_pieces(r, rid, took)
        head = _T_STREAM_ID + encode_varint(len(rid)) + rid if rid else b""
        return b"".join([head, _T_STREAM_RESULT + encode_varint(_size(body)), *body])
    if (not isinstance(r, MatmulReply) and took is not None
            and (got := _multi_stream_bytes(r, request_id.encode(), took)) is not None):
        return got
    if _y_nbytes(r) < SPLICE_MIN_BYTES:
        return stream_result(r, request_id, took)
    pieces = _reply_pieces(r, request_id, took)
    head = pb.MatmulStreamResponse(request_id=request_id).SerializeToString()
    return b"".join([head, record(_F_STREAM_RESULT, _size(pieces)), *pieces])


_STATUS_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def stream_reply_code(msg: pb.MatmulStreamResponse | bytes) -> grpc.StatusCode:
    """The status a stream reply gives its request (OK for a result; serialized replies are
    results: errors stay messages)."""
    if isinstance(msg, bytes) or msg.WhichOneof("outcome") != "error":
        return grpc.StatusCode.OK
    return _STATUS_BY_NUMBER.get(msg.error.code, grpc.StatusCode.UNKNOWN)


def stream_error(request_id: str, code: int, message: str) -> pb.MatmulStreamResponse:
    return pb.MatmulStreamResponse(request_id=request_id,
                                   error=pb.StreamError(code=code, message=message))


# -- shared-memory regions (service/regions.py) ----------------------------------------------
_REGION_KIND_TO_PB = {"system": pb.REGION_KIND_SYSTEM, "cuda": pb.REGION_KIND_CUDA}


def _region_ref(ref: pb.RegionRef, what: str) -> RegionRef:
    if not ref.region:
        raise InvalidArgument(f"MatmulRequest.{what}_region names no region")
    return RegionRef(ref.region, int(ref.offset))


def region_io(req: pb.MatmulRequest | MatmulIn | MatmulSeen) -> RegionIO | None:
    """The request's region references; None when it names none (bytes travel inline)."""
    if type(req) is MatmulSeen:  # (a skeleton names none)
        return None
    msg = message(req)
    has_x, has_y = msg.HasField("x_region"), msg.HasField("y_region")
    if not (has_x or has_y):
        return None
    if msg.weights or msg.HasField("topk"):
        raise InvalidArgument("x_region/y_region do not combine with weights or topk; send x "
                              "inline for a multi-weight or top-k request")
    x_ref = x_dtype = x_shape = None
    if has_x:
        if not req.HasField("x"):
            raise InvalidArgument("MatmulRequest.x is missing (with x_region it carries dtype "
                                  "and shape)")
        if data := _x_data(req):
            raise InvalidArgument(f"MatmulRequest.x carries {len(data)} bytes and names "
                                  "x_region; send one or the other")
        x_ref = _region_ref(req.x_region, "x")
        x_dtype, x_shape = tensor_spec(req.x)
    y_ref = _region_ref(req.y_region, "y") if has_y else None
    return RegionIO(x_ref, x_dtype, x_shape, y_ref)


def lane_dtype(v: int, what: str, default_f32: bool = False) -> np.dtype:
    """A fast-lane record's DType number (service/lane.py) as a dtype."""
    if v == pb.DTYPE_UNSPECIFIED and not default_f32:
        raise InvalidArgument(f"lane request: {what} is unspecified")
    return np.dtype(DTYPES[_enum(_DTYPE_FROM_PB, v, f"lane request {what}")])


def lane_precision(v: int) -> Precision:
    """A fast-lane record's Precision number."""
    return _enum(_PREC_FROM_PB, v, "lane request precision")


def open_lane_response(path: str, ticket: bytes) -> pb.OpenLaneResponse:
    return pb.OpenLaneResponse(socket_path=path, ticket=ticket)


def parse_matmul_request(data: bytes) -> pb.MatmulRequest:
    """A MatmulRequest a front-end process forwarded (service/frontends.py)."""
    return pb.MatmulRequest.FromString(data)


def region_source(req: pb.RegisterRegionRequest) -> ShmSource | CudaIpcSource:
    which = req.WhichOneof("source")
    if which == "system":
        s = req.system
        return ShmSource(s.key, int(s.offset), int(s.byte_size))
    if which == "cuda":
        c = req.cuda
        return CudaIpcSource(bytes(c.handle), int(c.device), int(c.byte_size), int(c.offset))
    raise InvalidArgument("RegisterRegionRequest needs a source (system or cuda)")


def region_info(v: RegionView) -> pb.RegionInfo:
    return pb.RegionInfo(name=v.name, kind=_REGION_KIND_TO_PB[v.kind], key=v.key,
                         offset=v.offset, byte_size=v.byte_size, in_use=v.in_use)


def register_region_response(v: RegionView) -> pb.RegisterRegionResponse:
    return pb.RegisterRegionResponse(region=region_info(v))


def unregister_region_response(v: RegionView) -> pb.UnregisterRegionResponse:
    return pb.UnregisterRegionResponse(region=region_info(v))


def list_regions_response(views: list[RegionView]) -> pb.ListRegionsResponse:
    return pb.ListRegionsResponse(regions=[region_info(v) for v in views])


def weight_info(w: WeightView) -> pb.WeightInfo:
    return pb.WeightInfo(name=w.name, rows=w.rows, k=w.k, nbytes=w.nbytes,
                         layout=_LAYOUT_TO_PB[w.layout], sha256=w.sha256, source=w.source,
                         in_flight=w.in_flight,
                         row_range=pb.RowRange(begin=w.row_begin, end=w.row_end),
                         tensor_rows=w.tensor_rows or w.rows)


_PLACEMENT_FROM_PB = {pb.PLACEMENT_UNSPECIFIED: None, pb.PLACEMENT_SHARD: "shard",
                      pb.PLACEMENT_REPLICATE: "replicate"}


def placement(req: pb.LoadWeightsRequest) -> str | None:
    """LoadWeightsRequest.placement (None: the worker's default)."""
    return _enum(_PLACEMENT_FROM_PB, req.placement, "placement")  # type: ignore[no-any-return]


def _vram_info(v: Any) -> pb.VramInfo:
    return pb.VramInfo(budget_bytes=v.budget, weights_bytes=v.weights, scratch_bytes=v.scratch,
                       staging_bytes=v.staging, pool_used_bytes=v.pool_used,
                       pool_total_bytes=v.pool_total, device_free_bytes=v.device_free,
                       device_total_bytes=v.device_total, reserved_bytes=v.reserved)


def row_select(req: pb.LoadWeightsRequest) -> RowSelect | None:
    """LoadWeightsRequest's optional ``rows`` oneof (None: every row)."""
    which = req.WhichOneof("rows")
    if which == "row_range":
        return RowSelect(range=RowRange(int(req.row_range.begin), int(req.row_range.end)))
    if which == "shard":
        if req.shard.count < 1:
            raise InvalidArgument(f"shard count {req.shard.count} must be >= 1")
        return RowSelect(shard=(int(req.shard.index), int(req.shard.count)))
    return None


def upload_spec(h: pb.UploadHeader) -> UploadSpec:
    return UploadSpec(name=h.name, rows=int(h.rows), k=int(h.k),
                      fmt=_enum(_UPLOAD_FROM_PB, h.format, "upload format"),
                      total_bytes=int(h.total_bytes), sha256=h.sha256)


def flags_msg(state: FlagState) -> list[pb.Flag]:
    return [pb.Flag(name=n, enabled=v) for n, v in state.as_dict().items()]


def flag_changes(req: pb.SetFlagsRequest) -> dict[str, bool]:
    out: dict[str, bool] = {}
    for f in req.flags:
        if f.name in out:
            raise InvalidArgument(f"flag {f.name} given twice")
        out[f.name] = f.enabled
    return out


def status_response(s: StatusView) -> pb.GetStatusResponse:
    v = s.vram
    vram = pb.VramInfo(budget_bytes=v.budget, weights_bytes=v.weights, scratch_bytes=v.scratch,
                       staging_bytes=v.staging, pool_used_bytes=v.pool_used,
                       pool_total_bytes=v.pool_total, device_free_bytes=v.device_free,
                       device_total_bytes=v.device_total, reserved_bytes=v.reserved)
    return pb.GetStatusResponse(backend=s.backend, device=s.device, version=s.version,
                                vram=vram, flags=flags_msg(s.flags),
                                weights_loaded=s.weights_loaded, serving=s.serving,
                                max_batch_rows=s.max_batch_rows,
                                max_batch_delay_us=s.max_batch_delay_us,
                                relayout_in_progress=s.relayout_in_progress,
                                max_weights=s.max_weights,
                                host_overhead_bytes=s.host_overhead_bytes,
                                devices=[pb.DeviceStatus(index=d.index, ordinal=d.ordinal,
                                                         device=d.device,
                                                         vram=_vram_info(d.vram),
                                                         weights_loaded=d.weights_loaded)
                                         for d in s.devices])


def load_response(views: list[WeightView]) -> pb.LoadWeightsResponse:
    return pb.LoadWeightsResponse(weights=[weight_info(v) for v in views])


def upload_response(view: WeightView) -> pb.UploadWeightResponse:
    return pb.UploadWeightResponse(weight=weight_info(view))


def list_response(views: list[WeightView]) -> pb.ListWeightsResponse:
    return pb.ListWeightsResponse(weights=[weight_info(v) for v in views])


def get_response(view: WeightView) -> pb.GetWeightResponse:
    return pb.GetWeightResponse(weight=weight_info(view))


def unload_response(view: WeightView) -> pb.UnloadWeightResponse:
    return pb.UnloadWeightResponse(weight=weight_info(view))


def set_flags_response(state: FlagState) -> pb.SetFlagsResponse:
    return pb.SetFlagsResponse(flags=flags_msg(state))


def _bytes_or(serialize: Any) -> Any:
    def ser(msg: Any) -> bytes:
        return msg if isinstance(msg, bytes) else serialize(msg)
    return ser


class _Registration:
    """What the generated add_*_to_server registers, with the matmul replies' serializers
    passing ready-made bytes through (matmul_response_bytes, stream_result_bytes) and their
    requests read by read_matmul_request."""

    def __init__(self, server: Any) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Dropped: the generated code registers the same table next, which is patched there
        and registered both ways."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        table = dict(handlers)
        for name in ("Matmul", "MatmulStream"):
            h = table[name]
            table[name] = h._replace(response_serializer=_bytes_or(h.response_serializer),
                                     request_deserializer=read_matmul_request)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, table),))
        self._server.add_registered_method_handlers(service, table)


def add_to_server(servicer: object, server: object) -> None:
    pb_grpc.add_Q6ServeServicer_to_server(servicer, _Registration(server))


# -- standard services: grpc.health.v1 and server reflection (v1 and v1alpha) ----------------

def health_servicer() -> Any:
    """grpcio's own asyncio health servicer, unchanged (Check, Watch; List as grpcio has it)."""
    from grpc_health.v1 import health

    return health.aio.HealthServicer()


def health_status(serving: bool) -> Any:
    from grpc_health.v1 import health_pb2

    return (health_pb2.HealthCheckResponse.SERVING if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING)


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


class _MethodLookupPool:
    """The default descriptor pool for reflection, plus method symbols: the reflection protocol
    lets file_containing_symbol name a method (``q6serve.v1.Q6Serve.Matmul``, what
    ``grpcurl describe`` sends), which protobuf's upb pool does not resolve by itself."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def FindFileContainingSymbol(self, name: str) -> Any:  # the pool API
        try:
            return self._pool.FindFileContainingSymbol(name)
        except KeyError:
            service, _, method = name.rpartition(".")
            try:
                found = self._pool.FindServiceByName(service)
            except KeyError:
                found = None
            if found is None or method not in found.methods_by_name:
                raise
            return found.file

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


def _add_reflection_v1_descriptor(pool: Any) -> None:
    """Put grpc/reflection/v1/reflection.proto into ``pool`` so reflection describes itself.

    grpcio-reflection ships only v1alpha. v1 is the same file under another package (same
    messages, fields and numbers), so its descriptor is v1alpha's with the package renamed."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2

    name = "grpc/reflection/v1/reflection.proto"
    try:
        pool.FindFileByName(name)
        return  # added by an earlier worker of this process
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    old, new = f".{fdp.package}.", ".grpc.reflection.v1."
    fdp.name, fdp.package = name, "grpc.reflection.v1"
    fdp.options.Clear()
    fdp.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    fdp.options.java_package = "io.grpc.reflection.v1"
    fdp.options.java_outer_classname = "ServerReflectionProto"
    fdp.options.java_multiple_files = True
    for msg in fdp.message_type:
        for f in msg.field:
            if f.HasField("type_name"):
                f.type_name = f.type_name.replace(old, new)
    for svc in fdp.service:
        for m in svc.method:
            m.input_type = m.input_type.replace(old, new)
            m.output_type = m.output_type.replace(old, new)
    pool.Add(fdp)


def add_health_and_reflection(server: Any, health_servicer: Any) -> None:
    """Health, and reflection as v1alpha (grpcio's servicer) and v1 (the same servicer: the
    two protocols' messages are wire-identical, so v1 bytes parse as v1alpha messages)."""
    from google.protobuf import descriptor_pool
    from grpc_health.v1 import health, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection, reflection_pb2

    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    pool = descriptor_pool.Default()
    _add_reflection_v1_descriptor(pool)
    names = (SERVICE_NAME, health.SERVICE_NAME, REFLECTION_V1, reflection.SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names, pool=_MethodLookupPool(pool))
    for service in (REFLECTION_V1, reflection.SERVICE_NAME):
        handler = grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {"ServerReflectionInfo": handler}),))
