"""The pair-stream layout (``Q6SERVE_Q6K_PAIRS``; kernels/cuda/q6k_common.cuh "pair streams",
docs/KERNELS.md "A decode from a resident repack") through the backend (``-m gpu``; skipped
without CuPy or a GPU).

A pair-stream weight is a SoA weight whose code planes are re-ordered per block on the device
(``Storage.pairs``: ``q6k_repack_pairs`` after each loaded chunk). Every reader decodes the same
A values from it, on the SoA twin's grid, so every path (exact, the f16 tile, the K-slice
and wgmma tiles, q8_1, cuBLAS) must give the SoA weight's results bit for bit; read-back
and relayout restore ggml's bytes exactly."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest
from pairs_ref import pack_pairs
from test_cuda_backend import _gpu_count, load, random_weight, recording_launcher, rel_fro

from q6serve.kernels import q6k, reference
from q6serve.kernels.api import KernelFlags, Layout, Precision
from q6serve.kernels.cuda.dispatch import Cfg
from q6serve.kernels.cuda.launch import IN_TYPES, KS_SMEM_MAX, MATMUL_FILE, smem_bytes
from q6serve.kernels.cuda.storage import pairs_from_env, slab_plan
from q6serve.kernels.errors import InvalidArgument

try:
    import cupy
except ImportError:  # CI: no CuPy at all
    cupy = None

pytestmark = [pytest.mark.gpu]
TOL = 2e-3
# One shape per reader the layout code changes (each costs two NVRTC instantiations, the SoA
# twin and the pair one; the module compiles ~30 names in small parallel groups): the K-slice
# tile at 8 and 12 warps (AUTO's test adds the table's nt 4 and 8 at 8 warps), the wgmma tile.
CFGS = (Cfg(nt=2, src=4, pf=True), Cfg(nt=4, src=4, pf=True, warps=12))
WG = (Cfg(nt=8, src=8, pf=True, warps=12),)
# the exact tile, the plain f16 tile (src 2) and the staged one (src 3), each also with two
# m-tiles (a pair weight runs them as one m-tile with twice the warps, or at 8 warps twice the
# CTAs: launch.pair_cfg), the int8 tile, cuBLAS's dequant; f32 activations only where the
# reader's x staging differs
OTHER = (("exact", Cfg(nt=1, pf=True)), ("mma_f16", Cfg(nt=1)),
         ("mma_f16", Cfg(nt=4, mt=2, src=3, warps=4)), ("mma_f16", Cfg(nt=1, mt=2)),
         ("mmq_q8_1", Cfg(nt=2)), ("cublas_f16", None))
F32 = (("exact", Cfg(nt=1, pf=True)), ("mma_f16", Cfg(nt=1)))


def compile_for(be, jobs, rows: int = 300, k: int = 2304) -> None:
    """Compile up front, in small parallel NVRTC programs, exactly the instantiations that
    ``jobs`` ((path, cfg, n, activation dtype)) ask for on a SoA and on a pair-stream weight:
    Launcher.plan on a device-less recording launcher names them (tiles, x prep, the split-K
    sum), cuBLAS's dequant by hand. What a test asks for beyond these compiles lazily, one
    program per name (slow): keep each test's jobs complete."""
    lc = recording_launcher()
    for path, cfg, n, dt in jobs:
        if path == "cublas_f16":
            lc.ctx.fn(MATMUL_FILE, "q6k_dequant_f16<true>")
            lc.ctx.fn(MATMUL_FILE, "q6k_dequant_f16<2>")
            continue
        for pairs in (False, True):
            lc.plan(rows, k, Layout.SOA, IN_TYPES[np.dtype(dt)], path, cfg, n, pairs)
    by_file: dict[str, set] = {}
    for file, name in lc.requested:
        by_file.setdefault(file, set()).add(name)
    with be.ctx.dev:
        for file, names in by_file.items():
            be.ctx.prefetch(file, names, threads=16, group=2)


@pytest.fixture(scope="module")
def be():
    if _gpu_count() == 0:
        pytest.skip("needs CuPy and a CUDA device")
    from q6serve.kernels.cuda_backend import CudaBackend

    b = CudaBackend(0)
    b.cfgs = CFGS + (WG if b.ctx.cc == "90" else ())
    yield b
    b.close()


@contextmanager
def held_as(be, pairs: bool):
    """SoA weights loaded or re-laid inside are held as pair streams (``pairs``) or not."""
    was, be.storage.pairs = be.storage.pairs, pairs
    try:
        yield
    finally:
        be.storage.pairs = was


def _pair(be, blocks, rows, k, chunk=1 << 20):
    """The same blocks as a SoA weight and as a pair-stream weight (loaded in ``chunk``-byte
    pieces, so each piece's blocks are re-ordered on their own)."""
    with held_as(be, False):
        soa = load(be, blocks, rows, k, Layout.SOA)
    with held_as(be, True):
        pairs = load(be, blocks, rows, k, Layout.SOA, chunk)
    assert pairs.data.pairs and not soa.data.pairs
    return soa, pairs


def _y(be, w, x, path, cfg):
    with be.ctx.dev, be.stream:
        return be.run(w, cupy.asarray(x), x.dtype, path, cfg).get(stream=be.stream)


def _same(y0, y1, label):
    np.testing.assert_array_equal(y1.view(np.uint32), y0.view(np.uint32),
                                  err_msg=f"{label}: pair streams differ from SoA")


def test_switch_reads_zero_one():
    assert pairs_from_env({}) is True and pairs_from_env({"Q6SERVE_Q6K_PAIRS": " "}) is True
    assert pairs_from_env({"Q6SERVE_Q6K_PAIRS": "0"}) is False
    assert pairs_from_env({"Q6SERVE_Q6K_PAIRS": "1"}) is True
    with pytest.raises(InvalidArgument, match="Q6SERVE_Q6K_PAIRS"):
        pairs_from_env({"Q6SERVE_Q6K_PAIRS": "maybe"})


def test_repack_keeps_scales_and_permutes_codes(be, rng):
    rows, k = 40, 512
    soa, pairs = _pair(be, random_weight(rng, rows, k), rows, k)
    a, b = soa.data.slabs[0].get(), pairs.data.slabs[0].get()
    nb = rows * (k // 256)
    assert np.array_equal(a[192 * nb:], b[192 * nb:]), "scales and d must stay"
    assert not np.array_equal(a[:192 * nb], b[:192 * nb])
    for i in range(nb):  # each block's 1536 code bits, re-ordered within the block
        assert (np.unpackbits(a[128 * i:128 * i + 128]).sum()
                + np.unpackbits(a[128 * nb + 64 * i:128 * nb + 64 * i + 64]).sum()
                == np.unpackbits(b[128 * i:128 * i + 128]).sum()
                + np.unpackbits(b[128 * nb + 64 * i:128 * nb + 64 * i + 64]).sum())


def test_repack_is_the_reference_order_at_any_chunk_offset(be, rng, monkeypatch):
    """The device repack's bytes are pairs_ref's (session 11's kernel, bit for bit) with chunks
    and slabs that start mid-warp (21-block chunks, 123-block slabs), and the inverse kernel on
    a block range restores exactly that range."""
    from q6serve.kernels.cuda import storage

    rows, k = 90, 768
    monkeypatch.setattr(storage, "SLAB_BYTES", 41 * q6k.aos_nbytes(1, k))
    soa, pairs = _pair(be, random_weight(rng, rows, k), rows, k, chunk=7 * q6k.aos_nbytes(1, k))
    assert len(pairs.data.slabs) == 3
    for (r0, r1), a, b in zip(slab_plan(rows, k), soa.data.slabs, pairs.data.slabs, strict=True):
        nb = (r1 - r0) * (k // 256)
        plain = a.get()[:210 * nb]  # (a slab rounds up to 16 bytes: 123 blocks leave 10 unset)
        want = pack_pairs(plain, nb)
        assert np.array_equal(b.get()[:210 * nb], want), f"slab of rows {r0}..{r1}"
        lo, hi = 5, nb - 3
        part = want.copy()  # blocks [lo, hi) back to ggml's planes, the others left as they are
        part[128 * lo:128 * hi] = plain[128 * lo:128 * hi]
        part[128 * nb + 64 * lo:128 * nb + 64 * hi] = plain[128 * nb + 64 * lo:128 * nb + 64 * hi]
        with be.ctx.dev, be.stream:
            dev = cupy.asarray(want)
            be.storage._pairs(dev, nb, lo, hi, inverse=True)
            got = dev.get(stream=be.stream)
        assert np.array_equal(got, part), f"inverse of blocks {lo}..{hi} of {nb}"


def test_kill_switch_relayout_is_bit_identical(be, rng):
    """Pair streams to AoS and back with the switch off give ggml's SoA bytes exactly (the
    plain weight's slabs), and back on the pair order again; the results stay the same."""
    rows, k = 96, 1024
    blocks = random_weight(rng, rows, k)
    compile_for(be, [("mma_f16", Cfg(nt=2, src=4, pf=True), 9, np.float16)], rows, k)
    soa, pairs = _pair(be, blocks, rows, k)
    plain = soa.data.slabs[0].get()
    x = rng.standard_normal((9, k)).astype(np.float16)
    y = _y(be, pairs, x, "mma_f16", Cfg(nt=2, src=4, pf=True))
    with held_as(be, False):
        aos = be.relayout(pairs, Layout.AOS)
        assert np.array_equal(aos.data.slabs[0].get(), blocks.reshape(-1))
        off = be.relayout(aos, Layout.SOA)
    assert not off.data.pairs and np.array_equal(off.data.slabs[0].get(), plain)
    _same(y, _y(be, off, x, "mma_f16", Cfg(nt=2, src=4, pf=True)), "switch off")
    with held_as(be, True):
        on = be.relayout(be.relayout(off, Layout.AOS), Layout.SOA)
    assert on.data.pairs and np.array_equal(on.data.slabs[0].get(), pack_pairs(plain, rows * 4))
    _same(y, _y(be, on, x, "mma_f16", Cfg(nt=2, src=4, pf=True)), "switch on again")


def test_pairs_take_the_plain_weights_vram(be, rng):
    """With pair streams the VRAM accountant's figures hold unchanged: the same pool bytes in
    use after a chunked load as the plain SoA weight (weight_nbytes), and the load's peak
    within the weight + one chunk (the repack is in place, per chunk)."""
    rows, k, chunk = 2048, 4096, 1 << 20
    blocks = random_weight(rng, rows, k)
    pool = cupy.get_default_memory_pool()
    used, peak, held = {}, {}, []
    for on in (False, True, False, True):
        cupy.cuda.Device().synchronize()
        pool.free_all_blocks()
        before, total = pool.used_bytes(), pool.total_bytes()
        with held_as(be, on):
            w = load(be, blocks, rows, k, Layout.SOA, chunk)
        assert w.data.pairs is on and w.nbytes == be.weight_nbytes(rows, k, Layout.SOA)
        used.setdefault(on, set()).add(pool.used_bytes() - before)
        peak[on] = pool.total_bytes() - total
        held.append(w)  # kept, so each load starts from an emptied pool beside the others
    assert used[True] == used[False] == {be.weight_nbytes(rows, k, Layout.SOA)}, used
    assert peak[True] <= be.weight_nbytes(rows, k, Layout.SOA) + chunk, peak


def test_read_back_and_relayout_restore_ggml_bytes(be, rng):
    rows, k = 96, 1024
    blocks = random_weight(rng, rows, k)
    compile_for(be, [("mma_f16", Cfg(nt=2, src=4, pf=True), 9, np.float16)], rows, k)
    soa, pairs = _pair(be, blocks, rows, k)
    assert np.array_equal(be.read_aos(pairs), blocks)
    x = rng.standard_normal((9, k)).astype(np.float16)
    y = _y(be, soa, x, "mma_f16", Cfg(nt=2, src=4, pf=True))
    aos = be.relayout(pairs, Layout.AOS)
    assert not aos.data.pairs and np.array_equal(be.read_aos(aos), blocks)
    with held_as(be, True):
        back = be.relayout(aos, Layout.SOA)
    assert back.data.pairs and np.array_equal(be.read_aos(back), blocks)
    _same(y, _y(be, back, x, "mma_f16", Cfg(nt=2, src=4, pf=True)), "after relayout")


def test_every_tile_shape_at_every_slice_count(be, rng):
    rows, k = 300, 2304
    bpr = k // 256
    blocks = random_weight(rng, rows, k)
    soa, pairs = _pair(be, blocks, rows, k, chunk=37 * q6k.aos_nbytes(1, k))
    x = rng.standard_normal((70, k)).astype(np.float16)
    y64 = reference.matmul_float64(x, blocks, rows)
    compile_for(be, [("mma_f16", c, n, np.float16) for c in be.cfgs for n in (1, 8 * c.nt + 3)],
                rows, k)  # (the slice count changes no name)
    for c in be.cfgs:
        for ks in sorted({0, 1, 2, 3, bpr}):
            cfg = replace(c, ksplit=ks)
            if ks and smem_bytes("mma_f16", cfg, -(-bpr // ks)) > KS_SMEM_MAX:
                continue
            for n in sorted({1, 8 * c.nt + 3}):
                label = f"{cfg.label()} N={n}"
                y1 = _y(be, pairs, x[:n], "mma_f16", cfg)
                _same(_y(be, soa, x[:n], "mma_f16", cfg), y1, label)
                assert rel_fro(y1, y64[:n]) <= TOL, (label, rel_fro(y1, y64[:n]))


def test_other_paths_and_dtypes(be, rng):
    rows, k = 517, 1536
    jobs = [(p, c, 40, np.float16) for p, c in OTHER] + [(p, c, 40, np.float32) for p, c in F32]
    compile_for(be, jobs, rows, k)
    blocks = random_weight(rng, rows, k)
    soa, pairs = _pair(be, blocks, rows, k)
    for path, cfg, _, dt in jobs:
        x = rng.standard_normal((40, k)).astype(np.float32).astype(dt)
        _same(_y(be, soa, x, path, cfg), _y(be, pairs, x, path, cfg), f"{path} {cfg} {dt}")


def test_matmul_auto_through_the_graph(be, rng):
    rows, k = 4096, 4096
    blocks = random_weight(rng, rows, k)
    ns = (1, 8, 16, 32, 64, 300)
    auto = [(be.choose(n, Precision.AUTO, KernelFlags(), rows, k), n) for n in ns]
    compile_for(be, [(c.path, c.cfg, n, np.float16) for c, n in auto
                     if c.cfg is not None or c.path == "cublas_f16"], rows, k)
    soa, pairs = _pair(be, blocks, rows, k)
    for n in ns:
        x = rng.standard_normal((n, k)).astype(np.float16)
        for _ in range(3):  # direct, then captured
            r0 = be.matmul(soa, x, precision=Precision.AUTO, flags=KernelFlags())
            r1 = be.matmul(pairs, x, precision=Precision.AUTO, flags=KernelFlags())
            _same(np.asarray(r0.y), np.asarray(r1.y), f"AUTO N={n}")


def test_tiles_across_slabs(be, rng, monkeypatch):
    from q6serve.kernels.cuda import storage

    rows, k = 700, 1024
    monkeypatch.setattr(storage, "SLAB_BYTES", 37 * q6k.aos_nbytes(1, k))
    blocks = random_weight(rng, rows, k)
    soa, pairs = _pair(be, blocks, rows, k, chunk=50 * q6k.aos_nbytes(1, k))
    assert len(pairs.data.slabs) == 19
    x = rng.standard_normal((64, k)).astype(np.float16)
    compile_for(be, [("mma_f16", c, 8 * c.nt, np.float16) for c in be.cfgs], rows, k)
    for c in be.cfgs:
        _same(_y(be, soa, x[: 8 * c.nt], "mma_f16", c), _y(be, pairs, x[: 8 * c.nt], "mma_f16", c),
              c.label())


def test_every_table_shape(be, rng):
    """Every launch shape the committed dispatch table names (re-tuned on pair weights in
    session 13), at each N bucket it is named for: pair weights give the SoA weight's bits and
    the float64 reference within the path's bound."""
    from q6serve.kernels.cuda.dispatch import load_default_table

    table = load_default_table()
    if table is None:
        pytest.skip("no committed dispatch table")
    named: dict = {}
    for cells in table.cells.values():
        for e in cells.values():
            if e.cfg is not None:
                named.setdefault((e.path, e.cfg), set()).add(e.n)
    rows = 300
    jobs = [(p, c, n, np.float16) for (p, c), ns in named.items() for n in sorted(ns)]
    tol = {"exact": 1e-5, "mma_f16": TOL, "mmq_q8_1": 2e-2}
    # K = 2304 for all but the cluster-sum tile (src 7), whose K split is its cluster size:
    # a K of two blocks per slice
    by_k: dict = {}
    for job in jobs:
        by_k.setdefault(512 * job[1].ksplit if job[1].src == 7 else 2304, []).append(job)
    for k, kjobs in by_k.items():
        compile_for(be, kjobs, rows, k)
        blocks = random_weight(rng, rows, k)
        soa, pairs = _pair(be, blocks, rows, k)
        x = rng.standard_normal((64, k)).astype(np.float16)
        y64 = reference.matmul_float64(x, blocks, rows)
        for path, cfg, n, _ in kjobs:
            label = f"{path}.{cfg.label()} N={n} K={k}"
            y1 = _y(be, pairs, x[:n], path, cfg)
            _same(_y(be, soa, x[:n], path, cfg), y1, label)
            assert rel_fro(y1, y64[:n]) <= tol[path], (label, rel_fro(y1, y64[:n]))
