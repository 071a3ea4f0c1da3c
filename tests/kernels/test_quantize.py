"""ggml's quantizers in NumPy (kernels/quantize.py): byte parity, rounding helpers, bounds."""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from q6serve.kernels import q6k
from q6serve.kernels.errors import FormatError
from q6serve.kernels.quantize import (
    nearest_int,
    q8_1_fields,
    quantize_q6_k,
    quantize_q8_1,
    roundf,
)

Q6_CASES = ["normal_64x1024", "student_t_outliers_32x2048", "mixed_rows_16x512",
            "real_shape_strip_8x3584"]
Q8_CASES = ["acts_normal_8x4096", "acts_spiky_4x1024"]


@pytest.mark.parametrize("name", Q6_CASES)
def test_q6_k_is_byte_identical_to_ggml(ggml_dir, manifest, name):
    x = np.load(ggml_dir / f"{name}.f32.npy")
    assert list(x.shape) == manifest[name]["shape"]
    got = quantize_q6_k(x)
    want = np.frombuffer((ggml_dir / f"{name}.q6_K.bin").read_bytes(), np.uint8)
    assert got.shape == (x.size // 256, 210)
    assert got.nbytes == manifest[name]["q6_K_bytes"]
    bad = np.flatnonzero((got != want.reshape(got.shape)).any(axis=1))
    assert bad.size == 0, f"{bad.size} blocks differ, first {bad[:5]}"
    assert hashlib.sha256(got.tobytes()).hexdigest() == manifest[name]["q6_K_sha256"]


@pytest.mark.parametrize("name", Q8_CASES)
def test_q8_1_is_byte_identical_to_ggml(ggml_dir, manifest, name):
    x = np.load(ggml_dir / f"{name}.f32.npy")
    got = quantize_q8_1(x)
    want = np.frombuffer((ggml_dir / f"{name}.q8_1.bin").read_bytes(), np.uint8)
    assert got.shape == (x.size // 32, 36)
    np.testing.assert_array_equal(got.reshape(-1), want)
    assert hashlib.sha256(got.tobytes()).hexdigest() == manifest[name]["q8_1_sha256"]


def test_nearest_int_is_ggml_magic_rounding():
    v = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 2.5000002, -31.5, 31.5, 4194303],
                 np.float32)
    np.testing.assert_array_equal(nearest_int(v), [0, 2, 2, 0, -2, -2, 0, 3, -32, 32, 4194303])


def test_roundf_rounds_half_away_from_zero():
    v = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, -0.49999997, 126.5, 3.0], np.float32)
    np.testing.assert_array_equal(roundf(v), [1, 2, 3, -1, -3, 0, 0, 127, 3])


def test_zero_and_tiny_blocks_are_all_zero_bytes():
    x = np.zeros((2, 512), np.float32)
    x[1, 256:] = 1e-30  # every group below GROUP_MAX_EPS: ggml memsets the block
    x[1, :256] = np.linspace(-1, 1, 256)
    q = quantize_q6_k(x)
    assert not q[[0, 1, 3]].any()
    assert q[2].any()


def test_q6_k_accepts_f16_and_bf16_exactly_as_their_f32_values():
    rng = np.random.default_rng(3)
    for dt in (np.float16, ml_dtypes.bfloat16):
        x = rng.standard_normal((3, 512)).astype(dt)
        np.testing.assert_array_equal(quantize_q6_k(x), quantize_q6_k(x.astype(np.float32)))


@pytest.mark.parametrize("shape,match", [((2, 1000), "K=1000"), ((1, 128), "K=128"),
                                         ((256,), "2-D"), ((0, 0), "K=0")])
def test_q6_k_rejects_bad_shapes(shape, match):
    with pytest.raises(FormatError, match=match):
        quantize_q6_k(np.zeros(shape, np.float32))


def test_quantizers_reject_bad_dtypes_and_non_finite_values():
    with pytest.raises(FormatError, match="int64"):
        quantize_q6_k(np.zeros((1, 256), np.int64))
    x = np.zeros((1, 256), np.float32)
    x[0, 7] = np.nan
    with pytest.raises(FormatError, match="1 non-finite"):
        quantize_q6_k(x)
    with pytest.raises(FormatError, match="K=48"):
        quantize_q8_1(np.zeros((1, 48), np.float32))
    with pytest.raises(FormatError, match="36-byte"):
        q8_1_fields(np.zeros(37, np.uint8))


@st.composite
def weight_rows(draw) -> np.ndarray:
    """Rows of 1-3 blocks in assorted shapes; each block's max |x| is drawn from [1, 1000]
    so the f16 ``d`` stays a normal number (the bound below assumes it)."""
    seed = draw(st.integers(0, 2**32 - 1))
    rows, nb = draw(st.integers(1, 6)), draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["normal", "heavy", "uniform", "spiky", "groups", "const"]))
    rng = np.random.default_rng(seed)
    shape = (rows * nb, 16, 16)  # [block, group, element]
    if kind == "normal":
        x = rng.standard_normal(shape)
    elif kind == "heavy":
        x = rng.standard_t(1.2, shape)
    elif kind == "uniform":
        x = rng.uniform(-1, 1, shape)
    elif kind == "spiky":
        x = rng.uniform(-0.1, 0.1, shape)
        x[:, :, 0] = rng.choice([-1, 1], shape[:2])
    elif kind == "groups":  # groups spanning 30 binary orders of magnitude, some all zero
        x = rng.standard_normal(shape) * np.exp2(rng.uniform(-30, 0, shape[:2]))[..., None]
        x[:, rng.integers(0, 16)] = 0
    else:
        x = np.full(shape, rng.choice([-1.0, 1.0]))
    amax = np.abs(x).reshape(shape[0], -1).max(axis=1)
    target = np.exp(rng.uniform(0, np.log(1000), shape[0]))
    x = x * (target / np.where(amax > 0, amax, 1))[:, None, None]
    return x.reshape(rows, nb * 256).astype(np.float32)


@settings(max_examples=80, deadline=None)
@given(x=weight_rows())
def test_q6_k_round_trip_error_is_bounded(x):
    """Sound bounds on |x - dequant(quant(x))| relative to the block's max |x| = A.

    For a 16-group with max |x| = a, make_qx_quants picks levels l for an inverse scale c in
    [31.1, 32.9]/a and returns the x^2-weighted least-squares scale, a weighted mean of the
    ratios x/l; the max element (weight a^2 l^2 >= 31.1^2 31^2 / c^2) has |a/l| <= 32.9/31/c
    and the only ratios above that belong to |l| = 1 elements of negligible weight, so
    |scale| <= 1.0614/c <= a/29.3 <= A/29.3. The block stores d = f16(max|scale|/128) (relative
    error 2**-11) and sc = round(128 scale/max_scale) (error <= 1 with the 127 clamp), so the
    final group scale D = d*sc is within 1.0625 * A/(29.3*128) of scale: |D| <= A/29.06.
    (1) An element the second pass does not clamp (|x| <= 31|D|) lands on its nearest level:
        error <= |D|/2 <= A/58.1; we allow A/57 for f32 rounding.
    (2) Any element: scale >= a/34.3 (the weighted error of the chosen candidate is at most
        that of c = 32/a, which bounds the max element's error), so a clamped element errs by
        at most a - 31|D| <= A (1 - 31/34.3 + 31*1.0625/3750) < A/9; a group whose sc
        rounds to 0 has a < A/200 and errs by at most a.
    """
    y = q6k.dequantize_aos(quantize_q6_k(x), *x.shape)
    err = np.abs(y - x).reshape(-1, 256)
    blk_max = np.abs(x).reshape(-1, 256).max(axis=1, keepdims=True)
    assert (err <= blk_max / 9).all(), float((err / blk_max).max())

    f = q6k.aos_fields(quantize_q6_k(x))
    dg = np.repeat(np.abs(q6k.group_scales(f["scales"], f["d"])), 16, axis=1)
    inner = np.abs(x.reshape(-1, 256)) <= 31 * dg
    ratio = np.where(inner, err / blk_max, 0)
    assert (ratio <= 1 / 57).all(), float(ratio.max())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 4), nb=st.integers(1, 8),
       scale=st.floats(1e-3, 1e3))
def test_q8_1_fields_are_consistent(seed, n, nb, scale):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, 32 * nb)) * scale).astype(np.float32)
    x[:, :32] = 0  # an all-zero block: d = 0, qs = 0
    d, s, qs = q8_1_fields(quantize_q8_1(x))
    xb = x.reshape(-1, 32)
    amax = np.abs(xb).max(axis=1)
    np.testing.assert_array_equal(d, (amax / np.float32(127)).astype(np.float16))
    assert qs.dtype == np.int8 and np.abs(qs.astype(int)).max() <= 127
    # |x - d*q| <= d/2 up to the f16 rounding of d, times |q| <= 127: half an ulp, i.e.
    # relative 2**-11 for normal d, absolute 2**-25 once d is subnormal (< 2**-14).
    err = np.abs(xb.astype(np.float64) - d[:, None].astype(np.float64) * qs)
    d64 = d[:, None].astype(np.float64)
    d_round = np.maximum(d64 * 2.0**-11, 2.0**-25)
    assert (err <= (d64 * 0.5 + 127 * d_round) * (1 + 2.0**-10)).all()
    want_s = (qs.sum(axis=1).astype(np.float32) * (amax / np.float32(127))).astype(np.float16)
    np.testing.assert_array_equal(s, want_s)
    assert not qs[::nb].any() and not d[::nb].any()
