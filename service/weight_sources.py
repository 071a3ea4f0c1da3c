"""Where weights are loaded from: a :class:`WeightSource` per weight (its rows read as
whole-row chunks from a GGUF memory map or an upload's buffer) and the GGUF files under the
worker's --model-dir, paths confined to it (:func:`confine`). Called by the engine and the
multi-device engine (service/devices.py), which loads one source's parts on each device."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from q6serve.kernels import gguf_io
from q6serve.kernels.errors import FailedPrecondition, InvalidArgument, PermissionDenied

from . import gcfreeze
from .shards import RowRange, RowSelect, slice_tensor
from .threads import run_in_thread

if TYPE_CHECKING:
    from q6serve.kernels.gguf_io import Q6KTensor


@dataclass(frozen=True)
class WeightSource:
    """One weight to load: its name, shape, where it came from, and how to read its AoS rows
    as whole-row chunks (from a GGUF memory map or an upload's buffer). A multi-device worker
    loads a :meth:`part` of one source on each device: the file or upload is read once."""

    name: str
    rows: int
    k: int
    source: str
    read: Callable[[int, int, int], Iterable[np.ndarray]]  # (row, end row, chunk bytes)
    row_begin: int = 0  # a row-sharded load holds rows [row_begin, row_begin + rows)
    tensor_rows: int = 0  # of the whole tensor (0: same as rows)
    first: int = 0  # this source's rows are [first, first + rows) of what ``read`` reads

    @property
    def whole_rows(self) -> int:
        return self.tensor_rows or self.rows

    def chunks(self, chunk_bytes: int) -> Iterable[np.ndarray]:
        return self.read(self.first, self.first + self.rows, chunk_bytes)

    def part(self, r: RowRange) -> WeightSource:
        """Rows ``r`` of this source (``r`` counted from its first row)."""
        return replace(self, rows=r.rows, first=self.first + r.begin,
                       row_begin=self.row_begin + r.begin, tensor_rows=self.whole_rows)


async def gguf_sources(model_dir: Path | None, rel_path: str, tensors: list[str],
                       prefix: str = "", rows: RowSelect | None = None,
                       cancelled: Callable[[], bool] | None = None) -> list[WeightSource]:
    """The Q6_K tensors of a GGUF file under ``model_dir`` (all, or ``tensors``), each narrowed
    to ``rows``; the file is opened once and its memory map read as the parts load. The
    header is parsed in a daemon thread polling ``cancelled`` (service/threads.py)."""
    path = confine(model_dir, rel_path)
    select = rows or RowSelect()

    def sources() -> list[WeightSource]:  # in the thread too: 65536 tensors are work
        out: list[WeightSource] = []
        where = f"gguf:{rel_path}"  # one string for all the file's weights
        found = gguf_io.read_q6k_tensors(path, tensors or None, cancelled)
        for t in found:
            if len(out) % gcfreeze.FREEZE_AT == 0 and len(found) >= gcfreeze.FREEZE_AT:
                gcfreeze.freeze()  # ~10 objects per tensor until loaded: keep GC walks short
            r: RowRange = select.resolve(t.name, t.rows)

            def read(r0: int, r1: int, chunk_bytes: int, t: Q6KTensor = t,
                     ) -> Iterable[np.ndarray]:
                return slice_tensor(t, RowRange(r0, r1)).iter_row_chunks(chunk_bytes)

            out.append(WeightSource(prefix + t.name, r.rows, t.k, where, read,
                                    r.begin, t.rows, first=r.begin))
        return out

    return await run_in_thread(sources)


MAX_PATH_LEN = 1024
MAX_PATH_PART = 255


def _short(text: str) -> str:
    return repr(text if len(text) <= 80 else text[:60] + "...")


def confine(model_dir: Path | None, rel: str) -> Path:
    """``rel`` inside ``model_dir``: absolute paths, ``..`` and symlink escapes are refused;
    paths that cannot be resolved (loops, overlong) are INVALID_ARGUMENT."""
    if model_dir is None:
        raise FailedPrecondition("this worker has no --model-dir; upload weights instead")
    if not rel:
        raise InvalidArgument("gguf path is empty")
    if "\x00" in rel:
        raise InvalidArgument(f"gguf path {_short(rel)} contains a NUL byte")
    p = Path(rel)
    if len(rel) > MAX_PATH_LEN or any(len(part) > MAX_PATH_PART for part in p.parts):
        raise InvalidArgument(f"gguf path of {len(rel)} characters is too long "
                              f"(at most {MAX_PATH_LEN}, {MAX_PATH_PART} per component)")
    if p.is_absolute() or ".." in p.parts:
        raise PermissionDenied(f"gguf path {_short(rel)} must be relative to the model dir "
                               "without '..'")
    root = model_dir.resolve()
    try:
        full = (root / p).resolve()
    except (OSError, RuntimeError) as e:  # symlink loops raise RuntimeError here
        raise InvalidArgument(f"gguf path {_short(rel)} cannot be resolved: "
                              f"{type(e).__name__}") from None
    if not full.is_relative_to(root):
        raise PermissionDenied(f"gguf path {_short(rel)} leaves the model dir (symlink?)")
    return full

