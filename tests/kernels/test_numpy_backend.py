from __future__ import annotations

import numpy as np
import pytest

from q6serve.kernels import q6k, reference
from q6serve.kernels.api import DTYPES, KernelFlags, Layout, Precision
from q6serve.kernels.errors import FailedPrecondition, FormatError
from q6serve.kernels.numpy_backend import NumpyBackend, dequantize
from tests.conftest import random_blocks


@pytest.fixture
def backend():
    b = NumpyBackend(threads=2)
    yield b
    b.close()


def chunks_of(blocks: np.ndarray, rows: int, k: int, rows_per: int):
    per = k // 256
    return [blocks[r * per : min(rows, r + rows_per) * per] for r in range(0, rows, rows_per)]


def test_tile_dequant_is_bit_identical(rng: np.random.Generator) -> None:
    blocks = random_blocks(rng, 300)  # two whole SUB sub-tiles and a ragged one
    f = q6k.aos_fields(blocks)
    got = dequantize(f)
    want = q6k.dequantize_fields(f)
    # bit patterns, not values: -0.0 and +0.0 (a zero scale) must come out the same too
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("layout", [Layout.SOA, Layout.AOS])
@pytest.mark.parametrize(("rows", "k", "n"), [(1, 256, 1), (37, 512, 3), (300, 1024, 64)])
def test_exact_matches_reference(backend: NumpyBackend, rng: np.random.Generator,
                                 layout: Layout, rows: int, k: int, n: int) -> None:
    blocks = random_blocks(rng, rows * k // 256)
    w = backend.load(chunks_of(blocks, rows, k, 7), rows, k, layout)
    assert w.nbytes == backend.weight_nbytes(rows, k, layout)
    x = rng.standard_normal((n, k)).astype(np.float32)
    res = backend.matmul(w, x)
    assert res.kernel == "numpy.exact" and res.precision is Precision.EXACT
    assert res.layout is layout and res.y.shape == (n, rows) and res.y.dtype == np.float32
    ref = reference.matmul_float64(x, blocks, rows)
    # f32 dot products: error relative to the sum of |terms| (a lone output can cancel to
    # near zero, so its plain relative error is unbounded); Frobenius once outputs are many.
    scale = np.abs(x.astype(np.float64)) @ np.abs(q6k.dequantize_aos(blocks, rows, k)).T
    assert (np.abs(res.y - ref) <= 1e-5 * scale).all()
    if res.y.size >= 64:
        assert np.linalg.norm(res.y - ref) / np.linalg.norm(ref) < 1e-6
    assert res.timing.seconds() is not None and res.timing.seconds() >= 0
    assert np.array_equal(backend.read_aos(w), blocks)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dtypes_and_precisions(backend: NumpyBackend, rng: np.random.Generator,
                               dtype: str) -> None:
    rows, k = 20, 512
    blocks = random_blocks(rng, rows * k // 256)
    w = backend.load([blocks], rows, k, Layout.SOA)
    x = rng.standard_normal((5, k)).astype(DTYPES[dtype])
    ref64 = reference.matmul_float64(x, blocks, rows)
    for precision, tol in ((Precision.EXACT, 1e-6), (Precision.F16, 2e-3),
                           (Precision.Q8_1, 2e-2)):
        y = backend.matmul(w, x, precision=precision).y
        assert np.linalg.norm(y - ref64) / np.linalg.norm(ref64) < tol
        cast = backend.matmul(w, x, precision=precision, out_dtype=DTYPES[dtype]).y
        assert cast.dtype == DTYPES[dtype]
        assert np.array_equal(cast, y.astype(DTYPES[dtype]))
    q8 = backend.matmul(w, x, precision=Precision.Q8_1)
    assert np.allclose(q8.y, reference.matmul_q8_1(x, blocks, rows), rtol=1e-6, atol=1e-6)


def test_relayout_round_trip_keeps_results(backend: NumpyBackend,
                                           rng: np.random.Generator) -> None:
    rows, k = 33, 768
    blocks = random_blocks(rng, rows * k // 256)
    w = backend.load([blocks], rows, k, Layout.SOA)
    x = rng.standard_normal((4, k)).astype(np.float32)
    before = backend.matmul(w, x).y
    held = backend.memory().pool_used
    a = backend.relayout(w, Layout.AOS)
    assert a.layout is Layout.AOS and np.array_equal(backend.read_aos(a), blocks)
    assert np.array_equal(backend.matmul(a, x).y, before)  # same tile order: bit-identical
    s = backend.relayout(a, Layout.SOA)
    assert np.array_equal(backend.matmul(s, x).y, before)
    assert backend.memory().pool_used == held
    backend.free(s)
    assert backend.memory().pool_used == held - s.nbytes


def test_refusals(backend: NumpyBackend, rng: np.random.Generator) -> None:
    blocks = random_blocks(rng, 2)
    w = backend.load([blocks], 1, 512, Layout.SOA)
    with pytest.raises(FormatError, match="K=256, weight has K=512"):
        backend.matmul(w, np.zeros((1, 256), np.float32))
    with pytest.raises(FormatError, match="N=0"):
        backend.matmul(w, np.zeros((0, 512), np.float32))
    with pytest.raises(FormatError, match="unsupported dtype"):
        backend.matmul(w, np.zeros((1, 512), np.int32))
    with pytest.raises(FailedPrecondition, match="Q6SERVE_DECODE_MMQ=0"):
        backend.matmul(w, np.ones((1, 512), np.float32), precision=Precision.Q8_1,
                       flags=KernelFlags(decode_mmq=False))
    with pytest.raises(FormatError, match="got 1 rows"):
        backend.load([blocks], 3, 512, Layout.SOA)
