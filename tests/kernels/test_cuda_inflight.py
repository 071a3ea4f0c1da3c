"""Launches in flight on one CudaBackend (kernels/cuda/launch.py, point 5: launch slots; SLOTS,
3 by default, Q6SERVE_LAUNCH_SLOTS).

CPU: the slot bookkeeping (which slot the next launch takes, a launch past SLOTS refused while
they await their waits). GPU (``-m gpu``): batches launched before the first's wait until every
slot is taken - same weight and N (the same bound sequence in each slot), small and large y, the
top-k epilogue, activations built in place in each slot's staging buffer - give bit-identical
results and kernel times; one more launch raises until one wait is called."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from test_cuda_backend import _gpu_count, load, random_weight

from q6serve.kernels.api import Layout
from q6serve.kernels.cuda.launch import SLOTS, Workspace
from q6serve.kernels.errors import DeviceError


def test_slots_go_to_the_first_free_one_and_a_launch_past_them_is_refused() -> None:
    ws = Workspace(SimpleNamespace())
    assert SLOTS >= 2
    for s in range(SLOTS):
        assert ws.free_slot() == s
        ws.take(s)
    with pytest.raises(DeviceError, match="in flight"):
        ws.free_slot()
    ws.release(0)
    assert ws.free_slot() == 0
    for s in range(1, SLOTS):
        ws.release(s)
    assert ws.free_slot() == 0


@pytest.fixture(scope="module")
def be():
    if _gpu_count() == 0:
        pytest.skip("needs CuPy and a CUDA GPU")
    from q6serve.kernels.cuda_backend import CudaBackend

    b = CudaBackend(0)
    yield b
    b.close()


def _same(a, b) -> None:
    if a.topk is not None:
        np.testing.assert_array_equal(a.topk.values, b.topk.values)
        np.testing.assert_array_equal(a.topk.indices, b.topk.indices)
        np.testing.assert_array_equal(a.topk.lse, b.topk.lse)
    else:
        np.testing.assert_array_equal(a.y, b.y)
    assert a.timing.seconds() is not None and a.timing.seconds() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("n, out, topk", [(1, np.float16, 0), (8, None, 0), (64, None, 0),
                                          (64, np.float16, 0), (16, None, 8)])
@pytest.mark.parametrize("staged", [False, True])
def test_launches_in_flight_equal_one_at_a_time(be, n, out, topk, staged) -> None:
    rng = np.random.default_rng(7)
    # y of N=64 f32 is 1 MiB (past SMALL_Y): both ways out of the launcher are taken
    w = load(be, random_weight(rng, 4096, 2048), 4096, 2048, Layout.SOA)
    xs = [rng.standard_normal((n, 2048)).astype(np.float16) for _ in range(SLOTS + 1)]
    want = [be.matmul(w, x, out_dtype=out, topk=topk) for x in xs]  # one at a time
    for _ in range(3):  # the first calls bind, then capture: every path of the sequence
        got = []
        launched = []
        waited = 0
        try:
            for x in xs[:SLOTS]:  # every slot taken
                if staged:  # built in place in the next launch's slot
                    st = be.staging(n, 2048, np.float16)
                    st[...] = x
                    x = st
                launched.append(be.launch(w, x, out_dtype=out, topk=topk))
            with pytest.raises(DeviceError, match="in flight"):
                be.launch(w, xs[SLOTS], out_dtype=out, topk=topk)
            got.append(launched[0].wait())
            waited = 1
            # a slot is free again
            launched.append(be.launch(w, xs[SLOTS], out_dtype=out, topk=topk))
            for c in launched[1:]:
                got.append(c.wait())
                waited += 1
        finally:  # a failed check leaves no slot held for the tests after it
            for c in launched[waited:]:
                c.wait()
        for g, h in zip(got, want, strict=True):
            _same(g, h)
    be.free(w)
