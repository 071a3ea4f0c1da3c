"""Matmul requests off the wire: the request deserializer of Matmul and MatmulStream
(:func:`read_matmul_request`), the checks that make a request the engine's call
(:func:`matmul_call`), its region references (:func:`region_io`) and the fast lane's enum
numbers. Called by the servicer, the front ends, the lane and wire.py's registration.

Activations decode without copying: ``np.frombuffer`` views the request's bytes (read-only),
after checking that dtype, shape and byte count agree. :func:`read_matmul_request` leaves
``x.data`` where gRPC put it (service/rawmsg.py), and reads a request like one seen before
through its skeleton, without upb.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from q6serve.kernels.api import DTYPES, Precision, dtype_name
from q6serve.kernels.epilogue import check_k
from q6serve.kernels.errors import InvalidArgument
from q6serve.v1 import q6serve_pb2 as pb

from .engine_types import MatmulCall
from .rawmsg import Unusual, record, take_bytes_field
from .regions import RegionIO, RegionRef
from .wire_enums import (
    _DTYPE_FROM_PB,
    _LITTLE,
    _PREC_FROM_PB,
    MAX_DIM,
    _enum,
    dtype_from_pb,
)


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



def parse_matmul_request(data: bytes) -> pb.MatmulRequest:
    """A MatmulRequest a front-end process forwarded (service/frontends.py)."""
    return pb.MatmulRequest.FromString(data)

