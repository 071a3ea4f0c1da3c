"""The Q6_K format core (kernels/q6k.py): ggml's dequantization, gguf-py parity, SoA planes."""

from __future__ import annotations

import itertools

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from q6serve.kernels import q6k
from q6serve.kernels.errors import FormatError

Q6_CASES = ["normal_64x1024", "student_t_outliers_32x2048", "mixed_rows_16x512",
            "real_shape_strip_8x3584"]


def bits(a: np.ndarray) -> np.ndarray:
    """float32 bit patterns, so -0.0 != 0.0 and the comparison is truly bit for bit."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("name", Q6_CASES)
def test_dequantize_matches_ggml(ggml_dir, manifest, name):
    rows, k = manifest[name]["shape"]
    raw = (ggml_dir / f"{name}.q6_K.bin").read_bytes()
    want = np.load(ggml_dir / f"{name}.dequant.f32.npy")
    got = q6k.dequantize_aos(raw, rows, k)
    assert got.shape == want.shape == (rows, k)
    np.testing.assert_array_equal(bits(got), bits(want))
    soa = q6k.aos_to_soa(q6k.as_blocks(raw, rows, k))
    np.testing.assert_array_equal(bits(q6k.dequantize_soa(soa, rows, k)), bits(want))


@pytest.mark.parametrize("n", [1, 7, 300])
def test_dequantize_matches_gguf_py(n, random_blocks):
    blocks = random_blocks(np.random.default_rng(n), n)
    want = gguf_dequantize(blocks, gguf.GGMLQuantizationType.Q6_K).reshape(n, 256)
    np.testing.assert_array_equal(bits(q6k.dequantize_aos(blocks, n, 256)), bits(want))
    soa = q6k.aos_to_soa(blocks)
    np.testing.assert_array_equal(bits(q6k.dequantize_soa(soa, n, 256)), bits(want))
    # Same weights seen as rows of 2 blocks: row-major blocks, so only the shape changes.
    if n % 2 == 0:
        two = q6k.dequantize_soa(soa, n // 2, 512)
        np.testing.assert_array_equal(bits(two), bits(want.reshape(n // 2, 512)))


def test_unpack_q_follows_ggml_bit_layout(random_blocks):
    # Element l + 32*s of each half takes ql nibble (s & 2 -> high) of ql[l + 32*(s & 1)]
    # and bits 2s..2s+1 of qh[l].
    blocks = random_blocks(np.random.default_rng(5), 3)
    f = q6k.aos_fields(blocks)
    q = q6k.unpack_q(f["ql"], f["qh"])
    for b in range(3):
        for e in range(256):
            half, n = divmod(e, 128)
            s, lane = divmod(n, 32)
            ql = int(f["ql"][b, 64 * half + lane + 32 * (s & 1)])
            nib = (ql >> 4) if s & 2 else (ql & 0xF)
            hi = (int(f["qh"][b, 32 * half + lane]) >> (2 * s)) & 3
            assert q[b, e] == nib | (hi << 4), (b, e)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 97), seed=st.integers(0, 2**32 - 1))
def test_aos_soa_round_trip(random_blocks, n, seed):
    blocks = random_blocks(np.random.default_rng(seed), n)
    soa = q6k.aos_to_soa(blocks)
    np.testing.assert_array_equal(q6k.soa_to_aos(soa, n), blocks)
    fa, fs = q6k.aos_fields(blocks), q6k.soa_fields(soa, n)
    for name in fa:
        np.testing.assert_array_equal(fa[name], fs[name])


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 5000))
def test_soa_layout_is_aligned_and_as_small_as_aos(n):
    layout = q6k.SoaLayout.for_blocks(n)
    pad = layout.nbytes - n * q6k.BLOCK_BYTES
    assert 0 <= pad < q6k.PLANE_ALIGN
    end = 0
    for name, _, width in q6k.FIELDS:  # planes in table order, aligned, not overlapping
        off = layout.offsets[name]
        assert off % q6k.PLANE_ALIGN == 0
        assert end <= off < end + q6k.PLANE_ALIGN
        end = off + n * width
    assert end <= layout.nbytes < end + q6k.PLANE_ALIGN


def test_fields_table_covers_the_block():
    spans = sorted((off, off + width) for _, off, width in q6k.FIELDS)
    assert spans[0][0] == 0 and spans[-1][1] == q6k.BLOCK_BYTES
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


@pytest.mark.parametrize("k", [0, -256, 100, 1000, 255])
def test_bad_k_is_rejected_with_the_number(k):
    with pytest.raises(FormatError, match=f"K={k}"):
        q6k.check_k(k)


def test_wrong_byte_counts_are_rejected(random_blocks):
    blocks = random_blocks(np.random.default_rng(0), 4)
    with pytest.raises(FormatError, match="840"):  # 2 rows x 2 blocks x 210
        q6k.as_blocks(blocks.reshape(-1)[:-1], 2, 512)
    with pytest.raises(FormatError, match="1260"):  # 3 rows x 2 blocks asked, 840 given
        q6k.dequantize_aos(blocks, 3, 512)
    soa = q6k.aos_to_soa(blocks)
    with pytest.raises(FormatError, match=str(soa.size)):
        q6k.soa_fields(soa, 5)


def test_random_blocks_are_valid_and_seeded():
    """The synthetic-weight generator (demo, benches, service tests): shape, finite positive
    f16 scales in the asked range, the same bytes for the same seed."""
    a = q6k.random_blocks(3, 512, np.random.default_rng(7), 1e-4, 4e-4)
    assert a.shape == (6, q6k.BLOCK_BYTES) and a.dtype == np.uint8
    d = q6k.aos_fields(a)["d"].view(np.float16).astype(np.float64).ravel()
    assert np.all((d >= 1e-4 * 0.999) & (d <= 4e-4 * 1.001))
    assert np.array_equal(a, q6k.random_blocks(3, 512, np.random.default_rng(7), 1e-4, 4e-4))
    assert np.isfinite(q6k.dequantize_aos(a, 3, 512)).all()
