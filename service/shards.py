"""Row sharding arithmetic: which rows of a tensor a shard holds (no gRPC, no backend).

Rows of ``y = x · Wᵀ`` are independent, so a row range ``[begin, end)`` of a Q6_K tensor is a
contiguous slice of its AoS blocks and the shards' outputs concatenate along the output columns.
One rule everywhere (LoadWeights' ShardSpec, the multi-device worker, the k8s StatefulSet):
an even split with the remainder spread over the first shards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from q6serve.kernels import q6k
from q6serve.kernels.errors import InvalidArgument

if TYPE_CHECKING:
    from q6serve.kernels.gguf_io import Q6KTensor


@dataclass(frozen=True)
class RowRange:
    begin: int
    end: int

    @property
    def rows(self) -> int:
        return self.end - self.begin

    def __str__(self) -> str:
        return f"[{self.begin}, {self.end})"


def even_split(rows: int, count: int) -> list[RowRange]:
    """``count`` contiguous ranges covering ``[0, rows)``; the first ``rows % count`` get one more
    row (rows=10, count=3 -> [0,4) [4,7) [7,10))."""
    if count < 1:
        raise InvalidArgument(f"shard count {count} must be >= 1")
    if rows < count:
        raise InvalidArgument(f"cannot split {rows} rows into {count} non-empty shards")
    base, extra = divmod(rows, count)
    out, begin = [], 0
    for i in range(count):
        end = begin + base + (1 if i < extra else 0)
        out.append(RowRange(begin, end))
        begin = end
    return out


def shard_range(rows: int, index: int, count: int) -> RowRange:
    if not 0 <= index < count:
        raise InvalidArgument(f"shard index {index} is not in [0, {count})")
    return even_split(rows, count)[index]


@dataclass(frozen=True)
class RowSelect:
    """What a load asks for: an explicit range, or shard ``index`` of ``count`` (not both)."""

    range: RowRange | None = None
    shard: tuple[int, int] | None = None  # (index, count)

    def resolve(self, name: str, rows: int) -> RowRange:
        """The rows of a ``rows``-row tensor ``name`` to load (checked, non-empty)."""
        if self.shard is not None:
            return shard_range(rows, *self.shard)
        if self.range is None:
            return RowRange(0, rows)
        r = self.range
        if not 0 <= r.begin < r.end <= rows:
            raise InvalidArgument(f"row range {r} of tensor {name!r} is not a non-empty range "
                                  f"within its {rows} rows")
        return r


def slice_blocks(aos_blocks: np.ndarray, k: int, r: RowRange) -> np.ndarray:
    """The AoS blocks ``[n, 210]`` of rows ``r``: a view (a row is a run of ``K/256`` blocks)."""
    per_row = k // q6k.QK_K
    return aos_blocks[r.begin * per_row : r.end * per_row]


def slice_tensor(t: Q6KTensor, r: RowRange) -> Q6KTensor:
    """``t`` narrowed to rows ``r`` (a view of the same memory map)."""
    if r.begin == 0 and r.end == t.rows:
        return t
    return dataclasses.replace(t, rows=r.rows, aos=slice_blocks(t.aos, t.k, r))
