"""The protobuf wire format, walked by hand for one purpose: taking a request's big bytes field
(``MatmulRequest.x.data``) out of the message without copying it.

Why: upb copies a bytes field into its arena while it parses, and again into a new Python
object each time the field is read. For a 32 MiB request that is two more copies on the event
loop, holding the GIL (~0.5 ms per MiB each on the CI VM), on top of gRPC's own read. Here the
field becomes a view of the bytes gRPC read, and upb parses only the rest of the message
(names, shape, enums: bytes, not megabytes).

Protobuf's rules are kept exactly: occurrences of a message field merge, and the last value of
a bytes field wins, so the value is the last ``inner`` field of the last ``outer`` field that
has one. Everything that is not a well-formed length-delimited ``inner`` field stays in the
rest, in order, for upb to accept or refuse as it would the whole message. What the walker does
not take (groups, a malformed varint or length, more than ``MAX_FIELDS`` fields at a level: a
message built to make a Python loop slow) raises :class:`Unusual`, and the caller parses the
whole message with upb instead -- the same result, with the copies.
"""

from __future__ import annotations

MAX_FIELDS = 64  # fields walked per level; a MatmulRequest has about ten

_LEN = 2  # wire type of length-delimited fields (bytes, strings, messages, packed)


class Unusual(Exception):
    """A message this walker does not take apart: parse it whole."""


def _varint(buf: memoryview, i: int, end: int) -> tuple[int, int]:
    """(value, next index) of the varint at ``buf[i]``."""
    value = shift = 0
    while i < end and shift < 64:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
    raise Unusual


_VARINT1 = tuple(bytes((i,)) for i in range(128))


def encode_varint(n: int) -> bytes:
    # the sizes of a reply's records written out (a reply encodes several per request on the
    # loop: the bytearray loop was 1.6% of a direct-path request in process)
    if n < 0x80:
        return _VARINT1[n]
    if n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    if n < 0x200000:
        return bytes((n & 0x7F | 0x80, (n >> 7) & 0x7F | 0x80, n >> 14))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def record(field: int, size: int) -> bytes:
    """Tag and length of a length-delimited field (wire type 2) of ``size`` bytes."""
    return encode_varint(field << 3 | _LEN) + encode_varint(size)


def fields(buf: memoryview, start: int, end: int) -> list[tuple[int, int, int, int, int]]:
    """(number, wire type, field start, value start, value end) of each field in
    ``buf[start:end]``, in order."""
    out: list[tuple[int, int, int, int, int]] = []
    i = start
    while i < end:
        if len(out) == MAX_FIELDS:
            raise Unusual
        first = i
        key, i = _varint(buf, i, end)
        wire_type = key & 7
        if wire_type == 0:
            _, j = _varint(buf, i, end)
        elif wire_type == 1:
            j = i + 8
        elif wire_type == 5:
            j = i + 4
        elif wire_type == _LEN:
            n, i = _varint(buf, i, end)
            j = i + n
        else:  # groups (3, 4) and the undefined 6, 7
            raise Unusual
        if j > end:
            raise Unusual
        out.append((key >> 3, wire_type, first, i, j))
        i = j
    return out


def take_bytes_field(raw: bytes, outer: int, inner: int) -> tuple[bytes, memoryview | None]:
    """``raw`` without the length-delimited ``inner`` fields of its length-delimited ``outer``
    fields (their length prefixes rewritten), and the value those fields give (None: none
    there) as a view of ``raw``. Raises :class:`Unusual` for what it does not take apart."""
    buf = memoryview(raw)
    pieces: list[bytes | memoryview] = []
    value: memoryview | None = None
    copied = 0  # raw[:copied] is in pieces already
    for number, wire_type, first, start, end in fields(buf, 0, len(buf)):
        if number != outer or wire_type != _LEN:
            continue
        kept = []
        for n2, wt2, first2, start2, end2 in fields(buf, start, end):
            if n2 == inner and wt2 == _LEN:
                value = buf[start2:end2]
            else:
                kept.append(buf[first2:end2])
        pieces += [buf[copied:first], record(outer, sum(len(k) for k in kept)), *kept]
        copied = end
    if not pieces:
        return raw, None
    pieces.append(buf[copied:])
    return b"".join(pieces), value
