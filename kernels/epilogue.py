"""The top-k / log-sum-exp epilogue: what a sampler needs from an lm-head instead of y.

Per row i of y ``[N, cols]`` (f32): the k largest values in descending order, their column
indices, and ``lse[i] = log(sum_j exp(y[i, j]))``. Order within the k: value descending, ties
by lower column index (both implementations below); NaN ranks above +inf (and makes lse NaN).
Which of several columns tied *at the k-th value* make the cut is not part of the contract.

Two implementations of one contract:

- :func:`topk_reference` (NumPy backend, tests): ``np.argpartition`` + a sort of the k
  survivors, lse accumulated in float64 from the f32 y, rounded to f32 once.
- :func:`topk_xp` (CUDA backend via CuPy; array-module generic, so CI runs the very same code
  with NumPy): no full sort of the row. The row is cut into G groups of g columns; the top-k
  columns lie in the k groups with the largest maxima (a column strictly in the top k has
  fewer than k larger columns, hence fewer than k groups with a larger maximum), so only
  ``k * g`` candidates per row are sorted, by one 64-bit key (order-preserving value bits,
  then column index). lse: max-shifted ``exp`` in f32, summed in float64.

Tolerances (tests/kernels/test_epilogue.py, the CUDA GPU test): values are y's own values
(bit-equal to the y the same backend returns); indices equal wherever the value is not tied
with a neighbour; lse within ``LSE_RTOL * max(1, |lse|)`` of the float64 reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidArgument

MAX_K = 256  # the largest k a request may ask for
LSE_RTOL = 1e-5  # |lse - float64 reference| <= LSE_RTOL * max(1, |lse|)
FULL_SORT_COLS = 4096  # rows this short are sorted whole (two sorts would cost more)


@dataclass(frozen=True)
class TopK:
    """Top-k of each row: ``values`` f32 [N, k], ``indices`` int32 [N, k], ``lse`` f32 [N]."""

    values: np.ndarray
    indices: np.ndarray
    lse: np.ndarray

    @property
    def k(self) -> int:
        return int(self.values.shape[1])

    def rows(self, begin: int, end: int) -> TopK:
        """Rows [begin, end) (a request's share of a batch: rows are independent)."""
        return TopK(self.values[begin:end], self.indices[begin:end], self.lse[begin:end])

    def first(self, k: int) -> TopK:
        """The top ``k`` <= self.k (a prefix: the order is total)."""
        return self if k == self.k else TopK(self.values[:, :k], self.indices[:, :k], self.lse)


def check_k(k: int, cols: int | None = None, what: str = "topk k",
            weight: str | None = None) -> int:
    """1 <= k <= MAX_K (and <= the row length ``cols`` when known), else INVALID_ARGUMENT."""
    if not 1 <= k <= MAX_K:
        raise InvalidArgument(f"{what}={k} is out of range: use 1..{MAX_K}")
    if cols is not None and k > cols:
        of = f" of weight {weight[:256]!r}" if weight is not None else ""
        raise InvalidArgument(f"{what}={k} exceeds the {cols} rows{of} (the columns of y)")
    return k


def _lse_f64(y: np.ndarray) -> np.ndarray:
    yf = y.astype(np.float64)
    m = yf.max(axis=1)
    shift = np.where(np.isfinite(m), m, 0.0)  # all -inf: log(0) = -inf; +inf: inf
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return (shift + np.log(np.exp(yf - shift[:, None]).sum(axis=1))).astype(np.float32)


def topk_reference(y: np.ndarray, k: int) -> TopK:
    """The NumPy epilogue (also the tests' reference): see the module docstring."""
    y = np.asarray(y, dtype=np.float32)
    cols = y.shape[1]
    check_k(k, cols)
    # NaN as +inf-plus for the selection: argpartition already sorts NaN last (largest)
    part = np.argpartition(y, cols - k, axis=1)[:, cols - k:]
    vals = np.take_along_axis(y, part, axis=1)
    # value descending (NaN first), then column ascending
    order = np.lexsort((part, ~_order_key(vals, np)), axis=1)
    idx = np.take_along_axis(part, order, axis=1).astype(np.int32)
    return TopK(np.take_along_axis(y, idx, axis=1), idx, _lse_f64(y))


def _order_key(v: Any, xp: Any) -> Any:
    """uint32 keys whose unsigned order is the float order of ``v`` (f32; NaN above +inf)."""
    u = v.view(xp.uint32)
    flip = xp.where(u >> 31 == 1, xp.uint32(0xFFFFFFFF), xp.uint32(0x80000000))
    key = u ^ flip
    return xp.where(xp.isnan(v), xp.uint32(0xFFFFFFFF), key)


def _sorted_desc(v: Any, cols: Any, xp: Any, k: int) -> Any:
    """Column ids of the ``k`` best of ``v`` [r, m] per row (value desc, then ``cols`` asc),
    by one ascending sort of 64-bit keys: (~value key) << 32 | column."""
    desc = (~_order_key(v, xp)).astype(xp.uint64)
    key = (desc << xp.uint64(32)) | cols.astype(xp.uint64)
    return (xp.sort(key, axis=1)[:, :k] & xp.uint64(0xFFFFFFFF)).astype(xp.int32)


def group_size(cols: int, k: int) -> int:
    """Columns per group: balances the group-maxima sort (cols/g) and the candidate sort
    (k*g) at g ~ sqrt(cols/k)."""
    return max(1, round((cols / k) ** 0.5))


def topk_xp(y: Any, k: int, xp: Any = np) -> tuple[Any, Any, Any]:
    """(values f32 [N, k], indices int32 [N, k], lse f32 [N]) of ``y`` f32 [N, cols] with array
    module ``xp`` (cupy on the device, numpy in CI); results stay in ``xp``. Transient memory:
    about 3 x y (padded copy, f32 exp terms) plus 16 bytes per candidate (k*g per row)."""
    n, cols = (int(d) for d in y.shape)
    check_k(k, cols)
    m = y.max(axis=1)
    shift = xp.where(xp.isfinite(m), m, xp.float32(0))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # NumPy only
        terms = xp.exp(y - shift[:, None]).sum(axis=1, dtype=xp.float64)
        lse = (shift.astype(xp.float64) + xp.log(terms)).astype(xp.float32)
    if cols <= FULL_SORT_COLS:
        cols_ids = xp.broadcast_to(xp.arange(cols, dtype=xp.int32), (n, cols))
        idx = _sorted_desc(y, cols_ids, xp, k)
    else:
        g = group_size(cols, k)
        groups = -(-cols // g)  # every group holds >= 1 real column (padding < g)
        padded = xp.full((n, groups * g), -xp.inf, dtype=xp.float32)
        padded[:, :cols] = y
        gmax = padded.reshape(n, groups, g).max(axis=2)
        gids = xp.broadcast_to(xp.arange(groups, dtype=xp.int32), (n, groups))
        best = _sorted_desc(gmax, gids, xp, k)  # [n, k] group ids
        cand = (best[:, :, None] * g + xp.arange(g, dtype=xp.int32)).reshape(n, k * g)
        # padding sorts after any real -inf (larger column id), and >= k real columns exist
        idx = _sorted_desc(xp.take_along_axis(padded, cand, axis=1), cand, xp, k)
    return xp.take_along_axis(y, idx, axis=1), idx, lse


def merge_topk(parts: list[TopK], offsets: list[int], k: int) -> TopK:
    """Top-k of y = [y_0 | y_1 | ...] (column blocks) from each block's top-k: indices of
    part p are shifted by ``offsets[p]``; lse combines as the log-sum-exp of the parts' lse.
    Each part must hold min(k, its columns) entries."""
    vals = np.concatenate([p.values for p in parts], axis=1)
    idx = np.concatenate([p.indices.astype(np.int64) + off
                          for p, off in zip(parts, offsets, strict=True)], axis=1)
    order = np.lexsort((idx, ~_order_key(vals, np)), axis=1)[:, :k]
    lse = _lse_f64(np.stack([p.lse for p in parts], axis=1))
    return TopK(np.take_along_axis(vals, order, axis=1),
                np.take_along_axis(idx, order, axis=1).astype(np.int32), lse)
