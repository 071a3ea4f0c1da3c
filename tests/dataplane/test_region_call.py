"""The CUDA backend's region call (``kernels/cuda/launch.py`` ``RegionCall``) without a device,
on tests/kernels/test_cuda_backend_host.py's fake CuPy (real copies, counted kernels, capture
into a replayable graph): a call whose x and y lie in page-locked host memory and whose route
asks for it (``Route.want``) leaves a region call that repeats it -- x DMA'd from the region,
y (converted to f16 where asked) DMA'd into it, as direct launches and then one graph per
launch slot; with copy streams (``Q6SERVE_REGION_STREAMS``, on by default) a call launched
beside another in flight passes x and y through its launch slot's own device buffers -- valid
until an unpin or the weight's data changes; a Q8_1 call leaves
none."""

from __future__ import annotations

import numpy as np
import pytest

from q6serve.kernels.api import KernelFlags, Precision
from q6serve.kernels.cuda.launch import SLOTS, RegionCall
from tests.kernels.test_cuda_backend_host import _Fn, _set_y, _Stream, fake_backend, fake_weight

ROWS, K = 4096, 14336  # a shape of the dispatch table (its cells settle the path)


def _backend(monkeypatch, streams: bool = False):
    """The fake backend; ``streams``: RegionCall's copy streams on (the fake runs every
    stream's work in program order, so what is checked is which buffers the bytes pass).
    Every kernel and conversion must be launched with the backend's stream current (CuPy
    launches on the current stream: one launched beside a capture is not in the graph)."""
    be, cp = fake_backend(monkeypatch)
    current: list = []
    monkeypatch.setattr(_Stream, "__enter__", lambda self: current.append(self) or self)
    monkeypatch.setattr(_Stream, "__exit__", lambda self, *a: current.pop())

    def on_main(fn):
        def checked(*a, **kw):
            assert current and current[-1] is be.ctx.stream, "launched off the backend's stream"
            return fn(*a, **kw)

        return checked

    monkeypatch.setattr(_Fn, "__call__", on_main(_Fn.__call__))
    monkeypatch.setattr(cp, "copyto", on_main(cp.copyto))
    be.launcher.region_streams = streams  # (on by default: Q6SERVE_REGION_STREAMS)
    if streams:
        monkeypatch.setattr(cp.cuda, "Stream", lambda non_blocking=False: _Stream(cp),
                            raising=False)
        monkeypatch.setattr(_Stream, "wait_event", lambda self, ev: None, raising=False)
    return be, cp


def _region(be, n: int, out: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A page-locked buffer with an f16 x [n, K] and a y [n, ROWS] of ``out`` in it."""
    xb, yb = n * K * 2, n * ROWS * np.dtype(out).itemsize
    buf = np.zeros(xb + yb + 4096, np.uint8)
    addr = buf.ctypes.data
    assert be.hostio.pin(addr, buf.nbytes)
    x = buf[:xb].view(np.float16).reshape(n, K)
    y = buf[xb : xb + yb].view(out).reshape(n, ROWS)
    return buf, x, y, addr


def _first(be, w, x: np.ndarray, y: np.ndarray, out: np.dtype, want: bool = True,
           precision: Precision = Precision.AUTO, flags: KernelFlags | None = None):
    """The call launched the usual way with its route asking for a region call: the route."""
    r = be.hostio.route(x, y)
    r.want = want
    kw = {} if flags is None else {"flags": flags}
    res = be.launch(w, x, out_dtype=out, precision=precision, **kw).wait()
    assert be.hostio.unroute(r) and res.y is y  # y taken: DMA'd into the region
    return r


@pytest.mark.parametrize("streams", [False, True], ids=["one-stream", "copy-streams"])
@pytest.mark.parametrize("n,out", [(64, np.float32), (64, np.float16), (1, np.float32),
                                   (8, np.float16)])
def test_region_call_repeats_the_call_in_one_graph(monkeypatch, n, out, streams):
    """One call at a time: with the copy streams on too, a call launched alone runs on the
    one stream (nothing in flight to overlap)."""
    be, cp = _backend(monkeypatch, streams)
    w = fake_weight(be, ROWS, K)
    rng = np.random.default_rng(7)
    buf, x, y, _ = _region(be, n, np.dtype(out))
    x[...] = rng.standard_normal((n, K))
    r = _first(be, w, x, y, out)
    rc = r.call
    assert isinstance(rc, RegionCall) and rc.live()
    choice = be.choose(n, Precision.AUTO, KernelFlags(), ROWS, K)
    rc.launch().wait()  # the first: bound (the slot's own buffers exist from here), direct
    graphs = cp.counts.get("graph", 0)
    for i in range(5):
        x[...] = rng.standard_normal((n, K))  # a new x at the same place each call
        want = _set_y(be, w, n, 10 + i)
        ws = be.launcher.ws
        res = rc.launch().wait()
        assert res.y is y and np.array_equal(y, want.astype(out))
        xd = ws._dev["x"].a
        assert np.array_equal(xd[: x.nbytes], x.reshape(-1).view(np.uint8))
        assert res.timing.seconds() == pytest.approx(25e-6)
        assert res.kernel == f"cuda.{choice.path}.soa" and res.precision is choice.precision
    # one call at a time: slot 0's sequence, direct twice (the second captured), then graphs
    assert cp.counts["graph"] - graphs == 4
    assert not any(be.launcher.ws._held)
    assert rc._sseqs == [None] * SLOTS and "rx0" not in be.launcher.ws._dev
    del buf


@pytest.mark.parametrize("streams", [False, True], ids=["one-stream", "copy-streams"])
def test_region_call_two_in_flight_use_both_slots(monkeypatch, streams):
    be, _ = _backend(monkeypatch, streams)
    w = fake_weight(be, ROWS, K)
    _, x, y, _ = _region(be, 64, np.dtype(np.float32))
    rc = _first(be, w, x, y, np.float32).call
    for _ in range(3):
        a, b = rc.launch(), rc.launch()
        a.wait(), b.wait()
    if streams:  # the first alone on one stream, the second beside it on the copy streams
        assert rc._seqs[0].graph and rc._sseqs[1].graph
        assert rc._seqs[1] is None and rc._sseqs[0] is None
    else:
        assert all(s is not None and s.graph for s in rc._seqs[:2])
    held = [rc.launch() for _ in range(SLOTS)]
    from q6serve.kernels.errors import DeviceError

    with pytest.raises(DeviceError):
        rc.launch()  # every slot in flight
    for h in held:
        h.wait()
    assert not any(be.launcher.ws._held)


def test_region_call_stale_after_an_unpin_or_a_freed_weight(monkeypatch):
    be, _ = fake_backend(monkeypatch)
    w = fake_weight(be, ROWS, K)
    _, x, y, _ = _region(be, 64, np.dtype(np.float32))
    other = np.zeros(8192, np.uint8)
    assert be.hostio.pin(other.ctypes.data, other.nbytes)
    rc = _first(be, w, x, y, np.float32).call
    assert rc.live()
    be.hostio.unpin(other.ctypes.data)  # any unpin: the addresses bound may be gone
    assert not rc.live()
    rc = _first(be, w, x, y, np.float32).call
    be.free(w)
    assert not rc.live()


def test_no_region_call_unless_asked_or_for_q8_1(monkeypatch):
    """No region call for a route that did not ask, nor for a Q8_1 call (``launch_ieee``
    checks its x for non-finite rows each call), nor for a call not routed into a region."""
    be, _ = fake_backend(monkeypatch)
    w = fake_weight(be, ROWS, K)
    _, x, y, _ = _region(be, 64, np.dtype(np.float32))
    assert _first(be, w, x, y, np.float32, want=False).call is None
    r = _first(be, w, x, y, np.float32, precision=Precision.Q8_1,
               flags=KernelFlags(decode_mmq=True))
    assert r.call is None


@pytest.mark.parametrize("out", [np.float32, np.float16])
def test_copy_streams_only_beside_a_call_in_flight(monkeypatch, out):
    """With the copy streams on, a call launched while another is in flight passes x and y
    through its slot's own buffers (copy-in / copy-out streams), the one launched alone through
    the one stream's; each gives its own y, and alone again is one stream again."""
    be, _ = _backend(monkeypatch, streams=True)
    w = fake_weight(be, ROWS, K)
    rng = np.random.default_rng(3)
    buf, x, y, _ = _region(be, 8, np.dtype(out))
    x[...] = rng.standard_normal((8, K))
    rc = _first(be, w, x, y, out).call
    ws = be.launcher.ws
    for i in range(4):  # direct launches, then each kind's graph
        want_a = _set_y(be, w, 8, 20 + i)
        x[...] = rng.standard_normal((8, K))
        xa = x.copy()
        a = rc.launch()  # alone: the one stream, slot 0
        assert np.array_equal(y, want_a.astype(out))  # (the fake runs each copy at once)
        assert np.array_equal(ws._dev["x"].a[: x.nbytes], xa.reshape(-1).view(np.uint8))
        want_b = want_a + 1000
        if i:  # (the first binds the slot's own buffers: set after it)
            ws._dev["ry1"].a[: want_b.nbytes] = want_b.reshape(-1).view(np.uint8)
        x[...] = rng.standard_normal((8, K))
        b = rc.launch()  # beside a: the copy streams, slot 1
        assert np.array_equal(ws._dev["rx1"].a[: x.nbytes], x.reshape(-1).view(np.uint8))
        if i:
            assert np.array_equal(y, want_b.astype(out))
        assert a.wait().y is y and b.wait().y is y
    assert rc._seqs[0].graph and rc._sseqs[1].graph
    assert rc._seqs[1] is None and rc._sseqs[0] is None
    assert not any(ws._held)
    want = _set_y(be, w, 8, 99)
    rc.launch().wait()  # alone again: the one stream
    assert np.array_equal(y, want.astype(out)) and rc._sseqs[0] is None
    del buf


def test_copy_streams_on_by_default():
    from q6serve.kernels.cuda.launch import region_streams_from_env

    assert region_streams_from_env({}) and region_streams_from_env({"Q6SERVE_REGION_STREAMS": ""})
    assert not region_streams_from_env({"Q6SERVE_REGION_STREAMS": "0"})
