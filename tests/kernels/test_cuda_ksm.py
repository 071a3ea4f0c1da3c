"""The 32-row K-slice tile ``q6k_ksm_f16`` (mma_f16 launch shapes with ``src=6``, in
kernels/cuda/q6k_matmul.cu) against the NumPy float64 reference (``-m gpu``; skipped without
CuPy or a GPU).

Its own risks: the warp-private half-block cp.async ring (stage reuse across row tiles and K
slices, units past the end), the d word and its parity copied per half, rows that fill no whole
32-row tile, tiles spanning slabs, activations staged in lane order, split-K partial sums added
by q6k_sum_parts (bit-identical call to call), every activation dtype, and the SoA/AoS twins
bit-identical. Outputs and partial sums are poisoned with NaN before each call. The last test
runs the weight shapes issue 16 names (48-56 MB and an lm-head) at N = 9, 16, 32, 64 with random
valid f16 scales of every magnitude.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_cuda_backend import KSM_CFGS, _gpu_count, load, random_weight
from test_cuda_ks import _check, _run

from q6serve.kernels import q6k, reference
from q6serve.kernels.api import BFLOAT16, Layout
from q6serve.kernels.cuda.launch import KS_SMEM_MAX, smem_bytes

try:
    import cupy
except ImportError:  # CI: no CuPy at all
    cupy = None

pytestmark = [pytest.mark.gpu]
MODEL_SHAPES = ((4096, 14336), (14336, 4096), (18944, 3584), (3584, 18944), (152064, 3584))


@pytest.fixture(scope="module")
def be():
    if _gpu_count() == 0:
        pytest.skip("needs CuPy and a CUDA device")
    from q6serve.kernels.cuda.launch import IN_TYPES, kernel_name
    from q6serve.kernels.cuda_backend import CudaBackend

    b = CudaBackend(0)
    names = [kernel_name("mma_f16", c, soa, t) for c in KSM_CFGS for soa in (True, False)
             for t in IN_TYPES.values()]
    with b.ctx.dev:
        b.ctx.prefetch("q6k_matmul.cu", names, threads=16)
    yield b
    b.close()


def _same(a, b, label):
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=label)


@pytest.mark.parametrize("shape", [(300, 2304), (33, 256 * 37), (1000, 512)])
def test_every_shape_and_slice_count(be, rng, shape):
    """Every launch shape x forced K-slice counts x N (a partial and an overfull chunk):
    reference, repeat and AoS twin identical."""
    from dataclasses import replace

    rows, k = shape
    bpr = k // 256
    blocks = random_weight(rng, rows, k)
    ws = load(be, blocks, rows, k, Layout.SOA)
    wa = load(be, blocks, rows, k, Layout.AOS)
    x = rng.standard_normal((70, k)).astype(np.float16)
    y64 = reference.matmul_float64(x, blocks, rows)
    for c in KSM_CFGS:
        for ks in sorted({0, 1, 2, 3, bpr} & set(range(bpr + 1))):
            cfg = replace(c, ksplit=ks)
            if ks and smem_bytes("mma_f16", cfg, -(-bpr // ks)) > KS_SMEM_MAX:
                continue  # the slice's activations do not fit one CTA
            for n in sorted({1, 8 * c.nt - 1, 8 * c.nt + 3}):
                label = f"{cfg.label()} N={n}"
                y = _run(be, ws, x[:n], cfg)
                _check(y, y64[:n], label)
                _same(y, _run(be, ws, x[:n], cfg), f"{label}: repeat differs")
                _same(y, _run(be, wa, x[:n], cfg), f"{label}: AoS twin differs")


@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16])
def test_activation_dtypes(be, rng, dtype):
    rows, k = 517, 1536
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA)
    x = rng.standard_normal((40, k)).astype(np.float32).astype(dtype)
    y64 = reference.matmul_float64(x.astype(np.float32), blocks, rows)
    for c in KSM_CFGS:
        _check(_run(be, w, x, c), y64, c.label())


def test_tiles_across_slabs_and_zero_blocks(be, rng, monkeypatch, random_blocks):
    """37 rows per slab (every 32-row tile spans slabs), random d of every magnitude and some
    zero d (masked blocks)."""
    from q6serve.kernels.cuda import storage

    rows, k = 700, 1024
    monkeypatch.setattr(storage, "SLAB_BYTES", 37 * q6k.aos_nbytes(1, k))
    blocks = random_blocks(rng, rows * (k // 256))
    blocks[::7, 208:210] = 0  # d = +0: the block adds nothing
    ws = load(be, blocks, rows, k, Layout.SOA)
    wa = load(be, blocks, rows, k, Layout.AOS)
    assert len(ws.data.slabs) == 19
    x = rng.standard_normal((64, k)).astype(np.float16)
    y64 = reference.matmul_float64(x, blocks, rows)
    for c in KSM_CFGS:
        y = _run(be, ws, x[: 8 * c.nt], c)
        _check(y, y64[: 8 * c.nt], c.label())
        _same(y, _run(be, wa, x[: 8 * c.nt], c), f"{c.label()}: AoS twin differs")


def _device_weight(be, aos, rows, k, layout):
    """A resident weight repacked on the device from device AoS blocks (as load does)."""
    from q6serve.kernels.api import ResidentWeight
    from q6serve.kernels.cuda import storage
    from q6serve.kernels.cuda.storage import CudaWeight

    plan = storage.slab_plan(rows, k)
    slabs: list = []
    be.storage._scatter(aos, 0, rows, plan, slabs, k, layout)
    return ResidentWeight(rows, k, layout, be.weight_nbytes(rows, k, layout),
                          CudaWeight(slabs, be.storage._table(slabs), storage.slab_rows(rows, k)))


@pytest.mark.parametrize("shape", MODEL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_model_shapes(be, rng, shape):
    """Issue 16's weight shapes at N = 9, 16, 32, 64, every src-6 launch shape of that N:
    768 rows (first, last, random) against float64, all outputs finite (poisoned first),
    repeat and AoS twin bit-identical. Random codes and scales, finite f16 d of magnitudes
    1e-7 .. 300 (built on the device: the host reference sees only the checked rows)."""
    rows, k = shape
    bpr = k // 256
    nb = rows * bpr
    pick = np.unique(np.concatenate([np.arange(64), np.arange(rows - 64, rows),
                                     rng.integers(0, rows, 640)]))
    with be.ctx.dev, be.stream:
        cupy.random.seed(int(rng.integers(1 << 31)))
        aos = cupy.random.randint(0, 256, size=(nb, 210), dtype=cupy.int32).astype(cupy.uint8)
        mag = cupy.asarray(np.array([1e-7, 1e-4, 1e-2, 1.0, 300.0], np.float32))[
            cupy.random.randint(0, 5, size=nb)]
        d = (cupy.random.standard_normal(nb, dtype=cupy.float32) * mag).astype(cupy.float16)
        aos[:, 208:210] = d.view(cupy.uint8).reshape(nb, 2)
        ws = _device_weight(be, aos, rows, k, Layout.SOA)
        wa = _device_weight(be, aos, rows, k, Layout.AOS)
        sub = aos.reshape(rows, bpr, 210)[cupy.asarray(pick)].get().reshape(-1, 210)
        del aos, mag, d
        be.stream.synchronize()
    try:
        for n in (9, 16, 32, 64):
            nt = 2 if n <= 16 else 4 if n <= 32 else 8
            x = rng.standard_normal((n, k)).astype(np.float16)
            y64 = reference.matmul_float64(x, sub, pick.size)
            for c in (c for c in KSM_CFGS if c.nt == nt):
                label = f"{rows}x{k} {c.label()} N={n}"
                y = _run(be, ws, x, c)
                assert np.isfinite(y).all(), f"{label}: unwritten or non-finite outputs"
                _check(y[:, pick], y64, label)
                _same(y, _run(be, ws, x, c), f"{label}: repeat differs")
                _same(y, _run(be, wa, x, c), f"{label}: AoS twin differs")
    finally:
        be.free(ws)
        be.free(wa)
        cupy.get_default_memory_pool().free_all_blocks()
