"""Session 14's K-slice launch shapes (``-m gpu``; skipped without CuPy or a GPU): 8 n-tiles
at 12 warps per CTA and 4 at 16, without the register prefetch (the table's 4096x14336 N=64
cell; both offered by bench/kernels.py --tune). A module of its own with a light fixture: only
these names are compiled (test_cuda_ks.py's fixture compiles every K-slice shape first).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_cuda_backend import _gpu_count
from test_cuda_ks import check_activation_dtype, sweep_slice_counts

from q6serve.kernels.cuda.dispatch import Cfg

pytestmark = [pytest.mark.gpu]


@pytest.fixture(scope="module")
def be():
    if _gpu_count() == 0:
        pytest.skip("needs CuPy and a CUDA device")
    from q6serve.kernels.cuda_backend import CudaBackend

    b = CudaBackend(0)
    yield b
    b.close()


KS14_CFGS = (Cfg(nt=8, src=4, warps=12), Cfg(nt=4, src=4, warps=16))


def _prefetch14(be, cfgs, in_types=("InF16",)):
    from q6serve.kernels.cuda.launch import kernel_name

    lays = (True, False, 2) if be.storage.pairs else (True, False)
    names = [kernel_name("mma_f16", c, soa, t) for c in cfgs for soa in lays for t in in_types]
    with be.ctx.dev:
        be.ctx.prefetch("q6k_matmul.cu", names, threads=16)


def test_session14_launch_shapes(be, rng):
    """The session-14 shapes at forced slice counts, several token chunks: reference, repeat
    and AoS twin identical; f32 activations."""
    _prefetch14(be, KS14_CFGS, ("InF16", "InF32"))
    sweep_slice_counts(be, rng, (300, 2304), KS14_CFGS)
    check_activation_dtype(be, rng, np.float32, KS14_CFGS)
