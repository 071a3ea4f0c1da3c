"""The TMA-fed tile ``q6k_tma_f16`` (mma_f16 launch shapes with ``src=7``, in
kernels/cuda/q6k_tma.cu, built for sm_90a) against the NumPy float64 reference (``-m gpu``;
skipped without CuPy, a GPU, or on a device that is not compute capability 9.0).

Its own risks beyond the K-slice tile's: the bulk copies' sizes and addresses (a row's run of
C blocks per plane, the last chunk of a slice shorter than C, the d plane's 16-byte span at
every start offset: odd block counts per row), the mbarrier phases of an S-stage ring over
many units (several row tiles per warp, slices of 1..bpr blocks), rows past the end, tiles
spanning slabs, and the AoS layout served by q6k_ks_f16 on the same grid (bit-identical).
Outputs and partial sums are poisoned with NaN before each call.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_cuda_backend import _gpu_count, load, random_weight
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
# (nt, warps, stages, chunk): every instantiation the nvcc check builds (q6k_tma.cu)
TMA_SHAPES = ((2, 8, 6, 1), (2, 8, 3, 2), (2, 12, 2, 2), (2, 16, 2, 1), (2, 16, 3, 1),
              (4, 8, 4, 1), (4, 12, 3, 1), (4, 8, 3, 2), (8, 8, 3, 1), (8, 8, 2, 2))
# pf: the 2D form (tensor-map boxes; tiles spanning slabs take the per-row copies)
TMA_CFGS = tuple(Cfg(nt=nt, src=7, warps=w, stages=s, chunk=c, pf=pf) for pf in (False, True)
                 for nt, w, s, c in TMA_SHAPES)


@pytest.fixture(scope="module")
def be():
    if _gpu_count() == 0:
        pytest.skip("needs CuPy and a CUDA device")
    from q6serve.kernels.cuda.launch import IN_TYPES, MATMUL_FILE, TMA_FILE, kernel_name
    from q6serve.kernels.cuda_backend import CudaBackend

    b = CudaBackend(0)
    if b.ctx.cc != "90":
        b.close()
        pytest.skip(f"TMA tile: sm_90 only (device is compute capability {b.ctx.cc})")
    names = [kernel_name("mma_f16", c, True, t) for c in TMA_CFGS for t in IN_TYPES.values()]
    aos = [kernel_name("mma_f16", Cfg(nt=nt, src=4, pf=True), soa, t) for nt in (2, 4, 8)
           for soa in (True, False) for t in IN_TYPES.values()]
    with b.ctx.dev:
        b.ctx.prefetch(TMA_FILE, names, threads=16)
        b.ctx.prefetch(MATMUL_FILE, aos, threads=16)
    yield b
    b.close()


@pytest.mark.parametrize("shape", [(300, 2304), (33, 256 * 37), (1000, 512), (177, 256 * 9)])
def test_every_shape_and_slice_count(be, rng, shape):
    sweep_slice_counts(be, rng, shape, TMA_CFGS)


def test_bit_identical_to_the_k_slice_tile(be, rng):
    """Same numerics, block order and slices as q6k_ks_f16: the same bits at every slice
    count (several row tiles per warp: 1100 rows)."""
    rows, k = 1100, 256 * 21
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA)
    x = rng.standard_normal((64, k)).astype(np.float16)
    y64 = reference.matmul_float64(x, blocks, rows)
    for c in TMA_CFGS:
        for ks in (1, 2, 7, 21):
            cfg = replace(c, ksplit=ks)
            if smem_bytes("mma_f16", cfg, -(-21 // ks)) > KS_SMEM_MAX:
                continue
            n = 8 * c.nt - 3
            y = _run(be, w, x[:n], cfg)
            _check(y, y64[:n], cfg.label())
            yk = _run(be, w, x[:n], Cfg(nt=c.nt, src=4, pf=True, ksplit=ks))
            same_bits(y, yk, f"{cfg.label()}: differs from q6k_ks_f16 at {ks} slices")


def test_zero_and_extreme_block_scales(be, rng):
    rows, k = 200, 256 * 13
    blocks = random_weight(rng, rows, k)
    n = blocks.shape[0]
    d = (rng.standard_normal(n) * 1e-3).astype(np.float16)
    d[rng.random(n) < 0.15] = 0
    d[rng.random(n) < 0.1] = np.float16(3e-7)  # f16 subnormal
    d[rng.random(n) < 0.1] = np.float16(40.0)
    blocks[:, 208:210] = d.view(np.uint8).reshape(n, 2)
    sc = blocks[:, 192:208].view(np.int8)
    sc[rng.random(sc.shape) < 0.1] = -128
    sc[rng.random(sc.shape) < 0.1] = 127
    ws = load(be, blocks, rows, k, Layout.SOA)
    wa = load(be, blocks, rows, k, Layout.AOS)
    x = rng.standard_normal((64, k)).astype(np.float16)
    y64 = reference.matmul_float64(x, blocks, rows)
    for c in TMA_CFGS:
        for ks in (1, 4):
            cfg = replace(c, ksplit=ks)
            if smem_bytes("mma_f16", cfg, -(-13 // ks)) > KS_SMEM_MAX:
                continue
            y = _run(be, ws, x[: 8 * c.nt], cfg)
            _check(y, y64[: 8 * c.nt], cfg.label())
            same_bits(y, _run(be, wa, x[: 8 * c.nt], cfg), f"{cfg.label()}: AoS twin differs")


@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16])
def test_activation_dtypes(be, rng, dtype):
    check_activation_dtype(be, rng, dtype, TMA_CFGS[::3])


def test_tiles_across_slabs(be, rng, monkeypatch):
    check_tiles_across_slabs(be, rng, monkeypatch, TMA_CFGS)


@pytest.mark.parametrize("rps", [40, 48])
def test_tensor_boxes_over_slabs(be, rng, monkeypatch, rps):
    """The 2D form with slabs of 40 rows (some tiles in one slab: boxes; some spanning two:
    per-row copies) and of 48 (every tile boxed, the last slab's box past its rows)."""
    from q6serve.kernels import q6k
    from q6serve.kernels.cuda import storage

    rows, k = 700, 256 * 11
    monkeypatch.setattr(storage, "SLAB_BYTES", rps * q6k.aos_nbytes(1, k))
    blocks = random_weight(rng, rows, k)
    ws = load(be, blocks, rows, k, Layout.SOA)
    assert len(ws.data.slabs) == -(-rows // rps)
    x = rng.standard_normal((64, k)).astype(np.float16)
    y64 = reference.matmul_float64(x, blocks, rows)
    for c in TMA_CFGS:
        if not c.pf:
            continue
        for ks in (1, 3):
            cfg = replace(c, ksplit=ks)
            if smem_bytes("mma_f16", cfg, -(-11 // ks)) > KS_SMEM_MAX:
                continue
            y = _run(be, ws, x[: 8 * c.nt - 1], cfg)
            _check(y, y64[: 8 * c.nt - 1], cfg.label())
            yk = _run(be, ws, x[: 8 * c.nt - 1], Cfg(nt=c.nt, src=4, pf=True, ksplit=ks))
            same_bits(y, yk, f"{cfg.label()}: differs from q6k_ks_f16")
