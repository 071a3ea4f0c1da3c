"""Reference matmuls (kernels/reference.py) against float64, the documented Q8_1 formula
and each other."""

from __future__ import annotations

import numpy as np
import pytest

from q6serve.kernels import q6k, reference
from q6serve.kernels.api import BFLOAT16
from q6serve.kernels.errors import FormatError
from q6serve.kernels.quantize import q8_1_fields, quantize_q6_k, quantize_q8_1

# Relative Frobenius error against matmul_float64 (the contract in docs and backends).
TOL = {"exact": 1e-6, "f16": 2e-3, "q8_1": 2e-2}
FUNCS = {"exact": reference.matmul_exact, "f16": reference.matmul_f16,
         "q8_1": reference.matmul_q8_1}


def rel_fro(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(y.astype(np.float64) - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def weight() -> tuple[np.ndarray, int, int]:
    rows, k = 96, 1024
    w = np.random.default_rng(11).standard_t(4, (rows, k)).astype(np.float32)
    return quantize_q6_k(w), rows, k


@pytest.mark.parametrize("prec", list(FUNCS))
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("n", [1, 7, 64])
def test_precisions_agree_with_float64(weight, prec, dtype, n):
    blocks, rows, k = weight
    dt = {"f32": np.float32, "f16": np.float16, "bf16": BFLOAT16}[dtype]
    x = np.random.default_rng(n).standard_normal((n, k)).astype(dt)
    ref = reference.matmul_float64(x, blocks, rows)
    y = FUNCS[prec](x, blocks, rows)
    assert y.dtype == np.float32 and y.shape == (n, rows)
    assert rel_fro(y, ref) <= TOL[prec]
    if prec != "exact":  # the looser paths really are lossier (the test can tell them apart)
        assert rel_fro(y, ref) > TOL["exact"] or (prec == "f16" and dtype != "f32")


def test_f16_path_is_exact_path_on_f16_activations(weight):
    blocks, rows, k = weight
    x = np.random.default_rng(0).standard_normal((5, k)).astype(np.float16)
    np.testing.assert_array_equal(reference.matmul_f16(x, blocks, rows),
                                  reference.matmul_exact(x, blocks, rows))


def test_float64_is_the_plain_product(weight):
    blocks, rows, k = weight
    x = np.random.default_rng(1).standard_normal((3, k)).astype(np.float32)
    w = q6k.dequantize_aos(blocks, rows, k).astype(np.float64)
    np.testing.assert_allclose(reference.matmul_float64(x, blocks, rows),
                               x.astype(np.float64) @ w.T, rtol=1e-12, atol=1e-12)


def q8_1_by_the_docstring(x: np.ndarray, blocks: np.ndarray, rows: int, pairs) -> list:
    """The module docstring's formula, one output at a time with scalar f32 operations."""
    n, k = x.shape
    dx, _, qx = q8_1_fields(quantize_q8_1(x))
    dx, qx = dx.reshape(n, k // 32), qx.reshape(n, k).astype(np.int64)
    f = q6k.aos_fields(blocks)
    q = q6k.unpack_q(f["ql"], f["qh"]).astype(np.int64) - 32
    f32 = np.float32
    out = []
    for nn, r in pairs:
        acc = f32(0)
        for g in range(k // 16):
            blk, i0 = r * (k // 256) + g // 16, (g % 16) * 16
            isum = int(q[blk, i0 : i0 + 16] @ qx[nn, 16 * g : 16 * g + 16])
            dsc = f32(f["d"][blk]) * f32(f["scales"][blk, g % 16])
            acc = f32(acc + f32(f32(dx[nn, g // 2] * dsc) * f32(isum)))
        out.append(acc)
    return out


def test_q8_1_follows_the_documented_formula_bit_for_bit(weight):
    blocks, rows, k = weight
    x = (np.random.default_rng(2).standard_normal((4, k)) * 3).astype(np.float32)
    y = reference.matmul_q8_1(x, blocks, rows, chunk_rows=5)
    pairs = [(0, 0), (3, rows - 1), (1, 37), (2, 5)]
    want = q8_1_by_the_docstring(x, blocks, rows, pairs)
    assert [y[p] for p in pairs] == want


def test_q8_1_summation_order_moves_y_by_far_less_than_the_gate(weight):
    """A GPU adds the same f32 terms in another order: check the documented 1e-6 gate has room,
    using the float64 sum of the f32 terms as the extreme reordering."""
    blocks, rows, k = weight
    x = np.random.default_rng(4).standard_normal((8, k)).astype(np.float32)
    n = x.shape[0]
    dx, _, qx = q8_1_fields(quantize_q8_1(x))
    f = q6k.aos_fields(blocks)
    wq = (q6k.unpack_q(f["ql"], f["qh"]).astype(np.int64) - 32).reshape(rows, k // 16, 16)
    isum = np.einsum("rgi,ngi->nrg", wq, qx.reshape(n, k // 16, 16).astype(np.int64))
    dsc = q6k.group_scales(f["scales"], f["d"]).reshape(rows, k // 16)
    dxg = np.repeat(dx.reshape(n, k // 32), 2, axis=1)
    terms = (dxg[:, None, :] * dsc[None]) * isum.astype(np.float32)  # f32, as documented
    y64 = terms.astype(np.float64).sum(axis=2)
    assert rel_fro(reference.matmul_q8_1(x, blocks, rows), y64) < 1e-6 / 4


@pytest.mark.parametrize("prec", [*FUNCS, "float64"])
def test_weight_forms_and_chunking_agree(weight, prec):
    blocks, rows, k = weight
    fn = FUNCS.get(prec, reference.matmul_float64)
    x = np.random.default_rng(5).standard_normal((3, k)).astype(np.float32)
    y = fn(x, blocks, rows)
    soa = q6k.aos_to_soa(blocks)
    forms = [blocks.tobytes(), blocks.reshape(-1), q6k.aos_fields(blocks),
             q6k.soa_fields(soa, blocks.shape[0])]
    if prec == "q8_1":  # integer dots + a fixed sum order: bit for bit whatever the form
        same = np.testing.assert_array_equal
    else:  # BLAS may pick another kernel per shape or alignment
        def same(a, b):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(y).max()))
    for form in forms:
        same(fn(x, form, rows), y)
        same(fn(x, form), y)  # rows inferred
    same(fn(x, blocks, rows, chunk_rows=7), y)


def test_multi_block_rows_map_blocks_row_major():
    rng = np.random.default_rng(6)
    w = rng.standard_normal((5, 768)).astype(np.float32)
    blocks = quantize_q6_k(w)
    x = rng.standard_normal((2, 768)).astype(np.float32)
    wd = q6k.dequantize_aos(blocks, 5, 768)
    np.testing.assert_allclose(reference.matmul_exact(x, blocks, 5), x @ wd.T, rtol=1e-5,
                               atol=1e-5)


def test_bad_inputs_raise_format_errors(weight):
    blocks, rows, k = weight
    x = np.zeros((2, k), np.float32)
    with pytest.raises(FormatError, match="K=1000"):
        reference.matmul_exact(np.zeros((2, 1000), np.float32), blocks, rows)
    with pytest.raises(FormatError, match=str(blocks.nbytes)):
        reference.matmul_exact(x, blocks, rows + 1)  # wrong byte count for rows+1
    with pytest.raises(FormatError):
        reference.matmul_q8_1(x, blocks.reshape(-1)[:-210], rows)
    with pytest.raises(FormatError, match="2-D"):
        reference.matmul_exact(np.zeros(k, np.float32), blocks, rows)
    with pytest.raises(FormatError, match="int32"):
        reference.matmul_f16(np.zeros((2, k), np.int32), blocks, rows)
    fields = q6k.aos_fields(blocks)
    fields["scales"] = fields["scales"][:, :8]
    with pytest.raises(FormatError, match="scales"):
        reference.matmul_exact(x, fields, rows)
