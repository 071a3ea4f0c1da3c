"""Which split a large call takes (kernels/cuda/launch.py points 8 and 10), on the fake device of
tests/kernels/test_cuda_backend_host.py: ``X_SPLIT_Y_MIN`` sends an idle call whose f32 y is
large (16 to ``X_SPLIT_MAX_N`` tokens) to token halves before row chunks."""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest

from q6serve.kernels.api import BFLOAT16, KernelFlags, Layout, Precision, ResidentWeight
from q6serve.kernels.cuda import launch as launch_mod
from q6serve.kernels.cuda.dispatch import Cfg, Dispatch, DispatchTable
from q6serve.kernels.cuda.storage import CudaWeight
from tests.kernels.test_cuda_backend_host import (
    _chunks,
    _device_y_call,
    _halves,
    _set_y,
    _set_y_chunked,
    _two_slab,
    _x,
    fake_backend,
)

Y_MIN = 3 << 19  # 1.5 MiB of f32 y
# The two-slab weights' N=64 cells on the register K-slice tile (as before session 25; whose
# token halves the tests below are about); the committed table gives 18944x3584's to the wgmma
# tile since session 25, whose large y goes by row chunks instead (test_wgmma_cells_take_row_
# chunks), and keeps 14336x4096's on the K-slice tile (bundle A: its wall in 2 chunks 0.979)
K_SLICE_N64 = {(14336, 4096): Cfg(nt=8, warps=8, src=4, pf=True),
               (18944, 3584): Cfg(nt=4, warps=12, src=4, pf=True)}
# Both on the wgmma tile at their measured K split (the mechanism holds for either weight)
WGMMA_N64 = {(14336, 4096): Cfg(nt=8, warps=12, src=8, pf=True, ksplit=6),
             (18944, 3584): Cfg(nt=8, warps=12, src=8, pf=True, ksplit=5)}


def _n64_cells(be, cfgs: dict[tuple[int, int], Cfg]) -> None:
    """``be``'s dispatch with the N=64 cells (auto, f16) of the weights in ``cfgs`` on the
    given tiles, the rest the committed table's."""
    t = be.dispatch.table
    cells = [replace(e, cfg=cfgs[e.rows, e.k])
             if (e.rows, e.k) in cfgs and e.n == 64 and e.column in ("auto", "f16")
             else e for cell in t.cells.values() for e in cell.values()]
    be.dispatch = Dispatch(DispatchTable(cells, t.meta), be.sm_count)


def _k_slice_n64(be) -> None:
    _n64_cells(be, K_SLICE_N64)


@pytest.mark.parametrize("rows,n,want", [(14336, 64, -4), (14336, 48, 2), (14336, 32, 2),
                                         (18944, 64, -4), (18944, 48, -4), (18944, 32, 2),
                                         (14336, 128, 2)])
def test_the_defaults_split_where_measured(monkeypatch, rows, n, want):
    """The defaults (X_SPLIT_Y_MIN 3 MiB, X_SPLIT_ROWS on): the two-slab weights' calls whose
    f32 y is 3 MiB or more (14336x4096 at N=64: 3.7 MB; 18944x3584 from N=42) run in halves x
    their row chunks; N=32 (1.8 / 2.4 MB: measured slower so) and N=128 (past X_SPLIT_MAX_N)
    keep the row chunks."""
    assert (launch_mod.X_SPLIT_Y_MIN, launch_mod.X_SPLIT_ROWS) == (3 << 20, 1)
    be, _, _, w = _two_slab(monkeypatch)
    k = 4096 if rows == 14336 else 3584
    assert be.launcher.chunks_for(w.data, 0, n * rows, n * k * 2, n) == want


@pytest.mark.parametrize("n,want", [(64, -2), (32, -2), (16, 0), (128, 2), (8, 0)])
def test_a_large_y_takes_token_halves_before_row_chunks(monkeypatch, n, want):
    """14336x4096 (two slabs, its own 2 row chunks), the rule at 1.5 MiB, X_SPLIT_ROWS off:
    N=64 (3.7 MB of y) and N=32 (1.8 MB) take halves; N=16 (0.9 MB: under the rule and
    Y_CHUNK_MIN) nothing; N=128 (past X_SPLIT_MAX_N) its row chunks as before; N=8 nothing.
    Unknown tokens (n 0): the rule does not apply."""
    monkeypatch.setattr(launch_mod, "X_SPLIT_Y_MIN", Y_MIN)
    monkeypatch.setattr(launch_mod, "X_SPLIT_ROWS", 0)
    be, _, _, w = _two_slab(monkeypatch)
    lc = be.launcher
    assert lc.chunks_for(w.data, 0, n * 14336, n * 4096 * 2, n) == want
    assert lc.chunks_for(w.data, 0, 64 * 14336, 64 * 4096 * 2) == 2  # (n unknown: chunks)
    monkeypatch.setattr(launch_mod, "X_SPLIT_Y_MIN", 0)
    assert lc.chunks_for(w.data, 0, 64 * 14336, 64 * 4096 * 2, 64) == 2


@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("out", [None, BFLOAT16])
def test_halves_by_y_return_y_whole(monkeypatch, staged, out):
    """The rule on, X_SPLIT_ROWS off: 14336x4096 at N=64 binds halves of 32 tokens (no row
    chunks), and y comes back whole on every kind of call (direct, capture, graph, the cached
    BoundCall): one copy per half."""
    monkeypatch.setattr(launch_mod, "X_SPLIT_Y_MIN", Y_MIN)
    monkeypatch.setattr(launch_mod, "X_SPLIT_ROWS", 0)
    be, cp, _, w = _two_slab(monkeypatch)
    _k_slice_n64(be)
    rng = np.random.default_rng(31)
    for i in range(5):
        y = _set_y(be, w, 64, i) if i else None
        before = cp.counts.get("d2h2d", 0)
        res = be.launch(w, _x(be, rng, 64, 4096, staged), out_dtype=out).wait()
        if y is not None:
            want = y if out is None else y.astype(out)
            assert res.y.dtype == want.dtype and np.array_equal(res.y, want)
            assert cp.counts["d2h2d"] == before + 2
    assert _halves(w, 64) == [(0, 32), (32, 64)]
    assert not [b for key, b in w.data.plans.items() if len(key) == 6 and key[2] == 64
                and b.extra.get("chunks")]


def test_halves_by_y_not_beside_a_launch_in_flight(monkeypatch):
    """Beside a launch in flight the call runs whole (Y_CHUNKS_IDLE's rule), and with the rule
    off the weight's row chunks come back."""
    monkeypatch.setattr(launch_mod, "X_SPLIT_Y_MIN", Y_MIN)
    be, _, _, w = _two_slab(monkeypatch)
    rng = np.random.default_rng(32)
    a = be.launch(w, _x(be, rng, 1, 4096, False))
    assert be.launcher.chunks_for(w.data, be.launcher.ws.free_slot(), 64 * 14336,
                                  64 * 4096 * 2, 64) == 0
    a.wait()
    monkeypatch.setattr(launch_mod, "X_SPLIT_Y_MIN", 0)
    be.matmul(w, _x(be, rng, 64, 4096, True))
    assert _chunks(w, 64) == [(0, 7168), (7168, 14336)]


def _set_y_parts(be, w, n: int, i: int, parts) -> np.ndarray:
    """Known values in the fake device's y laid out as X_SPLIT_ROWS's kernels write it: each
    token half's rows of y in place, within them each row chunk's own [m, r1 - r0] block."""
    y = (np.arange(n * w.rows, dtype=np.float32) % 991 - 450 + i).reshape(n, w.rows)
    dev = be.launcher.ws._dev["y"].a
    for t0, t1, r0, r1 in parts:
        block = np.ascontiguousarray(y[t0:t1, r0:r1]).reshape(-1).view(np.uint8)
        off = 4 * (t0 * w.rows + (t1 - t0) * r0)
        dev[off : off + block.size] = block
    return y


@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("out", [None, BFLOAT16])
def test_halves_in_row_chunks_return_y_whole(monkeypatch, staged, out):
    """X_SPLIT_ROWS on: 14336x4096 at N=64 runs as 4 parts (each token half in the weight's 2
    row chunks: its slabs), each part's kernels writing its own [32, 7168] block, and y comes
    back whole on every kind of call: x up in two halves, 4 2D copies, the first three after
    waits for their parts' events on the y stream."""
    monkeypatch.setattr(launch_mod, "X_SPLIT_Y_MIN", Y_MIN)
    monkeypatch.setattr(launch_mod, "X_SPLIT_ROWS", 1)
    be, cp, _, w = _two_slab(monkeypatch)
    _k_slice_n64(be)
    assert be.launcher.chunks_for(w.data, 0, 64 * 14336, 64 * 4096 * 2, 64) == -4
    rng = np.random.default_rng(33)
    parts = [(0, 32, 0, 7168), (0, 32, 7168, 14336), (32, 64, 0, 7168), (32, 64, 7168, 14336)]
    for i in range(5):  # (the first call binds: its y and copies not checked)
        y = _set_y_parts(be, w, 64, i, parts) if i else None
        _, grew = _device_y_call(be, w, rng, 64, 4096, staged, out, y, cp)
        assert y is None or (grew["d2h2d"], grew["h2d"]) == (4, 2)
    got = [b.extra["token_rows"] for key, b in w.data.plans.items()
           if len(key) == 6 and key[2] == 64 and b.extra.get("token_rows")]
    assert got and got[0] == parts
    # off: the plain halves (2 copies) under the y rule
    monkeypatch.setattr(launch_mod, "X_SPLIT_ROWS", 0)
    assert be.launcher.chunks_for(w.data, 0, 64 * 14336, 64 * 4096 * 2, 64) == -2


def test_halves_in_row_chunks_keep_the_k_split(monkeypatch):
    """Each part is its half's plan on its slabs' rows: the full call's K split, the half's
    tile, x at the half's first token, y at its own block."""
    monkeypatch.setattr(launch_mod, "X_SPLIT_Y_MIN", Y_MIN)
    monkeypatch.setattr(launch_mod, "X_SPLIT_ROWS", 1)
    be, _, _, w = _two_slab(monkeypatch)
    _k_slice_n64(be)
    lc = be.launcher
    seen = []
    orig = lc.steps
    monkeypatch.setattr(lc, "steps", lambda lp, w_, cw, xd, y, n_, r0=0, r1=None: seen.append(
        (lp.grid[1], xd, y, n_, r0, r1)) or orig(lp, w_, cw, xd, y, n_, r0, r1))
    be.matmul(w, np.ones((64, 4096), np.float16))
    c = be.choose(64, Precision.AUTO, KernelFlags(), 14336, 4096)
    ks = lc.plan(14336, 4096, w.layout, "InF16", c.path, c.cfg, 64).grid[1]
    xd, yd = lc.ws._dev["x"].data.ptr, lc.ws._dev["y"].data.ptr
    assert seen[-4:] == [(ks, xd, yd, 32, 0, 7168),
                         (ks, xd, yd + 4 * 32 * 7168, 32, 7168, 14336),
                         (ks, xd + 32 * 4096 * 2, yd + 4 * 32 * 14336, 32, 0, 7168),
                         (ks, xd + 32 * 4096 * 2, yd + 4 * (32 * 14336 + 32 * 7168), 32, 7168,
                          14336)]


def _tall(monkeypatch, rows: int, k: int, y_chunks: int = 2):
    """A fake backend and a tall ``rows`` x ``k`` weight as storage keeps it: two slabs of
    ``rows / 2`` rows, ``y_chunks`` its own row chunks."""
    be, cp = fake_backend(monkeypatch)
    cw = CudaWeight(slabs=[], table=cp.empty(16, np.uint8), rps=rows // 2, y_chunks=y_chunks)
    return be, cp, ResidentWeight(rows, k, Layout.SOA, rows * k, cw)


@pytest.mark.parametrize("rows,k,n,state", [(14336, 4096, 64, -4), (18944, 3584, 64, -4),
                                            (18944, 3584, 48, -4), (14336, 4096, 48, 2)])
@pytest.mark.parametrize("staged,out", [(True, None), (False, None), (True, BFLOAT16)])
def test_wgmma_cells_take_row_chunks(monkeypatch, rows, k, n, state, staged, out):
    """A two-slab weight's N=64 cell on the wgmma tile (18944x3584's in the table since session
    25; 14336x4096's set so here): a call whose y the rule by y's size would send to token
    halves (state -4: halves x row chunks) takes the weight's 2 row chunks instead
    (X_SPLIT_Y_SRCS: each half would run the full 64-token tile over the whole weight), as does
    one the rows rule sends there (state 2): x up in one copy, each slab's [N, rows / 2] block
    of y down by its 2D copy, y whole on every kind of call (direct, capture, graph, the cached
    BoundCall)."""
    be, cp, w = _tall(monkeypatch, rows, k)
    _n64_cells(be, WGMMA_N64)
    c = be.choose(n, Precision.AUTO, KernelFlags(), rows, k)
    assert c.cfg.src == 8 and c.cfg.ksplit == (6 if k == 4096 else 5)
    assert be.launcher.chunks_for(w.data, 0, n * rows, n * k * 2, n) == state
    rng = np.random.default_rng(41)
    cuts = [(0, rows // 2), (rows // 2, rows)]
    for i in range(5):  # (the first call binds: its y and copies not checked)
        y = _set_y_chunked(be, w, n, i, cuts) if i else None
        _, grew = _device_y_call(be, w, rng, n, k, staged, out, y, cp)
        assert y is None or (grew["d2h2d"], grew["h2d"], grew.get("d2h", 0)) == (2, 1, 0)
    assert _chunks(w, n) == cuts and _halves(w, n) is None


def test_wgmma_row_chunks_keep_the_k_split_and_grid(monkeypatch):
    """Each chunk is the full call's plan on its slab's rows: the table's K split, the same
    CTAs, threads and shared memory (the chunk's rows in the same rounds), x whole, y at its
    own [64, 9472] block: every value is the whole call's."""
    be, _, w = _tall(monkeypatch, 18944, 3584)
    lc = be.launcher
    seen = []
    orig = lc.steps
    monkeypatch.setattr(lc, "steps", lambda lp, w_, cw, xd, y, n_, r0=0, r1=None: seen.append(
        (lp.grid, lp.threads, lp.smem, xd, y, n_, r0, r1)) or orig(lp, w_, cw, xd, y, n_, r0,
                                                                  r1))
    be.matmul(w, np.ones((64, 3584), np.float16))
    c = be.choose(64, Precision.AUTO, KernelFlags(), 18944, 3584)
    full = lc.plan(18944, 3584, w.layout, "InF16", c.path, c.cfg, 64)
    assert full.grid[1] == 5
    xd, yd = lc.ws._dev["x"].data.ptr, lc.ws._dev["y"].data.ptr
    g = (full.grid, full.threads, full.smem)
    assert seen[-2:] == [(*g, xd, yd, 64, 0, 9472), (*g, xd, yd + 4 * 64 * 9472, 64, 9472, 18944)]


def test_wgmma_halves_by_y_fall_back_to_whole_or_halves(monkeypatch):
    """Where the weight has no row chunks of its own the wgmma cell runs whole (one copy down);
    with the tile in X_SPLIT_Y_SRCS it takes the halves (x 4 parts) as before session 25; an x
    of X_SPLIT_MIN bytes or more (the rule by x's size) keeps its halves."""
    rng = np.random.default_rng(42)
    be, cp, w = _tall(monkeypatch, 14336, 4096, y_chunks=0)
    _n64_cells(be, WGMMA_N64)
    assert be.launcher.chunks_for(w.data, 0, 64 * 14336, 64 * 4096 * 2, 64) == -2
    for _ in range(3):
        before = cp.counts.get("d2h", 0)
        be.launch(w, _x(be, rng, 64, 4096, True)).wait()
        assert cp.counts["d2h"] == before + 1
    assert _halves(w, 64) is None and not any(
        getattr(b, "extra", {}).get("chunks") for b in w.data.plans.values())
    monkeypatch.setattr(launch_mod, "X_SPLIT_Y_SRCS", (4, 8))
    be, _, w = _tall(monkeypatch, 14336, 4096)
    _n64_cells(be, WGMMA_N64)
    be.matmul(w, _x(be, rng, 64, 4096, True))
    assert _halves(w, 64) == [(0, 32), (32, 64)]
    monkeypatch.setattr(launch_mod, "X_SPLIT_Y_SRCS", (4,))
    monkeypatch.setattr(launch_mod, "X_SPLIT_MIN", 1 << 18)  # x: 512 KiB
    be, _, w = _tall(monkeypatch, 14336, 4096)
    _n64_cells(be, WGMMA_N64)
    be.matmul(w, _x(be, rng, 64, 4096, True))
    assert _halves(w, 64) == [(0, 32), (32, 64)]

def _gpu_weight(rng, rows, k):
    """The device backend, a random ``rows`` x ``k`` weight on it as storage keeps it (its
    slabs, their own row chunks) and the staged-x maker (test_cuda_backend_host.staged_copy)."""
    from q6serve.kernels.api import Layout, iter_aos_chunks
    from tests.conftest import random_blocks
    from tests.kernels.test_cuda_backend_host import _gpu_backend, staged_copy

    be = _gpu_backend()(0)
    w = be.load(iter_aos_chunks(random_blocks(rng, rows * (k // 256)), rows, k, 64 << 20),
                rows, k, Layout.SOA)
    return be, w, functools.partial(staged_copy, be)


def _calls_as_whole(be, w, x, out, staged, staged_x, monkeypatch, y_min):
    """The reference: the call's y run whole (no halves by y, no row chunks); then, with
    X_SPLIT_Y_MIN at ``y_min``, 4 launches (staged x or copied) each give it bit for bit
    (direct, capture, graph, the cached call). Returns the reference."""
    monkeypatch.setattr(launch_mod, "X_SPLIT_Y_MIN", 0)
    be.launcher.y_chunks = 0
    ref = be.matmul(w, x, out_dtype=out).y
    be.launcher.y_chunks = None
    monkeypatch.setattr(launch_mod, "X_SPLIT_Y_MIN", y_min)
    for _ in range(4):
        xi = staged_x(x) if staged else x
        np.testing.assert_array_equal(be.launch(w, xi, out_dtype=out).wait().y, ref)
    return ref


def _beside_one_in_flight(be, w, x, out, ref, staged_x):
    """3 times the call beside a launch in flight (an N=1 one): still ``ref`` bit for bit."""
    for _ in range(3):
        a = be.launch(w, staged_x(x[:1]))
        np.testing.assert_array_equal(be.launch(w, x, out_dtype=out).wait().y, ref)
        a.wait()


def _gpu_done(be, w):
    be.launcher.y_chunks = None
    be.free(w)
    be.close()


@pytest.mark.gpu
@pytest.mark.parametrize("split_rows", [0, 1])
@pytest.mark.parametrize("rows,k", [(14336, 4096), (18944, 3584)])
def test_halves_by_y_on_the_gpu_are_bit_identical(rng, monkeypatch, rows, k, split_rows):
    """On a device, the weights as storage keeps them (two slabs, their own 2 row chunks): with
    the rule on, N = 64 and 32 calls run in token halves (really bound; with X_SPLIT_ROWS each
    half in its row chunks where its own grid takes two rounds) and give the plain call's y
    bit for bit on every kind of call (direct, capture, graph, the cached BoundCall; staged
    and copied x; f32 and bf16 y); beside a launch in flight: plain. (The N=64 cells on the
    K-slice tile, as before session 25: ``_k_slice_n64``.)"""
    be, w, staged_x = _gpu_weight(rng, rows, k)
    _k_slice_n64(be)
    monkeypatch.setattr(launch_mod, "X_SPLIT_ROWS", split_rows)  # (no part in the whole call)
    try:
        for n, out, staged in ((64, None, True), (64, None, False), (64, BFLOAT16, True),
                               (32, None, True)):
            x = rng.standard_normal((n, k)).astype(np.float16)
            ref = _calls_as_whole(be, w, x, out, staged, staged_x, monkeypatch, Y_MIN)
            assert _halves(w, n) == [(0, n // 2), (n // 2, n)], (rows, n)
            want = ("tokens", 2, 2) if split_rows else ("tokens", 2)
            bound = [b for key, b in w.data.plans.items()
                     if len(key) == 6 and key[2] == n and key[4] == want]
            assert bound, (rows, n, split_rows)
            if split_rows:  # the parts are the halves' own row chunks, where they have them
                lc, c = be.launcher, be.choose(n, Precision.AUTO, KernelFlags(), rows, k)
                full = lc.plan(rows, k, Layout.SOA, "InF16", c.path, c.cfg, n, w.data.pairs)
                cut = []
                for t0, t1, tp in lc.token_parts(full, rows, k, Layout.SOA, "InF16", c.path,
                                                 c.cfg, n, 2, w.data.pairs):
                    rcs = lc.row_chunks(tp, rows, k, Layout.SOA, "InF16", c.path,
                                        lc.part_cfg(c.cfg, tp.grid[1], t1 - t0), t1 - t0,
                                        w.data.rps, 2, w.data.pairs)
                    cut += [(t0, t1, r0, r1) for r0, r1, _ in rcs or ()]
                assert bound[0].extra["token_rows"] == cut
                print(f"{rows}x{k} N={n}: parts {cut or 'halves only'}")
            _beside_one_in_flight(be, w, x, out, ref, staged_x)  # there: the plain sequence
    finally:
        _gpu_done(be, w)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,k", [(14336, 4096), (18944, 3584)])
def test_wgmma_row_chunks_on_the_gpu_are_bit_identical(rng, monkeypatch, rows, k):
    """On a device, the weights as storage keeps them (two slabs, their own 2 row chunks): their
    N = 33..64 cells on the wgmma tile (18944x3584's in the table; 14336x4096's set so) at N =
    64 and 48 run in the 2 row chunks (really bound, no halves) and give the whole call's y bit
    for bit on every kind of call (direct, capture, graph, the cached BoundCall; staged and
    copied x; f32 and bf16 y); beside a launch in flight: whole.
    (The whole call's own values: test_cuda_pairs.py's test_every_table_shape.)"""
    be, w, staged_x = _gpu_weight(rng, rows, k)
    _n64_cells(be, WGMMA_N64)
    y_min, cuts = launch_mod.X_SPLIT_Y_MIN, [(0, rows // 2), (rows // 2, rows)]
    try:
        assert (w.data.rps, w.data.y_chunks) == (rows // 2, 2)
        for n, out, staged in ((64, None, True), (64, None, False), (64, BFLOAT16, True),
                               (48, None, True)):
            c = be.choose(n, Precision.AUTO, KernelFlags(), rows, k)
            if be.launcher.tile_cfg(c.path, c.cfg).src != 8:
                pytest.skip(f"the table's cell runs {c.cfg.label()} here (no wgmma tile)")
            x = rng.standard_normal((n, k)).astype(np.float16)
            ref = _calls_as_whole(be, w, x, out, staged, staged_x, monkeypatch, y_min)
            assert _chunks(w, n) == cuts and _halves(w, n) is None, (rows, n)
            _beside_one_in_flight(be, w, x, out, ref, staged_x)  # there: the whole call
    finally:
        _gpu_done(be, w)


@pytest.mark.parametrize("anchor", [0, 1, 2])
@pytest.mark.parametrize("staged", [True, False])
def test_timing_anchor_runs_between_the_upload_and_the_start_event(monkeypatch, anchor, staged):
    """``Launcher.timing_anchor`` (Q6SERVE_TIMING_ANCHOR): 1, a captured sequence launches the
    empty anchor kernel after x's upload and before its start event node (once per capture,
    not on direct launches); 2, also one after its end event node, before y's download; 0,
    none. y is the device y either way, on every kind of call (direct
    launches, the capture, graph replays, the cached call)."""
    from tests.kernels.test_cuda_backend_host import fake_weight

    be, cp, order = _copy_kernel_fake(monkeypatch, 0, every_kernel=True)
    be.launcher.timing_anchor = anchor
    w = fake_weight(be, 4096, 14336)
    rng = np.random.default_rng(2)
    be.matmul(w, _x(be, rng, 1, 14336, staged))  # binds
    for i in range(5):
        y = _set_y(be, w, 1, i)
        res = be.launch(w, _x(be, rng, 1, 14336, staged)).wait()
        assert np.array_equal(res.y, y)
        assert res.timing.seconds() == pytest.approx(25e-6)
    # one capture: x's upload, the anchor, the two event nodes around the kernel, y's download
    anchor_ = "q6_timing_anchor"
    assert order == {0: ["h2d", "event", "event", "d2h"],
                     1: ["h2d", anchor_, "event", "event", "d2h"],
                     2: ["h2d", anchor_, "event", "event", anchor_, "d2h"]}[anchor]
    assert cp.counts["graph"] == 4


@pytest.mark.gpu
def test_timing_anchor_on_the_gpu(rng, monkeypatch):
    """On a device, with ``timing_anchor`` the captured sequence (the empty kernel before its
    start event) gives the same y bit for bit as without, on every kind of call (direct,
    capture, graph, the cached BoundCall; staged and copied x), and a kernel time (its events
    recorded) that is positive and under the call's wall."""
    import time

    from q6serve.kernels.api import Layout, iter_aos_chunks
    from tests.conftest import random_blocks
    from tests.kernels.test_cuda_backend_host import _gpu_backend, staged_copy

    rows, k = 3584, 18944
    monkeypatch.setenv("Q6SERVE_TIMING_ANCHOR", "2")
    be = _gpu_backend()(0)
    assert be.launcher.timing_anchor == 2  # (the backend passes the variable's value)
    w = be.load(iter_aos_chunks(random_blocks(rng, rows * (k // 256)), rows, k, 64 << 20),
                rows, k, Layout.SOA)
    try:
        x = rng.standard_normal((1, k)).astype(np.float16)
        be.launcher.timing_anchor = 0
        ref = be.matmul(w, x).y
        w.data.plans.clear()
        be.launcher.timing_anchor = 2
        w.data.plans.clear()
        for i in range(6):
            xi = staged_copy(be, x) if i % 2 else x
            t0 = time.perf_counter()
            res = be.launch(w, xi).wait()
            wall = time.perf_counter() - t0
            np.testing.assert_array_equal(res.y, ref)
            s = res.timing.seconds(wait=True)
            assert s is not None and 0 < s < wall, (i, s, wall)
        assert any(b.graph for b in w.data.plans.values() if type(b).__name__ == "Bound")
        assert be.launcher._anchor is not None  # (it ran)
    finally:
        be.free(w)
        be.close()


def test_timing_anchor_default_and_values() -> None:
    """Q6SERVE_TIMING_ANCHOR: unset, the measured default (1: the anchor before the start
    event); 0, 1 and 2 as given; anything else refused naming the variable."""
    assert launch_mod.timing_anchor_from_env({}) == 1
    assert [launch_mod.timing_anchor_from_env({"Q6SERVE_TIMING_ANCHOR": v})
            for v in ("0", "1", "2")] == [0, 1, 2]
    with pytest.raises(ValueError, match="Q6SERVE_TIMING_ANCHOR"):
        launch_mod.timing_anchor_from_env({"Q6SERVE_TIMING_ANCHOR": "3"})


def _copy_kernel_fake(monkeypatch, limit: int, every_kernel: bool = False):
    """A fake backend whose launcher moves copies of up to ``limit`` bytes by the copy kernel
    (``copy_kernel_max``; 0: none), the fake's kernels doing the copy (or recording it under
    capture), and ``order``: what each capture recorded (copy-engine copies, kernels, event
    nodes); ``every_kernel``: each kernel launched outside a capture too (a direct launch's)."""
    import ctypes

    from tests.kernels.test_cuda_backend_host import fake_backend

    be, cp = fake_backend(monkeypatch)
    be.launcher.copy_kernel_max = limit
    order: list[str] = []

    def raw_kernel(src: str, name: str):
        assert name in src

        def launch(grid, block, args, stream=None) -> None:
            if every_kernel or cp.capturing is not None:
                order.append(name)
            if name == "q6_copy":  # (src, dst, bytes): as many threads as 16-byte words
                src_, dst, n = int(args[0]), int(args[1]), int(args[2])
                assert grid[0] * block[0] >= min(-(-n // 16), launch_mod.COPY_MAX_BLOCKS
                                                 * launch_mod.COPY_THREADS)
                assert stream is be.ctx.stream  # (the backend's stream, captured or not)
                cp.op(lambda: ctypes.memmove(dst, src_, n))
            elif name == "q6_copy_h":  # (f32 src, f16 dst, values): a small f16 y's way out
                src_, dst, n = int(args[0]), int(args[1]), int(args[2])
                assert stream is be.ctx.stream

                def run() -> None:
                    f = np.ctypeslib.as_array((ctypes.c_float * n).from_address(src_))
                    np.ctypeslib.as_array((ctypes.c_uint16 * n).from_address(dst))[:] = (
                        f.astype(np.float16).view(np.uint16))

                cp.op(run)

        return launch

    cp.RawKernel = raw_kernel
    memcpy = cp.cuda.runtime.memcpyAsync

    def copy(dst: int, src: int, n: int, kind: int, stream: int) -> None:
        if cp.capturing is not None:
            order.append(("", "h2d", "d2h", "d2d")[kind])
        memcpy(dst, src, n, kind, stream)

    cp.cuda.runtime.memcpyAsync = copy
    monkeypatch.setattr(launch_mod, "_external_record",
                        lambda: (lambda ev, st, flags: order.append("event") or 0))
    return be, cp, order


@pytest.mark.parametrize("limit,want", [
    (0, ["h2d", "q6_timing_anchor", "event", "event", "d2h"]),  # off: the copy engine
    (1 << 20, ["q6_copy", "event", "event", "q6_copy"]),  # both by kernel, no anchor needed
    (16 << 10, ["h2d", "q6_timing_anchor", "event", "event", "q6_copy"]),  # x (28 KB) too large
])
@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("out", [None, np.float16])
def test_copy_kernel_moves_x_and_y_in_the_captured_sequence(monkeypatch, limit, want, staged,
                                                            out):
    """``Launcher.copy_kernel_max`` (Q6SERVE_COPY_KERNEL_MAX): x's upload and a small y's
    download of at most that many bytes are the copy kernel's (a capture records it where the
    copy-engine node was; with x's upload a kernel, no timing anchor), the rest the copy
    engine's as before; y is the device y and x reaches the device on every kind of call."""
    from tests.kernels.test_cuda_backend_host import fake_weight

    be, cp, order = _copy_kernel_fake(monkeypatch, limit)
    be.launcher.timing_anchor = 1
    w = fake_weight(be, 4096, 14336)
    rng = np.random.default_rng(5)
    be.matmul(w, _x(be, rng, 1, 14336, staged), out_dtype=out)  # binds
    for i in range(5):
        _device_y_call(be, w, rng, 1, 14336, staged, out, _set_y(be, w, 1, i))
    if out is not None and limit and launch_mod.Y16_COPY:  # (a small f16 y: one kernel)
        want = [*want[:-1], "q6_copy_h"]
    assert order == want
    assert cp.counts["graph"] == 4


def test_copy_kernel_in_the_multi_weight_sequence(monkeypatch):
    """A multi-weight call (q/k/v, N=1) with the copy kernel: its capture has the kernel's x
    upload (no anchor) and its small y's download, and each part's y comes back right."""
    from tests.kernels.test_cuda_backend_host import QKV, _set_many_y, fake_weight

    be, _, order = _copy_kernel_fake(monkeypatch, 1 << 20)
    be.launcher.timing_anchor = 1
    ws = [fake_weight(be, r, k) for r, k in QKV]
    rng = np.random.default_rng(6)
    be.launch_many(ws, _x(be, rng, 1, 3584, False)).wait()  # binds
    for i in range(5):
        ys = _set_many_y(be, [r for r, _ in QKV], 1, i)
        res = be.launch_many(ws, _x(be, rng, 1, 3584, i % 2 == 0)).wait()
        for r, y in zip(res, ys, strict=True):
            assert np.array_equal(r.y, y)
    assert order[0] == "q6_copy" and order[-1] == "q6_copy"
    assert "h2d" not in order and "d2h" not in order and "q6_timing_anchor" not in order
    assert order.count("event") == len(QKV) + 1


def test_copy_kernel_unaligned_goes_by_the_copy_engine(monkeypatch):
    """An address not 16-byte aligned, or a copy of 0 bytes, is the copy engine's."""
    be, _, _ = _copy_kernel_fake(monkeypatch, 1 << 20)
    lc = be.launcher
    assert lc.by_kernel(4096, 256, 512) and not lc.by_kernel(4096, 256, 520)
    assert not lc.by_kernel(0, 256, 512) and not lc.by_kernel((1 << 20) + 1, 256, 512)
    lc.copy_kernel_max = None  # unset: the module's
    monkeypatch.setattr(launch_mod, "COPY_KERNEL_MAX", 0)
    assert not lc.by_kernel(4096, 256, 512)


def test_copy_kernel_variable_values() -> None:
    """Q6SERVE_COPY_KERNEL_MAX: unset or empty, None (the module's COPY_KERNEL_MAX, 2 MiB as
    measured: x up to N=32 of K=18944 f16 and N=64 of K=14336 by the kernel, N=64 of K=18944 by
    the copy engine);
    bytes as given; anything else refused naming the variable. A launcher built without a
    value (the fake device's) has none."""
    from types import SimpleNamespace

    assert launch_mod.COPY_KERNEL_MAX == 2 << 20
    assert launch_mod.copy_kernel_from_env({}) is None
    lc = launch_mod.Launcher(SimpleNamespace(), copy_max=None)
    assert lc.copy_limit() == 2 << 20 and lc.by_kernel(32 * 18944 * 2, 256, 512)
    assert lc.by_kernel(64 * 14336 * 2, 256, 512)
    assert not lc.by_kernel(64 * 18944 * 2, 256, 512)
    assert launch_mod.Launcher(SimpleNamespace()).copy_limit() == 0
    assert launch_mod.copy_kernel_from_env({"Q6SERVE_COPY_KERNEL_MAX": " "}) is None
    assert launch_mod.copy_kernel_from_env({"Q6SERVE_COPY_KERNEL_MAX": "65536"}) == 65536
    assert launch_mod.copy_kernel_from_env({"Q6SERVE_COPY_KERNEL_MAX": "0"}) == 0
    for bad in ("-1", "1.5", "big"):
        with pytest.raises(ValueError, match="Q6SERVE_COPY_KERNEL_MAX"):
            launch_mod.copy_kernel_from_env({"Q6SERVE_COPY_KERNEL_MAX": bad})


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 3, 64])
def test_copy_kernel_on_the_gpu(rng, monkeypatch, n):
    """On a device, with every copy by the copy kernel (Q6SERVE_COPY_KERNEL_MAX large), a call's
    y equals the copy engine's bit for bit on every kind of call (direct, capture, graph, the
    cached BoundCall; staged and copied x; f32 and f16 y), with a kernel time under the call's
    wall; q/k/v as one multi-weight call too; and the copy kernel alone moves a count of bytes
    that is not whole 16-byte words (its tail) between device and pinned host memory."""
    import time

    from q6serve.kernels.api import Layout, iter_aos_chunks
    from tests.conftest import random_blocks
    from tests.kernels.test_cuda_backend_host import _gpu_backend, staged_copy

    rows, k = 3584, 18944
    monkeypatch.setenv("Q6SERVE_COPY_KERNEL_MAX", str(64 << 20))
    be = _gpu_backend()(0)
    assert be.launcher.copy_kernel_max == 64 << 20  # (the backend passes the variable's value)
    w = be.load(iter_aos_chunks(random_blocks(rng, rows * (k // 256)), rows, k, 64 << 20),
                rows, k, Layout.SOA)
    qkv = [be.load(iter_aos_chunks(random_blocks(rng, r * 14), r, 3584, 64 << 20), r, 3584,
                   Layout.SOA) for r in (3584, 512, 512)]
    try:
        x = rng.standard_normal((n, k)).astype(np.float16)
        xq = rng.standard_normal((n, 3584)).astype(np.float16)
        be.launcher.copy_kernel_max = 0
        refs = {out: be.matmul(w, x, out_dtype=out).y for out in (None, np.float16)}
        ref_q = [r.y for r in be.launch_many(qkv, xq).wait()]
        for cw in (w, *qkv):
            cw.data.plans.clear()
        be.launcher.copy_kernel_max = 64 << 20
        for out in (None, np.float16):
            for i in range(6):
                xi = staged_copy(be, x) if i % 2 else x
                t0 = time.perf_counter()
                res = be.launch(w, xi, out_dtype=out).wait()
                wall = time.perf_counter() - t0
                np.testing.assert_array_equal(res.y, refs[out])
                s = res.timing.seconds(wait=True)
                assert s is not None and 0 < s < wall, (i, s, wall)
        for _ in range(5):
            for r, want in zip(be.launch_many(qkv, xq).wait(), ref_q, strict=True):
                np.testing.assert_array_equal(r.y, want)
        assert any(b.graph for b in w.data.plans.values() if type(b).__name__ == "Bound")
        assert be.launcher._copy_fn is not None  # (it ran)
        cp, lc = be.ctx.cp, be.launcher
        src = rng.integers(0, 255, 4004 + 64, dtype=np.uint8)
        with be.ctx.dev:
            dsrc = cp.asarray(src)
            host = cp.cuda.alloc_pinned_memory(len(src))
            dst = np.frombuffer(host, np.uint8, len(src))
            dst[:] = 7
            lc._kernel_copy(host.ptr, int(dsrc.data.ptr), 4004)  # 250 words and 4 bytes
            be.ctx.stream.synchronize()
        np.testing.assert_array_equal(dst[:4004], src[:4004])
        assert (dst[4004:] == 7).all()  # (nothing past the count)
    finally:
        for cw in (w, *qkv):
            be.free(cw)
        be.close()


@pytest.mark.parametrize("mapped", [True, False])
@pytest.mark.parametrize("out", [np.float32, np.float16])
def test_copy_kernel_in_the_region_call(monkeypatch, mapped, out):
    """A fast lane's region call (one stream) with the copy kernel: x from the region and y
    into it are the copy kernel's at the region's device addresses (``Launcher.device_ptr``),
    its capture has no copy-engine node; where the driver maps no device address, the copy
    engine's with the timing anchor after x's upload (as a bound sequence's)."""
    from tests.dataplane.test_region_call import ROWS, K, _first, _region
    from tests.kernels.test_cuda_backend_host import fake_weight

    be, _, order = _copy_kernel_fake(monkeypatch, 8 << 20)
    lc = be.launcher
    lc.timing_anchor, lc.region_streams = 1, False
    seen: list[int] = []
    monkeypatch.setattr(lc, "device_ptr",
                        lambda host: seen.append(host) or (host if mapped else None))
    w = fake_weight(be, ROWS, K)
    rng = np.random.default_rng(9)
    buf, x, y, _ = _region(be, 8, np.dtype(out))
    x[...] = rng.standard_normal((8, K))
    rc = _first(be, w, x, y, out).call
    for i in range(5):
        x[...] = rng.standard_normal((8, K))
        want = _set_y(be, w, 8, 40 + i)
        assert rc.launch().wait().y is y
        assert np.array_equal(y, want.astype(out))
        assert np.array_equal(lc.ws._dev["x"].a[: x.nbytes], x.reshape(-1).view(np.uint8))
    assert seen == [x.ctypes.data, y.ctypes.data]  # (once, at the binding)
    assert order == (["q6_copy", "event", "event", "q6_copy"] if mapped else
                     ["h2d", "q6_timing_anchor", "event", "event", "d2h"])
    del buf


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


@pytest.mark.parametrize("staged", [True, False])
def test_large_y_blocks_are_reused_only_once_released(monkeypatch, staged):
    """A large y (4096x14336 at N=16: 256 KiB of f32, past SMALL_Y_F32) is DMA'd into one of
    the workspace's kept pinned blocks (Workspace.y_block): a result still held (or any view of
    it) keeps its block and its values while later calls run; a released one's block is the
    next call's; at most Y_BLOCKS are kept (past them, a block for the call alone), and a free
    block too small is replaced by one grown to the call."""
    from tests.kernels.test_cuda_backend_host import fake_backend, fake_weight

    monkeypatch.setattr(launch_mod, "Y_BLOCKS", 3)
    be, _ = fake_backend(monkeypatch)
    w = fake_weight(be, 4096, 14336)
    ws = be.launcher.ws
    rng = np.random.default_rng(41)
    for _ in range(3):  # direct, capture, graph: then the cached BoundCall
        be.launch(w, _x(be, rng, 16, 14336, staged)).wait()
    assert len(ws._yb) == 1
    held, want = [], []
    for i in range(5):  # each result held: 3 kept blocks, then 2 of the call's own
        want.append(_set_y(be, w, 16, i).copy())
        held.append(be.launch(w, _x(be, rng, 16, 14336, staged)).wait().y)
    assert len(ws._yb) == 3
    assert len({_ptr(y) for y in held}) == 5
    for y, v in zip(held, want, strict=True):
        assert np.array_equal(y, v)  # no later call wrote into a held result
    kept = _ptr(held[1])
    view = held[1][3:5]  # a view keeps the block too
    del held[1]
    y = be.launch(w, _x(be, rng, 16, 14336, staged)).wait().y
    assert _ptr(y) not in (kept, *map(_ptr, held))
    del y, view
    v = _set_y(be, w, 16, 9).copy()
    y = be.launch(w, _x(be, rng, 16, 14336, staged)).wait().y
    assert _ptr(y) == kept and np.array_equal(y, v)  # released: reused
    del y, held[:]
    be.launch(w, _x(be, rng, 64, 14336, staged)).wait()  # binds N=64 (its buffers grow)
    big = _set_y(be, w, 64, 3).copy()  # 1 MiB: a free block grown to it, none added
    y = be.launch(w, _x(be, rng, 64, 14336, staged)).wait().y
    assert np.array_equal(y, big) and len(ws._yb) == 3 and max(b.size for b in ws._yb) >= y.nbytes


def test_multi_weight_y_blocks_are_reused(monkeypatch):
    """A multi-weight call's one y (gate + up at N=8: 1.2 MB of f32) takes a kept block too,
    its parts' y's views of it: held parts keep it, released ones hand it back."""
    from tests.kernels.test_cuda_backend_host import GATE_UP, _many_counted, _set_many_y

    be, _, _, wts, rng = _many_counted(monkeypatch, GATE_UP, 12)
    ws = be.launcher.ws
    for _ in range(3):
        be.launch_many(wts, _x(be, rng, 8, 3584, False)).wait()
    ys = _set_many_y(be, [18944, 18944], 8, 1)
    first = be.launch_many(wts, _x(be, rng, 8, 3584, False)).wait()
    up = first[1].y  # one part held
    del first
    _set_many_y(be, [18944, 18944], 8, 2)
    second = be.launch_many(wts, _x(be, rng, 8, 3584, False)).wait()
    assert np.array_equal(up, ys[1])  # not overwritten by the second call
    p = _ptr(second[0].y)
    del second
    third = be.launch_many(wts, _x(be, rng, 8, 3584, False)).wait()
    assert _ptr(third[0].y) == p and len(ws._yb) == 2


def test_a_cached_call_is_found_before_the_checks_and_keeps_them(monkeypatch):
    """CudaBackend.launch looks a repeated call's BoundCall up before check_matmul: a strided
    x of the cached shape (one a 1-D view can cover: the fill's byte view of it would fail)
    takes the checks' contiguous copy, gives the device y and reaches the device unchanged;
    an x of another K, of one dimension or of another dtype is refused as before (the key
    never matches), and with every slot held the call is refused by the full path."""
    from q6serve.kernels.errors import DeviceError, FormatError
    from tests.kernels.test_cuda_backend_host import fake_backend, fake_weight

    be, cp = fake_backend(monkeypatch)
    w = fake_weight(be, 4096, 14336)
    rng = np.random.default_rng(42)
    for _ in range(3):  # direct, capture, graph: then the cached BoundCall
        be.launch(w, _x(be, rng, 4, 14336, False)).wait()
    calls = cp.counts["graph"]
    wide = rng.standard_normal((4, 2 * 14336)).astype(np.float16)
    x = wide[:, ::2]  # strided
    assert not x.flags.c_contiguous
    y = _set_y(be, w, 4, 5).copy()
    res = be.launch(w, x).wait()
    assert np.array_equal(res.y, y) and cp.counts["graph"] == calls + 1
    xd = be.launcher.ws._dev["x"].a[: x.nbytes]
    assert np.array_equal(xd, np.ascontiguousarray(x).reshape(-1).view(np.uint8))
    with pytest.raises(FormatError, match="K=4096"):
        be.launch(w, np.zeros((4, 4096), np.float16))
    with pytest.raises(FormatError, match="2-D"):
        be.launch(w, np.zeros(14336, np.float16))
    with pytest.raises(FormatError):
        be.launch(w, np.zeros((4, 14336), np.int32))
    held = [be.launch(w, _x(be, rng, 4, 14336, False)) for _ in range(launch_mod.SLOTS)]
    with pytest.raises(DeviceError, match="in flight"):
        be.launch(w, _x(be, rng, 4, 14336, False))
    for h in held:
        h.wait()


@pytest.mark.parametrize("n", [0, 15, 64, 100, 4096 + 17, 1 << 18])
@pytest.mark.parametrize("off", [0, 3, 16, 40])
def test_non_temporal_fill_copies_every_byte(n, off):
    """hostcopy.copy_into: the same bytes as NumPy's copy at any size and alignment (the
    aligned middle by the non-temporal routine where it runs here, head and tail by NumPy), and
    nothing past them; the routine ran for every body of a 64-byte line or more."""
    from q6serve.kernels.cuda import hostcopy

    src = np.random.default_rng(n + off).integers(0, 255, n, dtype=np.uint8)
    buf = np.zeros(n + 128, np.uint8)
    dst = buf[off:]
    used = hostcopy.copy_into(dst, src)
    assert np.array_equal(dst[:n], src) and not dst[n:].any()
    head = (-dst.ctypes.data) % 16
    assert used == (hostcopy.available() and n - head >= 64)


def test_non_temporal_fill_refuses_a_short_or_strided_destination():
    """copy_into writes raw memory: a destination shorter than the source, strided, or not
    bytes is refused before anything is written."""
    from q6serve.kernels.cuda import hostcopy

    src = np.arange(4096, dtype=np.uint8)
    buf = np.zeros(8192, np.uint8)
    for dst in (buf[:4095], buf[::2], buf.view(np.uint16), buf.reshape(2, 4096)):
        with pytest.raises(ValueError, match="copy_into"):
            hostcopy.copy_into(dst, src)
    assert not buf.any()


def test_fill_x_by_non_temporal_stores_from_its_size(monkeypatch):
    """launch.fill_x: x's bytes into the staging buffer, by hostcopy from NT_FILL_MIN bytes on
    (0: never), the same bytes either way; an f16 [N, K] x as the launcher's copies pass it."""
    from q6serve.kernels.cuda import hostcopy

    calls = []
    real = hostcopy.copy_into
    monkeypatch.setattr(hostcopy, "copy_into", lambda d, s: calls.append(s.nbytes) or real(d, s))
    x = np.random.default_rng(0).standard_normal((64, 4096)).astype(np.float16)
    for nt_min, want in ((0, []), (1 << 20, []), (512 << 10, [x.nbytes])):
        calls.clear()
        monkeypatch.setattr(launch_mod, "NT_FILL_MIN", nt_min)
        dst = np.zeros(x.nbytes + 64, np.uint8)
        launch_mod.fill_x(dst, x)
        assert calls == want
        assert np.array_equal(dst[: x.nbytes].view(np.float16).reshape(x.shape), x)
        assert not dst[x.nbytes :].any()


def test_the_default_fills_a_down_x_of_8_tokens_by_numpy(monkeypatch):
    """NT_FILL_MIN's default (1 MiB, session 28): the replay's S=8 down x (8 x 18944 f16,
    303 KB) goes by NumPy's copy, N=64's 1.8 MB x (K=14336) by the non-temporal stores."""
    from q6serve.kernels.cuda import hostcopy

    calls = []
    real = hostcopy.copy_into
    monkeypatch.setattr(hostcopy, "copy_into", lambda d, s: calls.append(s.nbytes) or real(d, s))
    rng = np.random.default_rng(1)
    for n, k, want in ((8, 18944, []), (64, 14336, [64 * 14336 * 2])):
        calls.clear()
        x = rng.standard_normal((n, k)).astype(np.float16)
        dst = np.zeros(x.nbytes + 64, np.uint8)
        launch_mod.fill_x(dst, x)
        assert calls == want
        assert np.array_equal(dst[: x.nbytes].view(np.float16).reshape(x.shape), x)


def test_a_cached_call_fills_its_staging_by_non_temporal_stores(monkeypatch):
    """A cached call (BoundCall, the graph's third call on the fake device) and a multi-weight
    one (ManyCall) with NT_FILL_MIN at 1 byte (0 before: none by hostcopy): each unstaged x
    reaches the slot's staging buffer whole, by hostcopy; the default sends 1.8 MB by it."""
    from q6serve.kernels.cuda import hostcopy
    from tests.kernels.test_cuda_backend_host import (
        GATE_UP,
        _many_counted,
        fake_backend,
        fake_weight,
    )

    calls = []
    real = hostcopy.copy_into
    monkeypatch.setattr(hostcopy, "copy_into", lambda d, s: calls.append(s.nbytes) or real(d, s))
    be, _ = fake_backend(monkeypatch)
    w = fake_weight(be, 4096, 14336)
    rng = np.random.default_rng(5)
    default = launch_mod.NT_FILL_MIN
    monkeypatch.setattr(launch_mod, "NT_FILL_MIN", 0)
    for _ in range(3):  # direct, capture, graph: then the cached BoundCall
        be.launch(w, _x(be, rng, 64, 14336, False)).wait()
    monkeypatch.setattr(launch_mod, "NT_FILL_MIN", 1)
    for _ in range(2):
        x = _x(be, rng, 64, 14336, False)
        be.launch(w, x).wait()
        host = be.launcher.ws.host(x.nbytes, 0)
        assert np.array_equal(host[: x.nbytes], x.reshape(-1).view(np.uint8))
    assert calls == [x.nbytes] * 2
    monkeypatch.setattr(launch_mod, "NT_FILL_MIN", default)
    be.launch(w, _x(be, rng, 64, 14336, False)).wait()
    assert default == 1 << 20 and calls[-1] == x.nbytes == 64 * 14336 * 2
    calls.clear()
    monkeypatch.setattr(launch_mod, "NT_FILL_MIN", 1)
    be, _, _, wts, rng = _many_counted(monkeypatch, GATE_UP, 12)
    for _ in range(3):
        be.launch_many(wts, _x(be, rng, 8, 3584, False)).wait()
    x = _x(be, rng, 8, 3584, False)
    be.launch_many(wts, x).wait()
    assert calls[-1] == x.nbytes
    host = be.launcher.ws.host(x.nbytes, 0)
    assert np.array_equal(host[: x.nbytes], x.reshape(-1).view(np.uint8))
