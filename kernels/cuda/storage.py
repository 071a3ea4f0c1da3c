"""Resident Q6_K weights in VRAM: load, relayout, read-back, and the exact VRAM figures.

A weight is a list of *slabs* of at most ``SLAB_BYTES`` (whole rows each; a tall weight of one
slab's size in two, ``TWO_SLAB_MIN_ROWS``), every slab one allocation laid out as AoS blocks or
as the packed SoA planes of :class:`q6k.SoaLayout` for that slab's blocks; the kernels find a
row's slab through a small device table of slab pointers. Loading streams AoS chunks through
one pinned host buffer and one device staging buffer (both <= ``chunk_bytes``) and repacks them
on the GPU straight into the slabs, so no full AoS copy ever exists; relayout converts one slab
at a time (one slab of scratch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import q6k
from ..api import AosChunks, Layout, ResidentWeight, env_switch
from ..errors import FormatError
from .context import DeviceContext

SLAB_BYTES = 64 << 20  # resident slab size (whole rows): bounds relayout scratch
# A weight that fits one slab but is tall (rows >= TWO_SLAB_RATIO x K, TWO_SLAB_MIN_ROWS rows or
# more: a y large against its x, e.g. Llama's 14336x4096 gate/up) is kept in two slabs of
# ceil(rows / 2) rows (rounded up to 16), so that its calls can compute and download y in two
# row chunks (kernels/cuda/launch.py point 8: chunk 0's y is DMA'd while chunk 1 computes). H200,
# session 13 (bench/RESULTS.md): two slabs cost the kernels nothing (AUTO f16 14336x4096 N=1/64
# x1.004/1.009, 18944x3584 x1.000/1.027), and 14336x4096 N=64 staged took 141.7 us of wall
# against 158.4 in one slab without chunks. TWO_SLAB_MIN_ROWS = 0: never.
TWO_SLAB_MIN_ROWS = 8192
TWO_SLAB_RATIO = 3
# the row chunks a two-slab weight's calls take by default (CudaWeight.y_chunks)
TWO_SLAB_CHUNKS = 2
POOL_ROUND = 512  # CuPy's pool rounds every allocation up to this
REPACK_FILE = "q6k_repack.cu"
PAIRS_FILE = "q6k_matmul.cu"  # q6k_repack_pairs / q6k_unpack_pairs


def pool_round(n: int) -> int:
    return -(-n // POOL_ROUND) * POOL_ROUND


def two_slabs(rows: int, k: int) -> bool:
    """Whether a ``rows`` x ``k`` weight is kept in two slabs (``TWO_SLAB_MIN_ROWS``)."""
    return (0 < TWO_SLAB_MIN_ROWS <= rows and rows >= TWO_SLAB_RATIO * k
            and rows <= SLAB_BYTES // q6k.aos_nbytes(1, k))


def slab_rows(rows: int, k: int) -> int:
    """Rows per slab of a ``rows`` x ``k`` weight (the last slab may have fewer)."""
    if two_slabs(rows, k):
        return -(-rows // 32) * 16  # ceil(rows / 2), rounded up to 16
    return max(1, SLAB_BYTES // q6k.aos_nbytes(1, k))


def slab_nbytes(rows: int, k: int, layout: Layout) -> int:
    nb = rows * q6k.check_k(k)
    return q6k.SoaLayout.for_blocks(nb).nbytes if layout is Layout.SOA else nb * q6k.BLOCK_BYTES


def slab_plan(rows: int, k: int) -> list[tuple[int, int]]:
    per = slab_rows(rows, k)
    return [(r0, min(rows, r0 + per)) for r0 in range(0, rows, per)]


def weight_nbytes(rows: int, k: int, layout: Layout) -> int:
    """Exactly what :meth:`Storage.load` allocates: slabs at pool granularity + the table."""
    plan = slab_plan(rows, k)
    return sum(pool_round(slab_nbytes(r1 - r0, k, layout)) for r0, r1 in plan) + pool_round(
        8 * len(plan))


def staging_rows(rows: int, k: int, chunk_bytes: int) -> int:
    return max(1, min(rows, chunk_bytes // q6k.aos_nbytes(1, k)))


@dataclass
class CudaWeight:
    slabs: list[Any]  # cupy uint8 arrays
    table: Any  # cupy uint64 [n_slabs] of slab pointers
    rps: int  # rows per slab
    # Launch plans of this weight by call shape (kernels/cuda/launch.py): they hold the slab
    # table's address, so they live and die with it (relayout clears them).
    plans: dict = field(default_factory=dict)
    # SoA slabs whose code planes are in pair-stream order (layout code 2 of the kernels;
    # Q6SERVE_Q6K_PAIRS, pairs_from_env): the same planes and bytes, each block re-ordered.
    pairs: bool = False
    # row chunks its calls' large y takes by default (launch.py point 8; TWO_SLAB_CHUNKS for a
    # two-slab weight, else 0: none)
    y_chunks: int = 0


def weight_data(w: ResidentWeight) -> CudaWeight:
    if not isinstance(w.data, CudaWeight):
        raise FormatError("weight was freed or does not belong to the CUDA backend")
    return w.data


def pairs_from_env(env: Any = None) -> bool:
    """``Q6SERVE_Q6K_PAIRS`` (unset or empty: on; session 12, H200: AUTO 1.02-1.11x in 67 of 70
    cells of the ten model shapes at N = 1..64, bench/RESULTS.md): SoA weights are kept with
    their code planes in pair-stream order (docs/KERNELS.md "A decode from a resident repack":
    the same bytes, one LOP3 + one HFMA2 per f16x2 in the tiles, results bit-identical to
    plain SoA). ``=0``: ggml's plane order. Read where a backend is built."""
    return env_switch("Q6SERVE_Q6K_PAIRS", env=env)


class Storage:
    """Loads, re-lays and reads back weights on one device (see the module docstring)."""

    def __init__(self, ctx: DeviceContext, pairs: bool = False) -> None:
        self.ctx = ctx
        self.pairs = pairs  # SoA slabs loaded or re-laid from now on are kept as pair streams

    def _pairs(self, slab: Any, nb: int, b0: int, b1: int, inverse: bool = False) -> None:
        """Blocks [b0, b1) of a SoA slab of nb blocks into pair-stream order, in place (or back
        to ggml's planes: ``inverse``): a thread per quarter block, 256 a CTA (a multiple of 32:
        a block's four quarters share a warp)."""
        if b1 <= b0:
            return
        name = "q6k_unpack_pairs" if inverse else "q6k_repack_pairs"
        self.ctx.fn(PAIRS_FILE, name)((-(-4 * (b1 - b0) // 256),), (256,), (
            slab, np.int32(nb), np.int32(b0), np.int32(b1)))

    def _repack(self, src: Any, src_layout: Layout, src_nb: int, src_b0: int, dst: Any,
                dst_layout: Layout, dst_nb: int, dst_b0: int, count: int) -> None:
        total = count * q6k.BLOCK_BYTES
        grid = min(65535 * 4, -(-total // 256))
        u64 = np.uint64
        self.ctx.fn(REPACK_FILE, "q6k_repack")((grid,), (256,), (
            src, np.int32(src_layout is Layout.SOA), u64(src_nb), u64(src_b0),
            dst, np.int32(dst_layout is Layout.SOA), u64(dst_nb), u64(dst_b0), u64(count)))

    def _table(self, slabs: list[Any]) -> Any:
        # On this backend's device whatever the caller's current device is: a table left on
        # device 0 made every kernel on device 1 read a foreign pointer (illegal address).
        with self.ctx.dev:
            return self.ctx.cp.asarray(np.array([s.data.ptr for s in slabs], dtype=np.uint64))

    def load(self, chunks: AosChunks, rows: int, k: int, layout: Layout,
             chunk_bytes: int = 64 << 20) -> ResidentWeight:
        cp, stream = self.ctx.cp, self.ctx.stream
        per_row = q6k.check_k(k)
        row_bytes = per_row * q6k.BLOCK_BYTES
        plan = slab_plan(rows, k)
        srows = staging_rows(rows, k, chunk_bytes)
        slabs: list[Any] = []
        with self.ctx.dev, stream:
            pinned = cp.cuda.alloc_pinned_memory(srows * row_bytes)
            host = np.frombuffer(pinned, np.uint8, srows * row_bytes)
            staging = cp.empty(srows * row_bytes, cp.uint8)
            row = 0
            try:
                for chunk in chunks:
                    data = np.frombuffer(chunk, np.uint8) if not isinstance(
                        chunk, np.ndarray) else chunk.reshape(-1).view(np.uint8)
                    if data.size % row_bytes:
                        raise FormatError(f"chunk of {data.size} bytes is not whole rows of "
                                          f"{row_bytes} bytes (K={k})")
                    n_rows = data.size // row_bytes
                    if row + n_rows > rows:
                        raise FormatError(f"weight {rows}x{k} got more than {rows} rows of data")
                    for p0 in range(0, n_rows, srows):
                        p1 = min(n_rows, p0 + srows)
                        nbytes = (p1 - p0) * row_bytes
                        host[:nbytes] = data[p0 * row_bytes : p1 * row_bytes]
                        staging[:nbytes].set(host[:nbytes], stream=stream)
                        self._scatter(staging, row + p0, row + p1, plan, slabs, k, layout)
                        stream.synchronize()  # the pinned buffer is reused next
                    row += n_rows
                if row != rows:
                    raise FormatError(f"weight {rows}x{k} got {row} rows of data")
            except BaseException:
                slabs.clear()
                raise
            finally:
                del staging
        data = CudaWeight(slabs, self._table(slabs), slab_rows(rows, k),
                          pairs=self.pairs and layout is Layout.SOA,
                          y_chunks=TWO_SLAB_CHUNKS if two_slabs(rows, k) else 0)
        return ResidentWeight(rows, k, layout, weight_nbytes(rows, k, layout), data)

    def _scatter(self, staging: Any, r0: int, r1: int, plan: list[tuple[int, int]],
                 slabs: list[Any], k: int, layout: Layout) -> None:
        """Repack AoS rows [r0, r1) from ``staging`` into the slabs they belong to."""
        per_row = k // q6k.QK_K
        for s, (s0, s1) in enumerate(plan):
            lo, hi = max(r0, s0), min(r1, s1)
            if lo >= hi:
                continue
            while len(slabs) <= s:
                a, b = plan[len(slabs)]
                slabs.append(self.ctx.cp.empty(slab_nbytes(b - a, k, layout), self.ctx.cp.uint8))
            self._repack(staging, Layout.AOS, 0, (lo - r0) * per_row, slabs[s], layout,
                         (s1 - s0) * per_row, (lo - s0) * per_row, (hi - lo) * per_row)
            if self.pairs and layout is Layout.SOA:  # the chunk's own blocks, in place
                self._pairs(slabs[s], (s1 - s0) * per_row, (lo - s0) * per_row,
                            (hi - s0) * per_row)

    def relayout(self, w: ResidentWeight, layout: Layout) -> ResidentWeight:
        """One slab of scratch at a time: new slab, convert, drop the old one."""
        if w.layout is layout:
            return w
        cw = weight_data(w)
        per_row = w.k // q6k.QK_K
        cp, stream = self.ctx.cp, self.ctx.stream
        to_pairs = self.pairs and layout is Layout.SOA
        with self.ctx.dev, stream:
            for s, (s0, s1) in enumerate(slab_plan(w.rows, w.k)):
                nb = (s1 - s0) * per_row
                new = cp.empty(slab_nbytes(s1 - s0, w.k, layout), cp.uint8)
                if cw.pairs:  # ggml's planes back first (the old slab is dropped anyway)
                    self._pairs(cw.slabs[s], nb, 0, nb, inverse=True)
                self._repack(cw.slabs[s], w.layout, nb, 0, new, layout, nb, 0, nb)
                if to_pairs:
                    self._pairs(new, nb, 0, nb)
                stream.synchronize()
                cw.slabs[s] = new  # the old slab returns to the pool for the next one
            cw.table = self._table(cw.slabs)
            cw.pairs = to_pairs
            cw.plans.clear()  # they hold the old table's address
        out = ResidentWeight(w.rows, w.k, layout, weight_nbytes(w.rows, w.k, layout), cw)
        w.data = None
        return out

    def read_aos(self, w: ResidentWeight) -> np.ndarray:
        cw = weight_data(w)
        per_row = w.k // q6k.QK_K
        cp, stream = self.ctx.cp, self.ctx.stream
        parts = []
        with self.ctx.dev, stream:
            for s, (s0, s1) in enumerate(slab_plan(w.rows, w.k)):
                nb = (s1 - s0) * per_row
                if w.layout is Layout.AOS:
                    parts.append(cw.slabs[s].get(stream=stream))
                    continue
                out = cp.empty(nb * q6k.BLOCK_BYTES, cp.uint8)
                src = cw.slabs[s]
                if cw.pairs:  # ggml's planes in a copy of the slab (one slab of scratch)
                    src = src.copy()
                    self._pairs(src, nb, 0, nb, inverse=True)
                self._repack(src, Layout.SOA, nb, 0, out, Layout.AOS, nb, 0, nb)
                parts.append(out.get(stream=stream))
        return np.concatenate(parts).reshape(-1, q6k.BLOCK_BYTES)
