"""The wgmma tile ``q6k_wg_f16`` (mma_f16 launch shapes with ``src=8``, in
kernels/cuda/q6k_wgmma.cu, built for sm_90a) against the NumPy float64 reference (``-m gpu``;
skipped without CuPy, a GPU, or on a device that is not compute capability 9.0).

Its own risks beyond the K-slice tile's: the B tiles' shared-memory layout and descriptors
(every k16 step, both k halves, every 8-token group), 64-row warpgroup tiles over rows that
fill no whole tile, two wgmma groups in flight while the next steps decode (m64n64k16 and
m64n32k16, whose slices hold up to 14 blocks: more of each row's d ahead), tokens past N
zero-filled in the staging, split-K partial sums. Each block's scale is folded into A: it adds
f16((4q - 128) * f16(sc * f16(d / dmax))) and scales by dmax / 4 once per tile (dmax: the row's
largest |d| over the warp's K slice), other roundings than the K-slice tile's, within the F16
contract of the reference, and the same value in every layout, so the SoA (pair-stream) and AoS
twins stay bit-identical, also with d = 0 blocks, f16 subnormal d and scales of every size in
one row. Outputs and partial sums are poisoned with NaN before each call. (Session 21 merged
session 20's test of the variants into this file when src 6 and 9 left the kernels.)
"""

from __future__ import annotations

from dataclasses import replace

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
# 8 n-tiles (m64n64k16) at one, two and three warpgroups per CTA (the table's cells run three),
# and 4 (m64n32k16, session 21) at two and three
WG_CFGS = (tuple(Cfg(nt=8, src=8, pf=True, warps=w) for w in (4, 8, 12))
           + tuple(Cfg(nt=4, src=8, pf=True, warps=w) for w in (8, 12)))


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
    """d = 0 blocks (r = 0), f16 subnormal d, d = 40 beside d ~ 1e-3 in the same rows (r down
    to ~1e-8, f16(r) subnormal), scale bytes -128 and 127: the reference's bound and the AoS
    twin's bits."""
    rows, k = 200, 4096
    blocks = extreme_scale_weight(rng, rows, k)
    ws = load(be, blocks, rows, k, Layout.SOA)
    wa = load(be, blocks, rows, k, Layout.AOS)
    x = rng.standard_normal((64, k)).astype(np.float16)
    y64 = reference.matmul_float64(x, blocks, rows)
    for c in WG_CFGS:
        for ks in (1, 5):
            cfg = replace(c, ksplit=ks)
            if smem_bytes("mma_f16", cfg, -(-(k // 256) // ks)) > KS_SMEM_MAX:
                continue  # the slice's activations do not fit one CTA
            y = _run(be, ws, x, cfg)
            _check(y, y64, cfg.label())
            same_bits(y, _run(be, wa, x, cfg), f"{cfg.label()}: AoS twin differs")


def test_all_zero_rows(be, rng):
    """A row whose blocks all have d = 0 in a K slice (dmax = 0): zeros, not NaN."""
    rows, k = 128, 2048
    blocks = random_weight(rng, rows, k)
    bpr = k // 256
    d = blocks[:, 208:210].copy().view(np.float16).reshape(rows, bpr)
    d[5] = 0
    d[70, : bpr // 2] = 0
    blocks[:, 208:210] = d.reshape(-1, 1).view(np.uint8).reshape(-1, 2)
    w = load(be, blocks, rows, k, Layout.SOA)
    x = rng.standard_normal((64, k)).astype(np.float16)
    y64 = reference.matmul_float64(x, blocks, rows)
    for c in WG_CFGS[1:]:
        for ks in (2, 4):  # (8 blocks: one slice's activations do not fit a CTA)
            y = _run(be, w, x, replace(c, ksplit=ks))
            _check(y, y64, c.label())
            assert (y[:, 5] == 0).all()


def test_agrees_with_the_k_slice_tile(be, rng):
    """Within 1e-3 (relative Frobenius) of q6k_ks_f16 on the same weight: the folded scale's two
    f16 roundings per weight; session 20 measured 2.3-3.1e-4 on the table's shapes, and a
    layout or descriptor error is O(1)."""
    rows, k = 384, 3072
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA)
    x = rng.standard_normal((64, k)).astype(np.float16)
    for c in WG_CFGS:
        n = 8 * c.nt
        y = _run(be, w, x[:n], c)
        yk = _run(be, w, x[:n], Cfg(nt=c.nt, src=4, pf=True))
        assert rel_fro(y, yk) <= 1e-3, (c.label(), rel_fro(y, yk))


@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16])
def test_activation_dtypes(be, rng, dtype):
    check_activation_dtype(be, rng, dtype, WG_CFGS)


def test_tiles_across_slabs(be, rng, monkeypatch):
    check_tiles_across_slabs(be, rng, monkeypatch, WG_CFGS)
