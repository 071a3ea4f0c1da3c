"""The CUDA backend's host path without a device: a fake CuPy whose copies are real
(``ctypes.memmove``), whose kernels only count their launches and whose stream capture records
the copies and launches into a replayable graph. What it checks: which steps a call takes
(bound sequence, graph, the cached staged call), that the bytes a call returns are the device
y's, and that a staged call after anything that changes its binding takes the full path again."""

from __future__ import annotations

import contextlib
import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from q6serve.kernels.api import BFLOAT16, KernelFlags, Layout, Precision, ResidentWeight
from q6serve.kernels.cuda import launch as launch_mod
from q6serve.kernels.cuda.dispatch import Dispatch, load_default_table
from q6serve.kernels.cuda.launch import Launcher
from q6serve.kernels.cuda.storage import CudaWeight


class _Fn:
    """A compiled kernel: counts its launches (in a graph: each replay)."""

    num_regs = 128
    max_dynamic_shared_size_bytes = 48 << 10

    def __init__(self, dev: _FakeCuda) -> None:
        self.dev = dev

    def __call__(self, grid, block, args, shared_mem=0) -> None:
        self.dev.op(lambda: self.dev.count("kernel"))


class _DevBuf:
    def __init__(self, nbytes: int) -> None:
        self.a = np.zeros(nbytes, np.uint8)
        self.nbytes = nbytes
        self.data = SimpleNamespace(ptr=self.a.ctypes.data, owner=self)


class _DevArray(np.ndarray):
    """A view of a fake device buffer; ``.data.ptr`` its address, as CuPy's."""

    @property
    def data(self):
        return SimpleNamespace(ptr=self.ctypes.data)


class _Pinned(bytearray):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.ptr = np.frombuffer(self, np.uint8).ctypes.data


class _Event:
    def __init__(self, disable_timing: bool = False) -> None:
        self.ptr = id(self)

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Graph:
    def __init__(self, dev: _FakeCuda, ops: list) -> None:
        self.dev, self.ops = dev, ops

    def launch(self, stream) -> None:
        self.dev.count("graph")
        for f in self.ops:
            f()


class _Stream:
    ptr = 1

    def __init__(self, dev: _FakeCuda) -> None:
        self.dev = dev

    def __enter__(self):
        return self

    def __exit__(self, *a) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def begin_capture(self, mode=None) -> None:
        self.dev.capturing = []

    def end_capture(self) -> _Graph:
        ops, self.dev.capturing = self.dev.capturing, None
        return _Graph(self.dev, ops)


class _FakeCuda:
    """The parts of CuPy the launcher uses (``ctx.cp``), run on the host."""

    uint8, float32, float16 = np.uint8, np.float32, np.float16

    def __init__(self) -> None:
        self.capturing: list | None = None
        self.counts: dict[str, int] = {}
        self.bufs: dict[int, _DevBuf] = {}
        dev = self
        self.cuda = SimpleNamespace(
            Event=_Event, alloc_pinned_memory=_Pinned,
            get_elapsed_time=self.elapsed,
            runtime=SimpleNamespace(memcpyAsync=self.memcpy, streamCaptureModeRelaxed=2))
        self.fn = lambda file, name: _Fn(dev)

    unrecorded = False  # events a refused graph node never recorded: no elapsed time

    def elapsed(self, start: _Event, end: _Event) -> float:
        if self.unrecorded:
            raise RuntimeError("event not recorded")
        return 0.025  # ms

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def op(self, f) -> None:
        """Run ``f`` now, or record it into the graph being captured."""
        if self.capturing is not None:
            self.capturing.append(f)
        else:
            f()

    def memcpy(self, dst: int, src: int, n: int, kind: int, stream: int) -> None:
        def run() -> None:
            self.count(("", "h2d", "d2h", "d2d")[kind])
            ctypes.memmove(dst, src, n)

        self.op(run)

    def empty(self, size: int, dtype) -> _DevBuf:
        b = _DevBuf(size)
        self.bufs[b.data.ptr] = b
        return b

    zeros = empty

    def ndarray(self, shape, dtype, memptr) -> np.ndarray:
        a = memptr.owner.a
        a = a[: int(np.prod(shape)) * np.dtype(dtype).itemsize].view(dtype).reshape(shape)
        return a.view(_DevArray)

    def copyto(self, dst: np.ndarray, src: np.ndarray, casting: str = "same_kind") -> None:
        self.op(lambda: np.copyto(dst, src, casting=casting))


def fake_backend(monkeypatch, graphs: bool = True):
    """A :class:`CudaBackend` on :class:`_FakeCuda` (the committed dispatch table)."""
    from q6serve.kernels.cuda_backend import CudaBackend
    from q6serve.kernels.hostio import HostIO

    monkeypatch.setattr(launch_mod, "_external_record", lambda: (lambda ev, st, flags: 0))
    cp = _FakeCuda()
    ctx = SimpleNamespace(cp=cp, sm_count=132, smem_sm=233472, cc="90", fn=cp.fn,
                          dev=contextlib.nullcontext(), stream=_Stream(cp))
    be = object.__new__(CudaBackend)
    be.ctx, be.device, be.sm_count, be.cc = ctx, 0, 132, "90"
    be.dispatch = Dispatch(load_default_table(), 132)
    be.launcher = Launcher(ctx, graphs=graphs)
    be.hostio = HostIO(lambda p, n: None, lambda p: None, lambda: None)
    return be, cp


def fake_weight(be, rows: int, k: int) -> ResidentWeight:
    cw = CudaWeight(slabs=[], table=be.ctx.cp.empty(64, np.uint8), rps=rows)
    return ResidentWeight(rows, k, Layout.SOA, rows * k, cw)


def _set_y(be, w, n: int, i: int) -> np.ndarray:
    """Known values in the fake device's y (what the kernels would have written)."""
    y = (np.arange(n * w.rows, dtype=np.float32) % 1000 - 500 + i).reshape(n, w.rows)
    be.launcher.ws._dev["y"].a[: y.nbytes] = y.reshape(-1).view(np.uint8)
    return y


def _x(be, rng, n: int, k: int, staged: bool) -> np.ndarray:
    x = rng.standard_normal((n, k)).astype(np.float16)
    if staged:
        st = be.staging(n, k, np.float16)
        st[...] = x
        return st
    return x


@pytest.mark.parametrize("rows,n,out", [(4096, 1, None), (14336, 1, None), (4096, 16, None),
                                        (4096, 64, None), (4096, 16, np.float16),
                                        (4096, 1, np.float16), (4096, 8, BFLOAT16)])
@pytest.mark.parametrize("staged", [True, False])
def test_calls_return_the_device_y(monkeypatch, rows, n, out, staged):
    """Every call (direct launches, capture, graph replays; staged or copied x) hands back
    the device y's bytes in the asked dtype, and x reaches the device unchanged."""
    be, cp = fake_backend(monkeypatch)
    k = 14336 if rows == 4096 else 4096  # the 48 MB shapes of the dispatch table
    w = fake_weight(be, rows, k)
    rng = np.random.default_rng(1)
    be.matmul(w, _x(be, rng, n, k, staged), out_dtype=out)  # binds: the buffers exist now
    for i in range(5):
        y = _set_y(be, w, n, i)
        x = _x(be, rng, n, k, staged)
        xb = x.copy()
        res = be.launch(w, x, out_dtype=out).wait()
        want = y if out is None else y.astype(out)
        assert res.y.dtype == want.dtype and np.array_equal(res.y, want)
        ws = be.launcher.ws
        assert np.array_equal(ws._dev["x"].a[: xb.nbytes], xb.reshape(-1).view(np.uint8))
        assert res.timing.seconds() == pytest.approx(25e-6)
        assert res.kernel == f"cuda.{be.choose(n, Precision.AUTO, KernelFlags(), rows, k).path}.soa"
    assert cp.counts["graph"] == 4  # the first two calls ran direct launches, then captured


@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("n", [16, 64])
def test_larger_f16_y_converted_in_the_graph(monkeypatch, n, staged):
    """Launcher.y16_graph: a larger f16 y (> SMALL_Y) is converted by the bound sequence (in
    its graph) instead of a CuPy launch per call; every call (direct, capture, replays; the
    cached BoundCall) still hands back the device y's bytes as f16, and the conversion is one
    graph node, not a launch per call."""
    be, cp = fake_backend(monkeypatch)
    assert be.launcher.y16_graph  # the default
    rows, k = 4096, 14336
    w = fake_weight(be, rows, k)
    rng = np.random.default_rng(2)
    be.matmul(w, _x(be, rng, n, k, staged), out_dtype=np.float16)
    converts = []
    monkeypatch.setattr(be.launcher, "_y_out", lambda *a: converts.append(a) or a[0])
    for i in range(5):
        y = _set_y(be, w, n, i)
        res = be.launch(w, _x(be, rng, n, k, staged), out_dtype=np.float16).wait()
        assert res.y.dtype == np.float16 and np.array_equal(res.y, y.astype(np.float16))
    assert not converts  # never a per-call conversion
    assert cp.counts["graph"] == 4


def _counted(monkeypatch, seed: int):
    """A fake backend whose full path (``CudaBackend._launch``) counts its calls into
    ``full``, a 4096x14336 weight on it, a generator: (be, cp, full, w, rng)."""
    be, cp = fake_backend(monkeypatch)
    full: list = []
    orig = be._launch
    monkeypatch.setattr(be, "_launch", lambda *a, **kw: full.append(1) or orig(*a, **kw))
    return be, cp, full, fake_weight(be, 4096, 14336), np.random.default_rng(seed)


@pytest.mark.parametrize("staged", [True, False])
def test_a_captured_call_takes_the_bound_call(monkeypatch, staged):
    """After its sequence is a graph a call is the cached BoundCall (no checks, dispatch or
    binding again); anything that changes the binding (a buffer grown by a larger call) sends
    the next call through the full path again, which rebinds, recaptures and re-caches."""
    be, cp, full, w, rng = _counted(monkeypatch, 2)
    for _ in range(6):
        be.launch(w, _x(be, rng, 16, 14336, staged)).wait()
    assert len(full) == 2 and cp.counts["graph"] == 4  # direct, direct + capture, then 4 graphs
    be.matmul(w, rng.standard_normal((64, 14336)).astype(np.float16))  # grows x and y
    full.clear()
    for i in range(4):
        y = _set_y(be, w, 16, i) if i >= 2 else None
        res = be.launch(w, _x(be, rng, 16, 14336, staged)).wait()
        if y is not None:
            assert np.array_equal(res.y, y)
    assert len(full) == 2  # rebound and recaptured: direct, direct + capture, then cached again


def test_bound_calls_keep_the_slots_and_the_checks(monkeypatch):
    """Two staged launches in flight (one per slot) return their own y; a third launch, a
    staged buffer still in flight, a wrong K, an unsupported dtype and a freed weight are
    refused as on the full path."""
    from q6serve.kernels.errors import DeviceError, FormatError

    be, _, full, w, rng = _counted(monkeypatch, 3)
    for _ in range(3):  # both slots captured
        a = be.launch(w, _x(be, rng, 8, 14336, True))
        b = be.launch(w, _x(be, rng, 8, 14336, True))
        a.wait(), b.wait()
    full.clear()
    ya = _set_y(be, w, 8, 1)
    a = be.launch(w, _x(be, rng, 8, 14336, True))
    yb = _set_y(be, w, 8, 2)
    st = _x(be, rng, 8, 14336, True)
    b = be.launch(w, st)
    assert not full
    with pytest.raises(DeviceError):
        be.launch(w, st)  # its slot is in flight
    with pytest.raises(DeviceError):
        be.launch(w, np.ones((8, 14336), np.float16))  # no free slot
    assert np.array_equal(a.wait().y, ya) and np.array_equal(b.wait().y, yb)
    with pytest.raises(FormatError):
        be.launch(w, be.staging(8, 4096, np.float16))
    with pytest.raises(FormatError):
        be.launch(w, be.staging(8, 14336, np.float64))
    be.free(w)
    with pytest.raises(FormatError):
        be.launch(w, be.staging(8, 14336, np.float16))


def test_bound_call_with_the_topk_epilogue(monkeypatch):
    be, _, full, w, rng = _counted(monkeypatch, 4)
    for _ in range(5):
        res = be.launch(w, _x(be, rng, 4, 14336, True), topk=8).wait()
        assert res.y is None and res.topk.indices.shape == (4, 8)
    assert len(full) == 2


def test_a_graph_whose_events_did_not_record_falls_back(monkeypatch):
    """A bound call whose kernel time cannot be read drops its graph: no figure for that call,
    direct launches (the full path) from then on, as a graph call of the full path does."""
    be, cp, full, w, rng = _counted(monkeypatch, 5)
    for _ in range(3):
        be.launch(w, _x(be, rng, 2, 14336, True)).wait()

    cp.unrecorded = True
    assert be.launch(w, _x(be, rng, 2, 14336, True)).wait().timing.seconds() is None
    graphs = cp.counts["graph"]
    full.clear()
    cp.unrecorded = False
    res = be.launch(w, _x(be, rng, 2, 14336, True)).wait()
    assert len(full) == 1 and cp.counts["graph"] == graphs and res.timing.seconds() == 25e-6
