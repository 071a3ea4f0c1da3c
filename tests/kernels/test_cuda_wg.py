"""The wgmma tile ``q6k_wg_f16`` (mma_f16 launch shapes with ``src=6``, in
kernels/cuda/q6k_wgmma.cu, built for sm_90a) against the NumPy float64 reference (``-m gpu``;
skipped without CuPy, a GPU, or on a device that is not compute capability 9.0).

Its own risks beyond the K-slice tile's: the B tiles' shared-memory layout and descriptors
(every k16 step, both k halves, every 8-token group), 64-row warpgroup tiles over rows that
fill no whole tile, the accumulators rescaled across blocks while wgmma runs asynchronously
(blocks with d = 0 masked, scales of every magnitude), tokens past N zero-filled in the staging,
split-K partial sums; SoA/AoS twins and repeated calls bit-identical. Outputs and partial sums
are poisoned with NaN before each call.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_cuda_backend import _gpu_count, extreme_scale_weight, load, random_weight, rel_fro
from test_cuda_ks import (  # one call with NaN-poisoned outputs and partials, the sweeps
    _check,
    _run,
    check_activation_dtype,
    check_tiles_across_slabs,
    same_bits,
    sweep_slice_counts,
)

from q6serve.kernels import reference
from q6serve.kernels.api import BFLOAT16, Layout
from q6serve.kernels.cuda.dispatch import Cfg
from q6serve.kernels.cuda.launch import KS_SMEM_MAX, smem_bytes

pytestmark = [pytest.mark.gpu]
# 8 n-tiles (its one width since session 15) at one, two and three warpgroups per CTA
WG_CFGS = tuple(Cfg(nt=8, src=6, pf=True, warps=w) for w in (4, 8, 12))


@pytest.fixture(scope="module")
def be():
    if _gpu_count() == 0:
        pytest.skip("needs CuPy and a CUDA device")
    from q6serve.kernels.cuda.launch import IN_TYPES, WG_FILE, kernel_name
    from q6serve.kernels.cuda_backend import CudaBackend

    b = CudaBackend(0)
    if b.ctx.cc != "90":
        b.close()
        pytest.skip(f"wgmma tile: sm_90 only (device is compute capability {b.ctx.cc})")
    lays = (True, False, 2) if b.storage.pairs else (True, False)  # SoA weights: pair streams
    names = [kernel_name("mma_f16", c, soa, t) for c in WG_CFGS for soa in lays
             for t in IN_TYPES.values()]
    with b.ctx.dev:
        b.ctx.prefetch(WG_FILE, names, threads=16)
    yield b
    b.close()


@pytest.mark.parametrize("shape", [(300, 2304), (33, 256 * 37), (1000, 512), (64, 1024)])
def test_every_shape_and_slice_count(be, rng, shape):
    sweep_slice_counts(be, rng, shape, WG_CFGS)


def test_zero_and_extreme_block_scales(be, rng):
    """d = 0 blocks (masked), tiny and large d, scale bytes -128 and 127: the accumulators
    are rescaled by d_prev / d between blocks while the tensor cores run."""
    rows, k = 200, 4096
    blocks = extreme_scale_weight(rng, rows, k)
    ws = load(be, blocks, rows, k, Layout.SOA)
    wa = load(be, blocks, rows, k, Layout.AOS)
    x = rng.standard_normal((64, k)).astype(np.float16)
    y64 = reference.matmul_float64(x, blocks, rows)
    for c in WG_CFGS:
        for ks in (1, 5):
            cfg = Cfg(nt=c.nt, src=6, pf=True, warps=c.warps, ksplit=ks)
            if smem_bytes("mma_f16", cfg, -(-(k // 256) // ks)) > KS_SMEM_MAX:
                continue  # the slice's activations do not fit one CTA
            y = _run(be, ws, x[: 8 * c.nt], cfg)
            _check(y, y64[: 8 * c.nt], cfg.label())
            same_bits(y, _run(be, wa, x[: 8 * c.nt], cfg), f"{cfg.label()}: AoS twin differs")


def test_agrees_with_the_k_slice_tile(be, rng):
    """Same numerics as q6k_ks_f16 up to f32 accumulation order."""
    rows, k = 384, 3072
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA)
    x = rng.standard_normal((64, k)).astype(np.float16)
    for c in WG_CFGS:
        n = 8 * c.nt
        y = _run(be, w, x[:n], c)
        yk = _run(be, w, x[:n], Cfg(nt=c.nt, src=4, pf=True))
        assert rel_fro(y, yk) <= 1e-5, (c.label(), rel_fro(y, yk))


@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16])
def test_activation_dtypes(be, rng, dtype):
    check_activation_dtype(be, rng, dtype, WG_CFGS)


def test_tiles_across_slabs(be, rng, monkeypatch):
    check_tiles_across_slabs(be, rng, monkeypatch, WG_CFGS)
