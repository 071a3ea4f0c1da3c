"""api.launch_ieee on the CUDA backend's host path (the fake CuPy of test_cuda_backend_host):
a call at precision AUTO costs the host what one at F16 does - no plan() query per call - on a
backend that never resolves AUTO to Q8_1 (``Backend.no_q8_1``), and a backend that may still
asks (its non-finite rows then take the exact kernel)."""

from __future__ import annotations

import numpy as np
import pytest

from q6serve.kernels.api import (
    DTYPES,
    Backend,
    KernelFlags,
    Precision,
    launch_ieee,
    launch_many_ieee,
)
from tests.kernels.test_cuda_backend_host import fake_backend, fake_weight


def _counting(monkeypatch, be) -> dict[str, int]:
    """Counts of ``be``'s dispatch questions (plan, choose) from now on."""
    got = {"plan": 0, "choose": 0}
    plan, choose = be.plan, be.dispatch.choose

    def counted_plan(*a, **kw):
        got["plan"] += 1
        return plan(*a, **kw)

    def counted_choose(*a, **kw):
        got["choose"] += 1
        return choose(*a, **kw)

    monkeypatch.setattr(be, "plan", counted_plan)
    monkeypatch.setattr(be.dispatch, "choose", counted_choose)
    return got


@pytest.mark.parametrize("n", [1, 64])
def test_a_repeated_auto_call_asks_no_more_than_f16(monkeypatch, n):
    """The worker's way (one flags object, the out dtype's object): once bound and cached, a
    call at AUTO and one at F16 ask the dispatch nothing (session 25's bundles E/F read AUTO
    15-45% dearer a replay step; its one per-call difference was launch_ieee's plan()), and
    give the same y."""
    be, _ = fake_backend(monkeypatch)
    w = fake_weight(be, 4096, 14336)
    flags, out = KernelFlags(), DTYPES["f16"]
    x = np.ones((n, 14336), np.float16)
    for prec in (Precision.AUTO, Precision.F16):
        for _ in range(3):  # bound, captured, cached
            launch_ieee(be, w, x, precision=prec, flags=flags, out_dtype=out).wait()
    got = _counting(monkeypatch, be)
    ys = {}
    for prec in (Precision.AUTO, Precision.F16, Precision.AUTO):
        got["plan"] = got["choose"] = 0
        for _ in range(4):
            r = launch_ieee(be, w, x, precision=prec, flags=flags, out_dtype=out).wait()
        assert got == {"plan": 0, "choose": 0}, prec
        assert r.precision is Precision.F16 and r.kernel.startswith("cuda.mma_f16")
        ys.setdefault(prec, r.y)
    assert np.array_equal(ys[Precision.AUTO], ys[Precision.F16])


def test_a_multi_weight_auto_call_asks_nothing_either(monkeypatch):
    """launch_many_ieee at AUTO: no plan() per part on the CUDA backend."""
    be, _ = fake_backend(monkeypatch)
    ws = [fake_weight(be, 3584, 3584), fake_weight(be, 512, 3584)]
    x = np.ones((1, 3584), np.float16)
    for _ in range(3):
        launch_many_ieee(be, ws, x, precision=Precision.AUTO, flags=KernelFlags()).wait()
    got = _counting(monkeypatch, be)
    launch_many_ieee(be, ws, x, precision=Precision.AUTO, flags=KernelFlags()).wait()
    assert got["plan"] == 0


def test_a_backend_that_may_resolve_auto_to_q8_1_is_still_asked(monkeypatch):
    """Without AUTO in its ``no_q8_1`` (the base class's default) a call at AUTO asks plan(),
    so a backend whose AUTO may be Q8_1 keeps its non-finite rows exact."""
    be, _ = fake_backend(monkeypatch)
    monkeypatch.setattr(be, "no_q8_1", Backend.no_q8_1)
    w = fake_weight(be, 4096, 14336)
    x = np.ones((1, 14336), np.float16)
    got = _counting(monkeypatch, be)
    launch_ieee(be, w, x, precision=Precision.AUTO, flags=KernelFlags()).wait()
    assert got["plan"] == 1
    got["plan"] = 0
    launch_ieee(be, w, x, precision=Precision.F16, flags=KernelFlags()).wait()
    assert got["plan"] == 0
