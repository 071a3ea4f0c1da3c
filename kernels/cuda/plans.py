"""A call's launch plan, by host arithmetic only (tests build every plan without a device):
the kernel's name and source file for a tile path and launch shape, its shared memory, the grid
with its K split (:meth:`Planner.grid`, :meth:`Planner.ks_grid`), the row chunks and token
halves of a large call (:meth:`Planner.chunks_for`, :meth:`Planner.row_chunks`,
:meth:`Planner.token_parts`), the :class:`LaunchPlan` record and the :class:`Step` launches a
plan becomes on a workspace's pointers (:meth:`Planner.steps`).

:class:`Planner` is one of the parts ``launcher.Launcher`` is made of (its methods are the
launcher's); kernels/cuda_backend.py, bench/kernels.py and the tests call them through a
launcher. The thresholds it reads are kernels/cuda/launch.py's, read there per call."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .. import q6k
from ..api import Layout, ResidentWeight
from ..errors import DeviceError
from . import launch
from .dispatch import Cfg
from .driver import clusters_fit, launch_pdl
from .loader import arch_specific
from .storage import CudaWeight


def smem_bytes(path: str, cfg: Cfg, per: int) -> int:
    """Shared memory of one CTA that owns ``per`` K blocks."""
    if path == "mma_f16" and cfg.src in launch.WG_SRCS:  # wg_stage_x: 16 k16 steps of 8*nt x 16 f16
        return 8 * cfg.nt * per * 512
    if path == "mma_f16" and cfg.src in (4, 7):  # stage_x_f16: 8*nt rows of per*32+4 uint4
        # src 7: the cluster's partial sums, a float per row and token of the CTA
        sums = cfg.warps * 16 * cfg.mt * 8 * cfg.nt * 4 if cfg.src == 7 else 0
        return 8 * cfg.nt * (per * 32 + 4) * 16 + sums
    if path == "mma_f16" and cfg.src == 3:
        return 2 * cfg.nt * 256 * 16
    if cfg.src != 2:
        return 0
    if path == "exact":
        return cfg.nt * per * 1024
    if path == "mma_f16":
        return 8 * cfg.nt * (per * 32 + 4) * 16
    return 0


def kernel_name(path: str, cfg: Cfg, soa: bool | int, in_t: str) -> str:
    """The template instantiation of a tile path (``soa`` picks the address arithmetic: False
    AoS, True SoA, 2 SoA in pair-stream order)."""
    lay = "2" if soa == 2 else "true" if soa else "false"
    pf = "true" if cfg.pf else "false"
    if path == "exact":
        return f"q6k_exact<{cfg.nt}, {lay}, {in_t}, {pf}>"
    if path == "mma_f16" and cfg.src == 4:
        return f"q6k_ks_f16<{cfg.nt}, {cfg.mt}, {lay}, {in_t}, {pf}, {cfg.warps}>"
    if path == "mma_f16" and cfg.src == 7:
        return (f"q6k_ksc_f16<{cfg.nt}, {cfg.mt}, {lay}, {in_t}, {pf}, {cfg.warps}, "
                f"{cfg.ksplit}>")
    if path == "mma_f16" and cfg.src == 8:
        return f"q6k_wg_f16<{cfg.nt}, {lay}, {in_t}, {cfg.warps // 4}>"
    if path == "mma_f16":
        t_in = "InF16" if cfg.src == 3 else in_t  # it reads only the prepass
        return f"q6k_mma_f16<{cfg.nt}, {cfg.mt}, {lay}, {cfg.src}, {t_in}, {pf}>"
    if path == "mmq_q8_1":
        return f"q6k_mmq_q8<{cfg.nt}, {cfg.mt}, {lay}>"
    raise DeviceError(f"unknown tile path {path!r}")


def pair_cfg(path: str, cfg: Cfg) -> Cfg:
    """The launch shape a pair-stream weight runs for ``cfg``: the f16 tile's two m-tiles per
    warp (src 2/3) become one m-tile per warp, with twice the warps where the CTA allows (the
    same rows per CTA), else twice the CTAs along rows (Launcher.plan), on the SoA twin's K
    split, so the same sums per output: the two-m-tile pair decode of ``q6k_mma_f16`` takes
    minutes to build (117-147 s for one name, nvcc 13.0 sm_90 on the CI VM; 1-3 s at one
    m-tile, and for the K-slice tile at two)."""
    if path == "mma_f16" and cfg.mt > 1 and cfg.src in (2, 3):
        wide = cfg.warps * cfg.mt
        return replace(cfg, mt=1, warps=wide if wide <= 8 else cfg.warps)
    return cfg


def kernel_file(path: str, cfg: Cfg) -> str:
    """The source file that holds a tile path's kernel."""
    return launch.WG_FILE if path == "mma_f16" and cfg.src in launch.WG_SRCS else launch.MATMUL_FILE


def _k_splits(cfg: Cfg, bpr: int) -> Iterator[tuple[int, int]]:
    """The K splits a grid search weighs for a weight of ``bpr`` blocks a row: (blocks per
    slice, slices) for each asked count, 1 to 64 (no more than ``bpr``), or ``cfg.ksplit``
    alone where the cell forces one."""
    for ks in [cfg.ksplit] if cfg.ksplit > 0 else range(1, min(bpr, 64) + 1):
        per = -(-bpr // min(ks, bpr))
        yield per, -(-bpr // per)


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a tile-kernel call needs besides its buffers."""

    path: str
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
    post: Any = None  # K-slice tiles split along K: q6k_sum_parts adds the partial sums
    src: int = 2  # the launch shape's kernel family (Cfg.src; PDL_SRCS take PDL for the sum)


@dataclass(frozen=True)
class Step:
    """One kernel launch with its arguments bound (raw device pointers). ``pdl``: launched
    with programmatic stream serialization (:func:`launch_pdl`): its CTAs may start while the
    launch before it is still running, and the kernel waits for that one's results itself
    (``griddepcontrol.wait``)."""

    fn: Any
    grid: tuple[int, ...]
    block: int
    args: tuple
    smem: int = 0
    pdl: Any = None  # the driver's cuLaunchKernelEx (ctypes) when launched that way

    def __call__(self) -> None:
        if self.pdl is not None:
            launch_pdl(self.pdl, self.fn, self.grid, self.block, self.args, self.smem)
        else:
            self.fn(self.grid, (self.block,), self.args, shared_mem=self.smem)


class Planner:
    """The launcher's planning methods (host arithmetic; see the module docstring)."""

    def chunks_wanted(self, cw: CudaWeight | None = None) -> int:
        """Row chunks ``cw``'s large y is computed and downloaded in (<= 1: off)."""
        v = launch.Y_CHUNKS if self.y_chunks is None else self.y_chunks
        if v is None:
            return 0 if cw is None else cw.y_chunks
        return v

    def chunks_for(self, cw: CudaWeight, slot: int, ys: int | None = None,
                   xs: int = 0, n: int = 0) -> int:
        """The split of a launch in ``slot`` now: C > 1 row chunks (:meth:`chunks_wanted`),
        -2 token halves (``X_SPLIT_MIN``: an x of ``xs`` bytes or more, not row-chunked; or
        ``X_SPLIT_Y_MIN``: ``n`` tokens, 16 to ``X_SPLIT_MAX_N``, of an f32 y that large,
        before row chunks), -2 C token halves in C row chunks each (``X_SPLIT_ROWS``), 0
        none; none while another launch is in flight (``Y_CHUNKS_IDLE``). A y of ``ys``
        values (N x rows) under ``Y_CHUNK_MIN`` as f32 is never row-chunked, and with an x
        under ``X_SPLIT_MIN`` and a y under both the state is 0 with no look at the slots (a
        small call's cached BoundCall is keyed by it)."""
        rows = ys is None or 4 * ys >= launch.Y_CHUNK_MIN
        by_y = (bool(launch.X_SPLIT_Y_MIN) and ys is not None and 4 * ys >= launch.X_SPLIT_Y_MIN
                and 16 <= n <= launch.X_SPLIT_MAX_N)
        tokens = by_y or (bool(launch.X_SPLIT_MIN) and xs >= launch.X_SPLIT_MIN)
        if not rows and not tokens:
            return 0
        want = self.chunks_wanted(cw)
        v = want if rows and not by_y else 0
        if v <= 1:  # token halves: -2, or in C row chunks each (X_SPLIT_ROWS): -2 C
            v = (-2 * want if launch.X_SPLIT_ROWS and want > 1 and rows else -2) if tokens else 0
        if v and launch.Y_CHUNKS_IDLE and self.ws.busy(slot):
            return 0
        return v

    # -- planning (host arithmetic) ------------------------------------------------------------
    def grid(self, rows: int, k: int, rows_cta: int, nz: int, cfg: Cfg, fn: Any, n: int,
             path: str) -> tuple[int, int, int]:
        """(row tiles, K splits, token chunks): the split that finishes in the fewest
        block-steps per SM given the kernel's occupancy (registers, shared memory), charging
        split-K's partial sums. Depends only on the SoA twin, so both layouts sum alike."""
        key = (rows, k, rows_cta, nz, cfg, n, path)
        hit = self._grids.get(key)
        if hit is not None:
            return hit
        gx = -(-rows // rows_cta)
        bpr = k // q6k.QK_K
        threads = 32 * cfg.warps
        regs = -(-max(int(fn.num_regs), 1) // 8) * 8
        occ_regs = max(1, min(2048 // threads, 65536 // (threads * regs)))
        best: tuple[float, int] | None = None
        for per, ks_eff in _k_splits(cfg, bpr):
            smem = smem_bytes(path, cfg, per)
            if smem > launch.KS_SMEM_MAX or (smem > launch.SMEM_LIMIT and cfg.src == 2
                                             and cfg.ksplit <= 0):
                continue  # (a forced split may opt in past 48 KiB, never past the device's max)
            occ = min(occ_regs, self.ctx.smem_sm // (smem + 1024)) if smem else occ_regs
            slots = self.ctx.sm_count * max(1, occ)
            waves = -(-(gx * nz * ks_eff) // slots)
            extra = 0.0 if ks_eff == 1 else ks_eff * n * rows * 8 / (rows * bpr * 210)
            cost = waves * per * (1 + extra)
            if best is None or cost < best[0] - 1e-9:
                best = (cost, ks_eff)
        if best is None:
            raise DeviceError(f"no K split fits {path} {cfg} in shared memory")
        if len(self._grids) > 4096:
            self._grids.clear()
        self._grids[key] = (gx, best[1], nz)
        return gx, best[1], nz

    def ks_grid(self, rows: int, k: int, nz: int, cfg: Cfg, fn: Any,
                n: int) -> tuple[int, int, int]:
        """(CTAs along rows, K slices, token chunks) of the K-slice tile: one wave of resident
        CTAs (registers and shared memory bound the occupancy). Per slice count ks, the
        cost of the busiest SM is its CTAs x (weight bytes + activation staging + partial
        sums written and re-read), divided by the fraction of ``KS_INFLIGHT`` its warps keep
        in flight (one block each with register prefetch); the cheapest wins, then fewer
        slices. SoA twin only, so both layouts cut and sum alike."""
        key = (rows, k, "ks", nz, cfg, n)
        hit = self._grids.get(key)
        if hit is not None:
            return hit
        bpr = k // q6k.QK_K
        sms = self.ctx.sm_count
        regs = -(-max(int(fn.num_regs), 1) // 8) * 8
        wpc = cfg.warps  # warps per CTA (K-slice tile 8/12/16, wgmma tile 4/8/12)
        occ_regs = max(1, min(64 // wpc, 65536 // (32 * wpc * regs)))
        wtiles = -(-rows // (16 * cfg.mt))
        toks = min(n, 8 * cfg.nt)
        best: tuple[float, int, int] | None = None
        for per, ks_eff in _k_splits(cfg, bpr):
            smem = smem_bytes("mma_f16", cfg, per)
            if smem > launch.KS_SMEM_MAX:
                continue
            occ = min(occ_regs, self.ctx.smem_sm // (smem + 1024))
            if occ < 1:
                continue
            gx = max(1, min(-(-wtiles // wpc), sms * occ // (ks_eff * nz)))
            rounds = -(-wtiles // (wpc * gx))
            gx = -(-wtiles // (wpc * rounds))  # as few CTAs as give the same rounds
            per_sm = -(-(gx * ks_eff * nz) // sms)
            wbytes = rounds * wpc * 16 * cfg.mt * per * 210
            xbytes = 8 * cfg.nt * per * 512 // 2  # L2 -> smem once, half a weight byte each
            # partial sums written, re-read by q6k_sum_parts, and that launch (~2 us of an SM)
            pbytes = 0 if ks_eff == 1 else 2 * rounds * wpc * 16 * cfg.mt * toks * 4 + (64 << 10)
            # blocks in flight per warp
            ahead = 1 if cfg.pf or cfg.src in launch.WG_SRCS else 0.5  # (wgmma: always one ahead)
            inflight = min(occ, per_sm) * wpc * ahead * 16 * cfg.mt * 210
            cost = per_sm * (wbytes + xbytes + pbytes) / min(1.0, inflight / launch.KS_INFLIGHT)
            if best is None or cost < best[0] * (1 - 1e-9):
                best = (cost, ks_eff, gx)
        if best is None:
            raise DeviceError(f"no K slice of mma_f16 {cfg.label()} fits shared memory (K={k})")
        if len(self._grids) > 4096:
            self._grids.clear()
        self._grids[key] = (best[2], best[1], nz)
        return best[2], best[1], nz

    def tile_cfg(self, path: str, cfg: Cfg) -> Cfg:
        """The launch shape a plan of ``cfg`` runs on this device."""
        if path == "mma_f16" and cfg.src in launch.WG_SRCS and arch_specific(launch.WG_FILE,
                                                                        self.ctx.cc) is None:
            # the wgmma tile builds for sm_90a only: elsewhere a table entry naming it (the
            # committed table was tuned on an H200) runs the K-slice tile of the same width
            return Cfg(nt=cfg.nt, src=4, pf=True)
        if path == "mma_f16" and cfg.src == 7 and int(self.ctx.cc) < 90:
            return replace(cfg, src=4)  # no clusters before sm_90: the sum as its own launch
        return cfg

    def row_chunks(self, lp: LaunchPlan, rows: int, k: int, layout: Layout, in_t: str,
                   path: str, cfg: Cfg, n: int, rps: int, want: int, pairs: bool = False,
                   ) -> list[tuple[int, int, LaunchPlan]] | None:
        """The row chunks of a K-slice tile call (launch.py's docstring, point 8): [(r0, r1, plan)],
        at most ``want``, each a run of whole slabs of ``rps`` rows as close as they allow to
        one launch round of ``lp``'s grid (gx CTAs x warps x 16 rows), each planned with
        ``lp``'s K split and token chunks (the in-kernel K slices follow gridDim.y, so every
        value is the full call's). None where it does not apply: not a ``Y_CHUNK_SRCS`` tile,
        one slab, one round, or a chunk whose plan would split K otherwise. ``pairs``: the
        weight's (CudaWeight.pairs), as for ``plan``."""
        if want < 2 or lp.path != "mma_f16" or lp.src not in launch.Y_CHUNK_SRCS or rps >= rows:
            return None
        tc = self.tile_cfg(path, cfg)
        gx, ks, nz = lp.grid
        per_round = gx * tc.warps * 16 * tc.mt
        rounds = -(-rows // per_round)
        c = min(want, rounds)
        if c < 2:
            return None
        cuts = [0]
        for i in range(1, c):
            r = round(i * rounds / c) * per_round
            r = round(r / rps) * rps  # the nearest slab boundary
            if cuts[-1] < r < rows:
                cuts.append(r)
        cuts.append(rows)
        if len(cuts) < 3:
            return None
        forced = replace(cfg, ksplit=ks)
        out, total = [], 0
        for r0, r1 in itertools.pairwise(cuts):
            p = self.plan(r1 - r0, k, layout, in_t, path, forced, n, pairs)
            if p.grid[1] != ks or p.grid[2] != nz:
                return None
            total += -(-(r1 - r0) // (16 * tc.mt * tc.warps * p.grid[0]))  # its rounds
            out.append((r0, r1, p))
        # no more rounds than the full call's (a chunk past its round's rows would take two
        # rounds on fewer CTAs: slabs too coarse for this grid)
        return out if total <= rounds else None

    @staticmethod
    def part_cfg(cfg: Cfg, ks: int, m: int) -> Cfg:
        """The launch shape of a token part of ``m`` tokens of a ``cfg`` call split ``ks`` ways
        along K: that split, its tile narrowed to its tokens with ``X_SPLIT_FIT``."""
        c = replace(cfg, ksplit=ks)
        if launch.X_SPLIT_FIT and cfg.src == 4:
            c = replace(c, nt=min(cfg.nt, 1 << (-(-m // 8) - 1).bit_length()))
        return c

    def token_parts(self, lp: LaunchPlan, rows: int, k: int, layout: Layout, in_t: str,
                    path: str, cfg: Cfg, n: int, want: int, pairs: bool = False,
                    ) -> list[tuple[int, int, LaunchPlan]] | None:
        """The token parts of a K-slice tile call (launch.py's docstring, point 10): [(t0, t1,
        plan)], ``want`` runs of whole 8-token columns, each planned with ``lp``'s K split (so
        every value is the full call's: tokens are independent columns of the same sums), its
        tile narrowed to its tokens with ``X_SPLIT_FIT``. None where it does not apply: not an
        ``X_SPLIT_SRCS`` tile, fewer than two parts, or a part whose plan would split K
        otherwise. ``pairs``: as for ``plan``."""
        if want < 2 or lp.path != "mma_f16" or lp.src not in launch.X_SPLIT_SRCS:
            return None
        h = -(-n // (8 * want)) * 8
        cuts = [*range(0, n, h), n]
        if len(cuts) < 3:
            return None
        ks, out = lp.grid[1], []
        for t0, t1 in itertools.pairwise(cuts):
            p = self.plan(rows, k, layout, in_t, path, self.part_cfg(cfg, ks, t1 - t0),
                          t1 - t0, pairs)
            if p.grid[1] != ks:
                return None
            out.append((t0, t1, p))
        return out

    def plan(self, rows: int, k: int, layout: Layout, in_t: str, path: str, cfg: Cfg,
             n: int, pairs: bool = False) -> LaunchPlan:
        """``pairs``: the weight's SoA code planes are in pair-stream order (CudaWeight.pairs):
        the layout-2 instantiation on the SoA twin's grid (so the same results); a shape of
        two m-tiles per warp runs as one m-tile per warp with twice the warps (``pair_cfg``)."""
        bpr = k // q6k.QK_K
        tok_per_cta = cfg.nt if path == "exact" else 8 * cfg.nt
        nz = -(-n // tok_per_cta)
        rows_cta = cfg.warps * 16 * (1 if path == "exact" else cfg.mt)
        cfg = self.tile_cfg(path, cfg)
        file = kernel_file(path, cfg)
        run_cfg = pair_cfg(path, cfg) if pairs else cfg
        fn = self.ctx.fn(file, kernel_name(path, run_cfg, 2 if pairs else layout is Layout.SOA,
                                           in_t))
        soa_fn = self.ctx.fn(file, kernel_name(path, cfg, True, in_t))
        ks_tile = path == "mma_f16" and cfg.src in (4, 7, 8)
        if ks_tile:
            gx, ks, _ = self.ks_grid(rows, k, nz, cfg, soa_fn, n)
            if cfg.src == 7 and ks != cfg.ksplit:  # the cluster is the grid's ksplit slices
                raise DeviceError(f"mma_f16 {cfg.label()}: K={k} cuts into {ks} slices, "
                                  f"not {cfg.ksplit}")
        else:
            gx, ks, _ = self.grid(rows, k, rows_cta, nz, cfg, soa_fn, n, path)
            if run_cfg.warps * run_cfg.mt < cfg.warps * cfg.mt:  # pair_cfg: more CTAs
                gx = -(-rows // (run_cfg.warps * 16 * run_cfg.mt))
        smem = smem_bytes(path, cfg, -(-bpr // ks))
        for f in (fn, soa_fn):
            if smem > launch.SMEM_LIMIT and int(f.max_dynamic_shared_size_bytes) < smem:
                f.max_dynamic_shared_size_bytes = smem
        if ks_tile and cfg.src == 7 and not clusters_fit(fn, (gx, ks, nz), 32 * run_cfg.warps,
                                                         smem, gx * nz):
            # the clusters would not all co-reside: the plain K-slice tile at the same split
            # (the same sums in the same order, so the same bits)
            return self.plan(rows, k, layout, in_t, path, replace(cfg, src=4), n, pairs)
        prep, prep_grid, sizes = None, (1,), (0, 0, 0)
        if path == "mma_f16" and cfg.src == 3:
            words = nz * bpr * cfg.nt * 8 * 32 * 4
            prep = self.ctx.fn(launch.MATMUL_FILE, f"q6k_prep_f16<{cfg.nt}, {in_t}>")
            prep_grid, sizes = (min(65535, -(-(words // 4) // 256)),), (words, 0, 0)
        elif path == "mmq_q8_1":
            nt = cfg.nt
            total = nz * bpr * nt * 64
            prep = self.ctx.fn(launch.MATMUL_FILE, f"q6k_prep_q8_1<{nt}, {in_t}>")
            prep_grid = (min(65535, -(-total // 256)),)
            sizes = (nz * bpr * nt * 4 * 32 * 4, nz * bpr * nt * 16 * 8, nz * bpr * nt * 8 * 8)
        post = (self.ctx.fn(launch.MATMUL_FILE, "q6k_sum_parts") if ks_tile and ks > 1
                and cfg.src != 7 else None)
        return LaunchPlan(path, fn, (gx, ks, nz), 32 * run_cfg.warps, smem, ks, gx * nz, bpr,
                          nz, prep, prep_grid, sizes, post, cfg.src)

    def steps(self, lp: LaunchPlan, w: ResidentWeight, cw: CudaWeight, xd: int, y: int,
              n: int, r0: int = 0, r1: int | None = None) -> list[Step]:
        """The launches of one tile call, scratch from the workspace (call under the stream).
        ``r0``, ``r1``: a row chunk of whole slabs (:meth:`row_chunks`), its rows' own
        [N, r1 - r0] y at ``y``; the weight is the slab table's view from its first slab."""
        ws, u64, i32 = self.ws, np.uint64, np.int32
        rows = w.rows if r1 is None else r1 - r0
        table = int(cw.table.data.ptr) + 8 * (r0 // cw.rps)
        part = ws.ptr("part", lp.ks * n * rows * 4) if lp.ks > 1 else 0
        tickets = ws.ptr("tickets", 4 * max(lp.tickets, 1024), zero=True)
        wargs = (u64(table), i32(rows), i32(lp.bpr), i32(cw.rps))
        oargs = (u64(y), u64(part), u64(tickets), i32(n))
        pre = (u64(xd), i32(n), i32(w.k), i32(lp.nz))
        if lp.path == "exact":
            return [Step(lp.fn, lp.grid, lp.threads, (*wargs, u64(xd), i32(w.k), *oargs),
                         lp.smem)]
        if lp.path == "mma_f16":
            out, xp = [], 0
            if lp.prep is not None:
                xp = ws.ptr("xp", 4 * lp.prep_sizes[0])
                out.append(Step(lp.prep, lp.prep_grid, 256, (*pre, u64(xp))))
            out.append(Step(lp.fn, lp.grid, lp.threads,
                            (*wargs, u64(xd), i32(w.k), u64(xp), *oargs), lp.smem))
            if lp.post is not None:
                total = n * rows
                # a thread per four outputs where the sum reads and writes float4 (the kernel
                # also checks the pointers' alignment; its grid-stride loop covers any total)
                per = 4 if total >= launch.SUM_VEC_MIN and total % 4 == 0 else 1
                out.append(Step(lp.post, (min(-(-total // (256 * per)), 4096),), 256,
                                (u64(part), u64(y), i32(lp.ks), np.int64(total)),
                                pdl=self._pdl_launcher() if lp.src in launch.PDL_SRCS else None))
            return out
        xq = ws.ptr("xq", 4 * lp.prep_sizes[0])  # mmq_q8_1: quantize x, then the int8 tile
        corr = ws.ptr("corr", 4 * lp.prep_sizes[1])
        d8 = ws.ptr("d8", 4 * lp.prep_sizes[2])
        return [Step(lp.prep, lp.prep_grid, 256, (*pre, u64(xq), u64(corr), u64(d8))),
                Step(lp.fn, lp.grid, lp.threads, (*wargs, u64(xq), u64(corr), u64(d8), *oargs))]

    def _pdl_launcher(self) -> Any:
        """cuLaunchKernelEx when the split-K sum is to be launched with PDL (``pdl`` on, a
        device of compute capability 9.0 or newer, a driver that has it), else None."""
        if not self.pdl or int(self.ctx.cc) < 90:
            return None
        if self._launch_ex is None:
            self._launch_ex = launch._driver_launch_ex() or False
        return self._launch_ex or None
