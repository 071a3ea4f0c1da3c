"""Session 20's variants of the wgmma tile (``q6k_wg_f16``'s V, mma_f16 ``src=8`` / ``src=9``)
against the NumPy float64 reference, the plain wgmma tile (``src=6``) and each other (``-m gpu``;
skipped without CuPy, a GPU, or on a device that is not compute capability 9.0).

- src 9 (two wgmma groups in flight, V = 1) changes only when the tile waits, not what it adds:
  its y must be src 6's bit for bit.
- src 8 (each block's scale folded into A, V = 2; pf: two groups in flight, V = 3) adds
  f16((4q - 128) * f16(sc * f16(d / dmax))) and scales by dmax / 4 once per tile: other bits
  than src 6, within the F16 contract of the reference; pf on and off the same bits; the same
  value in every layout, so the SoA (pair-stream) and AoS twins stay bit-identical, also with
  d = 0 blocks, f16 subnormal d and scales of every size in one row.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_cuda_backend import _gpu_count, extreme_scale_weight, load, random_weight
from test_cuda_ks import (
    _check,
    _run,
    check_activation_dtype,
    check_tiles_across_slabs,
    same_bits,
    sweep_slice_counts,
)

from q6serve.kernels import reference
from q6serve.kernels.api import Layout
from q6serve.kernels.cuda.dispatch import Cfg
from q6serve.kernels.cuda.launch import KS_SMEM_MAX, smem_bytes

pytestmark = [pytest.mark.gpu]
# two and three warpgroups per CTA (the widths the N = 64 cells would run)
FOLD_CFGS = tuple(Cfg(nt=8, src=8, pf=pf, warps=w) for w in (8, 12) for pf in (False, True))
DEEP_CFGS = tuple(Cfg(nt=8, src=9, pf=True, warps=w) for w in (8, 12))


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
    lays = (True, False, 2) if b.storage.pairs else (True, False)
    cfgs = FOLD_CFGS + DEEP_CFGS + tuple(replace(c, src=6) for c in DEEP_CFGS)
    names = [kernel_name("mma_f16", c, soa, t) for c in cfgs for soa in lays
             for t in IN_TYPES.values()]
    with b.ctx.dev:
        b.ctx.prefetch(WG_FILE, names, threads=16)
    yield b
    b.close()


@pytest.mark.parametrize("shape", [(300, 2304), (33, 256 * 37)])
def test_every_shape_and_slice_count(be, rng, shape):
    sweep_slice_counts(be, rng, shape, FOLD_CFGS + DEEP_CFGS)


def test_two_groups_in_flight_keep_the_bits(be, rng):
    """src 9 = src 6 and src 8 pf = src 8 bit for bit (only the waits differ), at forced K
    splits (one slice, several) and N = one token, a partial and the full chunk."""
    rows, k = 448, 3072
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA)
    x = rng.standard_normal((64, k)).astype(np.float16)
    for warps in (8, 12):
        for ks in (2, 3):  # (12 blocks: one slice's activations do not fit a CTA)
            for n in (1, 37, 64):
                deep = _run(be, w, x[:n], Cfg(nt=8, src=9, pf=True, warps=warps, ksplit=ks))
                plain = _run(be, w, x[:n], Cfg(nt=8, src=6, pf=True, warps=warps, ksplit=ks))
                same_bits(deep, plain, f"src 9 w{warps} k{ks} N={n} differs from src 6")
                f0 = _run(be, w, x[:n], Cfg(nt=8, src=8, pf=False, warps=warps, ksplit=ks))
                f1 = _run(be, w, x[:n], Cfg(nt=8, src=8, pf=True, warps=warps, ksplit=ks))
                same_bits(f0, f1, f"src 8 w{warps} k{ks} N={n}: pf changed the bits")


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
    for c in FOLD_CFGS:
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
    for c in FOLD_CFGS[:2]:
        for ks in (2, 4):  # (8 blocks: one slice's activations do not fit a CTA)
            y = _run(be, w, x, replace(c, ksplit=ks))
            _check(y, y64, c.label())
            assert (y[:, 5] == 0).all()


@pytest.mark.parametrize("dtype", [np.float32])
def test_activation_dtypes(be, rng, dtype):
    check_activation_dtype(be, rng, dtype, FOLD_CFGS[:2])


def test_tiles_across_slabs(be, rng, monkeypatch):
    check_tiles_across_slabs(be, rng, monkeypatch, FOLD_CFGS[:2] + DEEP_CFGS[:1])
