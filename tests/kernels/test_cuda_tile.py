"""The stream-K tile ``q6k_tile_f16`` (kernels/cuda/q6k_tile.cu) against the NumPy reference's
dequantization in float64 (``-m gpu``; skipped without CuPy or a GPU), launched through
``kernels/cuda/tile.py`` as the backend does. Every launch shape, rows that fill no whole
tile, weights split over slabs inside a tile, a tile cut between many CTAs, CTAs that own
several tiles (a small simulated SM count), SoA/AoS bit-identity, call-to-call
bit-identity and the tickets left at zero.
"""

from __future__ import annotations

import numpy as np
import pytest

from q6serve.kernels import q6k
from q6serve.kernels.api import Layout, iter_aos_chunks
from q6serve.kernels.cuda import loader, tile

try:
    import cupy
except ImportError:  # CI: no CuPy at all
    cupy = None

pytestmark = [pytest.mark.gpu]
TOL = 2e-3  # F16 contract: relative Frobenius error vs float64


def _gpu_count() -> int:
    if cupy is None:
        return 0
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


@pytest.fixture(scope="module")
def be():
    if _gpu_count() == 0:
        pytest.skip("needs CuPy and a CUDA device")
    from q6serve.kernels.cuda_backend import CudaBackend

    b = CudaBackend(0)
    yield b
    b.close()


@pytest.fixture(scope="module")
def get_fn(be):
    """Every instantiation compiled in one NVRTC call (one per name would take minutes)."""
    with be.ctx.dev:
        mods = {
            tile.TILE_FILE: loader.load(tile.TILE_FILE, tile.names()),
            tile.PREP_FILE: loader.load(tile.PREP_FILE, tuple(
                f"q6k_prep_f16<{nt}, {t}>" for nt in (2, 4, 8)
                for t in ("InF32", "InF16", "InBF16"))),
        }
    return lambda file, name: mods[file].function(name)


@pytest.fixture
def rng(request):
    seed = int(np.random.SeedSequence().entropy % (2**32))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def _run(be, get_fn, w, x, cfg, sm_count):
    """y [n, rows] of one call (NaN-poisoned output, partials and prepass buffers)."""
    cp = cupy
    n = x.shape[0]
    in_t = "InF16" if x.dtype == np.float16 else "InF32"
    with be.ctx.dev, be.stream:
        p = tile.plan(get_fn, cfg, w.rows, w.k, n, w.layout is Layout.SOA, in_t, sm_count,
                      be.ctx.smem_sm)
        cw = w.data
        y = cp.full((n, w.rows), np.nan, cp.float32)
        xp = cp.full(max(1, p.xp_words), 0x7FC00000, cp.uint32)
        part = cp.full(max(1, p.part_floats), np.nan, cp.float32)
        tickets = cp.zeros(p.tiles, cp.uint32)
        tile.launch(p, cw.table, w.rows, cw.rps, cp.asarray(x), n, y, xp, part, tickets)
        out = y.get(stream=be.stream)
        assert int(tickets.sum().get()) == 0, "tickets must be left at zero for the next call"
    return out


def _check(y, x, wd):
    """F16 contract against the reference on f16-rounded activations: relative Frobenius
    error <= TOL, and every output within 1e-3 of its sum of |terms| (tiny outputs)."""
    assert np.isfinite(y).all(), "unwritten or non-finite outputs"
    x16 = x.astype(np.float32).astype(np.float16).astype(np.float64)
    y64 = x16 @ wd.T
    bound = 1e-3 * (np.abs(x16) @ np.abs(wd).T) + 1e-30
    assert (np.abs(y - y64) <= bound).all()
    if y.size >= 64:
        err = np.linalg.norm(y - y64) / max(np.linalg.norm(y64), 1e-300)
        assert err <= TOL, err


def _dense(blocks, rows, k):
    """The reference's exact dequantization as float64 [rows, k]."""
    return q6k.dequantize_aos(blocks, rows, k).astype(np.float64)


def _load(be, blocks, rows, k, layout):
    return be.load(iter_aos_chunks(blocks, rows, k, 1 << 20), rows, k, layout, 1 << 20)


CASES = [  # rows, k: no whole tile, one block, a tile cut among many CTAs, many tiles
    (333, 1280), (1, 256), (129, 768), (100, 256 * 40), (2100, 256)]


@pytest.mark.parametrize("shape", CASES)
@pytest.mark.parametrize("sm_count", [0, 3])  # 0: the device's own
@pytest.mark.parametrize("dtype", [np.float32, np.float16])  # prepass / read by the tile
def test_every_launch_shape_matches_the_reference(be, get_fn, rng, random_blocks, shape,
                                                  sm_count, dtype):
    rows, k = shape
    blocks = random_blocks(rng, rows * (k // 256))
    ws = _load(be, blocks, rows, k, Layout.SOA)
    wa = _load(be, blocks, rows, k, Layout.AOS)
    sms = sm_count or be.sm_count
    wd = _dense(blocks, rows, k)
    for cfg in tile.CONFIGS:
        for n in sorted({1, 8 * cfg.nt - 7, 8 * cfg.nt}):
            x = rng.standard_normal((n, k)).astype(dtype)
            y = _run(be, get_fn, ws, x, cfg, sms)
            _check(y, x, wd)
            again = _run(be, get_fn, ws, x, cfg, sms)
            twin = _run(be, get_fn, wa, x, cfg, sms)
            np.testing.assert_array_equal(y.view(np.uint32), again.view(np.uint32),
                                          err_msg=f"{cfg.label} N={n}: repeat differs")
            np.testing.assert_array_equal(y.view(np.uint32), twin.view(np.uint32),
                                          err_msg=f"{cfg.label} N={n}: AoS twin differs")


def test_tiles_across_slabs_and_f16_activations(be, get_fn, rng, random_blocks, monkeypatch):
    from q6serve.kernels.cuda import storage

    rows, k = 700, 1024  # 37 rows per slab: every 128/256-row tile spans several slabs
    monkeypatch.setattr(storage, "SLAB_BYTES", 37 * q6k.aos_nbytes(1, k))
    blocks = random_blocks(rng, rows * (k // 256))
    ws = _load(be, blocks, rows, k, Layout.SOA)
    wa = _load(be, blocks, rows, k, Layout.AOS)
    assert len(ws.data.slabs) == 19
    wd = _dense(blocks, rows, k)
    for cfg in tile.CONFIGS:
        for sms in (be.sm_count, 5):
            x = rng.standard_normal((8 * cfg.nt - 3, k)).astype(np.float16)
            y = _run(be, get_fn, ws, x, cfg, sms)
            _check(y, x, wd)
            np.testing.assert_array_equal(y.view(np.uint32),
                                          _run(be, get_fn, wa, x, cfg, sms).view(np.uint32))


def test_too_many_tokens_for_the_shape_is_refused(be, get_fn):
    with pytest.raises(ValueError, match="at most 16 tokens"):
        tile.plan(get_fn, tile.TileCfg(2, 1, 4), 256, 256, 17, True, "InF32", be.sm_count,
                  be.ctx.smem_sm)
