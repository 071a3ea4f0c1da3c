"""A byte-level GGUF builder and the corpus of malformed files (shared by the corpus, service
and fuzz tests). Every case is built from scratch so each one breaks exactly one thing."""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from q6serve.kernels import q6k
from q6serve.kernels.errors import FormatError, NotFound, Q6Error

# GGUF value types and ggml type ids used below (gguf.GGUFValueType / GGMLQuantizationType).
U8, U32, F32V, STR, ARR, U64 = 0, 4, 6, 8, 9, 10
T_F32, T_F16, T_Q4_K, T_Q6_K = 0, 1, 12, 14
ALIGN = 32


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def gstr(s: str | bytes, length: int | None = None) -> bytes:
    """A GGUF string; ``length`` overrides the declared byte count."""
    b = s.encode() if isinstance(s, str) else s
    return u64(len(b) if length is None else length) + b


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + u32(vtype) + payload


def kv_array(key: str, itype: int, items: list[bytes], count: int | None = None) -> bytes:
    return kv(key, ARR, u32(itype) + u64(len(items) if count is None else count) + b"".join(items))


def tinfo(name: str | bytes, dims: list[int], type_id: int, offset: int,
          n_dims: int | None = None) -> bytes:
    return (gstr(name) + u32(len(dims) if n_dims is None else n_dims)
            + b"".join(u64(d) for d in dims) + u32(type_id) + u64(offset))


def q6k_blocks(rows: int, k: int, seed: int = 0) -> bytes:
    """Valid Q6_K AoS bytes with small finite scales."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * k // q6k.QK_K, q6k.BLOCK_BYTES), dtype=np.uint8)
    d = rng.uniform(1e-4, 1e-2, blocks.shape[0]).astype("<f2")
    blocks[:, 208:210] = d.view(np.uint8).reshape(-1, 2)
    return blocks.tobytes()


@dataclass
class Tensor:
    name: str | bytes
    dims: list[int]  # ggml order: [K, rows]
    type_id: int = T_Q6_K
    data: bytes = b""
    offset: int | None = None  # default: packed in order, aligned
    n_dims: int | None = None


@dataclass
class File:
    """A GGUF file spelled out; ``build()`` gives its bytes (with any overrides)."""

    tensors: list[Tensor] = field(default_factory=list)
    kvs: list[bytes] = field(default_factory=lambda: [kv("general.architecture", STR,
                                                         gstr("q6serve"))])
    magic: bytes = b"GGUF"
    version: int = 3
    n_tensors: int | None = None
    n_kv: int | None = None
    alignment: int = ALIGN  # used to place data; declare it with a general.alignment KV

    def build(self) -> bytes:
        infos, data, pos = [], [], 0  # parts joined once: 65536 tensors, not quadratic
        for t in self.tensors:
            off = pos if t.offset is None else t.offset
            infos.append(tinfo(t.name, t.dims, t.type_id, off, t.n_dims))
            if t.offset is None:
                pad = -len(t.data) % self.alignment
                data += (t.data, b"\0" * pad)
                pos += len(t.data) + pad
        head = (self.magic + u32(self.version)
                + u64(len(self.tensors) if self.n_tensors is None else self.n_tensors)
                + u64(len(self.kvs) if self.n_kv is None else self.n_kv))
        meta = head + b"".join(self.kvs) + b"".join(infos)
        return b"".join((meta, b"\0" * (-len(meta) % self.alignment), *data))


def valid_file(rows: int = 4, k: int = 512) -> File:
    """Two Q6_K matrices and an F32 vector, with string/array metadata (the fuzz seed)."""
    return File(
        tensors=[Tensor("blk.0.w", [k, rows], data=q6k_blocks(rows, k, 1)),
                 Tensor("output.weight", [256, 2], data=q6k_blocks(2, 256, 2)),
                 Tensor("norm", [8], T_F32, data=np.ones(8, "<f4").tobytes())],
        kvs=[kv("general.architecture", STR, gstr("q6serve")),
             kv("general.alignment", U32, u32(ALIGN)),
             kv_array("tokenizer.tokens", STR, [gstr(t) for t in ("a", "bb", "ccc")]),
             kv_array("tokenizer.scores", F32V, [struct.pack("<f", 0.5)] * 3)])


def _w(rows: int = 2, k: int = 256, **kw: object) -> Tensor:
    return Tensor("w", [k, rows], data=q6k_blocks(rows, k), **kw)  # type: ignore[arg-type]


def _with_d(value: float, block: int, rows: int = 3) -> bytes:
    t = _w(rows)
    raw = bytearray(t.data)
    raw[block * q6k.BLOCK_BYTES + 208 : block * q6k.BLOCK_BYTES + 210] = struct.pack(
        "<e", value)
    return File([Tensor("w", [256, rows], data=bytes(raw))]).build()


def _nan_tensor_data(rows: int) -> bytes:
    raw = bytearray(q6k_blocks(rows, 256, 5))
    raw[q6k.BLOCK_BYTES + 208 : q6k.BLOCK_BYTES + 210] = struct.pack("<e", float("nan"))
    return bytes(raw)


def _cut(data: bytes, marker: bytes, extra: int = 0) -> bytes:
    """``data`` cut right after the first occurrence of ``marker`` (+ ``extra`` bytes)."""
    return data[: data.index(marker) + len(marker) + extra]


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[], bytes]
    error: type[Q6Error]
    match: str  # regex the message must contain (the numbers that made it fail)
    tensors: tuple[str, ...] = ()  # names asked for (default: every Q6_K tensor)


def _nested(depth: int) -> bytes:
    inner = u32(U8) + u64(1) + b"\x07"
    for _ in range(depth - 1):
        inner = u32(ARR) + u64(1) + inner
    return kv("deep", ARR, inner)


CASES: tuple[Case, ...] = (
    # -- header ---------------------------------------------------------------------------------
    Case("empty", lambda: b"", FormatError, r"0 bytes is shorter than the 24-byte header"),
    Case("short-garbage", lambda: b"\x00" * 10, FormatError, r"10 bytes is shorter"),
    Case("bad-magic", lambda: File([_w()], magic=b"GGML").build(), FormatError,
         r"magic b'GGML', expected b'GGUF'"),
    Case("lowercase-magic", lambda: File([_w()], magic=b"gguf").build(), FormatError,
         r"magic b'gguf'"),
    Case("version-0", lambda: File([_w()], version=0).build(), FormatError,
         r"unsupported GGUF version 0 \(supported: 2, 3\)"),
    Case("version-1", lambda: File([_w()], version=1).build(), FormatError,
         r"unsupported GGUF version 1"),
    Case("version-4", lambda: File([_w()], version=4).build(), FormatError,
         r"unsupported GGUF version 4"),
    Case("version-huge", lambda: File([_w()], version=0xFFFFFFFF).build(), FormatError,
         r"unsupported GGUF version 4294967295"),
    Case("big-endian", lambda: File([_w()], version=3 << 24).build(), FormatError,
         r"big-endian GGUF \(version field 0x3000000\)"),
    Case("truncated-header", lambda: File([_w()]).build()[:30], FormatError,
         r"truncated: KV 0 key length needs 8 bytes, 6 left"),
    # -- counts ---------------------------------------------------------------------------------
    Case("tensor-count-2^63", lambda: File([_w()], n_tensors=1 << 63).build(), FormatError,
         r"tensor count 9223372036854775808 exceeds the limit of 65536"),
    Case("kv-count-2^40", lambda: File([_w()], n_kv=1 << 40).build(), FormatError,
         r"KV count 1099511627776 exceeds the limit of 65536"),
    Case("tensor-count-lies", lambda: _cut(File([_w()], n_tensors=1000).build(),
                                           gstr("w") + u32(2), 8 + 8 + 4 + 8), FormatError,
         r"truncated: tensor 1 name length needs 8 bytes, 0 left"),
    Case("kv-count-lies", lambda: _cut(File([], n_kv=5).build(), b"q6serve"), FormatError,
         r"truncated: KV 1 key length needs 8 bytes, 0 left"),
    # -- KV pairs -------------------------------------------------------------------------------
    Case("truncated-kv-key", lambda: _cut(File([_w()]).build(), b"general.archi"),
         FormatError, r"truncated: KV 0 key needs 20 bytes"),
    Case("truncated-kv-value", lambda: _cut(File([_w()]).build(), b"q6s"), FormatError,
         r"truncated: KV 'general.architecture' needs 7 bytes, 3 left"),
    Case("kv-key-length-2^64-1", lambda: File([_w()], kvs=[gstr("k", (1 << 64) - 1)]).build(),
         FormatError, r"KV 0 key length 18446744073709551615 exceeds the limit of 16777216"),
    Case("kv-string-2^62", lambda: File([_w()], kvs=[kv("s", STR, gstr("x", 1 << 62))]).build(),
         FormatError, r"KV 's' length 4611686018427387904 exceeds the limit"),
    Case("kv-string-beyond-eof", lambda: File([_w()], kvs=[kv("s", STR, gstr("x", 1 << 20))]
                                              ).build(), FormatError,
         r"truncated: KV 's' needs 1048576 bytes"),
    Case("array-2^62-items", lambda: File([_w()], kvs=[kv_array("a", U8, [], 1 << 62)]).build(),
         FormatError, r"KV 'a' has 4611686018427387904 items: arrays hold more than 4194304"),
    Case("array-items-beyond-eof", lambda: File([_w()], kvs=[kv_array(
        "a", U32, [u32(1)] * 10, 1000)]).build(), FormatError,
         r"truncated: KV 'a' \(1000 items of type 4\) needs 4000 bytes"),
    Case("array-of-strings-beyond-eof", lambda: File([], kvs=[kv_array(
        "a", STR, [gstr("t")], 100000)]).build(), FormatError, r"truncated: KV 'a'\[\d+\]"),
    Case("array-too-deep", lambda: File([_w()], kvs=[_nested(4)]).build(), FormatError,
         r"nests arrays deeper than 3"),
    Case("kv-unknown-type", lambda: File([_w()], kvs=[kv("x", 13, u32(0))]).build(),
         FormatError, r"KV 'x' has unknown value type 13"),
    Case("array-unknown-item-type", lambda: File([_w()], kvs=[kv_array("a", 99, [], 3)]).build(),
         FormatError, r"KV 'a' has unknown item type 99"),
    Case("duplicate-kv", lambda: File([_w()], kvs=[kv("a", U8, b"\1")] * 2).build(),
         FormatError, r"KV key 'a' appears twice"),
    Case("kv-key-bad-utf8", lambda: File([_w()], kvs=[kv(b"bad\xff\xfe", U8, b"\1")]).build(),
         FormatError, r"KV 0 key is not valid UTF-8 \(invalid start byte at byte 3 of 5\)"),
    Case("alignment-48", lambda: File([_w()], kvs=[kv("general.alignment", U32, u32(48))]
                                      ).build(), FormatError,
         r"general.alignment=48 is not a power of two"),
    Case("alignment-0", lambda: File([_w()], kvs=[kv("general.alignment", U32, u32(0))]
                                     ).build(), FormatError, r"general.alignment=0 is not"),
    Case("alignment-as-u64", lambda: File([_w()], kvs=[kv("general.alignment", U64, u64(32))]
                                          ).build(), FormatError,
         r"general.alignment has type 10, expected uint32 \(4\)"),
    Case("alignment-2^31", lambda: File([_w()], kvs=[kv("general.alignment", U32, u32(1 << 31))]
                                        ).build(), FormatError,
         r"tensor 'w' data \(420 bytes at offset 2147483648\) ends at byte 2147484068, "
         r"beyond the file's \d+ bytes"),
    # -- tensor infos ---------------------------------------------------------------------------
    Case("truncated-tensor-info", lambda: _cut(File([_w()]).build(), gstr("w") + u32(2), 5),
         FormatError, r"truncated: tensor 'w' dim 0 needs 8 bytes, 5 left"),
    Case("tensor-name-bad-utf8", lambda: File([Tensor(b"w\xff", [256, 1])]).build(),
         FormatError, r"tensor 0 name is not valid UTF-8"),
    Case("tensor-name-2000-bytes", lambda: File([Tensor("n" * 2000, [256, 1],
                                                        data=q6k_blocks(1, 256))]).build(),
         FormatError, r"tensor 0 name length 2000 exceeds the limit of 1024 bytes"),
    Case("n-dims-0", lambda: File([_w(n_dims=0)]).build(), FormatError,
         r"tensor 'w' has n_dims=0, expected 1..4"),
    Case("n-dims-5", lambda: File([Tensor("w", [256, 1, 1, 1, 1], data=q6k_blocks(1, 256))]
                                  ).build(), FormatError, r"tensor 'w' has n_dims=5"),
    Case("n-dims-2^32-1", lambda: File([_w(n_dims=(1 << 32) - 1)]).build(), FormatError,
         r"n_dims=4294967295"),
    Case("dims-overflow-int64", lambda: File([Tensor("w", [1 << 32, 1 << 32])]).build(),
         FormatError, r"dims \[4294967296, 4294967296\] overflow int64"),
    Case("dims-2^64-1", lambda: File([Tensor("w", [256, (1 << 64) - 1])]).build(), FormatError,
         r"overflow int64"),
    Case("dims-absurd", lambda: File([Tensor("w", [256, 1 << 40], data=q6k_blocks(1, 256))]
                                     ).build(), FormatError,
         r"tensor 'w' data \(230897441832960 bytes at offset \d+\) ends at byte \d+, beyond"),
    Case("offset-beyond-eof", lambda: File([_w(offset=1 << 40)]).build(), FormatError,
         r"tensor 'w' data \(420 bytes at offset \d+\) ends at byte \d+, beyond the file's"),
    Case("offset-misaligned", lambda: File([_w(offset=7)]).build(), FormatError,
         r"tensor 'w' data offset 7 is not a multiple of the file's alignment 32"),
    Case("offset-misaligned-custom", lambda: File(
        [_w(offset=32)], kvs=[kv("general.alignment", U32, u32(64))], alignment=64).build(),
         FormatError, r"offset 32 is not a multiple of the file's alignment 64"),
    Case("duplicate-tensor", lambda: File([_w(), _w()]).build(), FormatError,
         r"tensor name 'w' appears twice"),
    Case("type-unknown-99", lambda: File([Tensor("w", [256, 1], 99)]).build(), FormatError,
         r"tensor 'w' has unknown ggml type id 99"),
    Case("type-removed-4", lambda: File([Tensor("w", [256, 1], 4)]).build(), FormatError,
         r"unknown ggml type id 4"),
    Case("truncated-data", lambda: File([_w(rows=4)]).build()[:-100], FormatError,
         r"tensor 'w' data \(840 bytes at offset \d+\) ends at byte \d+, beyond the file's"),
    # -- what a Q6_K load accepts ---------------------------------------------------------------
    Case("f16-by-name", lambda: File([Tensor("emb", [256, 2], T_F16, b"\0" * 1024)]).build(),
         FormatError, r"tensor 'emb' is F16, not Q6_K", ("emb",)),
    Case("q4k-by-name", lambda: File([Tensor("q", [256, 2], T_Q4_K, b"\0" * 288)]).build(),
         FormatError, r"tensor 'q' is Q4_K, not Q6_K", ("q",)),
    Case("no-q6k-tensors", lambda: File([Tensor("f", [8], T_F32, b"\0" * 32)]).build(),
         FormatError, r"no Q6_K tensors among its 1 tensors"),
    Case("no-tensors", lambda: File([]).build(), FormatError, r"no Q6_K tensors among its 0"),
    Case("k-300", lambda: File([Tensor("w", [300, 2], data=b"\0" * 420)]).build(), FormatError,
         r"tensor 'w' is Q6_K with row length 300, not a multiple of its block size 256"),
    Case("k-0", lambda: File([Tensor("w", [0, 4])]).build(), FormatError,
         r"tensor 'w': K=0 is not a positive multiple of 256"),
    Case("zero-rows", lambda: File([Tensor("w", [256, 0])]).build(), FormatError,
         r"tensor 'w' has 0 rows"),
    Case("q6k-1d", lambda: File([Tensor("w", [256], data=q6k_blocks(1, 256))]).build(),
         FormatError, r"tensor 'w' has shape \(256,\); only 2-D"),
    Case("q6k-3d", lambda: File([Tensor("w", [256, 1, 2], data=q6k_blocks(2, 256))]).build(),
         FormatError, r"has shape \(2, 1, 256\); only 2-D"),
    Case("scale-nan", lambda: _with_d(float("nan"), 0), FormatError,
         r"tensor 'w': Q6_K block 0 \(row 0\) has a non-finite scale d=nan"),
    Case("scale-inf", lambda: _with_d(float("inf"), 1), FormatError,
         r"Q6_K block 1 \(row 1\) has a non-finite scale d=inf"),
    Case("scale-neg-inf", lambda: _with_d(float("-inf"), 2), FormatError,
         r"Q6_K block 2 \(row 2\) has a non-finite scale d=-inf"),
    Case("scale-nan-second-tensor", lambda: File([
        Tensor("a", [256, 2], data=q6k_blocks(2, 256)),
        Tensor("b", [256, 3], data=_nan_tensor_data(3))]).build(), FormatError,
         r"tensor 'b': Q6_K block 1 \(row 1\) has a non-finite scale d=nan"),
    Case("missing-tensor", lambda: File([_w()]).build(), NotFound,
         r"no tensor named 'nope' \(file has 1 tensors\)", ("nope",)),
)
