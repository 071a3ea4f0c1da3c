"""The session-11 probe of a decode from a resident repack (``-m gpu``; skipped without CuPy or a
GPU): ``q6k_repack_pairs`` rewrites a SoA weight's code planes into pair streams, and the probe
tiles ``q6k_ksp_f16`` (K-slice, src 4's plans) and ``q6k_wgp_f16`` (wgmma, src 6's, sm_90 only)
read them (kernels/cuda/q6k_matmul.cu, q6k_wgmma.cu; docs/KERNELS.md "A decode from a resident
repack"). Their A fragments are the plain tiles' bit for bit, so on the same plan (grid, forced
K-slice count, split-K sum) y must equal the plain tile's exactly, and the reference within the
F16 contract: at 1, 2, 3 and all K slices, a partial and several token chunks, and with warp
tiles spanning slabs. The probe's launcher is bench/tile_probe.py's (``run_tile``)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_cuda_backend import _gpu_count, load, random_weight, rel_fro

from q6serve.kernels import q6k, reference
from q6serve.kernels.api import Layout
from q6serve.kernels.cuda.dispatch import Cfg
from q6serve.kernels.cuda.launch import KS_SMEM_MAX, kernel_file, kernel_name, smem_bytes

try:
    import cupy
except ImportError:  # CI: no CuPy at all
    cupy = None

pytestmark = [pytest.mark.gpu]
TOL = 2e-3
KS = (Cfg(nt=1, src=4, pf=True), Cfg(nt=2, src=4, pf=True, warps=16),
      Cfg(nt=4, src=4, pf=True, warps=12), Cfg(nt=8, src=4, pf=True))
WG = (Cfg(nt=4, src=6, pf=True, warps=12), Cfg(nt=8, src=6, pf=True, warps=8))


def _probe():
    path = Path(__file__).resolve().parents[2] / "bench" / "tile_probe.py"
    spec = importlib.util.spec_from_file_location("_q6_tile_probe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def be():
    if _gpu_count() == 0:
        pytest.skip("needs CuPy and a CUDA device")
    from q6serve.kernels.cuda_backend import CudaBackend

    b = CudaBackend(0)
    tp = _probe()
    cfgs = KS + (WG if b.ctx.cc == "90" else ())
    with b.ctx.dev:
        for file in dict.fromkeys(kernel_file("mma_f16", c) for c in cfgs):
            names = {n for c in cfgs if kernel_file("mma_f16", c) == file
                     for n in (kernel_name("mma_f16", c, True, "InF16"), tp.rp_name(c))}
            b.ctx.prefetch(file, names, threads=16)
    b.tp = tp
    b.cfgs = cfgs
    yield b
    b.close()


def _pair(be, rng, rows, k):
    blocks = random_weight(rng, rows, k)
    plain = load(be, blocks, rows, k, Layout.SOA)
    pairs = be.tp.repack_pairs(be, load(be, blocks, rows, k, Layout.SOA))
    return blocks, plain, pairs


def _same(be, plain, pairs, x, cfg, y64, label):
    xd = cupy.asarray(x)
    with be.ctx.dev, be.stream:
        part = be.launcher.ws.array("part", (1 << 20,), np.float32)
        part.fill(np.nan)  # a partial sum the probe does not write shows up
    y0, g0 = be.tp.run_tile(cupy, be, plain, xd, x.shape[0], cfg, False)
    with be.ctx.dev, be.stream:
        part.fill(np.nan)
    y1, g1 = be.tp.run_tile(cupy, be, pairs, xd, x.shape[0], cfg, True)
    y0, y1 = y0.get(), y1.get()
    assert g0 == g1, label
    assert np.isfinite(y1).all(), f"{label}: unwritten or non-finite outputs"
    np.testing.assert_array_equal(y1.view(np.uint32), y0.view(np.uint32),
                                  err_msg=f"{label}: probe differs from the plain tile")
    assert rel_fro(y1, y64) <= TOL, (label, rel_fro(y1, y64))


def test_repack_leaves_scales_and_changes_codes(be, rng):
    rows, k = 40, 512
    _, plain, pairs = _pair(be, rng, rows, k)
    a = plain.data.slabs[0].get()
    b = pairs.data.slabs[0].get()
    nb = rows * (k // 256)
    assert np.array_equal(a[192 * nb:], b[192 * nb:]), "scales and d must stay"
    assert not np.array_equal(a[:192 * nb], b[:192 * nb])
    # same multiset of set bits per block: a permutation of the 1536 code bits
    ones = np.unpackbits(a[:192 * nb]).sum(), np.unpackbits(b[:192 * nb]).sum()
    assert ones[0] == ones[1]


def test_unpack_restores_the_planes_bit_exactly(be, rng):
    rows, k = 96, 1024
    _, plain, pairs = _pair(be, rng, rows, k)
    fn = be.ctx.fn("q6k_matmul.cu", "q6k_unpack_pairs")
    nb = rows * (k // 256)
    with be.ctx.dev, be.stream:
        for slab in pairs.data.slabs:
            fn(((nb + 127) // 128,), (128,), (slab, np.int32(nb)))
    np.testing.assert_array_equal(pairs.data.slabs[0].get(), plain.data.slabs[0].get())


def test_probe_equals_plain_tile_at_every_slice_count(be, rng):
    rows, k = 300, 2304
    bpr = k // 256
    blocks, plain, pairs = _pair(be, rng, rows, k)
    x = rng.standard_normal((70, k)).astype(np.float16)
    y64 = reference.matmul_float64(x, blocks, rows)
    for c in be.cfgs:
        for ks in sorted({0, 1, 2, 3, bpr}):
            cfg = replace(c, ksplit=ks)
            if ks and smem_bytes("mma_f16", cfg, -(-bpr // ks)) > KS_SMEM_MAX:
                continue
            for n in sorted({1, 8 * c.nt + 3}):
                _same(be, plain, pairs, x[:n], cfg, y64[:n], f"{cfg.label()} N={n}")


def test_probe_tiles_across_slabs(be, rng, monkeypatch):
    from q6serve.kernels.cuda import storage

    rows, k = 700, 1024
    monkeypatch.setattr(storage, "SLAB_BYTES", 37 * q6k.aos_nbytes(1, k))
    blocks, plain, pairs = _pair(be, rng, rows, k)
    assert len(pairs.data.slabs) == 19
    x = rng.standard_normal((64, k)).astype(np.float16)
    y64 = reference.matmul_float64(x, blocks, rows)
    for c in be.cfgs:
        _same(be, plain, pairs, x[: 8 * c.nt], c, y64[: 8 * c.nt], c.label())
