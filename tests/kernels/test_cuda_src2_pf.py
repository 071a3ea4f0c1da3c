"""GPU: the f16 tile's ``pf`` at src 2 (session 17: the first block's weight loads issued before
the activations are staged, the first block peeled) computes what ``pf = False`` does, bit for
bit, on the same grid: pair-stream, SoA and AoS weights, forced K splits (one block per CTA,
uneven slices, the in-kernel split-K sum) and the occupancy's own, every activation dtype,
token chunks past 8; and the float64 reference within F16's bound."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_cuda_backend import load, random_weight, rel_fro
from test_cuda_pairs import _pair, _same, be, compile_for  # noqa: F401 (be: the fixture)

from q6serve.kernels import reference
from q6serve.kernels.api import BFLOAT16, Layout
from q6serve.kernels.cuda.dispatch import Cfg

try:
    import cupy
except ImportError:  # CI: no CuPy at all
    cupy = None

pytestmark = [pytest.mark.gpu]
TOL = 2e-3


def _y(b, w, x, cfg):
    """y of one call, the split-K partials poisoned first; the tickets left at zero."""
    with b.ctx.dev, b.stream:
        b.launcher.ws.array("part", (1 << 20,), np.float32).fill(np.nan)
        xd = cupy.asarray(x.view(np.uint16) if x.dtype == BFLOAT16 else x)
        y = b.run(w, xd, x.dtype, "mma_f16", cfg).get(stream=b.stream)
        left = int(b.launcher.ws.array("tickets", (1024,), np.uint32).sum().get(
            stream=b.stream))
    assert left == 0, "tickets must be left at zero for the next call"
    assert np.isfinite(y).all(), "unwritten or non-finite outputs"
    return y


@pytest.mark.parametrize("rows, k", [(300, 2304), (1000, 7 * 256), (130, 256)])
def test_first_block_early_is_the_same_sums(be, rng, rows, k):  # noqa: F811
    bpr = k // 256
    splits = sorted({0, 1, 2, 3, bpr} & set(range(bpr + 1)))
    base = [Cfg(nt=1, ksplit=s) for s in splits] + [Cfg(nt=1, warps=4, ksplit=s)
                                                    for s in splits[:2]]
    jobs = [("mma_f16", c, n, dt) for c0 in base for c in (c0, replace(c0, pf=True))
            for n, dt in ((1, np.float16), (5, np.float32), (11, np.float16), (3, BFLOAT16))]
    compile_for(be, jobs, rows, k)
    blocks = random_weight(rng, rows, k)
    soa, pairs = _pair(be, blocks, rows, k)
    aos = load(be, blocks, rows, k, Layout.AOS)
    x = rng.standard_normal((11, k)).astype(np.float32)
    y64 = reference.matmul_float64(x, blocks, rows)
    for c0 in base:
        for n, dt in ((1, np.float16), (5, np.float32), (11, np.float16)):
            xs = x[:n].astype(dt)
            label = f"{c0.label()} N={n} {np.dtype(dt).name} {rows}x{k}"
            y_off = _y(be, pairs, xs, c0)
            y_on = _y(be, pairs, xs, replace(c0, pf=True))
            _same(y_off, y_on, label + " pf")
            _same(_y(be, soa, xs, replace(c0, pf=True)), y_on, label + " SoA")
            _same(_y(be, aos, xs, replace(c0, pf=True)), y_on, label + " AoS")
            assert rel_fro(y_on, y64[:n]) <= TOL, (label, rel_fro(y_on, y64[:n]))
        xb = x[:3].astype(BFLOAT16)  # the bf16 reader of the same tile
        _same(_y(be, pairs, xb, c0), _y(be, pairs, xb, replace(c0, pf=True)), f"{c0} bf16")
