"""Session 14's K-slice launch shapes (``-m gpu``; skipped without CuPy or a GPU): 8 n-tiles
at 12 warps per CTA, 4 at 16 (with and without the register prefetch), and the cp.async
activation staging of ``q6k_ks_f16`` (``Cfg.xa``: the same bytes in shared memory, so the same
bits as without it). A module of its own with a light fixture: only these names are compiled.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_cuda_backend import _gpu_count, load, random_weight
from test_cuda_ks import _check, _run, check_activation_dtype, same_bits, sweep_slice_counts

from q6serve.kernels import reference
from q6serve.kernels.api import Layout
from q6serve.kernels.cuda.dispatch import Cfg
from q6serve.kernels.cuda.launch import KS_SMEM_MAX, smem_bytes

pytestmark = [pytest.mark.gpu]


@pytest.fixture(scope="module")
def be():
    if _gpu_count() == 0:
        pytest.skip("needs CuPy and a CUDA device")
    from q6serve.kernels.cuda_backend import CudaBackend

    b = CudaBackend(0)
    yield b
    b.close()


KS14_CFGS = (Cfg(nt=8, src=4, pf=True, warps=12), Cfg(nt=8, src=4, warps=12),
             Cfg(nt=4, src=4, warps=16), Cfg(nt=4, src=4, pf=True, warps=16),
             Cfg(nt=8, src=4, pf=True, xa=True), Cfg(nt=4, src=4, pf=True, warps=12, xa=True),
             Cfg(nt=8, src=4, pf=True, warps=12, xa=True))


def _prefetch14(be, cfgs, in_types=("InF16",)):
    from q6serve.kernels.cuda.launch import kernel_name

    lays = (True, False, 2) if be.storage.pairs else (True, False)
    names = [kernel_name("mma_f16", c, soa, t) for c in cfgs for soa in lays for t in in_types]
    with be.ctx.dev:
        be.ctx.prefetch("q6k_matmul.cu", names, threads=16)


def test_session14_launch_shapes(be, rng):
    """The session-14 shapes at forced slice counts, several token chunks: reference, repeat
    and AoS twin identical; f32 activations (xa stages them with the loads, as without it)."""
    _prefetch14(be, KS14_CFGS, ("InF16", "InF32"))
    sweep_slice_counts(be, rng, (300, 2304), KS14_CFGS)
    check_activation_dtype(be, rng, np.float32, KS14_CFGS)


def test_cp_async_staging_same_bits(be, rng):
    """xa copies the same activation bytes into shared memory as the loads: every output bit
    the same as the shape without it, on the resident layout (pair streams by default) and on
    AoS, at one token, a partial chunk, a full one and two chunks."""
    xas = [c for c in KS14_CFGS if c.xa]
    _prefetch14(be, xas + [replace(c, xa=False) for c in xas])
    rows, k = 1000, 256 * 11
    blocks = random_weight(rng, rows, k)
    ws = load(be, blocks, rows, k, Layout.SOA)
    wa = load(be, blocks, rows, k, Layout.AOS)
    x = rng.standard_normal((150, k)).astype(np.float16)
    y64 = reference.matmul_float64(x, blocks, rows)
    for c in xas:
        for ks in (0, 2, 11):
            cfg = replace(c, ksplit=ks)
            if ks and smem_bytes("mma_f16", cfg, -(-11 // ks)) > KS_SMEM_MAX:
                continue
            for n in sorted({1, 8 * c.nt - 5, 8 * c.nt, 8 * c.nt + 7}):
                label = f"{cfg.label()} N={n}"
                y = _run(be, ws, x[:n], cfg)
                _check(y, y64[:n], label)
                same_bits(y, _run(be, ws, x[:n], replace(cfg, xa=False)), f"{label}: xa differs")
                same_bits(y, _run(be, wa, x[:n], cfg), f"{label}: AoS twin differs")
