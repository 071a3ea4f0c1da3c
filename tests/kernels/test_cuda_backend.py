"""The CUDA backend against the NumPy references (``-m gpu``; skipped without CuPy or a GPU).

Inputs are fresh random draws every run (the seed is printed on failure); outputs are
checked to be fully written by poisoning the allocator's free blocks with NaN first.
"""

from __future__ import annotations

import numpy as np
import pytest

from q6serve.kernels import q6k, reference
from q6serve.kernels.api import BFLOAT16, KernelFlags, Layout, Precision, iter_aos_chunks
from q6serve.kernels.cuda.dispatch import Cfg as KsCfg
from q6serve.kernels.errors import FailedPrecondition, FormatError, Unavailable

try:
    import cupy
except ImportError:  # CI: no CuPy at all
    cupy = None


def _gpu_count() -> int:
    if cupy is None:
        return 0
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


pytestmark = [pytest.mark.gpu]

TOL = {Precision.EXACT: 1e-5, Precision.F16: 2e-3, Precision.Q8_1: 2e-2}
SOA, AOS = KernelFlags(), KernelFlags(soa=False)


@pytest.mark.skipif(cupy is not None, reason="CuPy is installed")
def test_constructing_without_cupy_is_a_clear_error():
    from q6serve.kernels.cuda_backend import CudaBackend

    with pytest.raises(Unavailable, match="CuPy"):
        CudaBackend()


@pytest.fixture(scope="module")
def be():
    if _gpu_count() == 0:
        pytest.skip("needs CuPy and a CUDA device")
    from q6serve.kernels.cuda_backend import CudaBackend

    b = CudaBackend(0)
    # Every instantiation the tests ask for, compiled up front a dozen per NVRTC program on
    # parallel threads (one program per name spent minutes of device time).
    with b.ctx.dev:
        b.ctx.prefetch("q6k_matmul.cu", [n for f, n in requested_kernels(b.storage.pairs)
                                         if f == "q6k_matmul.cu"], threads=16)
    yield b
    b.close()


def random_weight(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """Valid Q6_K blocks ``[rows*k/256, 210]``: random codes and scales, finite f16 d."""
    n = rows * (k // 256)
    blocks = rng.integers(0, 256, size=(n, 210), dtype=np.uint8)
    d = (rng.standard_normal(n) * 1e-3).astype(np.float16)
    blocks[:, 208:210] = d.view(np.uint8).reshape(n, 2)
    return blocks


def extreme_scale_weight(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """:func:`random_weight` with the block scales a tile must survive: d = 0 blocks (15%),
    f16-subnormal d (10%), d = 40 beside d ~ 1e-3 in the same rows (10%), and sub-block scale
    bytes -128 and 127 (10% each)."""
    blocks = random_weight(rng, rows, k)
    n = blocks.shape[0]
    d = (rng.standard_normal(n) * 1e-3).astype(np.float16)
    d[rng.random(n) < 0.15] = 0
    d[rng.random(n) < 0.1] = np.float16(3e-7)  # f16 subnormal
    d[rng.random(n) < 0.1] = np.float16(40.0)
    blocks[:, 208:210] = d.view(np.uint8).reshape(n, 2)
    sc = blocks[:, 192:208].view(np.int8)
    sc[rng.random(sc.shape) < 0.1] = -128
    sc[rng.random(sc.shape) < 0.1] = 127
    return blocks


def rel_fro(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a64 - b64) / max(np.linalg.norm(b64), 1e-300))


def poison() -> None:
    """Fill the pool's free memory with NaN so unwritten outputs show up."""
    pool = cupy.get_default_memory_pool()
    junk = [cupy.full(1 << 20, np.nan, cupy.float32) for _ in range(16)]
    for i in range(8):  # a spread of sizes so small and large outputs reuse poisoned blocks
        junk.append(cupy.full(1 << (8 + 2 * i), np.nan, cupy.float32))
    cupy.cuda.Device().synchronize()
    del junk
    assert pool.used_bytes() >= 0


def load(be, blocks: np.ndarray, rows: int, k: int, layout: Layout, chunk: int = 1 << 20):
    return be.load(iter_aos_chunks(blocks, rows, k, chunk), rows, k, layout, chunk)


def check(be, w, blocks, x, precision, flags=SOA, y64=None):
    poison()
    res = be.matmul(w, x, precision=precision, flags=flags)
    assert res.y.shape == (x.shape[0], w.rows) and res.y.dtype == np.float32
    assert np.isfinite(res.y).all(), "unwritten or non-finite outputs"
    if y64 is None:
        y64 = reference.matmul_float64(x, blocks, w.rows)
    if res.precision is Precision.Q8_1:
        yq = reference.matmul_q8_1(x, blocks, w.rows)
        if res.y.size >= 64:
            e1 = rel_fro(res.y, yq)
            assert e1 <= 1e-6, (res.kernel, e1)
        else:  # a few outputs with cancellation: bound each by its sum of |terms| (below)
            wd = q6k.dequantize_aos(blocks, w.rows, w.k).astype(np.float64)
            scale = np.abs(x.astype(np.float64)) @ np.abs(wd).T
            assert (np.abs(res.y - yq) <= 1e-6 * scale + 1e-30).all(), (res.kernel, res.y, yq)
    err = rel_fro(res.y, y64)
    # The bounds are statistical (Frobenius over many outputs): a single dot product with
    # cancellation can exceed them (EXACT, one output of K=256: 1.11e-5 seen on the H200), so
    # tiny outputs get a per-element bound relative to the sum of |terms| instead.
    if res.y.size >= 64:
        assert err <= TOL[res.precision], (res.kernel, err)
    elif res.precision in (Precision.EXACT, Precision.F16):
        wd = q6k.dequantize_aos(blocks, w.rows, w.k).astype(np.float64)
        xr = x.astype(np.float32).astype(np.float64)
        if res.precision is Precision.F16:
            xr = x.astype(np.float32).astype(np.float16).astype(np.float64)
        scale = np.abs(xr) @ np.abs(wd).T  # sum of |terms| per output
        yr = xr @ wd.T
        bound = TOL[res.precision] if res.precision is Precision.EXACT else 1e-3
        assert (np.abs(res.y - yr) <= bound * scale + 1e-30).all(), res.kernel
    assert res.timing.seconds(wait=True) > 0
    return res


@pytest.mark.parametrize("precision", [Precision.EXACT, Precision.F16, Precision.Q8_1,
                                       Precision.AUTO])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 9, 16, 17, 32, 33, 64, 65, 130])
def test_accuracy_f32_activations(be, rng, precision, n):
    rows, k = 333, 1280  # rows not a multiple of any tile; 5 blocks per row
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA)
    x = rng.standard_normal((n, k)).astype(np.float32)
    check(be, w, blocks, x, precision)


@pytest.mark.parametrize("shape", [(1, 256), (7, 256), (16, 512), (129, 256), (2, 4096)])
@pytest.mark.parametrize("precision", [Precision.EXACT, Precision.F16, Precision.Q8_1])
@pytest.mark.parametrize("n", [1, 4, 24, 64])
def test_odd_shapes(be, rng, shape, precision, n):
    rows, k = shape
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA)
    x = rng.standard_normal((n, k)).astype(np.float32)
    check(be, w, blocks, x, precision)


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16])
@pytest.mark.parametrize("precision", [Precision.EXACT, Precision.F16, Precision.Q8_1])
@pytest.mark.parametrize("n", [1, 8, 40])
def test_half_activations(be, rng, dtype, precision, n):
    rows, k = 200, 768
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA)
    x = rng.standard_normal((n, k)).astype(np.float32).astype(dtype)
    check(be, w, blocks, x, precision)


def test_n_sweep_1_to_300(be, rng):
    rows, k = 150, 512
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA)
    xs = rng.standard_normal((300, k)).astype(np.float32)
    y64 = reference.matmul_float64(xs, blocks, rows)
    for n in [*range(1, 80), *range(80, 301, 11), 256, 257, 300]:
        for precision in (Precision.AUTO, Precision.EXACT, Precision.F16):
            check(be, w, blocks, xs[:n], precision, y64=y64[:n])


@pytest.mark.parametrize("precision", [Precision.EXACT, Precision.F16, Precision.Q8_1])
def test_soa_and_aos_readers_are_bit_identical(be, rng, precision):
    rows, k = 517, 1536
    blocks = random_weight(rng, rows, k)
    ws = load(be, blocks, rows, k, Layout.SOA)
    wa = load(be, blocks, rows, k, Layout.AOS)
    for n in (1, 2, 7, 8, 13, 16, 29, 32, 64, 100, 300):
        x = rng.standard_normal((n, k)).astype(np.float32)
        ys = be.matmul(ws, x, precision=precision, flags=SOA)
        ya = be.matmul(wa, x, precision=precision, flags=AOS)
        assert ys.kernel.endswith(".soa") and ya.kernel.endswith(".aos")
        np.testing.assert_array_equal(ys.y.view(np.uint32), ya.y.view(np.uint32),
                                      err_msg=f"{ys.kernel} vs {ya.kernel} at N={n}")


def test_decode_mmq_off_uses_no_tile_and_refuses_q8_1(be, rng):
    rows, k = 64, 512
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA)
    flags = KernelFlags(decode_mmq=False)
    for n in (1, 8, 9, 64):
        x = rng.standard_normal((n, k)).astype(np.float32)
        res = check(be, w, blocks, x, Precision.AUTO, flags)
        assert "mma" not in res.kernel and "mmq" not in res.kernel
        res = check(be, w, blocks, x, Precision.F16, flags)
        assert res.kernel.startswith("cuda.cublas_f16")
    with pytest.raises(FailedPrecondition, match="q8_1"):
        be.matmul(w, x, precision=Precision.Q8_1, flags=flags)


def test_lm_head_like_argmax(be, rng):
    rows, k, n = 8192, 1024, 256
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA, chunk=4 << 20)
    wd = q6k.dequantize_aos(blocks, rows, k)
    target = rng.integers(0, rows, n)
    # Hidden states that point at a planted token, as a real lm-head's inputs do.
    x = (wd[target] / np.linalg.norm(wd[target], axis=1, keepdims=True) * 4
         + rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    want = reference.matmul_float64(x, blocks, rows).argmax(axis=1)
    for precision in (Precision.EXACT, Precision.F16, Precision.Q8_1, Precision.AUTO):
        got = be.matmul(w, x, precision=precision).y.argmax(axis=1)
        assert (got == want).mean() >= 0.99, precision


def test_relayout_and_read_aos_round_trip(be, rng):
    rows, k = 300, 2048
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA)
    np.testing.assert_array_equal(be.read_aos(w), blocks)
    x = rng.standard_normal((5, k)).astype(np.float32)
    y0 = be.matmul(w, x, precision=Precision.F16).y
    wa = be.relayout(w, Layout.AOS, 1 << 20)
    assert wa.layout is Layout.AOS and wa.nbytes == be.weight_nbytes(rows, k, Layout.AOS)
    np.testing.assert_array_equal(be.read_aos(wa), blocks)
    np.testing.assert_array_equal(be.matmul(wa, x, precision=Precision.F16, flags=AOS).y, y0)
    ws = be.relayout(wa, Layout.SOA, 1 << 20)
    np.testing.assert_array_equal(be.read_aos(ws), blocks)
    np.testing.assert_array_equal(be.matmul(ws, x, precision=Precision.F16).y, y0)


def test_multi_slab_weight(be, rng, monkeypatch):
    from q6serve.kernels.cuda import storage

    monkeypatch.setattr(storage, "SLAB_BYTES", 37 * 5 * 210)  # 37-row slabs
    rows, k = 200, 1280
    blocks = random_weight(rng, rows, k)
    for layout, flags in ((Layout.SOA, SOA), (Layout.AOS, AOS)):
        w = load(be, blocks, rows, k, layout, chunk=23 * 5 * 210)
        assert len(w.data.slabs) == 6
        np.testing.assert_array_equal(be.read_aos(w), blocks)
        for precision in (Precision.EXACT, Precision.F16, Precision.Q8_1):
            x = rng.standard_normal((19, k)).astype(np.float32)
            check(be, w, blocks, x, precision, flags)


def test_load_peak_vram_is_bounded_by_the_chunk(be, rng):
    rows, k, chunk = 2048, 4096, 1 << 20
    blocks = random_weight(rng, rows, k)  # 7.3 MB of AoS
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    w = load(be, blocks, rows, k, Layout.SOA, chunk=chunk)
    peak = pool.total_bytes() - before  # the pool keeps every block it ever handed out
    assert be.load_scratch_nbytes(rows, k, chunk) <= chunk
    assert peak <= be.weight_nbytes(rows, k, Layout.SOA) + chunk, peak
    assert w.nbytes == be.weight_nbytes(rows, k, Layout.SOA)


def test_bad_chunks_are_rejected(be, rng):
    rows, k = 8, 512
    blocks = random_weight(rng, rows, k)
    with pytest.raises(FormatError, match="whole rows"):
        be.load([blocks.reshape(-1)[:-210]], rows, k, Layout.SOA, 1 << 20)
    with pytest.raises(FormatError, match="rows of data"):
        be.load([blocks[:10]], rows, k, Layout.SOA, 1 << 20)


def test_results_are_deterministic_with_split_k(be, rng):
    from q6serve.kernels.cuda_backend import Cfg

    rows, k = 96, 4096  # few rows: the grid splits K across CTAs
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA)
    x = rng.standard_normal((20, k)).astype(np.float32)
    runs = [be.matmul(w, x, precision=Precision.F16).y for _ in range(3)]
    for r in runs[1:]:
        np.testing.assert_array_equal(r, runs[0])
    with be.stream:
        xd = cupy.asarray(x)
    one = be.run(w, xd, x.dtype, "mma_f16", Cfg(nt=4, src=3, ksplit=1)).get(stream=be.stream)
    five = be.run(w, xd, x.dtype, "mma_f16", Cfg(nt=4, src=3, ksplit=5)).get(stream=be.stream)
    assert rel_fro(five, one) < 5e-5  # tensor-core f32 accumulation is not IEEE-exact


def test_plan_names_kernel_and_layout(be):
    assert be.plan(4, Precision.EXACT, AOS) == ("cuda.exact.aos", Precision.EXACT)
    assert be.plan(64, Precision.Q8_1, SOA) == ("cuda.mmq_q8_1.soa", Precision.Q8_1)
    name, prec = be.plan(1, Precision.AUTO, SOA)
    assert prec is not Precision.AUTO and name.endswith(".soa")


def test_every_launch_variant_is_correct(be, rng):
    """The shapes the bench compares (and the dispatch may pick) all compute the same thing."""
    rows, k = 300, 2304
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA)
    x = rng.standard_normal((70, k)).astype(np.float32)
    y64 = reference.matmul_float64(x, blocks, rows)
    with be.stream:
        xd = cupy.asarray(x)
    cases = variant_cases()
    for path, cfg, tol in cases:
        for n in (1, 5, 70):
            y = be.run(w, xd[:n], x.dtype, path, cfg).get(stream=be.stream)
            assert np.isfinite(y).all() and rel_fro(y, y64[:n]) <= tol, (path, cfg, n)


def variant_cases() -> list:
    """(path, launch shape, error bound vs float64) of every variant the bench may time."""
    from q6serve.kernels.cuda_backend import Cfg

    cases = [("exact", Cfg(nt=nt, pf=pf), 1e-5) for nt in (1, 2, 4) for pf in (False, True)]
    cases += [("mma_f16", Cfg(nt=nt, src=src, warps=wp), 2e-3) for nt in (1, 2, 4, 8)
              for src in (2, 3) for wp in (4, 8) if not (src == 2 and nt > 2)]
    cases += [("mma_f16", Cfg(nt=nt, mt=2, src=src, warps=wp), 2e-3) for nt in (1, 2, 4, 8)
              for src in (2, 3) for wp in (4, 8) if not (src == 2 and nt > 2)]
    cases += [("mmq_q8_1", Cfg(nt=nt), 2e-2) for nt in (1, 2, 4, 8)]
    cases += [("mma_f16", c, 2e-3) for c in KS_CFGS]
    return cases


# The K-slice tile's launch shapes (q6k_ks_f16 at 8, 12 and 16 warps per CTA, with the register
# prefetch: every such instantiation the nvcc check builds).
KS_CFGS = tuple(KsCfg(nt=nt, src=4, pf=True) for nt in (1, 2, 4, 8)) + tuple(
    KsCfg(nt=nt, src=4, pf=True, warps=wp) for nt, wp in ((1, 12), (2, 12), (4, 12), (1, 16),
                                                          (2, 16)))


# -- dispatch and launch-shape logic (no device needed) -----------------------------------------
def test_default_launch_shape_widens_warps_for_tall_weights():
    from q6serve.kernels.cuda.dispatch import Cfg, default_cfg

    wide = Cfg(nt=2, mt=2, src=3, warps=4)
    assert default_cfg("mma_f16", 16, 152064, 132) == wide  # 1188 row tiles: no K split
    assert default_cfg("mma_f16", 64, 152064, 132).mt == 2
    ks = Cfg(nt=2, src=4, pf=True)  # the K-slice tile below the lm-heads
    assert default_cfg("mma_f16", 16, 4096, 132) == ks  # 32 row tiles
    assert default_cfg("mma_f16", 64, 4096, 132) == Cfg(nt=8, src=4, pf=True)
    assert default_cfg("mma_f16", 8, 152064, 132) == Cfg(nt=1)  # decode N <= 8 unchanged
    assert default_cfg("mma_f16", 16) == ks  # no shape given


def test_heuristic_auto_is_shape_aware_for_small_weights():
    from q6serve.kernels.cuda.dispatch import heuristic_path as path

    auto, off = Precision.AUTO, KernelFlags(decode_mmq=False)
    for n, want in ((1, "mma_f16"), (4, "mma_f16"), (7, "mma_f16"), (8, "exact"), (32, "exact"),
                    (48, "exact"), (49, "cublas_f16"), (64, "cublas_f16"), (300, "cublas_f16")):
        assert path(n, auto, SOA, 512, 3584)[0] == want, n
    for n in (1, 8, 64):  # large weights, or no shape given: unchanged
        assert path(n, auto, SOA, 4096, 14336)[0] == "mma_f16"
        assert path(n, auto, SOA)[0] == "mma_f16"
    assert path(8, auto, SOA, 512, 3584)[1] is Precision.EXACT
    assert path(16, auto, off, 512, 3584)[0] == "cublas_f16"  # the kill switch's table
    assert path(16, Precision.F16, SOA, 512, 3584)[0] == "mma_f16"  # explicit precisions


class _StubFn:
    num_regs = 128
    max_dynamic_shared_size_bytes = 48 << 10


def recording_launcher():
    """A device-less launcher whose kernel lookups record the requested (file, name)."""
    from types import SimpleNamespace

    from q6serve.kernels.cuda.launch import Launcher

    requested: list = []

    def fn(file: str, name: str) -> _StubFn:
        requested.append((file, name))
        return _StubFn()

    launcher = Launcher(SimpleNamespace(sm_count=132, smem_sm=233472, cc="90", fn=fn))
    launcher.requested = requested
    return launcher


def requested_kernels(pairs: bool = False) -> set:
    """Every (file, template name) the backend asks NVRTC for: the bench's and tests' launch
    shapes, the heuristics' and the dispatch table's, N = 1..300, both layouts, every
    activation dtype; ``pairs``: SoA weights held as pair streams (Storage.pairs) too."""
    from q6serve.kernels.cuda.dispatch import default_cfg, load_default_table
    from q6serve.kernels.cuda.launch import IN_TYPES

    table = load_default_table()
    tabled = [] if table is None else [(e.path, e.cfg) for cells in table.cells.values()
                                       for e in cells.values() if e.cfg is not None]
    tabled = list(dict.fromkeys(tabled))
    lc = recording_launcher()
    for layout in (Layout.SOA, Layout.AOS):
        for in_t in IN_TYPES.values():
            for n in (1, 2, 3, 5, 8, 9, 16, 17, 33, 64, 70, 300):
                plans = [(p, default_cfg(p, n, r, 132)) for p in ("exact", "mma_f16", "mmq_q8_1")
                         for r in (300, 1 << 17)]
                plans += [(p, c) for p, c, _ in variant_cases()] + tabled
                for path, cfg in plans:
                    # the cluster-sum tile (src 7) plans only a K its cluster size cuts evenly
                    k = 512 * cfg.ksplit if cfg is not None and cfg.src == 7 else 2304
                    for pair in (False, True) if pairs and layout is Layout.SOA else (False,):
                        lp = lc.plan(300, k, layout, in_t, path, cfg, n, pair)
                        assert lp.grid[0] >= 1 and 1 <= lp.ks == lp.grid[1] <= 9 and lp.threads
    return set(lc.requested)


def test_launch_plans_without_a_device():
    """Every launch plan builds (host code only) and names instantiations that exist."""
    import re

    names = requested_kernels()
    files = {f for f, _ in names}
    assert "q6k_matmul.cu" in files <= {"q6k_matmul.cu", "q6k_wgmma.cu"}  # wgmma: the table
    pat = re.compile(r"^q6k_\w+(<[\w, ]+>)?$")  # templates, and q6k_sum_parts
    assert all(pat.match(n) for _, n in names)
    assert any(n.startswith("q6k_mma_f16<") and ", false, " in n for _, n in names)  # AoS twins


@pytest.mark.skipif(_gpu_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("precision", [Precision.EXACT, Precision.F16, Precision.Q8_1])
def test_second_device_from_a_thread_on_device_0(rng, precision):
    """A backend on device 1 driven from a thread whose current device is 0 (as the
    multi-device worker's threads are) keeps every buffer on device 1."""
    from q6serve.kernels.cuda_backend import CudaBackend

    b1 = CudaBackend(1)
    try:
        rows, k = 300, 1024
        blocks = random_weight(rng, rows, k)
        with cupy.cuda.Device(0):
            w = load(b1, blocks, rows, k, Layout.SOA)
            x = rng.standard_normal((8, k)).astype(np.float32)
            check(b1, w, blocks, x, precision)
            b1.free(w)
    finally:
        b1.close()


# -- the host path of matmul (kernels/cuda/launch.py) -------------------------------------------
def test_graphs_and_direct_launches_agree(be, rng):
    """Direct launches, the capturing call and graph replays give bit-identical results, for
    every precision, tile and cuBLAS N, and graphs are really used."""
    from q6serve.kernels.cuda_backend import CudaBackend

    rows, k = 700, 2048
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA)
    direct = CudaBackend(0, graphs=False)
    wd = load(direct, blocks, rows, k, Layout.SOA)
    for n in (1, 3, 16, 40, 64, 300):
        x = rng.standard_normal((n, k)).astype(np.float16)
        for precision in (Precision.EXACT, Precision.F16, Precision.Q8_1, Precision.AUTO):
            want = direct.matmul(wd, x, precision=precision)
            for _ in range(4):  # direct, direct + capture, graph, graph
                got = be.matmul(w, x, precision=precision)
                assert got.kernel == want.kernel and got.timing.seconds() > 0
                np.testing.assert_array_equal(got.y.view(np.uint32), want.y.view(np.uint32),
                                              err_msg=f"{got.kernel} N={n}")
    assert any(b.graph for b in w.data.plans.values()), "no launch sequence was captured"
    assert not any(b.graph for b in wd.data.plans.values())
    direct.close()


def test_returned_arrays_survive_later_calls_and_buffer_growth(be, rng):
    """y arrays own their pinned blocks: later calls (smaller, larger: the workspace grows and
    every bound sequence rebinds) never overwrite an earlier result."""
    rows, k = 300, 1024
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA)
    kept = []
    for n in (2, 1, 70, 5, 200, 2, 1):
        x = rng.standard_normal((n, k)).astype(np.float32)
        poison()
        kept.append((x, be.matmul(w, x, precision=Precision.EXACT).y))
    for x, y in kept:
        assert rel_fro(y, reference.matmul_float64(x, blocks, rows)) <= 1e-5


@pytest.mark.parametrize("out", [np.float16, BFLOAT16])
def test_half_outputs(be, rng, out):
    rows, k = 200, 768
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA)
    x = rng.standard_normal((9, k)).astype(np.float16)
    y32 = be.matmul(w, x, precision=Precision.F16).y
    got = be.matmul(w, x, precision=Precision.F16, out_dtype=np.dtype(out)).y
    assert got.dtype == np.dtype(out) and got.shape == y32.shape
    np.testing.assert_array_equal(got, y32.astype(out))


def test_activations_built_in_the_staging_buffer(be, rng):
    """x built in place in CudaBackend.staging (the upload buffer) gives the same results as
    a plain array, for every activation dtype and across buffer growth."""
    rows, k = 300, 1024
    blocks = random_weight(rng, rows, k)
    w = load(be, blocks, rows, k, Layout.SOA)
    for n, dt in ((3, np.float16), (70, np.float32), (5, BFLOAT16), (400, np.float16)):
        x = rng.standard_normal((n, k)).astype(np.float32).astype(dt)
        want = be.matmul(w, x, precision=Precision.F16).y
        st = be.staging(n, k, np.dtype(dt))
        assert st.shape == (n, k) and st.dtype == np.dtype(dt)
        st[...] = x
        for _ in range(3):  # direct, capture, graph
            np.testing.assert_array_equal(be.matmul(w, st, precision=Precision.F16).y, want)


def test_small_y_ways_out_without_a_device():
    """Which y the bound sequence downloads itself (then copied out after the sync) and which
    goes straight into a pinned block that becomes the result: f32 up to SMALL_Y_F32 bytes,
    f16 (converted on the device) up to SMALL_Y, bf16 never."""
    from q6serve.kernels.cuda.launch import SMALL_Y, SMALL_Y_F32, _small_out

    f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
    assert SMALL_Y_F32 < SMALL_Y
    assert _small_out(1, 4096, None, 0) == f32  # 16 KiB: 4096x14336 at N=1
    assert _small_out(1, SMALL_Y_F32 // 4, f32, 0) == f32
    assert _small_out(1, SMALL_Y_F32 // 4 + 1, None, 0) is None
    assert _small_out(1, 14336, None, 0) is None  # 56 KiB: 14336x4096 at N=1
    assert _small_out(1, 14336, f16, 0) == f16  # 28 KiB of f16
    assert _small_out(3, 14336, f16, 0) is None
    assert _small_out(1, 64, BFLOAT16, 0) is None
