"""GGUF files: list tensors, read Q6_K tensors lazily (memory-mapped), write them.

Reading never materialises a file's metadata: a bounded structural :func:`scan` walks the
header with Python ints (every count, length, shape and offset checked against the file and
the limits below), *skipping* KV values by their size -- a 1 M-item tokenizer array costs one
pass over its lengths, no objects -- and returns the tensor table. The tensors are then views
of one read-only ``np.memmap`` of the file: a tensor's bytes are only touched when a chunk of
rows is sliced out, so loading a 400 MB lm-head never reads the whole file at once. (gguf's
GGUFReader, which builds a numpy array per metadata item -- 70 s and 3 GB for a 4 Mi-item
array -- is used only to write files.) Every way a file can be wrong surfaces as
:class:`FormatError` with the numbers, and each chunk of Q6_K rows is checked for non-finite
scales ``d`` as it is read (rejected, as llama.cpp's ``ggml_validate_row_data`` does). The scan
polls a ``cancelled`` callable, so a draining worker can abandon a hostile file's parse.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFWriter

from . import q6k
from .errors import Cancelled, FormatError, NotFound

Q6_K = GGMLQuantizationType.Q6_K
ARCH = "q6serve"  # general.architecture of files we write


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str  # ggml type, e.g. "Q6_K", "F16"
    shape: tuple[int, ...]  # numpy order: (rows, K) for a matrix
    nbytes: int
    offset: int  # absolute byte offset of the data in the file

    @property
    def is_q6k(self) -> bool:
        return self.type_name == Q6_K.name


@dataclass(frozen=True)
class Q6KTensor:
    """A Q6_K matrix inside an open file: ``aos`` is a read-only memmap view ``[blocks, 210]``."""

    name: str
    rows: int
    k: int
    aos: np.ndarray
    # drops the mapped file pages of bytes [start, end) of the file once a chunk of them has
    # been consumed (see _Mapping)
    release: Callable[[int, int], None] | None = None
    offset: int = 0  # of aos in the file

    @property
    def nbytes(self) -> int:
        return self.aos.nbytes

    def iter_row_chunks(self, chunk_bytes: int) -> Iterator[np.ndarray]:
        """Whole-row AoS chunks of at most ``chunk_bytes`` (at least one row each)."""
        row_bytes = q6k.aos_nbytes(1, self.k)
        rows_per = max(1, chunk_bytes // row_bytes)
        per_row = self.k // q6k.QK_K
        for r0 in range(0, self.rows, rows_per):
            r1 = min(self.rows, r0 + rows_per)
            chunk = self.aos[r0 * per_row : r1 * per_row]
            q6k.check_scales_finite(chunk, f"tensor {self.name!r}", r0 * per_row, per_row)
            yield chunk
            if self.release is not None:
                self.release(self.offset + r0 * row_bytes, self.offset + r1 * row_bytes)


# ---------------------------------------------------------------------------------------------
# Bounded structural scan, run before ``gguf.GGUFReader`` sees a file.
#
# GGUFReader trusts the counts it reads: past EOF its reads come back empty and its loops keep
# going (an array header claiming 2**62 uint8 items spins forever, growing a list), it builds one
# numpy array per array element, and numpy's uint64 products wrap silently. So every count,
# length, shape and offset is checked here first with Python ints against the file size and the
# limits below; only a file that passes reaches GGUFReader, whose work is then bounded too.
GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_TENSORS = 1 << 16
MAX_KV = 1 << 16
MAX_STRING_BYTES = 1 << 24  # 16 MiB: chat templates are KBs, tokens bytes
MAX_ARRAY_ITEMS = 1 << 22  # items of all KV arrays together (a 256k vocab uses ~1M)
MAX_ARRAY_DEPTH = 3
MAX_TENSOR_NAME_BYTES = 1024
MAX_ELEMENTS = (1 << 63) - 1  # ggml's int64 element counts
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_UINT32 = 4
_ALIGNMENT_KEY = "general.alignment"


YIELD_S = 0.001  # a scan hands the GIL over this often (see _Cursor.poll)


class _Cursor:
    """Little-endian reads from a buffer; every read checks the bytes exist first."""

    def __init__(self, buf: memoryview, name: str,
                 cancelled: Callable[[], bool] | None = None) -> None:
        self.buf, self.name, self.pos, self.size = buf, name, 0, len(buf)
        self.array_items = 0
        self.cancelled = cancelled
        self._yielded = time.perf_counter()

    def poll(self) -> None:
        """Between slices of a long scan: stop if the caller gave up, and at most every
        YIELD_S hand the GIL over at once (sleep(0); by time, not by call: nested arrays
        poll once per inner array). A thread computing in Python keeps the GIL for up to the
        switch interval (5 ms) each time the event loop wants it back, and one health check
        needs it several times: 1.5 M tokenizer strings made loop wake-ups ~5 ms late."""
        now = time.perf_counter()
        if now - self._yielded >= YIELD_S:
            time.sleep(0)
            self._yielded = now
        if self.cancelled is not None and self.cancelled():
            raise Cancelled(f"{self.name}: parsing abandoned at byte {self.pos} of "
                            f"{self.size}")

    def fail(self, what: str) -> FormatError:
        return FormatError(f"{self.name}: {what} (at byte {self.pos} of {self.size})")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"truncated: {what} needs {n} bytes, {self.size - self.pos} left")

    def u32(self, what: str) -> int:
        self.need(4, what)
        v = struct.unpack_from("<I", self.buf, self.pos)[0]
        self.pos += 4
        return int(v)

    def u64(self, what: str) -> int:
        self.need(8, what)
        v = struct.unpack_from("<Q", self.buf, self.pos)[0]
        self.pos += 8
        return int(v)

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n

    def string(self, what: str, limit: int = MAX_STRING_BYTES, decode: bool = False,
               ) -> str | None:
        n = self.u64(f"{what} length")
        if n > limit:
            raise self.fail(f"{what} length {n} exceeds the limit of {limit} bytes")
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n]) if decode else None
        self.pos += n
        if raw is None:
            return None
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start} of "
                            f"{n})") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> int | None:
        """Skip one KV value; return it when it is a uint32 scalar (for general.alignment)."""
        if vtype in _SCALAR_SIZES:
            if vtype == _UINT32:
                return self.u32(what)
            self.skip(_SCALAR_SIZES[vtype], what)
            return None
        if vtype == _STRING:
            self.string(what)
            return None
        if vtype != _ARRAY:
            raise self.fail(f"{what} has unknown value type {vtype}")
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH}")
        itype = self.u32(f"{what} item type")
        count = self.u64(f"{what} item count")
        self.array_items += count
        if self.array_items > MAX_ARRAY_ITEMS:
            raise self.fail(f"{what} has {count} items: arrays hold more than "
                            f"{MAX_ARRAY_ITEMS} items in all")
        if itype in _SCALAR_SIZES:
            self.skip(count * _SCALAR_SIZES[itype], f"{what} ({count} items of type {itype})")
            return None
        if itype == _STRING:
            self._skip_strings(count, what)
            return None
        if itype != _ARRAY:
            raise self.fail(f"{what} has unknown item type {itype}")
        for i in range(count):  # each item takes >= 12 bytes, so EOF ends this loop early
            if not i & 0xFFF:
                self.poll()
            self.value(itype, f"{what}[{i}]", depth + 1)
        return None

    def _skip_strings(self, count: int, what: str) -> None:
        """Skip ``count`` length-prefixed strings (the tight loop of tokenizer arrays)."""
        buf, size, pos = self.buf, self.size, self.pos
        unpack = struct.Struct("<Q").unpack_from
        for i in range(count):  # each item takes >= 8 bytes, so EOF ends this loop early
            if not i & 0xFFF:
                self.pos = pos
                self.poll()
            if size - pos < 8:
                self.pos = pos
                raise self.fail(f"truncated: {what}[{i}] length needs 8 bytes, "
                                f"{size - pos} left")
            n = unpack(buf, pos)[0]
            pos += 8
            if n > MAX_STRING_BYTES or n > size - pos:
                self.pos = pos
                raise self.fail(f"{what}[{i}] length {n} exceeds the limit of "
                                f"{MAX_STRING_BYTES} bytes or the {size - pos} bytes left")
            pos += n
        self.pos = pos


@dataclass(frozen=True)
class _RawTensor:
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the row length K
    type_id: int
    offset: int  # relative to the data section


def _element_count(name: str, dims: tuple[int, ...], fname: str) -> int:
    n = 1
    for d in dims:
        n *= d
        if n > MAX_ELEMENTS:
            raise FormatError(f"{fname}: tensor {name!r} dims {list(dims)} overflow int64 "
                              f"(more than {MAX_ELEMENTS} elements)")
    return n


@dataclass(frozen=True)
class Header:
    """What :func:`scan` found: the tensor table, where the data starts, the file size."""

    tensors: tuple[_RawTensor, ...]
    data_start: int
    size: int


def scan(path: str | os.PathLike[str], cancelled: Callable[[], bool] | None = None,
         ) -> Header:
    """Check a GGUF file's structure within fixed limits; raise FormatError with the numbers."""
    p = Path(path)
    size = p.stat().st_size
    if size < 24:
        raise FormatError(f"{p.name}: not a valid GGUF file: {size} bytes is shorter than "
                          "the 24-byte header")
    with open(p, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        buf = memoryview(mm)
        try:
            return _scan(_Cursor(buf, p.name, cancelled))
        finally:
            buf.release()


def _scan(c: _Cursor) -> Header:
    magic = bytes(c.buf[:4])
    if magic != GGUF_MAGIC:
        raise FormatError(f"{c.name}: not a valid GGUF file: magic {magic!r}, "
                          f"expected {GGUF_MAGIC!r}")
    c.pos = 4
    version = c.u32("version")
    if version & 0xFFFF == 0 and version:
        raise FormatError(f"{c.name}: big-endian GGUF (version field {version:#x}) is not "
                          "supported")
    if version not in SUPPORTED_VERSIONS:
        raise FormatError(f"{c.name}: unsupported GGUF version {version} "
                          f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
    n_tensors = c.u64("tensor count")
    n_kv = c.u64("KV count")
    if n_tensors > MAX_TENSORS:
        raise c.fail(f"tensor count {n_tensors} exceeds the limit of {MAX_TENSORS}")
    if n_kv > MAX_KV:
        raise c.fail(f"KV count {n_kv} exceeds the limit of {MAX_KV}")
    alignment = GGUF_DEFAULT_ALIGNMENT
    keys: set[str] = set()
    for i in range(n_kv):
        if not i & 0xFF:
            c.poll()
        key = c.string(f"KV {i} key", decode=True)
        assert key is not None
        if key in keys:
            raise c.fail(f"KV key {key!r} appears twice")
        keys.add(key)
        vtype = c.u32(f"KV {key!r} type")
        v = c.value(vtype, f"KV {key!r}")
        if key == _ALIGNMENT_KEY:
            if vtype != _UINT32 or v is None:
                raise c.fail(f"{_ALIGNMENT_KEY} has type {vtype}, expected uint32 ({_UINT32})")
            if v == 0 or v & (v - 1):
                raise c.fail(f"{_ALIGNMENT_KEY}={v} is not a power of two")
            alignment = v
    tensors: list[_RawTensor] = []
    names: set[str] = set()
    for i in range(n_tensors):
        if not i & 0xFFF:
            c.poll()
        name = c.string(f"tensor {i} name", MAX_TENSOR_NAME_BYTES, decode=True)
        assert name is not None
        if name in names:
            raise c.fail(f"tensor name {name!r} appears twice")
        names.add(name)
        n_dims = c.u32(f"tensor {name!r} n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise c.fail(f"tensor {name!r} has n_dims={n_dims}, expected 1..{MAX_DIMS}")
        dims = tuple(c.u64(f"tensor {name!r} dim {j}") for j in range(n_dims))
        type_id = c.u32(f"tensor {name!r} type")
        offset = c.u64(f"tensor {name!r} offset")
        tensors.append(_RawTensor(name, dims, type_id, offset))
    data_start = -(-c.pos // alignment) * alignment
    for t in tensors:
        _check_tensor(c, t, data_start, alignment)
    return Header(tuple(tensors), data_start, c.size)


def _check_tensor(c: _Cursor, t: _RawTensor, data_start: int, alignment: int) -> None:
    f = c.name
    try:
        qtype = GGMLQuantizationType(t.type_id)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise FormatError(f"{f}: tensor {t.name!r} has unknown ggml type id {t.type_id}"
                          ) from None
    n = _element_count(t.name, t.dims, f)
    if t.dims[0] % block:
        raise FormatError(f"{f}: tensor {t.name!r} is {qtype.name} with row length "
                          f"{t.dims[0]}, not a multiple of its block size {block}")
    nbytes = n // block * type_size
    if t.offset % alignment:
        raise FormatError(f"{f}: tensor {t.name!r} data offset {t.offset} is not a multiple "
                          f"of the file's alignment {alignment}")
    end = data_start + t.offset + nbytes
    if end > c.size:
        raise FormatError(f"{f}: tensor {t.name!r} data ({nbytes} bytes at offset "
                          f"{data_start + t.offset}) ends at byte {end}, beyond the file's "
                          f"{c.size} bytes (truncated?)")


def _header(p: Path, cancelled: Callable[[], bool] | None) -> Header:
    """The scanned header of ``p``; unreadable paths are NotFound (the caller's path)."""
    try:
        if not p.is_file():
            raise NotFound(f"GGUF file {str(p)[-256:]!r} does not exist")
        return scan(p, cancelled)
    except OSError as e:  # ENAMETOOLONG, EACCES, EIO...: the caller's path, not our bug
        raise NotFound(f"GGUF file {p.name[:256]!r} cannot be read: "
                       f"{e.strerror or type(e).__name__}") from None


def _info(t: _RawTensor, data_start: int) -> TensorInfo:
    qtype = GGMLQuantizationType(t.type_id)
    block, type_size = GGML_QUANT_SIZES[qtype]
    n = 1
    for d in t.dims:
        n *= d
    return TensorInfo(t.name, qtype.name, tuple(reversed(t.dims)), n // block * type_size,
                      data_start + t.offset)


def list_tensors(path: str | os.PathLike[str],
                 cancelled: Callable[[], bool] | None = None) -> list[TensorInfo]:
    h = _header(Path(path), cancelled)
    return [_info(t, h.data_start) for t in h.tensors]


def _as_q6k(path: Path, info: TensorInfo, data: np.ndarray,
            release: Callable[[int, int], None] | None = None) -> Q6KTensor:
    if not info.is_q6k:
        raise FormatError(f"{path.name}: tensor {info.name!r} is {info.type_name}, not Q6_K")
    if len(info.shape) != 2:
        raise FormatError(f"{path.name}: tensor {info.name!r} has shape {info.shape}; "
                          "only 2-D [rows, K] Q6_K matrices are served")
    rows, k = info.shape
    if rows < 1:
        raise FormatError(f"{path.name}: tensor {info.name!r} has {rows} rows")
    try:
        q6k.check_k(k)
    except FormatError as e:
        raise FormatError(f"{path.name}: tensor {info.name!r}: {e}") from None
    aos = data[info.offset : info.offset + info.nbytes]  # a view: nothing is read yet
    return Q6KTensor(info.name, rows, k, q6k.as_blocks(aos, rows, k), release, info.offset)


def read_q6k_tensors(path: str | os.PathLike[str], names: list[str] | None = None,
                     cancelled: Callable[[], bool] | None = None) -> list[Q6KTensor]:
    """The named Q6_K tensors (all Q6_K tensors when ``names`` is empty/None), as views of
    one read-only memory map of the file."""
    p = Path(path)
    h = _header(p, cancelled)
    infos = {t.name: _info(t, h.data_start) for t in h.tensors}
    if names:
        missing = [n for n in names if n not in infos]
        if missing:
            shown = ", ".join(map(repr, missing[:8])) + (", ..." if len(missing) > 8 else "")
            raise NotFound(f"{p.name}: no tensor named {shown} (file has {len(infos)} "
                           "tensors)")
        chosen = [infos[n] for n in names]
    else:
        chosen = [i for i in infos.values() if i.is_q6k]
        if not chosen:
            raise FormatError(f"{p.name}: no Q6_K tensors among its {len(infos)} tensors")
    try:
        m = _Mapping(p)
    except (OSError, ValueError) as e:
        raise NotFound(f"GGUF file {p.name[:256]!r} cannot be mapped: {e}") from None
    release = m.release  # one bound method for all: 65536 tensors are 65536 objects each
    return [_as_q6k(p, i, m.data, release) for i in chosen]


class _Mapping:
    """A read-only memory map of a file as a uint8 array, whose pages a load hands back as
    it goes: the pages of a consumed chunk are the page cache's again (MADV_DONTNEED on a
    read-only file mapping only unmaps them; touching them again re-reads them), so a load
    holds its weight, not the weight plus the file's pages (RSS 2x before)."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as fh:
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self._mm, np.uint8)

    def release(self, start: int, end: int) -> None:
        """Bytes [start, end) of the file have been consumed. By file offsets, not from the
        chunk's array: ``__array_interface__`` builds a dict whose keys Python interns and
        frees again on every call, and that churn rebuilt the interpreter's table of interned
        strings now and then (1.9 MB, in whichever thread; test_many_weights saw it)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the chunk
        last = end // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            self._mm.madvise(mmap.MADV_DONTNEED, first, last - first)


def write_q6k_gguf(path: str | os.PathLike[str],
                   tensors: Mapping[str, tuple[np.ndarray, int, int]]) -> None:
    """Write a GGUF file of Q6_K matrices: ``{name: (aos_blocks, rows, K)}``."""
    writer = GGUFWriter(os.fspath(path), ARCH)
    block, type_size = GGML_QUANT_SIZES[Q6_K]
    for name, (aos, rows, k) in tensors.items():
        blocks = q6k.as_blocks(aos, rows, k)
        byte_rows = blocks.reshape(rows, (k // block) * type_size)
        writer.add_tensor(name, byte_rows, raw_dtype=Q6_K)  # shape from the byte shape
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
