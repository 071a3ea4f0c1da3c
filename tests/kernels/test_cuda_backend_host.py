"""The CUDA backend's host path without a device: a fake CuPy whose copies are real
(``ctypes.memmove``), whose kernels only count their launches and whose stream capture records
the copies and launches into a replayable graph. What it checks: which steps a call takes
(bound sequence, graph, the cached staged call), that the bytes a call returns are the device
y's, and that a staged call after anything that changes its binding takes the full path again."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from q6serve.kernels.api import BFLOAT16, KernelFlags, Layout, Precision, ResidentWeight
from q6serve.kernels.cuda import driver
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

    def wait_event(self, ev) -> None:
        self.dev.count("wait")

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
            get_elapsed_time=self.elapsed, Stream=lambda non_blocking=False: _Stream(dev),
            runtime=SimpleNamespace(memcpyAsync=self.memcpy, memcpy2DAsync=self.memcpy2d,
                                    streamCaptureModeRelaxed=2, hostAlloc=self.host_alloc,
                                    freeHost=self.host_free))
        self.fn = lambda file, name: _Fn(dev)

    unrecorded = False  # events a refused graph node never recorded: no elapsed time

    def host_alloc(self, size: int, flags: int) -> int:
        """cudaHostAlloc: host memory (its flags recorded in ``host_flags``)."""
        a = np.zeros(size, np.uint8)
        self.host_bufs = getattr(self, "host_bufs", {})
        self.host_bufs[a.ctypes.data] = (a, flags)
        return a.ctypes.data

    def host_free(self, ptr: int) -> None:
        self.host_bufs.pop(ptr)

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

    def memcpy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                 height: int, kind: int, stream: int) -> None:
        def run() -> None:
            self.count("d2h2d")
            for i in range(height):
                ctypes.memmove(dst + i * dpitch, src + i * spitch, width)

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


def staged_copy(be, x: np.ndarray) -> np.ndarray:
    """x copied into the backend's page-locked staging buffer (a staged call's input)."""
    xi = be.staging(*x.shape, np.float16)
    xi[...] = x
    return xi


@pytest.fixture(autouse=True)
def _no_halves_by_y(monkeypatch):
    """These tests are about the row chunks (point 8) and the token halves of a large x (point
    10): a large y's halves before the row chunks (X_SPLIT_Y_MIN, on by default) are off here,
    as they were when they were written; tests/service/test_launch_split.py has that rule."""
    monkeypatch.setattr(launch_mod, "X_SPLIT_Y_MIN", 0)


def fake_backend(monkeypatch, graphs: bool = True):
    """A :class:`CudaBackend` on :class:`_FakeCuda` (the committed dispatch table)."""
    from q6serve.kernels.cuda_backend import CudaBackend
    from q6serve.kernels.hostio import HostIO

    monkeypatch.setattr(launch_mod, "_external_record", lambda: (lambda ev, st, flags: 0))
    # The fake device has no driver: on a GPU host the real libcuda's entry points would take
    # the fake kernels (PDL's cuLaunchKernelEx reads a real function handle), so the launcher
    # sees what a host without libcuda sees.
    # (each where its caller looks it up: the launcher's in launch.py, clusters_fit's in driver.py)
    for name in ("_driver_launch_ex", "_host_device_ptr"):
        monkeypatch.setattr(launch_mod, name, lambda: None)
    monkeypatch.setattr(driver, "_driver_max_clusters", lambda: None)
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


def _device_y_call(be, w, rng, n: int, k: int, staged: bool, out, y, cp=None):
    """One launch (x staged or copied) after ``y`` went into the fake device's y (``_set_y``
    and its kin; None: not checked): it hands ``y`` back in ``out``'s dtype (None: f32) and x
    reached the device unchanged. Returns the launch's result and, with ``cp`` (the fake
    CuPy), by how much each of its counts (copies by kind, waits, ...) grew in the call."""
    x = _x(be, rng, n, k, staged)
    xb = x.copy()
    before = dict(cp.counts) if cp is not None else {}
    res = be.launch(w, x, out_dtype=out).wait()
    if y is not None:
        want = y if out is None else y.astype(out)
        assert res.y.dtype == want.dtype and np.array_equal(res.y, want)
    dev_x = be.launcher.ws._dev["x"].a[: xb.nbytes]
    assert np.array_equal(dev_x, xb.reshape(-1).view(np.uint8))
    grew = {} if cp is None else {c: v - before.get(c, 0) for c, v in cp.counts.items()}
    return res, grew


def _every_slot_captured(launch) -> None:
    """3 rounds of SLOTS launches in flight at once (``launch()`` each), each then waited:
    every launch slot captured."""
    from q6serve.kernels.cuda.launch import SLOTS

    for _ in range(3):
        for h in [launch() for _ in range(SLOTS)]:
            h.wait()


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
        res, _ = _device_y_call(be, w, rng, n, k, staged, out, _set_y(be, w, n, i))
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
    """Staged launches in flight (one per slot) return their own y; one more launch, a
    staged buffer still in flight, a wrong K, an unsupported dtype and a freed weight are
    refused as on the full path."""
    from q6serve.kernels.cuda.launch import SLOTS
    from q6serve.kernels.errors import DeviceError, FormatError

    be, _, full, w, rng = _counted(monkeypatch, 3)
    _every_slot_captured(lambda: be.launch(w, _x(be, rng, 8, 14336, True)))
    full.clear()
    ya = _set_y(be, w, 8, 1)
    a = be.launch(w, _x(be, rng, 8, 14336, True))
    yb = _set_y(be, w, 8, 2)
    st = _x(be, rng, 8, 14336, True)
    b = be.launch(w, st)
    rest = [be.launch(w, _x(be, rng, 8, 14336, True)) for _ in range(SLOTS - 2)]
    assert not full
    with pytest.raises(DeviceError):
        be.launch(w, st)  # its slot is in flight
    with pytest.raises(DeviceError):
        be.launch(w, np.ones((8, 14336), np.float16))  # no free slot
    assert np.array_equal(a.wait().y, ya) and np.array_equal(b.wait().y, yb)
    for r in rest:
        r.wait()
    with pytest.raises(FormatError):
        be.launch(w, be.staging(8, 4096, np.float16))
    with pytest.raises(FormatError):
        be.launch(w, be.staging(8, 14336, np.float64))
    be.free(w)
    with pytest.raises(FormatError):
        be.launch(w, be.staging(8, 14336, np.float16))


@pytest.mark.parametrize("staged", [True, False])
def test_a_repeated_call_is_found_by_its_shape_and_slot(monkeypatch, staged):
    """``HOT_CALLS``: a repeated call whose arguments are the very objects of the call before is
    its BoundCall found by (x's shape, slot), with no key built; an equal but other flags object
    takes the keyed lookup once, then the hot way; another out dtype or precision is its own
    call (its own y); with HOT_CALLS 0 every repeated call takes the keyed lookup. y right in
    every case."""
    from q6serve.kernels import cuda_backend

    be, _, full, w, rng = _counted(monkeypatch, 6)
    keyed: list = []
    key = cuda_backend._call_key
    monkeypatch.setattr(cuda_backend, "_call_key", lambda *a: keyed.append(1) or key(*a))
    flags = KernelFlags()
    for _ in range(3):  # bound, captured, cached
        be.launch(w, _x(be, rng, 8, 14336, staged), flags=flags).wait()
    full.clear(), keyed.clear()
    for i in range(4):
        y = _set_y(be, w, 8, i)
        assert np.array_equal(be.launch(w, _x(be, rng, 8, 14336, staged), flags=flags).wait().y,
                              y)
    assert not full and not keyed
    other = KernelFlags()  # equal, not the same object
    for i in range(3):
        y = _set_y(be, w, 8, i)
        assert np.array_equal(be.launch(w, _x(be, rng, 8, 14336, staged), flags=other).wait().y,
                              y)
    assert not full and len(keyed) == 1
    for i in range(3):  # f16 y: bound, captured, cached of its own; then f32 again
        y = _set_y(be, w, 8, i)
        got = be.launch(w, _x(be, rng, 8, 14336, staged), flags=other,
                        out_dtype=np.float16).wait().y
        assert got.dtype == np.float16 and np.array_equal(got, y.astype(np.float16))
    y = _set_y(be, w, 8, 5)
    res = be.launch(w, _x(be, rng, 8, 14336, staged), flags=other,
                    precision=Precision.F16).wait()
    assert res.y.dtype == np.float32 and np.array_equal(res.y, y)
    monkeypatch.setattr(launch_mod, "HOT_CALLS", 0)
    for _ in range(2):  # (f16 y grew the workspace: rebound, recaptured)
        be.launch(w, _x(be, rng, 8, 14336, staged), flags=other).wait()
    full.clear(), keyed.clear()
    for i in range(3):
        y = _set_y(be, w, 8, i)
        assert np.array_equal(be.launch(w, _x(be, rng, 8, 14336, staged), flags=other).wait().y,
                              y)
    assert not full and len(keyed) == 3


@pytest.mark.parametrize("n", [1, 64])
def test_repeated_auto_calls_take_the_hot_way_as_f16_calls_do(monkeypatch, n):
    """The worker's calls (api.launch_ieee, one flags object, the out dtype's object): a
    repeated call at AUTO finds its BoundCall the hot way (no key built, no full path), as
    one at F16 does; AUTO's key is not one per call (session 25's open question: bundles E/F
    read AUTO 15-45% dearer a replay step than F16 on one worker)."""
    from q6serve.kernels import cuda_backend
    from q6serve.kernels.api import DTYPES, launch_ieee

    be, _, full, w, rng = _counted(monkeypatch, 8)
    keyed: list = []
    key = cuda_backend._call_key
    monkeypatch.setattr(cuda_backend, "_call_key", lambda *a: keyed.append(1) or key(*a))
    flags, out = KernelFlags(), DTYPES["f16"]
    for prec in (Precision.AUTO, Precision.F16):
        for _ in range(3):  # bound, captured, cached
            launch_ieee(be, w, _x(be, rng, n, 14336, False), precision=prec, flags=flags,
                        out_dtype=out).wait()
        full.clear(), keyed.clear()
        for i in range(4):
            y = _set_y(be, w, n, i)
            got = launch_ieee(be, w, _x(be, rng, n, 14336, False), precision=prec,
                              flags=flags, out_dtype=out).wait()
            assert np.array_equal(got.y, y.astype(np.float16))
            assert got.precision is Precision.F16
        assert not full and not keyed, prec


def test_auto_never_resolves_to_q8_1():
    """``CudaBackend.no_q8_1`` lets api.launch_ieee skip plan() for AUTO (a call at AUTO then
    costs the host what one at F16 does): it holds only while no AUTO call can run the q8_1
    kernel - not in the table's column (a table that lists it is refused on load), not in
    the heuristics, under any flags, at any N, on table shapes and far from them."""
    from q6serve.kernels.cuda.dispatch import COLUMNS, KERNELS
    from q6serve.kernels.cuda_backend import CudaBackend

    for p in CudaBackend.no_q8_1:
        assert all(KERNELS[path] is not Precision.Q8_1 for path in COLUMNS[p.value])
    assert Precision.Q8_1 not in CudaBackend.no_q8_1
    d = Dispatch(load_default_table(), 132)
    shapes = [(4096, 14336), (14336, 4096), (512, 3584), (152064, 3584), (0, 0), (1024, 1024),
              (65536, 8192), (256, 256)]
    for soa, mmq in itertools.product((True, False), (True, False)):
        flags = KernelFlags(soa=soa, decode_mmq=mmq)
        for (rows, k), n in itertools.product(shapes, (1, 2, 3, 8, 9, 16, 33, 64, 65, 256, 257,
                                                       1024)):
            for p in CudaBackend.no_q8_1:
                assert d.choose(n, p, flags, rows, k).precision is not Precision.Q8_1


@pytest.mark.parametrize("raw,want", [(None, 1), ("", 1), (" ", 1), ("1", 1), ("on", 1),
                                      ("0", 0), ("off", 0), (" No ", 0)])
def test_hot_calls_from_the_environment(raw, want):
    """``Q6SERVE_HOT_CALLS`` (unset or empty: on) sets ``launch.HOT_CALLS``, so a worker can
    be A/B'd without a code edit; another word is refused, naming the variable."""
    from q6serve.kernels.errors import InvalidArgument

    env = {} if raw is None else {"Q6SERVE_HOT_CALLS": raw}
    assert launch_mod.hot_calls_from_env(env) == want
    with pytest.raises(InvalidArgument, match="Q6SERVE_HOT_CALLS='maybe'"):
        launch_mod.hot_calls_from_env({"Q6SERVE_HOT_CALLS": "maybe"})


def test_hot_calls_is_read_once_at_import():
    """A process started with ``Q6SERVE_HOT_CALLS=0`` runs the keyed lookup only (the module's
    constant, which CudaBackend.launch reads per call); a bad value stops the import."""
    import os
    import subprocess
    import sys

    code = "from q6serve.kernels.cuda import launch; print(launch.HOT_CALLS)"
    for raw, want in (("0", "0"), ("1", "1"), ("", "1")):
        got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "Q6SERVE_HOT_CALLS": raw}, timeout=60)
        assert got.returncode == 0 and got.stdout.strip() == want, got.stderr[-500:]
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "Q6SERVE_HOT_CALLS": "2"}, timeout=60)
    assert got.returncode != 0 and "Q6SERVE_HOT_CALLS='2'" in got.stderr


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


def _chunked(monkeypatch, rows: int, k: int, slab_rows: int, chunks: int):
    """A fake backend with ``Q6SERVE_Y_CHUNKS``-style row chunks on and a weight of slabs of
    ``slab_rows`` rows (its slab table a fake device buffer)."""
    be, cp = fake_backend(monkeypatch)
    be.launcher.y_chunks = chunks
    nslabs = -(-rows // slab_rows)
    cw = CudaWeight(slabs=[], table=cp.empty(8 * nslabs, np.uint8), rps=slab_rows)
    return be, cp, ResidentWeight(rows, k, Layout.SOA, rows * k, cw)


def _chunks(w, n: int) -> list[tuple[int, int]]:
    got = [b.extra["chunks"] for key, b in w.data.plans.items()
           if isinstance(key, tuple) and len(key) == 6 and key[2] == n and hasattr(b, "extra")
           and b.extra.get("chunks")]
    assert got, "no row-chunked sequence was bound"
    return [(r0, r1) for r0, r1, _ in got[0]]


def _set_y_chunked(be, w, n: int, i: int, cuts) -> np.ndarray:
    """Known values in the fake device's y laid out as the chunks' kernels write it: each
    chunk's rows as its own [N, r1 - r0] block, one after the other."""
    y = (np.arange(n * w.rows, dtype=np.float32) % 977 - 400 + i).reshape(n, w.rows)
    dev = np.concatenate([np.ascontiguousarray(y[:, r0:r1]).reshape(-1) for r0, r1 in cuts])
    be.launcher.ws._dev["y"].a[: dev.nbytes] = dev.view(np.uint8)
    return y


@pytest.mark.parametrize("rows,k,n,out", [(14336, 4096, 64, None), (14336, 4096, 64, BFLOAT16),
                                          (14336, 4096, 32, None)])
@pytest.mark.parametrize("staged", [True, False])
def test_row_chunked_y_comes_back_whole(monkeypatch, rows, k, n, out, staged):
    """Launcher point 8: a large y computed in row chunks (runs of whole slabs, each chunk's
    kernels writing its own [N, chunk rows] block) comes back as the whole [N, rows] y, every
    call (direct launches, the capture, graph replays, the cached BoundCall): one 2D copy per
    chunk, each after a wait for its chunk's event on the copy stream, the last one's on the
    backend's stream after a wait for the copy stream."""
    be, cp, w = _chunked(monkeypatch, rows, k, 512, 4)
    rng = np.random.default_rng(7)
    be.matmul(w, _x(be, rng, n, k, staged), out_dtype=out)
    cuts = _chunks(w, n)
    assert len(cuts) >= 2 and cuts[0][0] == 0 and cuts[-1][1] == rows
    assert all(a[1] == b[0] for a, b in itertools.pairwise(cuts))
    assert all(r0 % 512 == 0 for r0, _ in cuts)  # whole slabs
    for i in range(5):
        _, grew = _device_y_call(be, w, rng, n, k, staged, out,
                                 _set_y_chunked(be, w, n, i, cuts), cp)
        assert grew["d2h2d"] == len(cuts)
        assert grew.get("d2h", 0) == 0  # no whole-y copy
        # the copy stream waits for each chunk but the last, the stream for the copy stream
        assert grew["wait"] == len(cuts)
    assert cp.counts["graph"] == 4


def test_row_chunks_keep_the_k_split_and_the_rounds(monkeypatch):
    """Each chunk's launches are the full call's kernel with the full call's K split and token
    chunks on a view of the slab table from the chunk's first slab, its rows' count and its own
    y block; the chunks' rounds are the full call's. A weight of one slab, a small y, an f16 y,
    the setting off, or the lm-head's wgmma cell (its slab-rounded chunks would take more rounds
    than the whole call) bind the plain sequence. (The wgmma tile is in Y_CHUNK_SRCS since
    session 25, for 18944x3584 N=64.)"""
    rows, k, n = 14336, 4096, 64
    be, _, w = _chunked(monkeypatch, rows, k, 512, 4)
    lc = be.launcher
    c = be.choose(n, Precision.AUTO, KernelFlags(), rows, k)
    full = lc.plan(rows, k, Layout.SOA, "InF16", c.path, c.cfg, n)
    chunks = lc.row_chunks(full, rows, k, Layout.SOA, "InF16", c.path, c.cfg, n, 512, 4)
    assert chunks is not None and len(chunks) >= 2
    tc = lc.tile_cfg(c.path, c.cfg)
    per_round = full.grid[0] * tc.warps * 16 * tc.mt
    assert sum(-(-(r1 - r0) // (p.grid[0] * tc.warps * 16 * tc.mt)) for r0, r1, p in chunks) \
        == -(-rows // per_round)
    for _, _, p in chunks:  # the same kernel and shared memory, the same K slices
        assert p.grid[1:] == full.grid[1:] and (p.threads, p.smem) == (full.threads, full.smem)
    seen = []
    orig = lc.steps
    monkeypatch.setattr(lc, "steps", lambda lp, w_, cw, xd, y, n_, r0=0, r1=None: seen.append(
        (lp.grid, y, r0, r1)) or orig(lp, w_, cw, xd, y, n_, r0, r1))
    be.matmul(w, np.ones((n, k), np.float16))
    ybase = lc.ws._dev["y"].data.ptr
    seen = seen[-len(chunks):]  # (the binding's last pass: the first one grew the buffers)
    assert [(r0, r1) for _, _, r0, r1 in seen] == [(r0, r1) for r0, r1, _ in chunks]
    assert [y - ybase for _, y, _, _ in seen] == [4 * n * r0 for r0, _, _ in chunks]
    b = next(b for key, b in w.data.plans.items() if len(key) == 6 and b.extra.get("chunks"))
    table = w.data.table.data.ptr
    kernels = [s for s in b.steps if s.grid == chunks[0][2].grid or s.grid[1:] == full.grid[1:]]
    assert [int(s.args[0]) - table for s in kernels] == [8 * (r0 // 512) for r0, _, _ in chunks]
    assert [int(s.args[1]) for s in kernels] == [r1 - r0 for r0, r1, _ in chunks]
    # plain: the setting off, an f16 y, a small y, one slab, the lm-head's wgmma cell at N=64
    # (K split 3 on 44 CTAs: 18 rounds; chunks of 512-row slabs would take 4 + 5 + 6 + 4)
    for shape, out, nn, want, slab in (((rows, k), None, n, 0, 512),
                                       ((rows, k), np.float16, n, 4, 512),
                                       ((rows, k), None, 1, 4, 512), ((rows, k), None, n, 4, rows),
                                       ((152064, 3584), None, n, 4, 512)):
        be2, _, w2 = _chunked(monkeypatch, *shape, slab, want)
        c2 = be2.choose(nn, Precision.AUTO, KernelFlags(), *shape)
        assert shape[0] == rows or c2.cfg.src == 8  # the wgmma tile
        be2.matmul(w2, np.ones((nn, shape[1]), np.float16), out_dtype=out)
        assert not any(getattr(b, "extra", {}).get("chunks") for b in w2.data.plans.values())


@pytest.mark.parametrize("value,want", [("", None), ("0", 0), ("3", 3), ("16", 16)])
def test_y_chunks_env(value, want):
    assert launch_mod.y_chunks_from_env({"Q6SERVE_Y_CHUNKS": value}) == want


@pytest.mark.parametrize("value", ["-1", "17", "x"])
def test_y_chunks_env_refuses(value):
    with pytest.raises(ValueError, match="Q6SERVE_Y_CHUNKS"):
        launch_mod.y_chunks_from_env({"Q6SERVE_Y_CHUNKS": value})


def _gpu_backend():
    """The CudaBackend class where CuPy sees a CUDA device, else the test is skipped."""
    cupy = pytest.importorskip("cupy")
    try:
        devices = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        devices = 0
    if not devices:
        pytest.skip("needs a CUDA device")
    from q6serve.kernels.cuda_backend import CudaBackend

    return CudaBackend


# The ten model shapes (bench/kernels.py): Qwen2.5-7B's and Llama-3.1-8B's
TEN = ((3584, 3584), (512, 3584), (18944, 3584), (3584, 18944), (152064, 3584),
       (4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096))


def test_tall_weights_of_one_slab_are_kept_in_two(monkeypatch):
    """Storage: a weight that fits one slab and is tall (rows >= 3 K, 8192 rows or more) is
    kept in two slabs of ceil(rows / 2) rows rounded up to 16 - of the ten model shapes the
    two measured on the H200 (14336x4096, 18944x3584); every other weight keeps SLAB_BYTES'
    slabs; the VRAM figure is the two slabs and a two-entry table; TWO_SLAB_MIN_ROWS 0: never."""
    from q6serve.kernels import q6k
    from q6serve.kernels.cuda import storage

    def plain(rows, k):
        per = storage.SLAB_BYTES // q6k.aos_nbytes(1, k)
        return [(r0, min(rows, r0 + per)) for r0 in range(0, rows, per)]

    two = {s for s in TEN if storage.two_slabs(*s)}
    assert two == {(14336, 4096), (18944, 3584)}
    assert storage.slab_plan(14336, 4096) == [(0, 7168), (7168, 14336)]
    assert storage.slab_plan(18944, 3584) == [(0, 9472), (9472, 18944)]
    assert storage.slab_plan(9000, 2048) == [(0, 4512), (4512, 9000)]  # rounded up to 16
    assert storage.slab_plan(8176, 2048) == [(0, 8176)]  # >= 3 K, under 8192 rows: one
    assert storage.slab_plan(9000, 4096) == [(0, 9000)]  # 8192 rows or more, under 3 K: one
    for rows, k in set(TEN) - two:
        assert storage.slab_plan(rows, k) == plain(rows, k)
    assert len(storage.slab_plan(152064, 3584)) == 7  # the lm-head: SLAB_BYTES' slabs
    for layout in (Layout.SOA, Layout.AOS):
        assert storage.weight_nbytes(14336, 4096, layout) == (
            2 * storage.pool_round(storage.slab_nbytes(7168, 4096, layout))
            + storage.pool_round(16))
    monkeypatch.setattr(storage, "TWO_SLAB_MIN_ROWS", 0)
    assert storage.slab_plan(14336, 4096) == plain(14336, 4096) == [(0, 14336)]


def _two_slab(monkeypatch, y_chunks: int = 2):
    """A fake backend and a 14336x4096 weight as storage keeps it: two slabs of 7168 rows,
    ``y_chunks`` its own row chunks; its full path's calls counted into ``full``. (The fake
    kernels' registers make N=64's grid one the slabs cut in two, as the H200's build did:
    chunks 7168/7168, bench/RESULTS.md sessions 12-13.)"""
    monkeypatch.setattr(_Fn, "num_regs", 168)
    be, cp = fake_backend(monkeypatch)
    full: list = []
    orig = be._launch
    monkeypatch.setattr(be, "_launch", lambda *a, **kw: full.append(1) or orig(*a, **kw))
    cw = CudaWeight(slabs=[], table=cp.empty(16, np.uint8), rps=7168, y_chunks=y_chunks)
    return be, cp, full, ResidentWeight(14336, 4096, Layout.SOA, 14336 * 4096, cw)


def test_two_slab_weights_take_their_own_chunks_by_default(monkeypatch):
    """Unset Q6SERVE_Y_CHUNKS: a two-slab weight's large y comes in its own 2 row chunks (one
    a slab), whole and right on every kind of call; a y under Y_CHUNK_MIN stays whole;
    Q6SERVE_Y_CHUNKS=0 turns them off; a weight of several slabs without chunks of its own
    (an lm-head) stays plain."""
    assert launch_mod.Y_CHUNKS is None
    be, cp, _, w = _two_slab(monkeypatch)
    assert be.launcher.y_chunks is None  # (the test environment has no Q6SERVE_Y_CHUNKS)
    rng = np.random.default_rng(11)
    for staged in (True, False):
        be.matmul(w, _x(be, rng, 64, 4096, staged))
        assert _chunks(w, 64) == [(0, 7168), (7168, 14336)]
        for i in range(4):
            y = _set_y_chunked(be, w, 64, i, [(0, 7168), (7168, 14336)])
            before = cp.counts.get("d2h2d", 0)
            res = be.launch(w, _x(be, rng, 64, 4096, staged)).wait()
            assert np.array_equal(res.y, y) and cp.counts["d2h2d"] == before + 2
    # a y under Y_CHUNK_MIN (1.5 MiB of f32: 18944x3584 N=16's 1.2 MB) stays whole, and its
    # chunk state is 0; 14336x4096 N=32's 1.8 MB is chunked
    small_out = launch_mod._small_out
    assert small_out(16, 18944, None, 0, True, 2) is None
    assert small_out(32, 14336, None, 0, True, 2) == ("rows", 2)
    assert be.launcher.chunks_for(w.data, 0, 16 * 18944) == 0
    assert be.launcher.chunks_for(w.data, 0, 32 * 14336) == 2
    for chunks, own in ((0, 2), (None, 0)):
        be2, cp2, _, w2 = _two_slab(monkeypatch, own)
        be2.launcher.y_chunks = chunks
        be2.matmul(w2, _x(be2, rng, 64, 4096, True))  # binds: the buffers exist now
        for i in range(4):
            y = _set_y(be2, w2, 64, i)
            assert np.array_equal(be2.launch(w2, _x(be2, rng, 64, 4096, True)).wait().y, y)
        assert not cp2.counts.get("d2h2d") and cp2.counts["graph"] == 3


def test_no_chunks_beside_a_launch_in_flight(monkeypatch):
    """Y_CHUNKS_IDLE: a launch made while another is in flight on the launcher runs the plain
    sequence (one whole-y copy), an idle one the chunks; each state keeps its own cached
    BoundCall, so alternating between them never takes the full path again once both are
    bound. Y_CHUNKS_IDLE = 0: chunks beside a launch in flight too."""
    be, cp, full, w = _two_slab(monkeypatch)
    rng = np.random.default_rng(12)
    cuts = [(0, 7168), (7168, 14336)]

    def busy_call(i):  # a small call in flight (another slot), then the large one
        a = be.launch(w, _x(be, rng, 1, 4096, True))
        y = _set_y(be, w, 64, i)
        b = be.launch(w, _x(be, rng, 64, 4096, True))
        res = b.wait()
        a.wait()
        return res, y

    for i in range(3):  # bind and capture both states
        be.launch(w, _x(be, rng, 64, 4096, True)).wait()
        busy_call(i)
    full.clear()
    for i in range(4):
        n2d, n1d = cp.counts.get("d2h2d", 0), cp.counts.get("d2h", 0)
        y = _set_y_chunked(be, w, 64, i, cuts)
        assert np.array_equal(be.launch(w, _x(be, rng, 64, 4096, True)).wait().y, y)
        assert cp.counts["d2h2d"] == n2d + 2 and cp.counts.get("d2h", 0) == n1d
        res, y = busy_call(i)
        assert np.array_equal(res.y, y) and cp.counts["d2h2d"] == n2d + 2
    assert not full
    # the small calls' cached BoundCalls: one chunk state (0), idle or beside a launch
    assert {key[-1] for key in w.data.plans if len(key) == 8 and key[0][0] == 1} == {0}
    monkeypatch.setattr(launch_mod, "Y_CHUNKS_IDLE", 0)
    n2d = cp.counts["d2h2d"]
    for i in range(3):
        a = be.launch(w, _x(be, rng, 1, 4096, True))
        y = _set_y_chunked(be, w, 64, i, cuts)
        assert np.array_equal(be.launch(w, _x(be, rng, 64, 4096, True)).wait().y, y)
        a.wait()
    assert cp.counts["d2h2d"] == n2d + 6


@pytest.mark.gpu
@pytest.mark.parametrize("rows,k", [(4096, 14336), (14336, 4096)])
def test_row_chunks_on_the_gpu_are_bit_identical(rng, monkeypatch, rows, k):
    """On a device: a weight in 512-row slabs, and the weight as storage keeps it by default
    (14336x4096: two slabs, its own 2 chunks), give the one-slab weight's y bit for bit,
    without and with row chunks (Y_CHUNKS 4; the default's own), on every kind of call (direct
    launches, the capture, graph replays, the cached BoundCall; staged and copied x; f32 and
    bf16 y; beside a launch in flight: plain), and at N=64 the chunks are really used where the
    tile is a register K-slice tile."""
    gpu_backend = _gpu_backend()
    from q6serve.kernels import q6k
    from q6serve.kernels.api import iter_aos_chunks
    from q6serve.kernels.cuda import storage
    from tests.conftest import random_blocks

    be = gpu_backend(0)
    blocks = random_blocks(rng, rows * (k // 256))

    def load():
        return be.load(iter_aos_chunks(blocks, rows, k, 64 << 20), rows, k, Layout.SOA)

    wd = load()  # storage's default: 14336x4096 in two slabs
    assert (len(wd.data.slabs), wd.data.y_chunks) == ((2, 2) if rows == 14336 else (1, 0))
    monkeypatch.setattr(storage, "TWO_SLAB_MIN_ROWS", 0)
    w1 = load()
    monkeypatch.setattr(storage, "SLAB_BYTES", 512 * q6k.aos_nbytes(1, k))
    w = load()
    assert len(w1.data.slabs) == 1 and len(w.data.slabs) == -(-rows // 512)

    staged_x = functools.partial(staged_copy, be)

    try:
        for n, out, staged in ((64, None, True), (64, None, False), (64, BFLOAT16, True),
                               (32, None, True), (16, None, False)):
            x = rng.standard_normal((n, k)).astype(np.float16)
            be.launcher.y_chunks = 0
            ref = be.matmul(w1, x, out_dtype=out).y
            np.testing.assert_array_equal(be.matmul(w, x, out_dtype=out).y, ref)
            for chunks, wc in ((4, w), (None, wd)):
                be.launcher.y_chunks = chunks
                for _ in range(4):
                    xi = staged_x(x) if staged else x
                    np.testing.assert_array_equal(be.launch(wc, xi, out_dtype=out).wait().y, ref)
            # beside a launch in flight: the plain sequence (Y_CHUNKS_IDLE)
            for _ in range(3):
                a = be.launch(wd, staged_x(x[:1]))
                np.testing.assert_array_equal(be.launch(wd, x, out_dtype=out).wait().y, ref)
                a.wait()
        lc = be.launcher
        c = be.choose(64, Precision.AUTO, KernelFlags(), rows, k)
        for wc, want in ((w, 4), (wd, wd.data.y_chunks)):
            used = {key[2] for key, b in wc.data.plans.items()
                    if isinstance(key, tuple) and len(key) == 6
                    and getattr(b, "extra", {}).get("chunks")}
            full = lc.plan(rows, k, Layout.SOA, "InF16", c.path, c.cfg, 64, wc.data.pairs)
            cut = lc.row_chunks(full, rows, k, Layout.SOA, "InF16", c.path, c.cfg, 64,
                                wc.data.rps, want, wc.data.pairs)
            # chunks need a cut and a large enough y (launch.Y_CHUNK_MIN: 4096x14336's 1 MiB
            # y at N=64 is below it, whatever its tile)
            large = 4 * 64 * rows >= launch_mod.Y_CHUNK_MIN
            assert (64 in used) == (cut is not None and large), used
        # the default two-slab 14336x4096 takes its chunks at N=64 (the point of the two slabs)
        assert (64 in used) == (rows == 14336), used
    finally:
        be.launcher.y_chunks = None
        be.close()


def test_a_changed_chunk_setting_rebinds_the_bound_call(monkeypatch):
    """A cached BoundCall holds the chunk setting it was bound under: after the setting
    changes, the next call takes the full path (the other binding), chunked or not."""
    be, cp, w = _chunked(monkeypatch, 14336, 4096, 512, 4)
    rng = np.random.default_rng(8)
    for _ in range(3):
        be.launch(w, _x(be, rng, 64, 4096, True)).wait()
    n2d = cp.counts["d2h2d"]
    be.launcher.y_chunks = 0
    for _ in range(3):
        be.launch(w, _x(be, rng, 64, 4096, True)).wait()
    assert cp.counts["d2h2d"] == n2d and cp.counts["d2h"] >= 3
    be.launcher.y_chunks = 4
    be.launch(w, _x(be, rng, 64, 4096, True)).wait()
    assert cp.counts["d2h2d"] > n2d


# -- x's upload beside the kernels by token halves (launch.py point 10) -------------------------
def _halves(w, n: int) -> list[tuple[int, int]] | None:
    got = [b.extra["tokens"] for key, b in w.data.plans.items()
           if isinstance(key, tuple) and len(key) == 6 and key[2] == n and hasattr(b, "extra")
           and b.extra.get("tokens")]
    return got[0] if got else None


@pytest.mark.parametrize("n,out", [(64, None), (64, BFLOAT16), (40, None), (16, None)])
@pytest.mark.parametrize("staged", [True, False])
def test_token_halves_upload_x_and_return_y_whole(monkeypatch, n, out, staged):
    """X_SPLIT_MIN: an idle call with a large x runs in two token halves: x reaches the device
    whole (the first half's copy on the stream, the second's on the x stream, which the stream
    waits for before the second half's kernels), and y comes back whole, on every kind of call
    (direct launches, the capture, graph replays, the cached BoundCall; staged or copied x):
    one 2D copy per half, the first after a wait for its half's event on the y stream."""
    monkeypatch.setattr(launch_mod, "X_SPLIT_MIN", 1 << 18)
    be, cp = fake_backend(monkeypatch)
    rows, k = 4096, 14336
    w = fake_weight(be, rows, k)
    rng = np.random.default_rng(21)
    be.matmul(w, _x(be, rng, n, k, staged), out_dtype=out)
    h = -(-n // 16) * 8
    assert _halves(w, n) == [(0, h), (h, n)]
    for i in range(5):
        _, grew = _device_y_call(be, w, rng, n, k, staged, out, _set_y(be, w, n, i), cp)
        assert (grew["d2h2d"], grew.get("d2h", 0), grew["h2d"]) == (2, 0, 2)  # no whole-y copy
        # per call: the y stream waits for the first half's kernels, the stream for the y
        # stream; bound in the sequence (the fake counts them when enqueued, not replayed):
        # the x stream for the fork, the stream for the second x half
        assert grew["wait"] == (6 if i == 0 else 2), grew  # (i == 0: direct, then the capture)
    assert cp.counts["graph"] == 4


def test_token_halves_keep_the_k_split(monkeypatch):
    """Each half is the full call's K split on its own tokens (x and y at the half's first
    token), its tile narrowed to its tokens (X_SPLIT_FIT); a small x, the setting off, an f16
    y, a launch in flight or a row-chunked call bind no halves; a call whose x is under the
    setting has state 0."""
    monkeypatch.setattr(launch_mod, "X_SPLIT_MIN", 1 << 20)
    be, _, _, w, rng = _counted(monkeypatch, 22)
    lc, n, k = be.launcher, 64, 14336
    c = be.choose(n, Precision.AUTO, KernelFlags(), 4096, k)
    whole = lc.plan(4096, k, Layout.SOA, "InF16", c.path, c.cfg, n)
    parts = lc.token_parts(whole, 4096, k, Layout.SOA, "InF16", c.path, c.cfg, n, 2)
    assert [(t0, t1) for t0, t1, _ in parts] == [(0, 32), (32, 64)]
    assert all(p.grid[1] == whole.grid[1] for _, _, p in parts)
    seen = []
    orig = lc.steps
    monkeypatch.setattr(lc, "steps", lambda lp, w_, cw, xd, y, n_, r0=0, r1=None: seen.append(
        (xd, y, n_)) or orig(lp, w_, cw, xd, y, n_, r0, r1))
    be.matmul(w, np.ones((n, k), np.float16))
    xd, yd = lc.ws._dev["x"].data.ptr, lc.ws._dev["y"].data.ptr
    assert seen[-2:] == [(xd, yd, 32), (xd + 32 * k * 2, yd + 4 * 32 * 4096, 32)]
    assert lc.chunks_for(w.data, 0, 64 * 4096, n * k * 2) == -2
    assert lc.chunks_for(w.data, 0, 16 * 4096, 16 * k * 2) == 0  # 448 KiB of x
    for nn, out in ((16, None), (n, np.float16)):
        be.matmul(w, np.ones((nn, k), np.float16), out_dtype=out)
    assert _halves(w, 16) is None
    assert not [b for key, b in w.data.plans.items() if len(key) == 6 and key[2] == n
                and key[4] != ("tokens", 2) and b.extra.get("tokens")]
    a = be.launch(w, _x(be, rng, 1, k, True))  # beside a launch in flight: plain
    assert lc.chunks_for(w.data, lc.ws.free_slot(), 64 * 4096, n * k * 2) == 0
    a.wait()
    monkeypatch.setattr(launch_mod, "X_SPLIT_MIN", 0)
    assert lc.chunks_for(w.data, 0, 64 * 4096, n * k * 2) == 0
    be2, _, w2 = _chunked(monkeypatch, 14336, 4096, 512, 4)  # row chunks first
    monkeypatch.setattr(launch_mod, "X_SPLIT_MIN", 1 << 18)
    assert be2.launcher.chunks_for(w2.data, 0, 64 * 14336, 64 * 4096 * 2) == 4


def test_token_halves_by_default_where_measured(monkeypatch):
    """The defaults (X_SPLIT_MIN 2 MiB since session 21, X_SPLIT_MAX_N 64): 4096x14336 at N=64
    with f16 x (1.75 MiB: measured faster whole since its N=64 tile is src 8) and N=32 (0.875
    MiB: slower in halves) run whole, f32 x at N=64 (3.5 MiB) in halves, N=128 not (past
    X_SPLIT_MAX_N), nor an f16 y."""
    assert (launch_mod.X_SPLIT_MIN, launch_mod.X_SPLIT_MAX_N) == (2 << 20, 64)
    be, _, _, w, rng = _counted(monkeypatch, 24)
    k = 14336
    for n, dt, out, want in ((64, np.float16, None, None),
                             (32, np.float16, None, None),
                             (64, np.float32, None, [(0, 32), (32, 64)]),
                             (128, np.float16, None, None), (48, np.float32, np.float16, None)):
        w.data.plans.clear()
        be.matmul(w, rng.standard_normal((n, k)).astype(dt), out_dtype=out)
        assert _halves(w, n) == want, (n, dt, out)


@pytest.mark.gpu
@pytest.mark.parametrize("fit", [1, 0])
def test_token_halves_on_the_gpu_are_bit_identical(rng, monkeypatch, fit):
    """On a device: 4096x14336 and 3584x18944 calls in token halves (X_SPLIT_MIN 256 KiB)
    give the whole call's y bit for bit on every kind of call (direct launches, the capture,
    graph replays, the cached BoundCall; staged and copied x; f32 and bf16 y; N = 64, 40,
    16), the halves really used; beside a launch in flight: plain."""
    gpu_backend = _gpu_backend()
    from q6serve.kernels.api import iter_aos_chunks
    from tests.conftest import random_blocks

    be = gpu_backend(0)
    monkeypatch.setattr(launch_mod, "X_SPLIT_FIT", fit)
    try:
        for rows, k in ((4096, 14336), (3584, 18944)):
            blocks = random_blocks(rng, rows * (k // 256))
            w = be.load(iter_aos_chunks(blocks, rows, k, 64 << 20), rows, k, Layout.SOA)
            for n, out, staged in ((64, None, True), (64, None, False), (64, BFLOAT16, True),
                                   (40, None, False), (16, None, True)):
                x = rng.standard_normal((n, k)).astype(np.float16)
                monkeypatch.setattr(launch_mod, "X_SPLIT_MIN", 0)
                ref = be.matmul(w, x, out_dtype=out).y
                monkeypatch.setattr(launch_mod, "X_SPLIT_MIN", 1 << 18)
                for _ in range(4):
                    xi = x
                    if staged:
                        xi = be.staging(n, k, np.float16)
                        xi[...] = x
                    np.testing.assert_array_equal(be.launch(w, xi, out_dtype=out).wait().y, ref)
                assert _halves(w, n) is not None, (rows, k, n)
                for _ in range(3):  # beside a launch in flight: the plain sequence
                    a = be.launch(w, x[:1])
                    np.testing.assert_array_equal(be.launch(w, x, out_dtype=out).wait().y, ref)
                    a.wait()
            be.free(w)
    finally:
        be.close()


# -- a multi-weight call: launch_many (issue 14, one launch per multi-weight call) ------------
QKV = ((3584, 3584), (512, 3584), (512, 3584))
GATE_UP = ((18944, 3584), (18944, 3584))


def _set_many_y(be, rows: list[int], n: int, i: int) -> list[np.ndarray]:
    """Known values in the fake device's y for a multi-weight call: each part's [N, rows]
    block after the one before it (what each part's kernels would have written)."""
    flat = (np.arange(n * sum(rows), dtype=np.float32) % 997 - 400 + i)
    be.launcher.ws._dev["y"].a[: flat.nbytes] = flat.view(np.uint8)
    out, off = [], 0
    for r in rows:
        out.append(flat[n * off : n * (off + r)].reshape(n, r))
        off += r
    return out


def _many_counted(monkeypatch, shapes, seed: int):
    """A fake backend whose full multi-weight path (``Launcher.launch_many``) counts its calls
    into ``full``, the weights of ``shapes`` on it, a generator."""
    be, cp = fake_backend(monkeypatch)
    full: list = []
    orig = be.launcher.launch_many
    monkeypatch.setattr(be.launcher, "launch_many",
                        lambda *a, **kw: full.append(1) or orig(*a, **kw))
    ws = [fake_weight(be, r, k) for r, k in shapes]
    return be, cp, full, ws, np.random.default_rng(seed)


@pytest.mark.parametrize("shapes", [QKV, GATE_UP], ids=["qkv", "gate_up"])
@pytest.mark.parametrize("n,out", [(1, None), (8, None), (64, None), (1, np.float16),
                                   (64, np.float16), (8, BFLOAT16)])
@pytest.mark.parametrize("staged", [True, False])
def test_launch_many_returns_each_parts_y(monkeypatch, shapes, n, out, staged):
    """Every multi-weight call (direct launches, the capture, graph replays, then the cached
    ManyCall; staged or copied x) uploads x once, hands back each part's own block of the
    device y in the asked dtype, each part named and timed as its own launch, with one
    download; from the third call on it is one graph launch."""
    be, cp, full, ws, rng = _many_counted(monkeypatch, shapes, 11)
    k = shapes[0][1]
    rows = [r for r, _ in shapes]
    be.launch_many(ws, _x(be, rng, n, k, staged), out_dtype=out).wait()  # binds
    for i in range(6):
        ys = _set_many_y(be, rows, n, i)
        x = _x(be, rng, n, k, staged)
        xb = x.copy()
        h2d, d2h, graphs = (cp.counts.get(c, 0) for c in ("h2d", "d2h", "graph"))
        res = be.launch_many(ws, x, out_dtype=out).wait()
        assert len(res) == len(ws)
        for r, y, w in zip(res, ys, ws, strict=True):
            want = y if out is None else y.astype(out)
            assert r.y.dtype == want.dtype and np.array_equal(r.y, want)
            assert r.timing.seconds() == pytest.approx(25e-6)
            c = be.choose(n, Precision.AUTO, KernelFlags(), w.rows, w.k)
            assert (r.kernel, r.precision) == (f"cuda.{c.path}.soa", c.precision)
        assert np.array_equal(be.launcher.ws._dev["x"].a[: xb.nbytes],
                              xb.reshape(-1).view(np.uint8))
        assert cp.counts["h2d"] - h2d == 1 and cp.counts["d2h"] - d2h == 1  # x in, y out once
        if i >= 1:
            assert cp.counts["graph"] - graphs == 1
    assert len(full) == 2  # direct, direct + capture; then the cached ManyCall (graphs)


def test_launch_many_matches_each_parts_launch(monkeypatch):
    """The kernels' launches of a multi-weight call are each part's own (the same steps a
    launch of that part takes), in order, and the result equals per-part launches."""
    be, cp, _, ws, rng = _many_counted(monkeypatch, QKV, 12)
    x = rng.standard_normal((8, 3584)).astype(np.float16)
    kernels = cp.counts.get("kernel", 0)
    be.launch_many(ws, x).wait()
    many = cp.counts["kernel"] - kernels
    kernels = cp.counts["kernel"]
    for w in ws:
        be.launch(w, x).wait()
    assert many == cp.counts["kernel"] - kernels


def test_launch_many_refuses_before_launching(monkeypatch):
    """A part that would be refused (wrong K, a freed weight, a wrong flags count, no
    weights) refuses the whole call before anything is launched or a slot taken; the cached
    call is dropped by a freed or re-laid weight."""
    from q6serve.kernels.errors import FormatError, InvalidArgument

    be, cp, full, ws, rng = _many_counted(monkeypatch, QKV, 13)
    for _ in range(4):
        be.launch_many(ws, _x(be, rng, 4, 3584, True)).wait()
    odd = fake_weight(be, 512, 4096)
    before = dict(cp.counts)
    with pytest.raises(FormatError) as e:
        be.launch_many([*ws, odd], _x(be, rng, 4, 3584, True))
    assert e.value.part == 3  # the index of the weight it is about
    with pytest.raises(InvalidArgument):
        be.launch_many(ws, _x(be, rng, 4, 3584, True), flags=[KernelFlags()])
    with pytest.raises(InvalidArgument):
        be.launch_many([], _x(be, rng, 4, 3584, True))
    assert cp.counts == before and not any(be.launcher.ws._held)
    full.clear()
    ws[1].data.plans.clear()  # what a relayout does: the cached call is not live any more
    be.launch_many(ws, _x(be, rng, 4, 3584, True)).wait()
    assert len(full) == 1
    be.free(ws[2])
    with pytest.raises(FormatError) as e:
        be.launch_many(ws, _x(be, rng, 4, 3584, True))
    assert e.value.part == 2
    assert not any(be.launcher.ws._held)


def test_launch_many_holds_one_slot(monkeypatch):
    """A multi-weight call in flight holds one launch slot until its wait, as a launch; two
    in flight return their own y's."""
    from q6serve.kernels.cuda.launch import SLOTS
    from q6serve.kernels.errors import DeviceError

    be, _, full, ws, rng = _many_counted(monkeypatch, GATE_UP, 14)
    rows = [w.rows for w in ws]
    _every_slot_captured(lambda: be.launch_many(ws, _x(be, rng, 2, 3584, True)))
    full.clear()
    ya = _set_many_y(be, rows, 2, 1)
    a = be.launch_many(ws, _x(be, rng, 2, 3584, True))
    yb = _set_many_y(be, rows, 2, 2)
    b = be.launch_many(ws, _x(be, rng, 2, 3584, False))
    rest = [be.launch(ws[0], _x(be, rng, 2, 3584, True)) for _ in range(SLOTS - 2)]
    with pytest.raises(DeviceError):
        be.launch_many(ws, np.ones((2, 3584), np.float16))
    assert not full
    for r, y in zip(a.wait(), ya, strict=True):
        assert np.array_equal(r.y, y)
    for r, y in zip(b.wait(), yb, strict=True):
        assert np.array_equal(r.y, y)
    for r in rest:
        r.wait()
    assert not any(be.launcher.ws._held)


def test_launch_many_falls_back_to_each_parts_launch(monkeypatch):
    """A top-k epilogue and a single weight take each part's launch in turn (the ABC's
    default): the same results as per-part launches."""
    be, _, full, ws, rng = _many_counted(monkeypatch, QKV, 15)
    x = rng.standard_normal((4, 3584)).astype(np.float16)
    res = be.launch_many(ws, x, topk=8).wait()
    assert [r.topk.indices.shape for r in res] == [(4, 8)] * 3 and not full
    _set_many_y(be, [ws[0].rows], 4, 0)
    y = be.launch_many(ws[:1], x).wait()
    assert len(y) == 1 and not full


def test_launch_many_on_numpy_is_each_parts_matmul(rng):
    """The NumPy backend's launch_many (the ABC's default) and launch_many_ieee: each part's
    matmul, bit for bit, also with non-finite rows at q8_1 (checked once for all parts)."""
    from q6serve.kernels import q6k
    from q6serve.kernels.api import iter_aos_chunks, launch_ieee, launch_many_ieee
    from q6serve.kernels.numpy_backend import NumpyBackend

    be = NumpyBackend(threads=1)
    shapes = ((64, 512), (16, 512), (32, 512))
    ws = [be.load(iter_aos_chunks(q6k.random_blocks(r, k, rng), r, k, 1 << 20), r, k,
                  Layout.SOA, 1 << 20) for r, k in shapes]
    x = rng.standard_normal((3, 512)).astype(np.float32)
    for prec in (Precision.AUTO, Precision.EXACT, Precision.Q8_1):
        got = be.launch_many(ws, x, precision=prec, out_dtype=np.float16).wait()
        for r, w in zip(got, ws, strict=True):
            want = be.matmul(w, x, precision=prec, out_dtype=np.float16)
            assert np.array_equal(r.y, want.y) and r.kernel == want.kernel
    from q6serve.kernels.errors import FormatError

    odd = be.load(iter_aos_chunks(q6k.random_blocks(16, 256, rng), 16, 256, 1 << 20), 16, 256,
                  Layout.SOA, 1 << 20)
    for f in (be.launch_many, functools.partial(launch_many_ieee, be)):
        with pytest.raises(FormatError) as e:
            f([ws[0], odd, ws[1]], x)
        assert e.value.part == 1
    xn = x.copy()
    xn[1, 7] = np.nan
    got = launch_many_ieee(be, ws, xn, precision=Precision.Q8_1).wait()
    for r, w in zip(got, ws, strict=True):
        want = launch_ieee(be, w, xn, precision=Precision.Q8_1).wait()
        assert np.array_equal(r.y, want.y, equal_nan=True)
        assert np.isnan(r.y[1]).all() and np.isfinite(r.y[0]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("shapes", [QKV, GATE_UP], ids=["qkv", "gate_up"])
def test_launch_many_on_the_gpu_is_bit_identical(rng, shapes):
    """On a device: a multi-weight call gives each part's launch's y bit for bit on every
    kind of call (direct, capture, graph replays, the cached ManyCall; staged and copied x;
    f32, f16 and bf16 y) at N = 1, 8, 64 and 300 (cuBLAS: each part's launch in turn), with
    a new x each call."""
    gpu_backend = _gpu_backend()
    from q6serve.kernels.api import iter_aos_chunks
    from tests.conftest import random_blocks

    be = gpu_backend(0)
    ws = [be.load(iter_aos_chunks(random_blocks(rng, r * (k // 256)), r, k, 64 << 20), r, k,
                  Layout.SOA) for r, k in shapes]
    k = shapes[0][1]
    try:
        for n, out, staged in ((1, None, True), (1, np.float16, False), (8, None, False),
                               (8, BFLOAT16, True), (64, None, True), (64, np.float16, True),
                               (300, None, False)):
            for _ in range(4):  # a new x each call: a copy that ran early would show
                x = rng.standard_normal((n, k)).astype(np.float16)
                refs = [be.launch(w, x, out_dtype=out).wait() for w in ws]
                xi = x
                if staged:
                    xi = be.staging(n, k, np.float16)
                    xi[...] = x
                got = be.launch_many(ws, xi, out_dtype=out).wait()
                for g, r in zip(got, refs, strict=True):
                    assert g.y.dtype == r.y.dtype and g.kernel == r.kernel
                    np.testing.assert_array_equal(g.y, r.y)
                    assert g.timing.seconds() is not None and g.timing.seconds() > 0
    finally:
        for w in ws:
            be.free(w)
        be.close()


@pytest.mark.parametrize("staged", [True, False])
def test_write_combined_staging(monkeypatch, staged):
    """STAGING_WC_MIN: an x of that many bytes or more is staged in a write-combined buffer of
    its own per slot (staging() hands it out too), smaller ones in the usual one; every call
    (direct, capture, graph, cached) still uploads x unchanged and returns the device y; a
    grown buffer is freed."""
    monkeypatch.setattr(launch_mod, "STAGING_WC_MIN", 1 << 18)
    be, cp = fake_backend(monkeypatch)
    w = fake_weight(be, 4096, 14336)
    rng = np.random.default_rng(17)
    ws = be.launcher.ws
    for n in (1, 64, 1, 32):
        be.matmul(w, _x(be, rng, n, 14336, staged))
        for i in range(4):
            y = _set_y(be, w, n, i)
            x = _x(be, rng, n, 14336, staged)
            xb = x.copy()
            assert np.array_equal(be.launch(w, x).wait().y, y)
            assert np.array_equal(ws._dev["x"].a[: xb.nbytes], xb.reshape(-1).view(np.uint8))
        big = xb.nbytes >= 1 << 18
        wc = [h for h in ws._host_wc if h is not None]
        assert wc or not big  # (a WC buffer once any x was big enough)
        if staged and big:
            assert x.ctypes.data in {h[1].ctypes.data for h in wc}
        if staged and not big:
            assert x.ctypes.data in {h[1].ctypes.data for h in ws._host if h is not None}
    assert all(f == 5 for _, f in cp.host_bufs.values())  # write-combined | portable
    assert cp.host_bufs
    ws.clear()
    be.free(w)  # (its cached calls hold views of the buffers: the buffers outlive no view)
    del x, wc
    import gc

    gc.collect()
    assert not cp.host_bufs


@pytest.mark.gpu
def test_write_combined_staging_on_the_gpu_is_bit_identical(rng, monkeypatch):
    """On a device: calls whose x is staged in a write-combined buffer (STAGING_WC_MIN) give
    the usual buffer's y bit for bit (staged and copied x, a new x each call)."""
    gpu_backend = _gpu_backend()
    from q6serve.kernels.api import iter_aos_chunks
    from tests.conftest import random_blocks

    rows, k = 4096, 14336
    be = gpu_backend(0)
    w = be.load(iter_aos_chunks(random_blocks(rng, rows * (k // 256)), rows, k, 64 << 20), rows,
                k, Layout.SOA)
    try:
        for n, staged in ((64, True), (64, False), (32, True), (1, True)):
            for _ in range(4):
                x = rng.standard_normal((n, k)).astype(np.float16)
                monkeypatch.setattr(launch_mod, "STAGING_WC_MIN", 0)
                ref = be.matmul(w, x).y
                monkeypatch.setattr(launch_mod, "STAGING_WC_MIN", 1 << 18)
                xi = x
                if staged:
                    xi = be.staging(n, k, np.float16)
                    xi[...] = x
                np.testing.assert_array_equal(be.launch(w, xi).wait().y, ref)
    finally:
        be.free(w)
        be.close()

