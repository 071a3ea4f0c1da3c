"""A layout flip reserves the copy it holds (issue 18, item 11).

The NumPy backend builds a weight's new slabs before it lets go of the old ones, so a flip
holds two copies; the engine reserves the second (``Backend.relayout_scratch_nbytes``) and a
flip that does not fit the budget is refused, leaving the weight as it was.
"""

from __future__ import annotations

import numpy as np

from q6serve.kernels.api import Layout
from q6serve.kernels.backends import make_backend
from q6serve.service.config import Budget, WorkerConfig
from tests.reliability.harness import RunningWorker, health, random_q6k, reference, vram_figures
from tests.service.svc_util import assert_close, wait_until

ROWS, K = 2048, 1024  # 1.7 MB of Q6_K


def test_numpy_relayout_scratch_is_the_old_copy():
    b = make_backend("numpy")
    try:
        to_aos = b.relayout_scratch_nbytes(ROWS, K, Layout.AOS, 1 << 20)
        assert to_aos >= b.weight_nbytes(ROWS, K, Layout.SOA)
        assert b.relayout_scratch_nbytes(ROWS, K, Layout.SOA, 1 << 20) == b.weight_nbytes(
            ROWS, K, Layout.AOS)
    finally:
        b.close()


def test_a_flip_that_does_not_fit_twice_is_refused_and_the_weight_kept(rng):
    # room for the weight and its matmul workspace, not for a second copy of it
    probe = make_backend("numpy")
    wbytes = probe.weight_nbytes(ROWS, K, Layout.SOA)
    probe.close()
    n = 256  # max(max_batch_rows, max_request_rows) of the config below
    workspace = n * (K + ROWS) * 4
    rw = RunningWorker(WorkerConfig(port=0, max_request_rows=n, max_batch_rows=64,
                                    vram_budget=Budget(nbytes=wbytes * 3 // 2 + workspace)))
    try:
        c = rw.client()
        blocks = random_q6k(ROWS, K, 3)
        c.upload("w", blocks, ROWS, K)
        before = vram_figures(c)
        c.flags({"Q6SERVE_Q6K_SOA": False})
        wait_until(lambda: not c.status().relayout_in_progress, what="the relayout to end")
        assert c.get("w").layout == "soa"  # refused: the budget holds one copy only
        assert vram_figures(c) == before
        x = rng.standard_normal((2, K)).astype(np.float32)
        assert_close(c.matmul("w", x), reference(blocks, ROWS, K, x))
        assert health(rw.target) == "SERVING"
    finally:
        rw.stop()
