"""Matmul replies onto the wire: an engine result (one weight's y, a multi-weight call's
parts, top-k) as a MatmulResponse or MatmulStreamResponse, and a stream's error records. The
common replies are written as wire bytes here, byte for byte what upb writes
(tests/service/test_wire_replies.py), y spliced in from the backend's buffer with one copy.
Called by the servicer and the front ends (service/frontends.py).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import grpc
import numpy as np

from q6serve.kernels.api import dtype_name
from q6serve.kernels.epilogue import TopK
from q6serve.v1 import q6serve_pb2 as pb

from .batcher import MatmulReply
from .rawmsg import encode_varint, record
from .wire_enums import _DTYPE_TO_PB, _LAYOUT_TO_PB, _LITTLE, _PB_OF_DTYPE, _PREC_TO_PB
from .wire_requests import _F_TENSOR_DATA


def encode_tensor(a: np.ndarray) -> pb.Tensor:
    a = np.ascontiguousarray(a)
    le = a.astype(a.dtype.newbyteorder("<"), copy=False)
    return pb.Tensor(dtype=_DTYPE_TO_PB[dtype_name(a.dtype)], shape=list(a.shape),
                     data=le.tobytes())



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

