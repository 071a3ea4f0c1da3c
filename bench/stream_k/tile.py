"""Host side of the stream-K tensor-core tile ``q6k_tile_f16`` (``q6k_tile.cu`` beside this file,
issue 16): a bench experiment, not in the dispatch (measured slower than the product kernels;
bench/RESULTS.md), launched only by ``bench/tile_probe.py``.

One place for its launch shapes, shared memory, grid and buffers, so the backend and
``bench/tile_probe.py`` launch it the same way. f16 activations (what the service receives)
are read by the tile itself (one launch); f32/bf16 ones first go through the f16 prepass
``q6k_prep_f16<NT, In>`` of ``q6k_matmul.cu`` (fragment order, one token chunk of 8*NT).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent  # loader.load(TILE_FILE, ..., root=HERE)
TILE_FILE = "q6k_tile.cu"
PREP_FILE = "q6k_matmul.cu"
THREADS = 256  # 8 warps (TileGeom::WARPS)
MAX_N = 64  # one token chunk of 8 n-tiles


@dataclass(frozen=True)
class TileCfg:
    """Launch shape: ``nt`` n-tiles of 8 tokens, ``mt`` m-tiles of 16 rows per warp,
    ``stages`` cp.async stages, ``minb`` CTAs per SM the registers are bounded for."""

    nt: int
    mt: int
    stages: int
    minb: int = 1

    @property
    def rows(self) -> int:
        """Rows of one tile (8 warps x 16 x mt)."""
        return 8 * 16 * self.mt

    @property
    def label(self) -> str:
        return f"tile.nt{self.nt}.m{self.mt}.s{self.stages}.b{self.minb}"


# Every instantiation q6k_tile.cu's nvcc check builds (keep the two lists in step).
CONFIGS = (
    TileCfg(2, 1, 4), TileCfg(2, 1, 3, 2), TileCfg(2, 2, 3),
    TileCfg(4, 1, 4), TileCfg(4, 1, 2, 2), TileCfg(4, 2, 3),
    TileCfg(8, 1, 3), TileCfg(8, 2, 2),
)


def nt_for(n: int) -> int:
    if not 1 <= n <= MAX_N:
        raise ValueError(f"q6k_tile_f16 takes 1..{MAX_N} tokens, got {n}")
    return 2 if n <= 16 else 4 if n <= 32 else 8


def default_cfg(n: int) -> TileCfg:
    """The launch shape of an ``n``-token call (bench/RESULTS.md, tile section)."""
    return {2: TileCfg(2, 1, 4), 4: TileCfg(4, 1, 4), 8: TileCfg(8, 1, 3)}[nt_for(n)]


def stage_bytes(cfg: TileCfg) -> int:
    """One stage (TileGeom): ql, qh, scales, d word and its half of the tile's rows for one
    256-block, and the block's activations."""
    return cfg.rows * (128 + 64 + 16 + 4 + 1) + cfg.nt * 8 * 32 * 16


def smem_bytes(cfg: TileCfg) -> int:
    return cfg.stages * stage_bytes(cfg)


def kernel_name(cfg: TileCfg, soa: bool, xh: bool) -> str:
    """``xh``: the kernel reads f16 activations itself (else the prepass buffer)."""
    b = {True: "true", False: "false"}
    return f"q6k_tile_f16<{cfg.nt}, {cfg.mt}, {cfg.stages}, {b[soa]}, {cfg.minb}, {b[xh]}>"


def names(in_types: tuple[str, ...] = ("InF32", "InF16", "InBF16")) -> tuple[str, ...]:
    """Every tile instantiation for activations of ``in_types`` (compile them in one go)."""
    xhs = sorted({t == "InF16" for t in in_types})
    return tuple(kernel_name(c, soa, xh) for c in CONFIGS for soa in (True, False) for xh in xhs)


@dataclass(frozen=True)
class TilePlan:
    """Everything a call needs besides its buffers (cache it per call shape)."""

    fn: Any
    prep: Any  # the f16 prepass, None for f16 activations
    grid: int  # CTAs: resident slots, at most the (row tile, K block) units
    smem: int
    tiles: int  # row tiles = ticket counters
    part_floats: int  # partial sums [grid][2][8*nt][rows of a tile]
    xp_words: int  # prepass buffer (u32)
    prep_grid: int
    nt: int
    bpr: int


def plan(get_fn: Callable[[str, str], Any], cfg: TileCfg, rows: int, k: int, n: int, soa: bool,
         in_t: str, sm_count: int, smem_sm: int) -> TilePlan:
    """Launch plan of ``cfg`` for a ``rows`` x ``k`` weight and ``n`` tokens.

    ``get_fn(file, name)`` returns a compiled function. The grid comes from the SoA twin's
    occupancy, so both layouts cut the work (and sum the partials) alike."""
    if n > 8 * cfg.nt:
        raise ValueError(f"{cfg.label} takes at most {8 * cfg.nt} tokens, got {n}")
    bpr = k // 256
    smem = smem_bytes(cfg)
    xh = in_t == "InF16"
    fn = get_fn(TILE_FILE, kernel_name(cfg, soa, xh))
    ref = get_fn(TILE_FILE, kernel_name(cfg, True, xh))
    for f in (fn, ref):
        if int(f.max_dynamic_shared_size_bytes) < smem:
            f.max_dynamic_shared_size_bytes = smem
    regs = -(-max(int(ref.num_regs), 1) // 8) * 8
    static = int(ref.shared_size_bytes)
    occ = max(1, min(cfg.minb, smem_sm // (smem + static + 1024), 65536 // (THREADS * regs)))
    tiles = -(-rows // cfg.rows)
    grid = max(1, min(sm_count * occ, tiles * bpr))
    prep = None if xh else get_fn(PREP_FILE, f"q6k_prep_f16<{cfg.nt}, {in_t}>")
    xp_words = 0 if xh else bpr * cfg.nt * 8 * 32 * 4
    return TilePlan(fn, prep, grid, smem, tiles, grid * 2 * 8 * cfg.nt * cfg.rows, xp_words,
                    min(65535, -(-(xp_words // 4) // 256)), cfg.nt, bpr)


def launch(p: TilePlan, table: Any, rows: int, rps: int, xd: Any, n: int, y: Any, xp: Any,
           part: Any, tickets: Any) -> None:
    """Enqueue the prepass (f32/bf16 activations) and the tile on the current stream. ``xd``
    C-contiguous [n][K] on the device (f16 rows start 16-byte aligned: K is a multiple of
    256); ``y`` f32 [n][rows]; ``xp`` >= ``p.xp_words`` u32 (unused for f16); ``part`` >=
    ``p.part_floats`` f32; ``tickets`` >= ``p.tiles`` zeroed u32 (the kernel leaves them zero)."""
    k = p.bpr * 256
    if p.prep is not None:
        p.prep((p.prep_grid,), (256,), (xd, np.int32(n), np.int32(k), np.int32(1), xp))
        xd = xp
    p.fn((p.grid,), (THREADS,), (table, np.int32(rows), np.int32(p.bpr), np.int32(rps), xd, y,
                                 part, tickets, np.int32(n)), shared_mem=p.smem)
