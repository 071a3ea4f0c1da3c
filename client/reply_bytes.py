"""A matmul reply's arrays as views of the reply's own bytes: y is not copied on the way in.

Why: upb copies every bytes field when it parses a reply, and Python's read of the field
(``Tensor.data``) makes a new bytes object of it again: y was copied twice before NumPy saw
it. For the replay's S=8 gate+up reply (606 KB, two f16 y) that was 39 us of the caller's
decode on the CI VM, and on the H200 host the caller's encode + decode of that call 108 us
(session 19); the copies grow with N (S=64: 4.8 MB a gate+up reply).

How: the reply is walked along the fields that can hold an array's bytes (a response's
``y.data``, ``topk.values`` / ``indices`` / ``lse``, the same in each of ``outputs``; a
stream reply's ``result`` around them). Those bytes fields are left out of a *shell*: the
reply's other bytes, in order, with the length prefixes of the messages around them rewritten.
upb parses the shell (a few hundred bytes), and each array is ``np.frombuffer`` over the
reply's bytes at its field's place. The arrays are read-only views of the reply (as
``np.frombuffer`` over the copy was), so an array keeps the whole reply alive. A reply the
walk does not expect (a message field twice where it is not repeated, a group, a length past
the end) is parsed whole by upb instead, which raises what it always raised for a bad one.
Replies under :data:`VIEW_MIN` bytes are parsed whole too: there the walk in Python costs more
than the copies it saves. The varint helpers are this module's own: the worker's walker of
requests (``service/rawmsg.py``) sits below the client library's layer, which never imports
the service (DESIGN.md; tests/client/test_layers.py).
"""

from __future__ import annotations

from typing import Any

# key of a spec: field number -> (the field's own spec, or None: its bytes are an array's;
# repeated?). A path names one such field in a reply: (field, occurrence, field, occurrence...)
Spec = dict[int, tuple["Spec | None", bool]]
TENSOR: Spec = {3: (None, False)}  # Tensor.data
TOPK: Spec = {3: (None, False), 4: (None, False), 5: (None, False)}  # values, indices, lse
OUTPUT: Spec = {2: (TENSOR, False), 3: (TOPK, False)}  # WeightOutput.y, .topk
RESPONSE: Spec = {1: (TENSOR, False), 7: (TOPK, False), 8: (OUTPUT, True)}  # y, topk, outputs
STREAM: Spec = {2: (RESPONSE, False)}  # MatmulStreamResponse.result

# Below this many bytes a reply is parsed whole: the walk's Python costs ~0.5 us a field, ~15
# us for a three-weight reply, ~5 for one weight, which the copies it saves outweigh from a few
# hundred KB (CI VM, per reply, whole / walked: S=8 q+k+v 74 KB 15.6 / 32.9 us, gate+up 606 KB
# 47.6 / 25.4; S=64 o 459 KB 26.8 / 10.7, q+k+v 590 KB 42.8 / 34.2, gate+up 4.8 MB 709 / 28)
VIEW_MIN = 256 * 1024

Views = dict[tuple[int, ...], memoryview]


class _Unexpected(Exception):
    """The reply is not what the walk reads: parse it whole."""


def _varint(b: bytes, i: int) -> tuple[int, int]:
    x = b[i]
    if x < 0x80:
        return x, i + 1
    x &= 0x7F
    shift = 7
    while True:
        i += 1
        c = b[i]
        x |= (c & 0x7F) << shift
        if c < 0x80:
            return x, i + 1
        shift += 7
        if shift > 63:
            raise _Unexpected


def _encode_varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _strip(raw: bytes, b: memoryview, start: int, end: int, spec: Spec,
           path: tuple[int, ...], views: Views) -> list[Any]:
    """The shell's parts of raw[start:end], a message of ``spec``; the array fields' bytes
    (views: slices of ``b``, raw's memoryview) into ``views`` by path. (Indexing the bytes,
    one-byte varints inline: a reply's ~30 fields cost ~0.6 us each through a helper.)"""
    parts: list[Any] = []
    keep = start  # bytes from here not yet in parts
    seen: dict[int, int] = {}
    i = start
    while i < end:
        f0 = i
        tag = raw[i]
        i += 1
        if tag >= 0x80:
            tag, i = _varint(raw, i - 1)
        wt = tag & 7
        if wt == 2:
            n = raw[i]
            i += 1
            if n >= 0x80:
                n, i = _varint(raw, i - 1)
            j = i
            i += n
            got = spec.get(tag >> 3)
            if got is None:
                continue
            sub, repeated = got
            field = tag >> 3
            k = seen.get(field, 0)
            if k and not repeated:  # upb would merge the two: leave that to upb
                raise _Unexpected
            seen[field] = k + 1
            if i > end:
                raise _Unexpected
            if f0 > keep:
                parts.append(b[keep:f0])
            key = (*path, field, k)
            if sub is None:
                views[key] = b[j:i]
            else:
                inner = _strip(raw, b, j, i, sub, key, views)
                parts.append(_encode_varint(tag))
                parts.append(_encode_varint(sum(map(len, inner))))
                parts.extend(inner)
            keep = i
        elif wt == 0:
            while raw[i] >= 0x80:
                i += 1
            i += 1
        elif wt == 1:
            i += 8
        elif wt == 5:
            i += 4
        else:
            raise _Unexpected
    if i != end:
        raise _Unexpected
    if end > keep:
        parts.append(b[keep:end])
    return parts


def parse(message_type: Any, raw: bytes, spec: Spec) -> tuple[Any, Views | None]:
    """``raw`` parsed as ``message_type`` (a message of ``spec``) with its array fields left
    out, and those fields' bytes by path (views of ``raw``); ``raw`` parsed whole and None
    where it is small or not what the walk reads."""
    if len(raw) < VIEW_MIN:
        return message_type.FromString(raw), None
    views: Views = {}
    try:
        shell = b"".join(_strip(raw, memoryview(raw), 0, len(raw), spec, (), views))
    except (_Unexpected, IndexError):
        return message_type.FromString(raw), None
    return message_type.FromString(shell), views
