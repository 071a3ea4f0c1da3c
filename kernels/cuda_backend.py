"""The CUDA backend: Q6_K weights resident in VRAM, kernels from ``kernels/cuda/*.cu``.

Storage: a weight is a list of *slabs* of at most ``SLAB_BYTES`` (whole rows each), every slab
one allocation laid out as AoS blocks or as the packed SoA planes of :class:`q6k.SoaLayout`
for that slab's blocks; the kernels find a row's slab through a small device table of slab
pointers. Loading streams AoS chunks through one pinned host buffer and one device staging
buffer (both <= ``chunk_bytes``) and repacks them on the GPU straight into the slabs, so no
full AoS copy ever exists; relayout converts one slab at a time (one slab of scratch).

Dispatch (``plan``; documented in docs/KERNELS.md, one row per case)::

    precision  decode_mmq  N              kernel                 numerics
    EXACT      any         any            cuda.exact             f32 FMAs, exact weights
    F16        on          <= F16_TILE_N  cuda.mma_f16           f16 MMA, f32 accumulate
    F16        on          >  F16_TILE_N  cuda.cublas_f16        f16 dequant tiles + cuBLAS
    F16        off         any            cuda.cublas_f16
    Q8_1       on          any            cuda.mmq_q8_1          q8_1 x int8 MMA (llama.cpp)
    Q8_1       off         -              refused (FailedPrecondition)
    AUTO       on          <= AUTO_EXACT_N  cuda.exact
    AUTO       on          <= F16_TILE_N  cuda.mma_f16 (small weights, rows*K <= SMALL_WEIGHT:
                                          N in SMALL_EXACT_N cuda.exact, N above cublas_f16)
    AUTO       on          larger         cuda.cublas_f16
    AUTO       off         <= 8           cuda.exact, else cuda.cublas_f16

The shape-aware rows need the weight's shape (``matmul`` passes it; ``plan(n, ...)`` without
``rows``/``k`` answers for a large weight).

Kernel names carry the layout (``cuda.mma_f16.soa``); the AoS twins run the same code with
the AoS address arithmetic and give bit-identical results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import q6k
from .api import (
    BFLOAT16,
    AosChunks,
    Backend,
    KernelFlags,
    KernelTiming,
    Layout,
    MatmulResult,
    MemoryInfo,
    Precision,
    ResidentWeight,
    check_activations,
    refuse_q8_1_without_mmq,
)
from .errors import DeviceError, FormatError, Unavailable

SLAB_BYTES = 64 << 20  # resident slab size (whole rows): bounds relayout scratch
POOL_ROUND = 512  # CuPy's pool rounds every allocation up to this
F16_TILE_N = 256  # above: dequantized f16 tiles + cuBLAS beat re-reading Q6_K per 64 tokens
AUTO_EXACT_N = 0  # AUTO uses the exact kernel up to this N (0: the f16 tile is faster)
# Small weights (rows*K <= SMALL_WEIGHT; measured on 512x3584, bench/RESULTS.md): the f16 tile
# has too few row tiles to fill the GPU, so AUTO runs the exact kernel for N in SMALL_EXACT_N
# (10.6/12.2/15.6 us vs 12.2/18.9/29.5 us at N = 8/16/32) and cuBLAS above it (18.4 us vs exact
# 21.1 us at N = 64; the 48 boundary is interpolated, not measured).
SMALL_WEIGHT = 1 << 21
SMALL_EXACT_N = (8, 48)
CUBLAS_TILE_BYTES = 64 << 20  # f16 scratch per cuBLAS tile
MATMUL_FILE = "q6k_matmul.cu"
REPACK_FILE = "q6k_repack.cu"
DEFAULT_FLAGS = KernelFlags()
IN_TYPES = {np.dtype(np.float32): "InF32", np.dtype(np.float16): "InF16", BFLOAT16: "InBF16"}


def _round(n: int) -> int:
    return -(-n // POOL_ROUND) * POOL_ROUND


def slab_rows(rows: int, k: int) -> int:
    return max(1, SLAB_BYTES // q6k.aos_nbytes(1, k))


def _slab_nbytes(rows: int, k: int, layout: Layout) -> int:
    nb = rows * q6k.check_k(k)
    return q6k.SoaLayout.for_blocks(nb).nbytes if layout is Layout.SOA else nb * q6k.BLOCK_BYTES


@dataclass(frozen=True)
class Cfg:
    """Launch shape of one tile kernel (the bench overrides it to compare variants)."""

    nt: int = 1  # n-tiles of 8 tokens per CTA (mma/mmq) or tokens per CTA (exact)
    mt: int = 1  # m-tiles of 16 rows per warp
    warps: int = 8  # warps per CTA (row-split: each warp its own rows)
    src: int = 2  # activations: 0 read in the loop, 1 f16 prepass buffer, 2 staged in smem,
    #               3 prepass buffer streamed through two smem stages (cp.async)
    pf: bool = False  # prefetch the next block's weights (double buffer in registers)
    ksplit: int = 0  # CTAs along K (0: choose from the occupancy and grid size)


def default_cfg(path: str, n: int, rows: int = 0, sm_count: int = 0) -> Cfg:
    """The launch shape a call of ``n`` tokens gets (measured choices: bench/RESULTS.md).

    ``rows``/``sm_count`` (the weight and the device) pick 32-row warps for 9..64 tokens when
    the 128-row tiles alone fill the GPU (no K split): one activation fragment then feeds two
    m-tiles (H200 lm-head: 1.50x at N=16, 1.08x at N=64; slower on 4096-row weights)."""
    if path == "exact":
        return Cfg(nt=1 if n == 1 else 2 if n == 2 else 4, pf=n <= 2)
    if path == "mmq_q8_1":
        return Cfg(nt=1 if n <= 8 else 2 if n <= 16 else 4 if n <= 32 else 8)
    if n <= 8:
        return Cfg(nt=1)
    if sm_count and rows >= 128 * sm_count:
        return Cfg(nt=2 if n <= 16 else 4 if n <= 32 else 8, mt=2, src=3, warps=4)
    if n <= 16:
        return Cfg(nt=2, src=1)
    if n <= 32:  # cp.async-staged prepass + prefetch: 7-15% faster than the L1 reads (H200)
        return Cfg(nt=4, src=3, pf=True)
    return Cfg(nt=8, src=3, pf=True)


SMEM_LIMIT = 47 << 10  # staged activations per CTA: 48 KiB (no opt-in) minus static smem


def smem_bytes(path: str, cfg: Cfg, per: int) -> int:
    """Shared memory of one CTA that owns ``per`` K blocks."""
    if path == "mma_f16" and cfg.src == 3:
        return 2 * cfg.nt * 256 * 16
    if cfg.src != 2:
        return 0
    if path == "exact":
        return cfg.nt * per * 1024
    if path == "mma_f16":
        return 8 * cfg.nt * (per * 32 + 4) * 16
    return 0


@dataclass(frozen=True)
class _Launch:
    """Everything a tile-kernel call needs besides its buffers (cached per call shape)."""

    fn: Any
    grid: tuple[int, int, int]
    threads: int
    smem: int
    ks: int  # K splits (partial sums when > 1)
    tickets: int  # split-K ticket counters
    bpr: int
    nz: int  # token chunks
    prep: Any  # activation prepass kernel (f16 fragments or q8_1), or None
    prep_grid: tuple[int]
    prep_sizes: tuple[int, int, int]  # prepass buffer elements


@dataclass
class CudaWeight:
    slabs: list[Any]  # cupy uint8 arrays
    table: Any  # cupy uint64 [n_slabs] of slab pointers
    rps: int


class CudaBackend(Backend):
    """Q6_K matmuls on one CUDA device through CuPy; see the module docstring."""

    name = "cuda"

    def __init__(self, device: int = 0) -> None:
        try:
            import cupy
        except ImportError as e:
            raise Unavailable(f"the CUDA backend needs CuPy (pip install q6serve[cuda12] or "
                              f"[cuda13]); importing it failed: {e}") from None
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # no driver, no device
            raise Unavailable(f"the CUDA backend found no usable GPU: {e}") from None
        if not 0 <= device < count:
            raise Unavailable(f"CUDA device {device} asked for, {count} visible")
        self._cp = cupy
        self.device = device
        self._dev = cupy.cuda.Device(device)
        with self._dev:
            props = cupy.cuda.runtime.getDeviceProperties(device)
            self._name = props["name"].decode() if isinstance(props["name"], bytes) else str(
                props["name"])
            self.sm_count = int(props["multiProcessorCount"])
            rt = cupy.cuda.runtime
            self.smem_sm = int(props.get("sharedMemPerMultiprocessor") or rt.deviceGetAttribute(
                81, device))  # cudaDevAttrMaxSharedMemoryPerMultiprocessor
            self.cc = self._dev.compute_capability
            self._stream = cupy.cuda.Stream(non_blocking=True)
            self._pool = cupy.get_default_memory_pool()
            self._tickets = cupy.zeros(1024, dtype=cupy.uint32)
        self._fns: dict[str, Any] = {}
        self._grids: dict[tuple, tuple[int, int, int]] = {}  # launch grids by shape and N
        self._launches: dict[tuple, _Launch] = {}  # launch plans by call shape

    @property
    def stream(self) -> Any:
        """The CuPy stream every call of this backend is enqueued on."""
        return self._stream

    # -- kernels ------------------------------------------------------------------------------
    def _fn(self, file: str, name: str) -> Any:
        fn = self._fns.get(name)
        if fn is None:
            from .cuda import loader

            names = () if "<" not in name else (name,)
            fn = loader.load(file, names, self.device).function(name)
            self._fns[name] = fn
        return fn

    def _launch(self, file: str, name: str, grid: tuple[int, ...], block: int,
                args: tuple) -> None:
        self._fn(file, name)(grid, (block,), args)

    def _tickets_for(self, n: int) -> Any:
        if self._tickets.size < n:
            self._tickets = self._cp.zeros(max(n, 2 * self._tickets.size), self._cp.uint32)
        return self._tickets

    # -- memory -------------------------------------------------------------------------------
    def device_name(self) -> str:
        return f"{self._name} (cuda:{self.device}, sm_{self.cc}, {self.sm_count} SMs)"

    def memory(self) -> MemoryInfo:
        with self._dev:
            free, total = self._cp.cuda.runtime.memGetInfo()
        return MemoryInfo(free=int(free), total=int(total), pool_used=self._pool.used_bytes(),
                          pool_total=self._pool.total_bytes())

    def _slab_plan(self, rows: int, k: int) -> list[tuple[int, int]]:
        per = slab_rows(rows, k)
        return [(r0, min(rows, r0 + per)) for r0 in range(0, rows, per)]

    def weight_nbytes(self, rows: int, k: int, layout: Layout) -> int:
        plan = self._slab_plan(rows, k)
        return sum(_round(_slab_nbytes(r1 - r0, k, layout)) for r0, r1 in plan) + _round(
            8 * len(plan))

    @staticmethod
    def _staging_rows(rows: int, k: int, chunk_bytes: int) -> int:
        return max(1, min(rows, chunk_bytes // q6k.aos_nbytes(1, k)))

    def load_scratch_nbytes(self, rows: int, k: int, chunk_bytes: int) -> int:
        """Device staging for one chunk (the pinned host buffer is not VRAM)."""
        return _round(self._staging_rows(rows, k, chunk_bytes) * q6k.aos_nbytes(1, k))

    # -- weights ------------------------------------------------------------------------------
    def _repack(self, src: Any, src_layout: Layout, src_nb: int, src_b0: int, dst: Any,
                dst_layout: Layout, dst_nb: int, dst_b0: int, count: int) -> None:
        total = count * q6k.BLOCK_BYTES
        grid = min(65535 * 4, -(-total // 256))
        u64 = np.uint64
        self._launch(REPACK_FILE, "q6k_repack", (grid,), 256, (
            src, np.int32(src_layout is Layout.SOA), u64(src_nb), u64(src_b0),
            dst, np.int32(dst_layout is Layout.SOA), u64(dst_nb), u64(dst_b0), u64(count)))

    def _table(self, slabs: list[Any]) -> Any:
        # On this backend's device whatever the caller's current device is: a table left on
        # device 0 made every kernel on device 1 read a foreign pointer (illegal address).
        with self._dev:
            return self._cp.asarray(np.array([s.data.ptr for s in slabs], dtype=np.uint64))

    def load(self, chunks: AosChunks, rows: int, k: int, layout: Layout,
             chunk_bytes: int = 64 << 20) -> ResidentWeight:
        cp = self._cp
        per_row = q6k.check_k(k)
        row_bytes = per_row * q6k.BLOCK_BYTES
        plan = self._slab_plan(rows, k)
        srows = self._staging_rows(rows, k, chunk_bytes)
        slabs: list[Any] = []
        with self._dev, self._stream:
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
                        staging[:nbytes].set(host[:nbytes], stream=self._stream)
                        self._scatter(staging, row + p0, row + p1, plan, slabs, k, layout)
                        self._stream.synchronize()  # the pinned buffer is reused next
                    row += n_rows
                if row != rows:
                    raise FormatError(f"weight {rows}x{k} got {row} rows of data")
            except BaseException:
                slabs.clear()
                raise
            finally:
                del staging
        data = CudaWeight(slabs, self._table(slabs), slab_rows(rows, k))
        return ResidentWeight(rows, k, layout, self.weight_nbytes(rows, k, layout), data)

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
                slabs.append(self._cp.empty(_slab_nbytes(b - a, k, layout), self._cp.uint8))
            self._repack(staging, Layout.AOS, 0, (lo - r0) * per_row, slabs[s], layout,
                         (s1 - s0) * per_row, (lo - s0) * per_row, (hi - lo) * per_row)

    def relayout(self, w: ResidentWeight, layout: Layout,
                 chunk_bytes: int = 64 << 20) -> ResidentWeight:
        """One slab of scratch at a time: new slab, convert, drop the old one."""
        if w.layout is layout:
            return w
        cw: CudaWeight = self._data(w)
        per_row = w.k // q6k.QK_K
        with self._dev, self._stream:
            for s, (s0, s1) in enumerate(self._slab_plan(w.rows, w.k)):
                nb = (s1 - s0) * per_row
                new = self._cp.empty(_slab_nbytes(s1 - s0, w.k, layout), self._cp.uint8)
                self._repack(cw.slabs[s], w.layout, nb, 0, new, layout, nb, 0, nb)
                self._stream.synchronize()
                cw.slabs[s] = new  # the old slab returns to the pool for the next one
            cw.table = self._table(cw.slabs)
        out = ResidentWeight(w.rows, w.k, layout, self.weight_nbytes(w.rows, w.k, layout), cw)
        w.data = None
        return out

    def free(self, w: ResidentWeight) -> None:
        w.data = None

    @staticmethod
    def _data(w: ResidentWeight) -> CudaWeight:
        if not isinstance(w.data, CudaWeight):
            raise FormatError("weight was freed or does not belong to the CUDA backend")
        return w.data

    def read_aos(self, w: ResidentWeight) -> np.ndarray:
        cw = self._data(w)
        per_row = w.k // q6k.QK_K
        parts = []
        with self._dev, self._stream:
            for s, (s0, s1) in enumerate(self._slab_plan(w.rows, w.k)):
                nb = (s1 - s0) * per_row
                if w.layout is Layout.AOS:
                    parts.append(cw.slabs[s].get(stream=self._stream))
                    continue
                out = self._cp.empty(nb * q6k.BLOCK_BYTES, self._cp.uint8)
                self._repack(cw.slabs[s], Layout.SOA, nb, 0, out, Layout.AOS, nb, 0, nb)
                parts.append(out.get(stream=self._stream))
        return np.concatenate(parts).reshape(-1, q6k.BLOCK_BYTES)

    # -- dispatch -----------------------------------------------------------------------------
    def plan(self, n: int, precision: Precision, flags: KernelFlags, rows: int = 0,
             k: int = 0) -> tuple[str, Precision]:
        path, prec = self._path(n, precision, flags, rows, k)
        return f"cuda.{path}.{flags.layout.value}", prec

    @staticmethod
    def _path(n: int, precision: Precision, flags: KernelFlags, rows: int = 0,
              k: int = 0) -> tuple[str, Precision]:
        refuse_q8_1_without_mmq(precision, flags)
        if precision is Precision.EXACT:
            return "exact", Precision.EXACT
        if precision is Precision.Q8_1:
            return "mmq_q8_1", Precision.Q8_1
        if precision is Precision.F16:
            if flags.decode_mmq and n <= F16_TILE_N:
                return "mma_f16", Precision.F16
            return "cublas_f16", Precision.F16
        if flags.decode_mmq:  # AUTO
            if n <= AUTO_EXACT_N:
                return "exact", Precision.EXACT
            if 0 < rows * k <= SMALL_WEIGHT and n >= SMALL_EXACT_N[0]:
                if n <= SMALL_EXACT_N[1]:
                    return "exact", Precision.EXACT
                return "cublas_f16", Precision.F16
            if n <= F16_TILE_N:
                return "mma_f16", Precision.F16
            return "cublas_f16", Precision.F16
        return ("exact", Precision.EXACT) if n <= 8 else ("cublas_f16", Precision.F16)

    # -- matmul -------------------------------------------------------------------------------
    def matmul(self, w: ResidentWeight, x: np.ndarray, *, precision: Precision = Precision.AUTO,
               flags: KernelFlags = DEFAULT_FLAGS, out_dtype: np.dtype | None = None,
               topk: int = 0) -> MatmulResult:
        x = check_activations(x, w.k)
        path, prec = self._path(x.shape[0], precision, flags, w.rows, w.k)
        cp = self._cp
        with self._dev, self._stream:
            xd = cp.asarray(x.view(np.uint16) if x.dtype == BFLOAT16 else x)
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(self._stream)
            y = self._run(w, xd, x.dtype, path)  # already on the device and stream
            end.record(self._stream)
            if topk:  # the epilogue on the device, then only its result is downloaded
                from .cuda_topk import topk_on_device

                return MatmulResult(None, f"cuda.{path}.{w.layout.value}", w.layout, prec,
                                    KernelTiming(_events=(start, end)),
                                    topk=topk_on_device(cp, y, topk, self._stream))
            if out_dtype is not None and np.dtype(out_dtype) == np.float16:
                y = y.astype(cp.float16)
            host = y.get(stream=self._stream)
        if out_dtype is not None and np.dtype(out_dtype) == BFLOAT16:
            host = host.astype(BFLOAT16)
        return MatmulResult(host, f"cuda.{path}.{w.layout.value}", w.layout, prec,
                            KernelTiming(_events=(start, end)))

    def run(self, w: ResidentWeight, xd: Any, dtype: np.dtype, path: str,
            cfg: Cfg | None = None) -> Any:
        """Device-side matmul: ``xd`` [N, K] on the device (bf16 as uint16 bits) -> f32 y.

        Enqueues on the backend's stream and returns without synchronizing.
        """
        with self._dev, self._stream:
            return self._run(w, xd, dtype, path, cfg)

    def _run(self, w: ResidentWeight, xd: Any, dtype: np.dtype, path: str,
             cfg: Cfg | None = None) -> Any:
        cw = self._data(w)
        n = int(xd.shape[0])
        cfg = cfg or default_cfg(path, n, w.rows, self.sm_count)
        in_t = IN_TYPES.get(np.dtype(dtype))
        if in_t is None:
            raise FormatError(f"unsupported activation dtype {dtype}")
        y = self._cp.empty((n, w.rows), self._cp.float32)
        if path == "cublas_f16":
            self._cublas(w, cw, xd, in_t, y)
        elif path in ("exact", "mma_f16", "mmq_q8_1"):
            self._tile(w, cw, xd, in_t, y, path, cfg)
        else:
            raise DeviceError(f"unknown kernel path {path!r}")
        return y

    def _grid(self, w: ResidentWeight, rows_cta: int, nz: int, cfg: Cfg, fn: Any, n: int,
              path: str) -> tuple[int, int, int]:
        """(row tiles, K splits, token chunks): the split that finishes in the fewest
        block-steps per SM given the kernel's occupancy (registers, shared memory), charging
        split-K's partial sums. Depends only on the SoA twin, so both layouts sum alike."""
        key = (w.rows, w.k, rows_cta, nz, cfg, n, path)
        hit = self._grids.get(key)
        if hit is not None:
            return hit
        gx = -(-w.rows // rows_cta)
        bpr = w.k // q6k.QK_K
        threads = 32 * cfg.warps
        regs = -(-max(int(fn.num_regs), 1) // 8) * 8
        occ_regs = max(1, min(2048 // threads, 65536 // (threads * regs)))
        best: tuple[float, int] | None = None
        choices = [cfg.ksplit] if cfg.ksplit > 0 else range(1, min(bpr, 64) + 1)
        for ks in choices:
            per = -(-bpr // min(ks, bpr))
            ks_eff = -(-bpr // per)
            smem = smem_bytes(path, cfg, per)
            if smem > SMEM_LIMIT and cfg.src == 2 and cfg.ksplit <= 0:
                continue
            occ = min(occ_regs, self.smem_sm // (smem + 1024)) if smem else occ_regs
            slots = self.sm_count * max(1, occ)
            waves = -(-(gx * nz * ks_eff) // slots)
            extra = 0.0 if ks_eff == 1 else ks_eff * n * w.rows * 8 / (w.rows * bpr * 210)
            cost = waves * per * (1 + extra)
            if best is None or cost < best[0] - 1e-9:
                best = (cost, ks_eff)
        if best is None:
            raise DeviceError(f"no K split fits {path} {cfg} in shared memory")
        if len(self._grids) > 4096:
            self._grids.clear()
        self._grids[key] = (gx, best[1], nz)
        return gx, best[1], nz

    def _tile(self, w: ResidentWeight, cw: CudaWeight, xd: Any, in_t: str, y: Any, path: str,
              cfg: Cfg) -> None:
        """One tile-kernel call: the launch plan is cached per (path, cfg, N, shape, layout,
        dtype), so a repeated call only allocates its buffers and launches."""
        cp = self._cp
        n = int(xd.shape[0])
        key = (path, cfg, n, w.rows, w.k, w.layout, in_t)
        lp = self._launches.get(key)
        if lp is None:
            lp = self._plan_launch(w, in_t, path, cfg, n)
            if len(self._launches) > 4096:
                self._launches.clear()
            self._launches[key] = lp
        part = cp.empty((lp.ks, n, w.rows), cp.float32) if lp.ks > 1 else None
        tickets = self._tickets_for(lp.tickets)
        wargs = (cw.table, np.int32(w.rows), np.int32(lp.bpr), np.int32(cw.rps))
        oargs = (y, part if part is not None else np.uint64(0), tickets, np.int32(n))
        if lp.prep is None:
            xp: Any = np.uint64(0)
        elif path == "mma_f16":
            xp = cp.empty(lp.prep_sizes[0], cp.uint32)
            lp.prep(lp.prep_grid, (256,), (xd, np.int32(n), np.int32(w.k), np.int32(lp.nz), xp))
        else:  # mmq_q8_1: quantize to q8_1 in fragment order, then the int8 tile
            xq = cp.empty(lp.prep_sizes[0], cp.uint32)
            corr = cp.empty(lp.prep_sizes[1], cp.int32)
            d8 = cp.empty(lp.prep_sizes[2], cp.float32)
            lp.prep(lp.prep_grid, (256,), (xd, np.int32(n), np.int32(w.k), np.int32(lp.nz), xq,
                                           corr, d8))
            lp.fn(lp.grid, (lp.threads,), (*wargs, xq, corr, d8, *oargs))
            return
        if path == "exact":
            lp.fn(lp.grid, (lp.threads,), (*wargs, xd, np.int32(w.k), *oargs),
                  shared_mem=lp.smem)
            return
        lp.fn(lp.grid, (lp.threads,), (*wargs, xd, np.int32(w.k), xp, *oargs),
              shared_mem=lp.smem)

    def _plan_launch(self, w: ResidentWeight, in_t: str, path: str, cfg: Cfg,
                     n: int) -> _Launch:
        bpr = w.k // q6k.QK_K
        soa = "true" if w.layout is Layout.SOA else "false"
        warps = cfg.warps
        tok_per_cta = cfg.nt if path == "exact" else 8 * cfg.nt
        nz = -(-n // tok_per_cta)
        rows_cta = warps * 16 * (1 if path == "exact" else cfg.mt)
        pf = "true" if cfg.pf else "false"

        def kname(lay: str) -> str:
            if path == "exact":
                sm = "true" if cfg.src == 2 else "false"
                return f"q6k_exact<{cfg.nt}, {lay}, {in_t}, {pf}, {sm}>"
            if path == "mma_f16":
                t_in = "InF16" if cfg.src in (1, 3) else in_t  # it reads only the prepass
                return f"q6k_mma_f16<{cfg.nt}, {cfg.mt}, {lay}, {cfg.src}, {t_in}, {pf}>"
            return f"q6k_mmq_q8<{cfg.nt}, {cfg.mt}, {lay}>"

        fn = self._fn(MATMUL_FILE, kname(soa))
        gx, ks, _ = self._grid(w, rows_cta, nz, cfg, self._fn(MATMUL_FILE, kname("true")), n,
                               path)
        per = -(-bpr // ks)
        smem = smem_bytes(path, cfg, per)
        if smem > SMEM_LIMIT and int(fn.max_dynamic_shared_size_bytes) < smem:
            fn.max_dynamic_shared_size_bytes = smem
        prep, prep_grid, sizes = None, (1,), (0, 0, 0)
        if path == "mma_f16" and cfg.src in (1, 3):
            words = nz * bpr * cfg.nt * 8 * 32 * 4
            prep = self._fn(MATMUL_FILE, f"q6k_prep_f16<{cfg.nt}, {in_t}>")
            prep_grid, sizes = (min(65535, -(-(words // 4) // 256)),), (words, 0, 0)
        elif path == "mmq_q8_1":
            nt = cfg.nt
            total = nz * bpr * nt * 64
            prep = self._fn(MATMUL_FILE, f"q6k_prep_q8_1<{nt}, {in_t}>")
            prep_grid = (min(65535, -(-total // 256)),)
            sizes = (nz * bpr * nt * 4 * 32 * 4, nz * bpr * nt * 16 * 8, nz * bpr * nt * 8 * 8)
        return _Launch(fn, (gx, ks, nz), 32 * warps, smem, ks, gx * nz, bpr, nz, prep,
                       prep_grid, sizes)

    def _cublas(self, w: ResidentWeight, cw: CudaWeight, xd: Any, in_t: str, y: Any) -> None:
        cp = self._cp
        from cupy_backends.cuda.libs import cublas

        n = int(xd.shape[0])
        if in_t == "InF16":
            x16 = xd
        elif in_t == "InF32":
            x16 = xd.astype(cp.float16)
        else:  # bf16 bits -> f32 (exact) -> f16
            x16 = (xd.astype(cp.uint32) << 16).view(cp.float32).astype(cp.float16)
        x16 = cp.ascontiguousarray(x16)
        soa = "true" if w.layout is Layout.SOA else "false"
        tile_rows = max(16, min(w.rows, CUBLAS_TILE_BYTES // (2 * w.k)))
        w16 = cp.empty((tile_rows, w.k), cp.float16)
        handle = cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, self._stream.ptr)
        one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)
        bpr = w.k // q6k.QK_K
        for r0 in range(0, w.rows, tile_rows):
            rt = min(tile_rows, w.rows - r0)
            total = rt * bpr * 4
            self._launch(MATMUL_FILE, f"q6k_dequant_f16<{soa}>",
                         (min(65535 * 8, -(-total // 256)),), 256,
                         (cw.table, np.int32(w.rows), np.int32(bpr), np.int32(cw.rps),
                          np.int32(r0), np.int32(rt), w16))
            # column-major: C[rt, n] (ldc = rows) = W16[rt, K] (op T of [K, rt]) . X16[K, n]
            cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, rt, n, w.k,
                          one.ctypes.data, w16.data.ptr, _CUDA_R_16F, w.k,
                          x16.data.ptr, _CUDA_R_16F, w.k,
                          zero.ctypes.data, y.data.ptr + 4 * r0, _CUDA_R_32F, w.rows,
                          _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)


_CUDA_R_16F = 2
_CUDA_R_32F = 0
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1

