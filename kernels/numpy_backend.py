"""The NumPy backend: the CPU twin of the CUDA backend (and what CI serves from).

Weights are held as *slabs* of whole rows, each slab at most ``chunk_bytes`` and laid out
as packed SoA (or AoS when the SOA flag is off). Slabs keep every transient bounded: a load
never holds more than one chunk besides the weight, and a relayout swaps one slab at a time.

Matmul dequantizes a few hundred rows at a time into a float32 tile and hands it to BLAS.
The unpacking runs as long contiguous uint64 operations on sub-tiles transposed to
``[word, block]`` (see :func:`unpack_q`); the tile comes out in the weight's own column order.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from . import q6k
from .api import (
    DEFAULT_FLAGS,
    AosChunks,
    Backend,
    KernelFlags,
    KernelTiming,
    Layout,
    MatmulResult,
    MemoryInfo,
    Precision,
    ResidentWeight,
    check_matmul,
    refuse_q8_1_without_mmq,
)
from .epilogue import topk_reference
from .errors import FormatError

_M4 = np.uint64(0x0F0F0F0F0F0F0F0F)
_M30 = np.uint64(0x3030303030303030)
# int8(q - 32) for a byte q in 0..63 is (q + 0x60) ^ 0x80: q + 0x60 <= 0x9f never carries into
# the next byte, so both run on whole uint64 words.
_B60 = np.uint64(0x6060606060606060)
_B80 = np.uint64(0x8080808080808080)


GEMV_MAX_N = 4  # up to this N a tile is N GEMVs, above it one W @ x.T GEMM
SUB = 128  # blocks per transposed sub-tile: short strides for the transposes


class Workspace:
    """Scratch for dequantizing up to ``max_blocks`` blocks, reused across calls.

    Allocating these per tile would page-fault fresh memory every time and cost more than
    the arithmetic (measured ~3x on the 2-core CI machine).
    """

    def __init__(self, max_blocks: int) -> None:
        n = -(-max_blocks // SUB) * SUB
        self.max_blocks = n
        self.ql_t = np.empty((n // SUB, 16, SUB), dtype=np.uint64)
        self.qh_t = np.empty((n // SUB, 8, SUB), dtype=np.uint64)
        self.out_t = np.empty((n // SUB, 32, SUB), dtype=np.uint64)
        self.tmp = np.empty((n // SUB, 2, 4, SUB), dtype=np.uint64)
        self.q = np.empty((n, 32), dtype=np.uint64)
        self.w = np.empty((n, q6k.QK_K), dtype=np.float32)


def unpack_q(ql: np.ndarray, qh: np.ndarray, ws: Workspace | None = None,
             centered: bool = False) -> np.ndarray:
    """6-bit quants ``[n, 256]`` uint8, using only whole-word operations;
    with ``centered``, int8 ``q - 32`` instead (two more word operations, which cost less
    than a float subtract pass: the caller then only casts).

    Blocks are padded to a multiple of SUB and each sub-tile of SUB blocks is transposed to
    ``[word, block]``, so every ufunc call runs long contiguous uint64 loops.
    """
    n = ql.shape[0]
    ws = ws or Workspace(n)
    big = -(-n // SUB)
    pad = big * SUB
    ql_t, qh_t, out_t, tmp = ws.ql_t[:big], ws.qh_t[:big], ws.out_t[:big], ws.tmp[:big]
    full = n // SUB  # whole sub-tiles, then a zero-padded ragged tail
    ql64, qh64 = ql.view(np.uint64), qh.view(np.uint64)
    np.copyto(ql_t[:full], ql64[: full * SUB].reshape(full, SUB, 16).transpose(0, 2, 1))
    np.copyto(qh_t[:full], qh64[: full * SUB].reshape(full, SUB, 8).transpose(0, 2, 1))
    if pad != n:
        rem = n - full * SUB
        ql_t[-1].fill(0)
        qh_t[-1].fill(0)
        ql_t[-1, :, :rem] = ql64[full * SUB :].T
        qh_t[-1, :, :rem] = qh64[full * SUB :].T
    ql4 = ql_t.reshape(big, 2, 2, 4, SUB)  # half h, quarter m, word
    qh2 = qh_t.reshape(big, 2, 4, SUB)  # half h, word
    # Element h*128 + s*32 + l is in word h*16 + s*4 + l//8: for one s, two runs of 4 * SUB.
    out = out_t.reshape(big, 2, 4, 4, SUB)  # h, s, word
    for s in range(4):
        # s selects ql's low (s<2) or high nibble of quarter m = s % 2, and qh bits 2s..2s+1.
        o = out[:, :, s]
        if s < 2:
            np.bitwise_and(ql4[:, :, s], _M4, out=o)
        else:
            np.right_shift(ql4[:, :, s - 2], np.uint64(4), out=o)
            o &= _M4
        # qh bits 2s..2s+1 to bits 4..5 of each byte: one shift (none at s = 2) and a mask;
        # bits shifted in from the next byte land outside the mask.
        if s == 2:
            np.bitwise_and(qh2, _M30, out=tmp)
        else:
            shift = np.left_shift if s < 2 else np.right_shift
            shift(qh2, np.uint64(abs(4 - 2 * s)), out=tmp)
            tmp &= _M30
        o |= tmp
    if centered:
        out_t += _B60
        out_t ^= _B80
    q = ws.q[:pad]
    np.copyto(q.reshape(big, SUB, 32), out_t.transpose(0, 2, 1))
    return q[:n].view(np.int8 if centered else np.uint8)


def dequantize(f: dict[str, np.ndarray], ws: Workspace | None = None) -> np.ndarray:
    """float32 ``[n, 256]`` weights; each value bit-identical to gguf's."""
    n = f["ql"].shape[0]
    ws = ws or Workspace(n)
    q = unpack_q(f["ql"], f["qh"], ws, centered=True)  # int8 q - 32
    scales = q6k.group_scales(f["scales"], f["d"])  # [n, 16]
    out = ws.w[:n]
    np.copyto(out, q, casting="unsafe")  # int8 -> f32 is exact: the same values as before
    out.reshape(n * 16, 16)[:] *= scales.reshape(n * 16, 1)
    return out


@dataclass
class Slab:
    row0: int
    rows: int
    data: np.ndarray  # packed SoA bytes, or AoS [blocks, 210]
    layout: Layout

    def fields(self, k: int) -> dict[str, np.ndarray]:
        n = self.rows * (k // q6k.QK_K)
        if self.layout is Layout.SOA:
            return q6k.soa_fields(self.data, n)
        return q6k.aos_fields(self.data)


def _slab_bytes(rows: int, k: int, layout: Layout) -> int:
    n = rows * (k // q6k.QK_K)
    return q6k.SoaLayout.for_blocks(n).nbytes if layout is Layout.SOA else n * q6k.BLOCK_BYTES


def _pack(blocks: np.ndarray, layout: Layout) -> np.ndarray:
    return q6k.aos_to_soa(blocks) if layout is Layout.SOA else np.array(blocks, dtype=np.uint8)


def _slice_fields(f: dict[str, np.ndarray], b0: int, b1: int) -> dict[str, np.ndarray]:
    return {name: arr[b0:b1] for name, arr in f.items()}


class NumpyBackend(Backend):
    """Chunked dequantization + BLAS on the host. AUTO precision is EXACT here."""

    name = "numpy"
    no_q8_1 = frozenset((Precision.EXACT, Precision.F16, Precision.AUTO))  # AUTO is EXACT here
    TILE_ROWS_BYTES = 2 << 20  # float32 tile per thread, sized for L2
    SLAB_BYTES = 64 << 20  # resident slab size: bounds load and relayout transients

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or max(1, min(4, os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="q6-numpy")
        # Our tiles already use every core; BLAS threads on top of them oversubscribe the CPU
        # (measured on 2 cores: ffn_down N=1 0.50 -> 0.84 GB/s, N=64 0.22 -> 0.33 GB/s).
        # OpenBLAS's thread count is process-wide, so this holds until close().
        self._blas_limit = threadpool_limits(1, user_api="blas") if self.threads > 1 else None
        self._held = 0
        self._lock = threading.Lock()
        self._local = threading.local()  # one dequant Workspace per pool thread

    def _workspace(self, n_blocks: int) -> Workspace:
        ws = getattr(self._local, "ws", None)
        if ws is None or ws.max_blocks < n_blocks:
            ws = self._local.ws = Workspace(max(n_blocks, self.TILE_ROWS_BYTES // 1024))
        return ws

    # -- memory -----------------------------------------------------------------------------
    def device_name(self) -> str:
        return f"cpu ({os.cpu_count()} cores, NumPy {np.__version__})"

    def memory(self) -> MemoryInfo:
        total = free = 0
        try:
            with open("/proc/meminfo") as fh:
                info = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in fh}
            total, free = info["MemTotal"], info["MemAvailable"]
        except (OSError, KeyError, ValueError):
            pass
        return MemoryInfo(free=free, total=total, pool_used=self._held, pool_total=self._held)

    def weight_nbytes(self, rows: int, k: int, layout: Layout) -> int:
        return sum(_slab_bytes(r1 - r0, k, layout)
                   for r0, r1 in self._slab_rows(rows, k, self.SLAB_BYTES))

    def load_scratch_nbytes(self, rows: int, k: int, chunk_bytes: int) -> int:
        return 0  # chunks come from the caller's mmap/stream; slabs are packed straight in

    def relayout_scratch_nbytes(self, rows: int, k: int, layout: Layout,
                                chunk_bytes: int) -> int:
        """:meth:`relayout` builds the new slabs before it lets go of the old ones (so a
        failure leaves the weight intact): the whole old copy is held until the end, plus
        one slab converted back to AoS on the way from SoA."""
        other = Layout.AOS if layout is Layout.SOA else Layout.SOA
        old = self.weight_nbytes(rows, k, other)
        slab = max(_slab_bytes(r1 - r0, k, Layout.AOS)
                   for r0, r1 in self._slab_rows(rows, k, self.SLAB_BYTES))
        return old + (slab if other is Layout.SOA else 0)

    @staticmethod
    def _slab_rows(rows: int, k: int, chunk_bytes: int) -> list[tuple[int, int]]:
        per = max(1, chunk_bytes // q6k.aos_nbytes(1, k))
        return [(r0, min(rows, r0 + per)) for r0 in range(0, rows, per)]

    def _adjust_held(self, delta: int) -> None:
        with self._lock:
            self._held += delta

    # -- weights ----------------------------------------------------------------------------
    def load(self, chunks: AosChunks, rows: int, k: int, layout: Layout,
             chunk_bytes: int = 64 << 20) -> ResidentWeight:
        per_row = q6k.check_k(k)
        slabs: list[Slab] = []
        row = 0
        pending: list[np.ndarray] = []
        pending_rows = 0
        slab_plan = iter(self._slab_rows(rows, k, self.SLAB_BYTES))
        want = next(slab_plan, None)
        for chunk in chunks:
            blocks = np.frombuffer(chunk, dtype=np.uint8) if not isinstance(
                chunk, np.ndarray) else chunk.reshape(-1).view(np.uint8)
            if blocks.size % (per_row * q6k.BLOCK_BYTES):
                raise FormatError(f"chunk of {blocks.size} bytes is not whole rows of "
                                  f"{per_row * q6k.BLOCK_BYTES} bytes")
            pending.append(blocks.reshape(-1, q6k.BLOCK_BYTES))
            pending_rows += blocks.size // (per_row * q6k.BLOCK_BYTES)
            while want is not None and pending_rows >= want[1] - want[0]:
                n_rows = want[1] - want[0]
                allb = np.concatenate(pending) if len(pending) > 1 else pending[0]
                take = n_rows * per_row
                slabs.append(Slab(row, n_rows, _pack(allb[:take], layout), layout))
                row += n_rows
                rest = allb[take:]
                pending = [rest] if rest.size else []
                pending_rows -= n_rows
                want = next(slab_plan, None)
        if row != rows or pending_rows:
            raise FormatError(f"weight {rows}x{k} got {row + pending_rows} rows of data")
        nbytes = sum(s.data.nbytes for s in slabs)
        self._adjust_held(nbytes)
        return ResidentWeight(rows, k, layout, nbytes, slabs)

    def relayout(self, w: ResidentWeight, layout: Layout,
                 chunk_bytes: int = 64 << 20) -> ResidentWeight:
        if w.layout is layout:
            return w
        slabs: list[Slab] = w.data
        new = []
        for s in slabs:  # one slab of scratch at a time
            blocks = (q6k.soa_to_aos(s.data, s.rows * (w.k // q6k.QK_K))
                      if s.layout is Layout.SOA else s.data)
            new.append(Slab(s.row0, s.rows, _pack(blocks, layout), layout))
        nbytes = sum(s.data.nbytes for s in new)
        self._adjust_held(nbytes - w.nbytes)
        return ResidentWeight(w.rows, w.k, layout, nbytes, new)

    def free(self, w: ResidentWeight) -> None:
        if w.data is not None:
            self._adjust_held(-w.nbytes)
            w.data = None

    def read_aos(self, w: ResidentWeight) -> np.ndarray:
        per_row = w.k // q6k.QK_K
        parts = [q6k.soa_to_aos(s.data, s.rows * per_row) if s.layout is Layout.SOA
                 else s.data for s in w.data]
        return np.concatenate(parts)

    # -- matmul -----------------------------------------------------------------------------
    def plan(self, n: int, precision: Precision, flags: KernelFlags) -> tuple[str, Precision]:
        refuse_q8_1_without_mmq(precision, flags)
        resolved = Precision.EXACT if precision is Precision.AUTO else precision
        return f"numpy.{resolved.value}", resolved

    def matmul(self, w: ResidentWeight, x: np.ndarray, *, precision: Precision = Precision.AUTO,
               flags: KernelFlags = DEFAULT_FLAGS, out_dtype: np.dtype | None = None,
               topk: int = 0) -> MatmulResult:
        x = check_matmul(w, x, topk)
        kernel, resolved = self.plan(x.shape[0], precision, flags)
        slabs: list[Slab] | None = w.data
        if slabs is None:
            raise FormatError("weight was freed")
        t0 = time.perf_counter()
        if resolved is Precision.Q8_1:
            y = self._matmul_q8_1(w, slabs, x)
        else:
            xf = x.astype(np.float16) if resolved is Precision.F16 else x
            y = self._matmul_float(w, slabs, xf.astype(np.float32))
        elapsed = time.perf_counter() - t0  # the matmul only (as the CUDA events)
        if topk:
            return MatmulResult(None, kernel, w.layout, resolved,
                                KernelTiming(host_seconds=elapsed), topk=topk_reference(y, topk))
        if out_dtype is not None and np.dtype(out_dtype) != y.dtype:
            y = y.astype(out_dtype)
        return MatmulResult(y, kernel, w.layout, resolved, KernelTiming(host_seconds=elapsed))

    def _tiles(self, w: ResidentWeight, slabs: list[Slab]):
        """(slab, first block, last block, first output row) tiles of ~TILE_ROWS_BYTES."""
        per_row = w.k // q6k.QK_K
        tile_rows = max(1, self.TILE_ROWS_BYTES // (4 * w.k))
        for s in slabs:
            for r0 in range(0, s.rows, tile_rows):
                r1 = min(s.rows, r0 + tile_rows)
                yield s, r0 * per_row, r1 * per_row, s.row0 + r0, r1 - r0

    def _each_tile(self, run: Callable[[Any], None], w: ResidentWeight,
                   slabs: list[Slab]) -> None:
        """``run`` over the tiles, on the pool's threads; a single tile on this thread (a
        small weight: the hand-off to a pool thread and back cost more than its work)."""
        tiles = list(self._tiles(w, slabs))
        if len(tiles) == 1:
            run(tiles[0])
        else:
            list(self._pool.map(run, tiles))

    def _matmul_float(self, w: ResidentWeight, slabs: list[Slab], x: np.ndarray) -> np.ndarray:
        n = x.shape[0]
        xp = np.ascontiguousarray(x)
        y = np.empty((n, w.rows), dtype=np.float32)

        def run(tile) -> None:
            s, b0, b1, row0, rows = tile
            f = _slice_fields(s.fields(w.k), b0, b1)
            wt = dequantize(f, self._workspace(b1 - b0)).reshape(rows, w.k)
            out = y[:, row0 : row0 + rows]
            # OpenBLAS packs the big operand for x @ Wt.T even at N = 2 (9x slower than
            # GEMVs there); W @ x.T packs x instead. Measured on a 146 x 3584 tile.
            if n <= GEMV_MAX_N:
                for i in range(n):
                    np.matmul(wt, xp[i], out=out[i])
            else:
                out[:] = (wt @ xp.T).T

        self._each_tile(run, w, slabs)
        return y

    def _matmul_q8_1(self, w: ResidentWeight, slabs: list[Slab], x: np.ndarray) -> np.ndarray:
        from .reference import matmul_q8_1  # the reference *is* the CPU q8_1 kernel

        y = np.empty((x.shape[0], w.rows), dtype=np.float32)

        def run(tile) -> None:
            s, b0, b1, row0, rows = tile
            f = _slice_fields(s.fields(w.k), b0, b1)
            y[:, row0 : row0 + rows] = matmul_q8_1(x, f, rows)

        self._each_tile(run, w, slabs)
        return y

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._blas_limit is not None:
            self._blas_limit.restore_original_limits()
            self._blas_limit = None
