"""A merged batch's x gathered from page-locked front-end arenas (issue 15, session 22;
``Q6SERVE_DP_ARENA_GATHER`` with ``Q6SERVE_DP_PIN_ARENA``): ``CudaBackend.gathered`` hands out
a placeholder x whose launch DMAs each piece into its rows of the device's x
(``Launcher.launch_pieces``: no concatenation on the host), or, where that launch cannot be
taken, fills the placeholder first; the device process passes each merged call's slot. CPU:
the CUDA backend's host path on tests/kernels' fake device, and a --frontends worker on a
NumPy backend that honours the same contract."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from q6serve.kernels.cuda_backend import fill_gathered
from tests.dataplane.test_frontends import start  # noqa: F401  (fixture)
from tests.dataplane.test_pinned_regions import DmaBackend, Recorder
from tests.dataplane.tol import assert_ref
from tests.kernels.test_cuda_backend_host import _set_y, fake_backend, fake_weight
from tests.service.svc_util import random_q6k, reference


def _pieces(be: Any, rng: np.random.Generator, rows: list[int], k: int,
            pin: bool = True) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
    """x's parts, each in a host buffer of its own (page-locked with the backend's HostIO
    where ``pin``), and their (address, bytes)."""
    parts = [rng.standard_normal((n, k)).astype(np.float16) for n in rows]
    for p in parts:
        if pin:
            be.hostio.pin(p.ctypes.data, p.nbytes)
    return parts, [(p.ctypes.data, p.nbytes) for p in parts]


@pytest.mark.parametrize("out", [None, np.float16])
def test_gathered_x_is_dma_d_piece_by_piece(monkeypatch: pytest.MonkeyPatch, out: Any) -> None:
    """Every call (direct launches, capture, graph replays) of a gathered x copies each piece
    host-to-device into its rows of the device's x (one copy a piece, the placeholder never
    written on the host) and hands back the device y."""
    be, cp = fake_backend(monkeypatch)
    k = 14336
    w = fake_weight(be, 4096, k)
    rng = np.random.default_rng(3)
    kept = []  # (every part stays allocated: a pinned range's address is never reused)
    for i in range(5):
        parts, pieces = _pieces(be, rng, [2, 1, 3], k)
        kept.append(parts)
        n = sum(p.shape[0] for p in parts)
        x = be.gathered(pieces, n, k, np.float16)
        assert x is not None and x.shape == (n, k) and x is be.launcher.ws.staged
        x[...] = 0  # (what the host wrote there; the launch must not read it)
        h2d = cp.counts.get("h2d", 0)
        if i:
            y = _set_y(be, w, n, i)
        res = be.launch(w, x, out_dtype=out).wait()
        assert cp.counts["h2d"] - h2d == 3  # one DMA a piece, nothing else up
        want_x = np.concatenate(parts)
        ws = be.launcher.ws
        assert np.array_equal(ws._dev["x"].a[: want_x.nbytes], want_x.reshape(-1).view(np.uint8))
        assert not x.any()  # never filled on the host
        if i:
            assert np.array_equal(res.y, y if out is None else y.astype(out))
    assert cp.counts.get("graph", 0) >= 2  # the bound sequence became a graph


def test_gathered_x_outside_the_pinned_ranges_is_refused(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    be, _ = fake_backend(monkeypatch)
    rng = np.random.default_rng(4)
    k = 14336
    _, pieces = _pieces(be, rng, [1, 2], k, pin=False)
    assert be.gathered(pieces, 3, k, np.float16) is None
    be.hostio.pin(*pieces[0])
    assert be.gathered(pieces, 3, k, np.float16) is None  # one piece still pageable
    be.hostio.pin(*pieces[1])
    assert be.gathered(pieces, 4, k, np.float16) is None  # rows that are not the pieces'
    assert be.gathered(pieces, 3, k, np.float64) is None  # a dtype the kernels do not take
    assert be.gathered(pieces, 3, k, np.float16) is not None


def test_a_launch_that_cannot_take_the_pieces_fills_x_first(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """A top-k launch (or a piece unpinned between gathered() and the launch) fills the
    placeholder from the pieces on the host and takes the staged way: x reaches the device
    right either way."""
    be, cp = fake_backend(monkeypatch)
    k = 14336
    w = fake_weight(be, 4096, k)
    rng = np.random.default_rng(5)
    parts, pieces = _pieces(be, rng, [2, 2], k)
    x = be.gathered(pieces, 4, k, np.float16)
    assert x is not None
    be.launch(w, x, topk=4).wait()
    assert np.array_equal(x, np.concatenate(parts))  # filled on the host
    kept = parts  # (still pinned: its addresses are not to be reused)
    parts, pieces = _pieces(be, rng, [1, 3], k)
    x = be.gathered(pieces, 4, k, np.float16)
    be.hostio.unpin(pieces[1][0])
    h2d = cp.counts.get("h2d", 0)
    be.launch(w, x).wait()
    assert np.array_equal(x, np.concatenate(parts))
    ws = be.launcher.ws
    assert np.array_equal(ws._dev["x"].a[: x.nbytes], x.reshape(-1).view(np.uint8))
    assert cp.counts["h2d"] - h2d <= 1  # the staged upload (or the copy kernel), not 2 pieces
    del kept


def test_fill_gathered() -> None:
    rng = np.random.default_rng(6)
    parts = [rng.standard_normal((n, 8)).astype(np.float32) for n in (1, 3, 2)]
    x = np.zeros((6, 8), np.float32)
    fill_gathered(x, [(p.ctypes.data, p.nbytes) for p in parts])
    assert np.array_equal(x, np.concatenate(parts))


class GatherBackend(DmaBackend):
    """test_pinned_regions' DmaBackend with ``gathered``: a placeholder (NaN until filled) whose
    pieces must be page-locked; its matmul fills it from the pieces as the CUDA backend's
    launch DMAs them (so a wrong address, size or order gives a wrong y)."""

    def __init__(self, rec: Recorder) -> None:
        super().__init__(rec)
        self.pending: tuple[np.ndarray, list[tuple[int, int]]] | None = None
        self.gathers: list[int] = []  # pieces a gathered x had

    def gathered(self, pieces: list[tuple[int, int]], n: int, k: int,
                 dtype: np.dtype) -> np.ndarray | None:
        if not all(self.hostio.covers_range(p, nb) for p, nb in pieces):
            return None
        x = np.full((n, k), np.nan, dtype)
        self.pending = (x, list(pieces))
        return x

    def matmul(self, w: Any, x: np.ndarray, **kw: Any) -> Any:
        if self.pending is not None and x is self.pending[0]:
            fill_gathered(x, self.pending[1])
            self.gathers.append(len(self.pending[1]))
            self.pending = None
        return super().matmul(w, x, **kw)


def _warm(client: Any, rows: int, k: int) -> None:
    """One call alone of each row bucket a merged batch may have (1-32 rows, f16): its job is
    then measured, so a merged batch of that size may take the direct path (whose x is the
    gathered one) instead of being queued (concatenated): without it the tests below failed
    now and then on a loaded host (every batch of a bucket not measured yet queued)."""
    for n in (1, 2, 3, 5, 9, 17, 24):
        client.matmul("w", np.ones((n, k), np.float16), precision="f16")


def _gathered_all(w: Any, backend: GatherBackend) -> None:
    """Every merged batch on the direct path went to the backend gathered, with calls of
    several messages in one. On a loaded host a run may have none on that path (the device
    busy, each batch queued and concatenated): nothing to check then, said as a skip."""
    wk = w.worker
    if not wk.merged_direct:
        pytest.skip(f"no merged batch took the direct path here (merged {wk.merged}, "
                    f"gathered {wk.gathered})")
    assert wk.gathered == wk.merged_direct == len(backend.gathers), (
        wk.merged, wk.merged_direct, wk.gathered)
    assert max(backend.gathers) >= 2


def test_front_ends_merged_batches_gathered(start: Any,  # noqa: F811
                                            monkeypatch: pytest.MonkeyPatch,
                                            rng: np.random.Generator) -> None:
    """Calls of several callers through two front ends whose arenas are pinned: the device
    process's merged batches go to the backend as their slots (``gathered``), every caller
    gets its own rows; with the gather off (or the arenas not pinned) x is concatenated."""
    from concurrent.futures import ThreadPoolExecutor

    rows, k = 96, 512
    blocks = random_q6k(rows, k, 13)

    def run(env: dict[str, str]) -> tuple[Any, GatherBackend]:
        for name, v in env.items():
            monkeypatch.setenv(name, v)
        backend = GatherBackend(Recorder())
        # (any measured job inlines: on a loaded host a slow one kept every batch queued,
        # concatenated, and the test failed now and then)
        w = start(backend=backend, inline_device_us=200_000)
        clients = [w.client() for _ in range(8)]
        clients[0].upload("w", blocks, rows, k)
        _warm(clients[0], rows, k)
        xs = [rng.standard_normal((1 + i % 3, k)).astype(np.float16) for i in range(8)]

        def caller(i: int) -> None:
            for _ in range(30):
                got = clients[i].matmul("w", xs[i], precision="f16")
                assert_ref(got, reference(blocks, rows, k, xs[i].astype(np.float32)),
                           atol=2e-2)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(caller, range(8)))
        return w, backend

    w, backend = run({"Q6SERVE_DP_PIN_ARENA": "1"})
    _gathered_all(w, backend)
    w.stop()
    w, backend = run({"Q6SERVE_DP_PIN_ARENA": "1", "Q6SERVE_DP_ARENA_GATHER": "0"})
    assert w.worker.gathered == 0 and not backend.gathers and w.worker.merged[0] > 0
    w.stop()
    w, backend = run({"Q6SERVE_DP_PIN_ARENA": "0", "Q6SERVE_DP_ARENA_GATHER": "1"})
    assert w.worker.gathered == 0 and not backend.gathers
    w.stop()


def test_front_ends_merged_region_calls_answered_from_the_batch(
        start: Any,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    """System-region calls of several callers through two front ends (x and y in each
    caller's page-locked region, arenas not pinned): the device process merges them (x
    concatenated: a batch of T2's ~20 calls gathered from their regions lost on the H200,
    session 27 bundle A, the per-piece DMAs dearer than the copy), each caller's y lands in
    its region from the batch's y (``_region_answer``: no reply object or future), only a
    call left alone is routed (its y written in place by the backend), and no y route is
    left."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.dataplane.test_pinned_regions import _routes

    monkeypatch.setenv("Q6SERVE_DP_PIN_ARENA", "0")
    rows, k = 96, 512
    blocks = random_q6k(rows, k, 17)
    backend = GatherBackend(Recorder())
    w = start(backend=backend, inline_device_us=200_000)  # (as the test above)
    clients = [w.client() for _ in range(8)]
    clients[0].upload("w", blocks, rows, k)
    _warm(clients[0], rows, k)
    regions = [c.register_shm(f"g{i}", 1 << 16) for i, c in enumerate(clients)]
    xs = [rng.standard_normal((1 + i % 3, k)).astype(np.float16) for i in range(8)]
    wants = [reference(blocks, rows, k, x.astype(np.float32)) for x in xs]

    def caller(i: int) -> None:
        for j in range(20):
            off = 16384 + 4096 * (j % 2)  # (y at two places: a stale y would show)
            got = clients[i].matmul("w", xs[i], precision="f16", x_region=regions[i],
                                    y_region=(regions[i], off))
            assert_ref(got, wants[i], atol=2e-2)

    with ThreadPoolExecutor(8) as pool:
        for _ in range(5):  # (batches merge when calls meet in a trip: a few rounds)
            list(pool.map(caller, range(8)))
            if w.worker.merged_direct and backend.direct_y:
                break
    wk = w.worker
    if not wk.merged_direct:
        pytest.skip(f"no merged batch took the direct path here (merged {wk.merged})")
    assert wk.gathered == 0 and not backend.gathers
    assert backend.direct_y > 0  # calls left alone: y routed into place
    assert w.call(_routes(backend)) == 0
    for r in regions:
        r.close()


@pytest.mark.gpu
@pytest.mark.parametrize("out", [None, np.float16])
def test_gathered_x_on_the_gpu_is_bit_identical(rng: np.random.Generator, out: Any) -> None:
    """On a device: x's rows in pieces of page-locked memory (cudaHostRegistered, as the
    device process pins its arenas), launched as ``gathered`` placeholders (direct launches,
    capture, graph replays), give the staged x's y bit for bit; the placeholder is never
    written on the host; unpinned, the same pieces are refused."""
    import mmap

    from q6serve.kernels.api import Layout, iter_aos_chunks
    from tests.conftest import random_blocks
    from tests.kernels.test_cuda_backend_host import _gpu_backend

    be = _gpu_backend()(0)
    rows, k = 3584, 18944
    blocks = random_blocks(rng, rows * (k // 256))
    w = be.load(iter_aos_chunks(blocks, rows, k, 64 << 20), rows, k, Layout.SOA)
    buf = mmap.mmap(-1, 8 << 20)  # (page-aligned, as an arena's mapping)
    mem = np.frombuffer(buf, np.uint8)
    addr = mem.ctypes.data
    assert be.hostio.pin(addr, mem.size)
    try:
        for split in ([2, 1, 3], [1] * 9, [4, 4], [1]):
            parts = [rng.standard_normal((n, k)).astype(np.float16) for n in split]
            x = np.concatenate(parts)
            ref = be.matmul(w, x, out_dtype=out).y
            pieces, at = [], 0
            for p in parts:
                mem[at : at + p.nbytes] = p.reshape(-1).view(np.uint8)
                pieces.append((addr + at, p.nbytes))
                at += -(-p.nbytes // 4096) * 4096  # (each in a slot of its own)
            for _ in range(4):
                xg = be.gathered(pieces, x.shape[0], k, np.float16)
                assert xg is not None
                xg[...] = 0
                np.testing.assert_array_equal(be.launch(w, xg, out_dtype=out).wait().y, ref)
                assert not xg.any()
        be.hostio.unpin(addr)
        assert be.gathered(pieces, x.shape[0], k, np.float16) is None
    finally:
        be.hostio.unpin(addr)
        be.close()
