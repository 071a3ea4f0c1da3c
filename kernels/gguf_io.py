"""GGUF files through the ``gguf`` package: list tensors, read Q6_K tensors lazily, write them.

Reading memory-maps the file (``gguf.GGUFReader``); a tensor's bytes are only touched when a
chunk of rows is sliced out, so loading a 400 MB lm-head never reads the whole file at once.
Every way a file can be wrong surfaces as :class:`FormatError` with the numbers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter

from . import q6k
from .errors import FormatError, NotFound

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
            yield self.aos[r0 * per_row : r1 * per_row]


def open_reader(path: str | os.PathLike[str]) -> GGUFReader:
    """Open a GGUF file, turning the parser's many failure modes into one clear FormatError."""
    p = Path(path)
    if not p.is_file():
        raise NotFound(f"GGUF file {str(p)!r} does not exist")
    size = p.stat().st_size
    try:
        reader = GGUFReader(p, "r")
    except (ValueError, KeyError, IndexError, OverflowError, TypeError, MemoryError) as e:
        raise FormatError(f"{p.name}: not a valid GGUF file ({size} bytes): {e}") from e
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise FormatError(f"{p.name}: tensor {t.name!r} data ends at byte {end}, "
                              f"beyond the file's {size} bytes (truncated?)")
    return reader


def _info(t) -> TensorInfo:
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return TensorInfo(t.name, GGMLQuantizationType(t.tensor_type).name, shape, int(t.n_bytes),
                      int(t.data_offset))


def list_tensors(path: str | os.PathLike[str]) -> list[TensorInfo]:
    return [_info(t) for t in open_reader(path).tensors]


def _as_q6k(path: Path, t) -> Q6KTensor:
    info = _info(t)
    if not info.is_q6k:
        raise FormatError(f"{path.name}: tensor {t.name!r} is {info.type_name}, not Q6_K")
    if len(info.shape) != 2:
        raise FormatError(f"{path.name}: tensor {t.name!r} has shape {info.shape}; "
                          "only 2-D [rows, K] Q6_K matrices are served")
    rows, k = info.shape
    if rows < 1:
        raise FormatError(f"{path.name}: tensor {t.name!r} has {rows} rows")
    q6k.check_k(k)
    aos = np.asarray(t.data).reshape(-1).view(np.uint8)
    return Q6KTensor(t.name, rows, k, q6k.as_blocks(aos, rows, k))


def read_q6k_tensors(path: str | os.PathLike[str],
                     names: list[str] | None = None) -> list[Q6KTensor]:
    """The named Q6_K tensors (all Q6_K tensors when ``names`` is empty/None), memory-mapped."""
    p = Path(path)
    reader = open_reader(p)
    by_name = {t.name: t for t in reader.tensors}
    if names:
        missing = [n for n in names if n not in by_name]
        if missing:
            raise NotFound(f"{p.name}: no tensor named {', '.join(map(repr, missing))} "
                           f"(file has {len(by_name)} tensors)")
        return [_as_q6k(p, by_name[n]) for n in names]
    found = [_as_q6k(p, t) for t in reader.tensors
             if GGMLQuantizationType(t.tensor_type) == Q6_K]
    if not found:
        raise FormatError(f"{p.name}: no Q6_K tensors among its {len(by_name)} tensors")
    return found


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
