"""The K-slice grid model (kernels/cuda/launch.py ``Launcher.ks_grid``) without a device: an
H200-like context (132 SMs, 228 KiB of shared memory per SM) and a kernel of 128 registers.
The per-tile charge (``KS_TILE_BLOCKS``) keeps the model from cutting a 16-block K into one-
block slices (14336x4096 at N = 4: 16 slices ran 27.0 us, 2-4 slices 23.7-24.3, H200 session
10), and leaves the long-K shapes' picks where the sweep measured them best."""

from __future__ import annotations

from types import SimpleNamespace

from q6serve.kernels.cuda import launch as lm
from q6serve.kernels.cuda.dispatch import Cfg


def _launcher(charge: float) -> lm.Launcher:
    ctx = SimpleNamespace(sm_count=132, smem_sm=228 << 10, cc="90")
    la = lm.Launcher(ctx)
    la.ks_tile_blocks = charge
    return la


FN = SimpleNamespace(num_regs=128)
CFG = Cfg(nt=1, src=4, pf=True)  # the 8-token K-slice tile, 8 warps


def test_tile_charge_keeps_short_k_from_one_block_slices():
    rows, k = 14336, 4096
    _, ks_old, _ = _launcher(0.0).ks_grid(rows, k, 1, CFG, FN, 4)
    _, ks_new, _ = _launcher(lm.KS_TILE_BLOCKS).ks_grid(rows, k, 1, CFG, FN, 4)
    assert ks_old == 16  # what the sweep measured slowest
    assert 2 <= ks_new <= 8, ks_new


def test_charge_is_part_of_the_cache_key():
    la = _launcher(0.0)
    first = la.ks_grid(14336, 4096, 1, CFG, FN, 4)
    la.ks_tile_blocks = lm.KS_TILE_BLOCKS
    assert la.ks_grid(14336, 4096, 1, CFG, FN, 4) != first

