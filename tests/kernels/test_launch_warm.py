"""``launch.MANY_WARM`` (session 27's A/B of a single-weight call's launch right after a
multi-weight call): a cached multi-weight call launches, after its completion event, the
launcher's one-empty-kernel graph, captured once; off (the default) it launches nothing more.
The fake device of tests/kernels/test_cuda_backend_host.py counts graph launches and kernels."""

from __future__ import annotations

import numpy as np
import pytest

from q6serve.kernels.cuda import launch as launch_mod
from tests.kernels.test_cuda_backend_host import QKV, _set_many_y, fake_backend, fake_weight


class _Kernel:
    """A fake RawKernel: counts its runs on the fake device (or records them under capture)."""

    def __init__(self, cp, name: str) -> None:
        self.cp, self.name, self.kernel = cp, name, object()

    def __call__(self, grid, block, args, stream=None) -> None:
        self.cp.op(lambda: self.cp.count(self.name))


@pytest.mark.parametrize("warm", [0, 1])
def test_many_warm_launches_the_empty_graph_after_the_event(monkeypatch, warm):
    monkeypatch.setattr(launch_mod, "MANY_WARM", warm)
    be, cp = fake_backend(monkeypatch)
    cp.RawKernel = lambda src, name: _Kernel(cp, name)
    order: list[str] = []
    done = be.launcher.ws.done_event(0)
    rec = type(done).record

    def record(ev, stream=None) -> None:
        order.append("done" if ev is done else "event")
        rec(ev, stream)

    monkeypatch.setattr(type(done), "record", record)
    ws = [fake_weight(be, r, k) for r, k in QKV]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 3584)).astype(np.float16)
    for _ in range(3):  # direct, capture, then the cached ManyCall
        be.launch_many(ws, x).wait()
    graphs, nops = cp.counts.get("graph", 0), cp.counts.get("q6_timing_anchor", 0)
    order.clear()
    for i in range(4):
        ys = _set_many_y(be, [r for r, _ in QKV], 1, i)
        res = be.launch_many(ws, x).wait()
        for r, y in zip(res, ys, strict=True):
            np.testing.assert_array_equal(r.y, y)
    # 4 cached calls: one graph each, and with MANY_WARM the empty-kernel graph after each
    assert cp.counts["graph"] - graphs == 4 * (1 + warm)
    assert cp.counts.get("q6_timing_anchor", 0) - nops == 4 * warm
    assert order == ["done"] * 4  # (the graph's own events are nodes of it)
    lc = be.launcher
    assert (lc._warm is None) == (not warm)


def test_warm_graph_refused_capture_launches_nothing(monkeypatch):
    be, cp = fake_backend(monkeypatch)
    cp.RawKernel = lambda src, name: _Kernel(cp, name)

    def refuse(mode=None) -> None:
        raise RuntimeError("capture refused")

    monkeypatch.setattr(be.ctx.stream, "begin_capture", refuse)
    lc = be.launcher
    lc.warm_graph()
    lc.warm_graph()
    assert lc._warm is False and cp.counts.get("graph", 0) == 0
    assert cp.counts.get("q6_timing_anchor", 0) == 0
