"""The K-slice tile ``q6k_ks_f16`` (mma_f16 launch shapes with ``src=4``, in
kernels/cuda/q6k_matmul.cu) against the NumPy float64 reference (``-m gpu``; skipped without
CuPy or a GPU).

Its own risks beyond the shared variant test: many K slices whose partial sums q6k_sum_parts
adds after the kernel (results bit-identical call to call, tickets untouched), warps that
stream several row tiles with the next tile's weights prefetched, rows that fill no whole warp
tile, tiles spanning slabs, token chunks beyond 8*nt, every activation dtype, and the SoA/AoS
twins bit-identical. Outputs and partial sums are poisoned with NaN before each call.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_cuda_backend import KS_CFGS, _gpu_count, load, poison, random_weight, rel_fro

from q6serve.kernels import q6k, reference
from q6serve.kernels.api import BFLOAT16, Layout
from q6serve.kernels.cuda.dispatch import Cfg
from q6serve.kernels.cuda.launch import KS_SMEM_MAX, smem_bytes

try:
    import cupy
except ImportError:  # CI: no CuPy at all
    cupy = None

pytestmark = [pytest.mark.gpu]
TOL = 2e-3  # F16 contract: relative Frobenius error vs float64


@pytest.fixture(scope="module")
def be():
    if _gpu_count() == 0:
        pytest.skip("needs CuPy and a CUDA device")
    from q6serve.kernels.cuda.launch import IN_TYPES, kernel_name
    from q6serve.kernels.cuda_backend import CudaBackend

    b = CudaBackend(0)
    lays = (True, False, 2) if b.storage.pairs else (True, False)  # SoA weights: pair streams
    names = [kernel_name("mma_f16", c, soa, t) for c in KS_CFGS for soa in lays
             for t in IN_TYPES.values()]
    with b.ctx.dev:
        b.ctx.prefetch("q6k_matmul.cu", names, threads=16)
    yield b
    b.close()


def _run(be, w, x, cfg):
    """y [n, rows] of one call; outputs and the partial-sum buffer poisoned first."""
    poison()
    with be.ctx.dev, be.stream:
        part = be.launcher.ws.array("part", (1 << 20,), np.float32)
        part.fill(np.nan)
        dt = np.dtype(np.uint16) if x.dtype == BFLOAT16 else x.dtype
        xd = cupy.asarray(x.view(dt) if x.dtype == BFLOAT16 else x)
        y = be.run(w, xd, x.dtype, "mma_f16", cfg).get(stream=be.stream)
        tickets = be.launcher.ws.array("tickets", (1024,), np.uint32)
        left = int(tickets.sum().get(stream=be.stream))
    assert left == 0, "tickets must be left at zero for the next call"
    return y


def _check(y, y64, label):
    assert np.isfinite(y).all(), f"{label}: unwritten or non-finite outputs"
    assert rel_fro(y, y64) <= TOL, (label, rel_fro(y, y64))


def same_bits(a, b, msg=""):
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=msg)


def check_tokens(be, ws, wa, x, y64, cfg, also=None):
    """``cfg`` at N = one token, a partial and a full chunk, and several chunks: within F16's
    bound of the reference ``y64``, repeat and AoS twin ``wa`` identical to SoA ``ws``;
    ``also(n, y, label)`` for a caller's own comparison of each y."""
    for n in sorted({1, 8 * cfg.nt - 1, 8 * cfg.nt + 3}):
        label = f"{cfg.label()} N={n}"
        y = _run(be, ws, x[:n], cfg)
        _check(y, y64[:n], label)
        if also is not None:
            also(n, y, label)
        same_bits(y, _run(be, ws, x[:n], cfg), f"{label}: repeat differs")
        same_bits(y, _run(be, wa, x[:n], cfg), f"{label}: AoS twin differs")


def sweep_slice_counts(be, rng, shape, cfgs):
    """Every launch shape of ``cfgs`` as it is (warps, tile) x forced K-slice counts (1,
    2, 3, all blocks) x N (one token, a partial and a full chunk, several chunks): reference,
    repeat and AoS twin identical."""
    rows, k = shape
    bpr = k // 256
    blocks = random_weight(rng, rows, k)
    ws = load(be, blocks, rows, k, Layout.SOA)
    wa = load(be, blocks, rows, k, Layout.AOS)
    x = rng.standard_normal((70, k)).astype(np.float16)
    y64 = reference.matmul_float64(x, blocks, rows)
    for c in cfgs:
        for ks in sorted({0, 1, 2, 3, bpr} & set(range(bpr + 1))):
            cfg = replace(c, ksplit=ks)
            if ks and smem_bytes("mma_f16", cfg, -(-bpr // ks)) > KS_SMEM_MAX:
                continue  # the slice's activations do not fit one CTA
            check_tokens(be, ws, wa, x, y64, cfg)


def check_activation_dtype(be, rng, dtype, cfgs):
    rows, k = 517, 1536
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA)
    x = rng.standard_normal((40, k)).astype(np.float32).astype(dtype)
    y64 = reference.matmul_float64(x.astype(np.float32), blocks, rows)
    for c in cfgs:
        _check(_run(be, w, x, c), y64, c.label())


def check_tiles_across_slabs(be, rng, monkeypatch, cfgs):
    """700 rows at 37 rows per slab: every warp (or warpgroup) tile spans slabs."""
    from q6serve.kernels.cuda import storage

    rows, k = 700, 1024
    monkeypatch.setattr(storage, "SLAB_BYTES", 37 * q6k.aos_nbytes(1, k))
    blocks = random_weight(rng, rows, k)
    ws = load(be, blocks, rows, k, Layout.SOA)
    wa = load(be, blocks, rows, k, Layout.AOS)
    assert len(ws.data.slabs) == 19
    x = rng.standard_normal((64, k)).astype(np.float16)
    y64 = reference.matmul_float64(x, blocks, rows)
    for c in cfgs:
        y = _run(be, ws, x[: 8 * c.nt], c)
        _check(y, y64[: 8 * c.nt], c.label())
        same_bits(y, _run(be, wa, x[: 8 * c.nt], c), c.label())


@pytest.mark.parametrize("shape", [(300, 2304), (33, 256 * 37), (1000, 512)])
def test_every_shape_and_slice_count(be, rng, shape):
    sweep_slice_counts(be, rng, shape, KS_CFGS)


@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16])
def test_activation_dtypes(be, rng, dtype):
    check_activation_dtype(be, rng, dtype, KS_CFGS)


def test_tiles_across_slabs(be, rng, monkeypatch):
    check_tiles_across_slabs(be, rng, monkeypatch, KS_CFGS)


def test_backend_matmul_through_the_graph(be, rng):
    """The backend's own host path (bound sequence, CUDA graph from the second call) with a
    K-slice launch shape: the same bits every call."""
    from q6serve.kernels.api import KernelFlags, Precision
    from q6serve.kernels.cuda.dispatch import Choice

    rows, k = 640, 2048
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA)
    x = rng.standard_normal((48, k)).astype(np.float16)
    cfg = Cfg(nt=8, mt=1, src=4, pf=True, ksplit=3)
    orig = be.dispatch.choose
    be.dispatch.choose = lambda *a, **kw: Choice("mma_f16", Precision.F16, cfg, "test")
    try:
        ys = [be.matmul(w, x, precision=Precision.F16, flags=KernelFlags()).y for _ in range(3)]
    finally:
        be.dispatch.choose = orig
    _check(ys[0], reference.matmul_float64(x, blocks, rows), cfg.label())
    for y in ys[1:]:
        np.testing.assert_array_equal(y.view(np.uint32), ys[0].view(np.uint32))


# -- the split-K sum launched with PDL (Launcher.pdl, sm_90) ------------------------------------
def test_pdl_sum_same_bits_direct_and_through_the_graph(be, rng):
    """q6k_sum_parts launched with programmatic stream serialization waits for the tile's
    partials itself (griddepcontrol.wait): the same bits as the plain launch at several slice
    counts (partials poisoned with NaN before each call), for the register and wgmma tiles,
    and through the backend's captured graph."""
    from q6serve.kernels.api import KernelFlags, Precision
    from q6serve.kernels.cuda.dispatch import Choice

    be.launcher.pdl = True
    have = be.launcher._pdl_launcher() is not None
    be.launcher.pdl = False
    if not have:
        pytest.skip("PDL needs compute capability 9.0 and the driver's cuLaunchKernelEx")
    rows, k = 1100, 256 * 13
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA)
    x = rng.standard_normal((64, k)).astype(np.float16)
    y64 = reference.matmul_float64(x, blocks, rows)
    cfgs = [Cfg(nt=1, src=4, pf=True, warps=16), Cfg(nt=2, src=4, pf=True, warps=12),
            Cfg(nt=8, src=4, pf=True)]
    if be.ctx.cc == "90":
        cfgs.append(Cfg(nt=8, src=8, pf=True, warps=12))
    try:
        for c in cfgs:
            for ks in (2, 5, 13):
                cfg = replace(c, ksplit=ks)
                if smem_bytes("mma_f16", cfg, -(-13 // ks)) > KS_SMEM_MAX:
                    continue  # the slice's activations do not fit one CTA
                n = 8 * c.nt - 3
                be.launcher.pdl = False
                plain = _run(be, w, x[:n], cfg)
                be.launcher.pdl = True
                pdl = _run(be, w, x[:n], cfg)
                _check(pdl, y64[:n], f"{cfg.label()} PDL")
                same_bits(plain, pdl, f"{cfg.label()} N={n}: PDL differs")
        cfg = Cfg(nt=2, src=4, pf=True, warps=12, ksplit=3)
        orig = be.dispatch.choose
        be.dispatch.choose = lambda *a, **kw: Choice("mma_f16", Precision.F16, cfg, "test")
        try:
            w2 = load(be, blocks, rows, k, Layout.SOA)  # its own bound sequences, bound with PDL
            ys = [be.matmul(w2, x[:13], precision=Precision.F16, flags=KernelFlags()).y
                  for _ in range(4)]
        finally:
            be.dispatch.choose = orig
        be.launcher.pdl = False
        ref = _run(be, w, x[:13], cfg)
        for y in ys:
            same_bits(y, ref, "PDL through the graph")
    finally:
        be.launcher.pdl = False
