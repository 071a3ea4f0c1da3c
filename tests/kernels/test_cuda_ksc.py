"""The K-slice tile with its split-K sum inside a thread-block cluster (``src=7``,
``q6k_ksc_f16``; ``-m gpu``, compute capability 9.0+; session 15's experiment): at every forced
cluster size it adds the slices' partial sums in q6k_sum_parts's order, so its y is src 4's at
the same K split bit for bit; reference, repeat and AoS twin identical, several token chunks,
rows that fill no whole round.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_cuda_backend import _gpu_count, load, random_weight
from test_cuda_ks import _run, check_tokens, same_bits

from q6serve.kernels import reference
from q6serve.kernels.api import Layout
from q6serve.kernels.cuda.dispatch import Cfg

pytestmark = [pytest.mark.gpu]
# (shape, cluster sizes that cut its K blocks into exactly that many slices), launch shapes
CASES = (((300, 2048), (2, 8)), ((517, 1792), (7,)))
KSC = (Cfg(nt=1, src=7, pf=True), Cfg(nt=2, src=7, pf=True, warps=16),
       Cfg(nt=8, src=7, warps=12))


@pytest.fixture(scope="module")
def be():
    if _gpu_count() == 0:
        pytest.skip("needs CuPy and a CUDA device")
    from q6serve.kernels.cuda.launch import kernel_name
    from q6serve.kernels.cuda_backend import CudaBackend

    b = CudaBackend(0)
    if int(b.ctx.cc) < 90:
        b.close()
        pytest.skip(f"thread-block clusters: sm_90+ (device is {b.ctx.cc})")
    lays = (True, False, 2) if b.storage.pairs else (True, False)
    names = {kernel_name("mma_f16", replace(c, src=s, ksplit=ks), soa, "InF16")
             for c in KSC for _, kss in CASES for ks in kss for s in (4, 7) for soa in lays}
    with b.ctx.dev:
        b.ctx.prefetch("q6k_matmul.cu", sorted(names), threads=16)
    yield b
    b.close()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0][0]}x{c[0][1]}")
def test_cluster_sum_is_the_split_k_sum_bit_for_bit(be, rng, case):
    (rows, k), sizes = case
    blocks = random_weight(rng, rows, k)
    ws = load(be, blocks, rows, k, Layout.SOA)
    wa = load(be, blocks, rows, k, Layout.AOS)
    x = rng.standard_normal((70, k)).astype(np.float16)
    y64 = reference.matmul_float64(x, blocks, rows)
    for c in KSC:
        for ks in sizes:
            cfg = replace(c, ksplit=ks)
            def src4(n, y, label, cfg=cfg):
                same_bits(y, _run(be, ws, x[:n], replace(cfg, src=4)), f"{label}: not src 4's")

            check_tokens(be, ws, wa, x, y64, cfg, also=src4)


def test_a_k_split_that_is_not_the_cluster_is_refused(be, rng):
    from q6serve.kernels.errors import DeviceError

    rows, k = 300, 2048  # 8 blocks: 3 slices of 3, 3, 2 blocks; 7 would be 4 slices of 2
    w = load(be, random_weight(rng, rows, k), rows, k, Layout.SOA)
    with pytest.raises(DeviceError, match="not 7"):
        _run(be, w, rng.standard_normal((8, k)).astype(np.float16), replace(KSC[0], ksplit=7))
