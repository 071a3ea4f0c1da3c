"""A matmul request as bytes, with x's bytes copied once.

Why: a MatmulRequest built with protobuf copies x three times on the caller's thread (NumPy's
``tobytes``, upb's field set, ``SerializeToString``): 12.6 µs of T1's 15 µs request building
on the CI VM for a [1, 18944] f16 x (37 KB); at N = 64 (2.4 MB) 1.1 ms -> 0.3 ms.

Protobuf still writes every byte but x's data, and :func:`.core.request_head` still checks
every argument: once per (weights, x's shape and dtype, options), the request is serialized
with zero bytes as x's data and split around them. A call then joins that head, x's own bytes
and the fields after x, the request id (upb-serialized) in its place by field number. The
result is byte for byte what ``SerializeToString`` writes for the same message (upb writes
fields in number order; ``tests/client/test_matmul_bytes.py`` compares them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from q6serve.v1 import q6serve_pb2 as pb

MAX_CACHED = 1024  # (weights, shape, dtype, options) combinations kept; the table starts over
_F_X = pb.MatmulRequest.DESCRIPTOR.fields_by_name["x"].number
_F_ID = pb.MatmulRequest.DESCRIPTOR.fields_by_name["request_id"].number
_T_ID = bytes((_F_ID << 3 | 2,))  # the request id's tag (length-delimited)
_LEN1 = tuple(bytes((n,)) for n in range(0x80))  # a length below 128: one varint byte


def _only(req: pb.MatmulRequest, keep: Callable[[int], bool]) -> bytes:
    """``req`` serialized with only the fields whose number ``keep`` takes."""
    m = pb.MatmulRequest()
    m.CopyFrom(req)
    for f, _ in req.ListFields():
        if not keep(f.number):
            m.ClearField(f.name)
    return m.SerializeToString()


class Splice:
    """A request's bytes around x's data: ``head`` (up to the data, length prefixes
    included), then the fields before and after the request id's place."""

    __slots__ = ("after_id", "before_id", "head")

    def __init__(self, req: pb.MatmulRequest, nbytes: int) -> None:
        """``req``: the request with x's dtype and shape, no data, no request id; ``nbytes``:
        x's data size."""
        self.before_id = _only(req, lambda n: _F_X < n < _F_ID)
        self.after_id = _only(req, lambda n: n > _F_ID)
        m = pb.MatmulRequest()
        m.CopyFrom(req)
        m.x.data = bytes(nbytes)
        whole = m.SerializeToString()
        cut = len(whole) - len(self.before_id) - len(self.after_id) - nbytes
        if whole.count(0, cut, cut + nbytes) != nbytes or (
                whole[cut + nbytes:] != self.before_id + self.after_id):
            raise AssertionError("x's data is not where a MatmulRequest's serialization puts it")
        self.head = whole[:cut]

    def join(self, data: Any, request_id: str) -> bytes:
        if not request_id:
            return b"".join((self.head, data, self.before_id, self.after_id))
        if len(request_id) < 0x80 and request_id.isascii():  # its record written here: tag,
            # a one-byte length, the id (upb's bytes; ~0.7 -> ~0.2 us on the VM)
            rid = _T_ID + _LEN1[len(request_id)] + request_id.encode()
        else:
            rid = pb.MatmulRequest(request_id=request_id).SerializeToString()
        return b"".join((self.head, data, self.before_id, rid, self.after_id))


_splices: dict[tuple[Any, ...], Splice] = {}


def splice_for(key: tuple[Any, ...], shell: Callable[[], pb.MatmulRequest],
               nbytes: int) -> Splice:
    """The cached :class:`Splice` of ``key``; ``shell()`` builds its request (no x data, no
    request id) on a miss."""
    s = _splices.get(key)
    if s is None:
        if len(_splices) >= MAX_CACHED:
            _splices.clear()
        s = _splices[key] = Splice(shell(), nbytes)
    return s
