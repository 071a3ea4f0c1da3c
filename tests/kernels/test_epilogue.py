"""The top-k / log-sum-exp epilogue: the NumPy reference against float64 ground truth, the
device algorithm (``topk_xp``) run with NumPy against the reference (CI), and the CUDA backend's
epilogue against the reference on the GPU (``-m gpu``; skipped without CuPy or a device)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from q6serve.kernels import epilogue
from q6serve.kernels.api import Layout, Precision, iter_aos_chunks
from q6serve.kernels.cuda.launch import GRAPH_AFTER
from q6serve.kernels.epilogue import LSE_RTOL, TopK, check_k, merge_topk, topk_reference, topk_xp
from q6serve.kernels.errors import InvalidArgument
from q6serve.kernels.numpy_backend import NumpyBackend


def _truth(y: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Stable full sort (value desc, column asc) and the float64 lse, the slow obvious way."""
    order = np.array([sorted(range(y.shape[1]), key=lambda j, r=r: (-y[r, j], j))[:k]
                      for r in range(y.shape[0])])
    m = y.astype(np.float64).max(axis=1, keepdims=True)
    return order, (m[:, 0] + np.log(np.exp(y - m).sum(axis=1)))


def _assert_same(got: TopK | tuple, want: TopK) -> None:
    v, i, lse = (got.values, got.indices, got.lse) if isinstance(got, TopK) else got
    assert v.dtype == np.float32 and i.dtype == np.int32 and lse.dtype == np.float32
    np.testing.assert_array_equal(v, want.values)
    np.testing.assert_array_equal(i, want.indices)
    np.testing.assert_allclose(lse, want.lse, rtol=LSE_RTOL, atol=LSE_RTOL)


@pytest.mark.parametrize("n,cols,k", [(1, 1, 1), (3, 17, 17), (4, 300, 7), (2, 5000, 64),
                                      (3, 40000, 256), (2, 152064, 64), (5, 4097, 1)])
def test_reference_and_device_algorithm_agree_with_truth(n: int, cols: int, k: int) -> None:
    rng = np.random.default_rng(cols + k)
    y = (rng.standard_normal((n, cols)) * 8).astype(np.float32)  # continuous: no ties
    ref = topk_reference(y, k)
    if cols <= 5000:
        order, lse = _truth(y, k)
        np.testing.assert_array_equal(ref.indices, order)
        np.testing.assert_allclose(ref.lse, lse, rtol=1e-7)
    np.testing.assert_array_equal(ref.values, np.take_along_axis(y, ref.indices, axis=1))
    _assert_same(topk_xp(y, k, np), ref)


def test_ties_extremes_and_nan() -> None:
    y = np.zeros((5, 6000), np.float32)
    y[0, 10] = np.inf
    y[1, :] = -np.inf
    y[1, 5999] = 1.0  # one finite value in a row of -inf
    y[2, [7, 3, 4000]] = 5.0  # a three-way tie: lower column first
    y[3, 123] = np.nan
    y[4, :] = -np.inf  # nothing but -inf
    got = topk_xp(y, 3, np)
    v, i, lse = got
    assert list(i[0][:1]) == [10] and v[0, 0] == np.inf and lse[0] == np.inf
    assert list(i[1][:1]) == [5999] and lse[1] == pytest.approx(1.0)
    assert list(i[2]) == [3, 7, 4000] and list(v[2]) == [5, 5, 5]
    assert i[3, 0] == 123 and np.isnan(v[3, 0]) and np.isnan(lse[3])
    assert np.all(v[4] == -np.inf) and np.all(i[4] < 6000) and lse[4] == -np.inf
    assert np.all(i[1, 1:] < 6000)  # padding never wins over a real -inf column
    ref = topk_reference(y, 3)
    np.testing.assert_array_equal(ref.values[:3], v[:3])  # tie *order* is part of the contract
    np.testing.assert_array_equal(ref.indices[2], i[2])
    np.testing.assert_array_equal(ref.lse, lse)


def test_group_bound_holds_when_the_top_k_share_a_group() -> None:
    """All k winners in one group (and the runner-ups spread out): still exact."""
    cols, k = 20000, 16
    g = epilogue.group_size(cols, k)
    y = np.random.default_rng(0).standard_normal((1, cols)).astype(np.float32)
    y[0, 5 * g : 5 * g + min(g, k)] = 100 + np.arange(min(g, k), dtype=np.float32)
    _assert_same(topk_xp(y, k, np), topk_reference(y, k))


def test_prefix_and_rows_and_merge() -> None:
    rng = np.random.default_rng(1)
    y = rng.standard_normal((6, 900)).astype(np.float32)
    full = topk_reference(y, 50)
    _assert_same(full.first(9), topk_reference(y, 9))
    _assert_same(full.rows(2, 5), topk_reference(y[2:5], 50))
    cuts = [0, 5, 450, 900]  # one part narrower than k
    parts = [topk_reference(y[:, a:b], min(50, b - a)) for a, b in itertools.pairwise(cuts)]
    _assert_same(merge_topk(parts, cuts[:-1], 50), full)


@pytest.mark.parametrize("k,cols,msg", [(0, 10, "out of range"), (257, 1000, "out of range"),
                                        (-1, 10, "out of range"), (11, 10, "exceeds the 10 rows")])
def test_bad_k_is_invalid_argument(k: int, cols: int, msg: str) -> None:
    with pytest.raises(InvalidArgument, match=msg):
        check_k(k, cols)
    with pytest.raises(InvalidArgument, match=msg):
        topk_reference(np.zeros((1, cols), np.float32), k)


def _blocks(rows: int, k: int, seed: int) -> np.ndarray:
    blocks = np.random.default_rng(seed).integers(0, 256, (rows * k // 256, 210), dtype=np.uint8)
    blocks[:, 208:210] = np.array([1e-3], np.float16).view(np.uint8)  # finite, modest scales
    return blocks


def test_numpy_backend_epilogue() -> None:
    be = NumpyBackend(threads=1)
    try:
        rows, k = 1000, 256
        w = be.load(iter_aos_chunks(_blocks(rows, k, 2), rows, k, 1 << 20), rows, k,
                    Layout.SOA, 1 << 20)
        x = np.random.default_rng(3).standard_normal((5, k)).astype(np.float32)
        plain = be.matmul(w, x, precision=Precision.EXACT)
        top = be.matmul(w, x, precision=Precision.EXACT, topk=32)
        assert top.y is None and top.kernel == plain.kernel and top.topk is not None
        _assert_same(top.topk, topk_reference(plain.y, 32))
        small = be.load(iter_aos_chunks(_blocks(16, k, 4), 16, k, 1 << 20), 16, k,
                        Layout.SOA, 1 << 20)
        with pytest.raises(InvalidArgument, match="topk k=17 exceeds the 16 rows"):
            be.matmul(small, x, topk=17)
    finally:
        be.close()


# -- CUDA (the lead's GPU run) -----------------------------------------------------------------
@pytest.fixture(scope="module")
def cuda_be():  # type: ignore[no-untyped-def]
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError("no device")
    except Exception:  # no CuPy, no driver, no device
        pytest.skip("needs CuPy and a CUDA device")
    from q6serve.kernels.cuda_backend import CudaBackend

    be = CudaBackend(0)
    yield be
    be.close()


def _assert_matches(top: TopK, y: np.ndarray, k: int) -> None:
    """Values bit-equal to the reference's (NaN == NaN), indices equal where not tied, lse
    within LSE_RTOL (equal where infinite or NaN)."""
    ref = topk_reference(y, k)
    v, i, lse = top.values, top.indices, top.lse
    assert v.shape == i.shape == (y.shape[0], k) and lse.shape == (y.shape[0],)
    np.testing.assert_array_equal(v, ref.values)
    np.testing.assert_array_equal(v, np.take_along_axis(y, i, axis=1))
    untied = np.ones(v.shape, bool)
    untied[:, 1:] &= v[:, 1:] != v[:, :-1]
    untied[:, :-1] &= v[:, :-1] != v[:, 1:]
    np.testing.assert_array_equal(i[untied], ref.indices[untied])
    finite = np.isfinite(ref.lse)
    np.testing.assert_array_equal(lse[~finite], ref.lse[~finite])
    assert np.all(np.abs(lse[finite] - ref.lse[finite])
                  <= LSE_RTOL * np.maximum(1, np.abs(ref.lse[finite])))


# The device paths: the group form as dispatched (q6_topk_scan + q6_topk_pick), the same with
# every row through q6_topk_pick's one-CTA-per-row passes (its fallback for rows with too many
# columns at or above the group bound), CuPy ops.
PATHS = ["groups", "groups_rowpasses", "cupy_ops"]


def _path(monkeypatch: pytest.MonkeyPatch, path: str) -> bool:
    from q6serve.kernels import cuda_topk

    if path == "groups_rowpasses":
        monkeypatch.setattr(cuda_topk, "CAND_CAP", 0)
    return path != "cupy_ops"


def test_group_form_sends_rows_it_cannot_bound_to_the_row_passes() -> None:
    from q6serve.kernels.cuda_topk import CAND_CAP, rows_only

    assert rows_only(4096, 64) and rows_only(4096, 256) and rows_only(8192, 128)
    assert not rows_only(4096, 63)  # 64 groups bound the 63rd
    assert not rows_only(CAND_CAP, 256)  # staged whole: ranked or sorted in shared memory
    assert not rows_only(18944, 256) and not rows_only(152064, 256)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,n,k", [(512, 1, 1), (4096, 8, 64), (152064, 64, 64),
                                      (152064, 3, 256), (300, 5, 256), (18944, 8, 64),
                                      (4099, 300, 17)])
@pytest.mark.parametrize("precision", [Precision.EXACT, Precision.F16])
@pytest.mark.parametrize("path", PATHS)
def test_cuda_epilogue_matches_reference(cuda_be, rows: int, n: int, k: int,  # type: ignore[no-untyped-def]
                                         precision: Precision, path: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The device's top-k == the NumPy reference on the y a plain call downloads (the kernels
    are deterministic, split-K included), as direct launches and from the captured graph
    that binds the epilogue in (kernels/cuda/launch.py)."""
    from q6serve.kernels import cuda_topk

    monkeypatch.setattr(cuda_topk, "FUSED", _path(monkeypatch, path))
    kk = 256 if rows > 100_000 else 512  # keep the lm-head-sized weight small in K
    w = cuda_be.load(iter_aos_chunks(_blocks(rows, kk, rows), rows, kk, 64 << 20), rows, kk,
                     Layout.SOA, 64 << 20)
    try:
        x = np.random.default_rng(n).standard_normal((n, kk)).astype(np.float32)
        plain = cuda_be.matmul(w, x, precision=precision)
        for _ in range(GRAPH_AFTER + 2):  # direct launches, then the bound sequence's graph
            top = cuda_be.matmul(w, x, precision=precision, topk=k)
            assert top.y is None and top.topk is not None and top.kernel == plain.kernel
            _assert_matches(top.topk, plain.y, k)
    finally:
        cuda_be.free(w)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_cuda_epilogue_special_rows(cuda_be, path: str,  # type: ignore[no-untyped-def]
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Ties, +-inf, NaN, rows of -inf, k == columns, one column: on the device directly."""
    import cupy

    fused = _path(monkeypatch, path)

    from q6serve.kernels.cuda_topk import topk_on_device

    rng = np.random.default_rng(11)
    cases = []
    y = rng.standard_normal((6, 7000)).astype(np.float32)
    y[0, [5, 900, 6999]] = 50.0  # a three-way tie at the top
    y[1, :] = 0.0  # every column tied
    y[2, 17] = np.inf
    y[3, 4242] = np.nan
    y[4, :] = -np.inf
    y[5, :6990] = -np.inf  # fewer finite columns than k
    cases.append((y, 16))
    cases.append((rng.standard_normal((3, 256)).astype(np.float32), 256))  # k == columns
    cases.append((rng.standard_normal((4, 1)).astype(np.float32), 1))
    cases.append((np.round(rng.standard_normal((5, 20000)) * 4).astype(np.float32), 100))
    y = rng.standard_normal((4, 9000)).astype(np.float32)  # specials in some chunks only
    y[0, 8999] = np.nan
    y[1, :4500] = -np.inf
    y[2, 1] = np.inf
    y[3, :] = -np.inf
    y[3, 7777] = 1.0
    cases.append((y, 256))
    y = rng.standard_normal((5, 152064)).astype(np.float32)  # wide rows, specials in one group
    # ascending, the top k in the last chunk; the 1024 columns >= the bound are sorted, not ranked
    y[0] = np.arange(152064, dtype=np.float32) + (2**18 - 152064)
    y[1] = -np.arange(152064, dtype=np.float32)  # descending: in the first groups
    y[2, 4096 * 20 + 5] = np.nan  # NaN and +inf in one chunk, -inf elsewhere
    y[2, 4096 * 20 + 6] = np.inf
    y[2, 100:200] = -np.inf
    y[3, 1000:1100] = 7.5  # 100 columns tied at the top (k=16 of them: under the stage cap)
    y[4] = 3.0  # tied at the k-th value in every group (over the stage cap: the row passes)
    y[4, rng.choice(152064, 10, replace=False)] = 5 + np.arange(10, dtype=np.float32)
    cases.append((y, 16))
    cases.append((y[[0, 1, 2, 4]], 1))  # (row 3's tie would be at the k-th value)
    cases.append((np.round(rng.standard_normal((2, 152064)) * 3).astype(np.float32), 256))
    cases.append((rng.standard_normal((7, 17)).astype(np.float32), 5))  # cols % 4 != 0
    cases.append((rng.standard_normal((1, 1)).astype(np.float32), 1))
    for y, k in cases:
        with cupy.cuda.Device(0):
            yd = cupy.asarray(y)
            cupy.cuda.Device(0).synchronize()  # the backend's stream does not wait for the upload
            top = topk_on_device(cupy, yd, k, cuda_be.stream, fused=fused)
        _assert_matches(top, y, k)


@pytest.mark.gpu
@pytest.mark.parametrize("path,n,cols,k", [
    *((p, *s) for p in ("groups", "groups_rowpasses")
      for s in ((3, 9000, 64), (64, 152064, 256), (2, 4099, 1))),
    ("groups", 256, 152064, 64), ("groups_rowpasses", 300, 128256, 32)])
def test_cuda_epilogue_writes_every_word_and_reads_unaligned_rows(  # type: ignore[no-untyped-def]
        cuda_be, path: str, n: int, cols: int, k: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every word of the packed result is written (the buffer starts poisoned), and y rows that
    are not 16-byte aligned (a contiguous view one element into its allocation: the scalar scan)
    give the same result as aligned ones (the float4 scan where cols % 4 == 0)."""
    import cupy

    from q6serve.kernels import cuda_topk

    _path(monkeypatch, path)
    y = np.random.default_rng(cols).standard_normal((n, cols)).astype(np.float32)
    with cupy.cuda.Device(0), cuda_be.stream:
        flat = cupy.empty(n * cols + 1, cupy.float32)
        flat[1:] = cupy.asarray(y).ravel()
        views = [cupy.asarray(y), flat[1:].reshape(n, cols)]
        cupy.cuda.Device(0).synchronize()  # the uploads, whatever stream they took
        for yd in views:
            packed = cupy.full((n, 2 * k + 1), 0x7FBADBAD, cupy.int32)
            cuda_topk._fused(cupy, yd, k, packed)
            _assert_matches(cuda_topk.unpack(cupy.asnumpy(packed, stream=cuda_be.stream), k),
                            y, k)


def test_device_driver_chunks_and_packs(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels/cuda_topk.py's chunking into one packed result and its unpacking, run with
    NumPy standing in for CuPy: the same result as one unchunked pass."""
    from q6serve.kernels import cuda_topk

    monkeypatch.setattr(cuda_topk, "CHUNK_ELEMS", 3 * 5000)  # 3 rows per chunk
    y = np.random.default_rng(7).standard_normal((8, 5000)).astype(np.float32)
    y[3, 17] = np.nan
    got = cuda_topk.unpack(cuda_topk._packed(np, y, 20, fused=False), 20)
    want = topk_xp(y, 20, np)
    np.testing.assert_array_equal(got.values, want[0])
    np.testing.assert_array_equal(got.indices, want[1])
    np.testing.assert_array_equal(got.lse, want[2])
    assert got.indices.dtype == np.int32 and got.values.flags.c_contiguous
