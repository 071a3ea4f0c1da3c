"""GPU: the K-slice tile's two-blocks-ahead loop (session 19: ``q6k_ks_f16`` at one or two
n-tiles and 12 warps keeps two weight blocks in flight per warp, loads on their own (tile,
block) iterator) computes what the one-block-ahead loop at 8 warps does, bit for bit, at the
same K split (also as the cluster-sum tile, src 7): warps with several tiles (the load
iterator crossing into the next tile), an odd number of blocks per warp (the second slot's
guard), a warp without a tile, uneven slices, one block per CTA; pair-stream, SoA and AoS
weights, every activation dtype, token chunks past 8; and the float64 reference within F16's
bound."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_cuda_backend import load, random_weight, rel_fro
from test_cuda_pairs import _pair, _same, be, compile_for  # noqa: F401 (be: the fixture)
from test_cuda_src2_pf import _y

from q6serve.kernels import reference
from q6serve.kernels.api import BFLOAT16, Layout
from q6serve.kernels.cuda.dispatch import Cfg

pytestmark = [pytest.mark.gpu]
TOL = 2e-3


# 4000 rows: 250 warp tiles, so a small grid gives a warp several tiles; 130 rows: 9 tiles, so
# most of a 12-warp CTA has none; 7 and 13 blocks per row: odd per-warp block counts
# (two n-tiles on one shape: each further shape compiles its own programs)
@pytest.mark.parametrize("rows, k, nt", [(4000, 13 * 256, 1), (130, 7 * 256, 1),
                                         (1000, 2304, 1), (4000, 13 * 256, 2)])
def test_two_blocks_ahead_is_the_same_sums(be, rng, rows, k, nt):  # noqa: F811
    bpr = k // 256
    splits = sorted({0, 1, 2, 3, bpr} & set(range(bpr + 1)))
    d1 = [Cfg(nt=nt, src=4, pf=True, warps=8, ksplit=s) for s in splits]
    d2 = [replace(c, warps=12) for c in d1]
    # the cluster form (src 7: the split-K sum in the cluster, round by round) at 12 warps: the
    # same bits as src 4 at its split
    cl = [s for s in (2, 3) if s <= bpr]
    d1 += [Cfg(nt=nt, src=4, pf=True, warps=8, ksplit=s) for s in cl]
    d2 += [Cfg(nt=nt, src=7, pf=True, warps=12, ksplit=s) for s in cl]
    dts = ((1, np.float16), (5, np.float32), (11, np.float16), (3, BFLOAT16))
    jobs = [("mma_f16", c, n, dt) for c in d1 + d2 for n, dt in dts]
    compile_for(be, jobs, rows, k)
    blocks = random_weight(rng, rows, k)
    soa, pairs = _pair(be, blocks, rows, k)
    aos = load(be, blocks, rows, k, Layout.AOS)
    x = rng.standard_normal((11, k)).astype(np.float32)
    y64 = reference.matmul_float64(x, blocks, rows)
    for a, b in zip(d1, d2, strict=True):
        if a.ksplit == 0:
            continue  # the occupancy's own split differs between 8 and 12 warps: below
        for n, dt in dts:
            xs = x[:n].astype(dt)
            label = f"{b.label()} N={n} {np.dtype(dt).name} {rows}x{k}"
            y2 = _y(be, pairs, xs, b)
            _same(_y(be, pairs, xs, a), y2, label + " vs 8 warps")
            if dt is not BFLOAT16:
                _same(_y(be, soa, xs, b), y2, label + " SoA")
                if dt is np.float16:  # (AoS names compile one program each: f16 only)
                    _same(_y(be, aos, xs, b), y2, label + " AoS")
                assert rel_fro(y2, y64[:n]) <= TOL, (label, rel_fro(y2, y64[:n]))
    # the occupancy's own split (ksplit 0): the reference, and SoA/AoS twins bit-identical
    b = d2[0]
    for n, dt in ((1, np.float16), (11, np.float16), (5, np.float32)):
        xs = x[:n].astype(dt)
        y2 = _y(be, pairs, xs, b)
        if dt is np.float16:
            _same(_y(be, aos, xs, b), _y(be, soa, xs, b), f"{b.label()} N={n} AoS/SoA")
        assert rel_fro(y2, y64[:n]) <= TOL, (b.label(), n, rel_fro(y2, y64[:n]))
