"""Uploads refuse what Q6_K cannot represent (issue 18, item 3).

ggml's quantizer, and ours byte for byte, stores a block's scale as an f16 ``d`` of about
``max|x| / 4096``: beyond ~2.7e8 it overflows to Inf (every caller then gets NaN for that
output row), and beyond ~1e12 the scale search overflows and the block is silently written as
zeros. ``quantize.check_q6_k_representable`` refuses both, naming the row, column and value;
every f32/f16 upload and ``q6serve quantize`` go through it.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from q6serve.client.client import Q6ServeError
from q6serve.kernels import q6k
from q6serve.kernels.errors import FormatError
from q6serve.kernels.quantize import check_q6_k_representable, quantize_q6_k
from q6serve.service.config import Budget, WorkerConfig
from tests.reliability.harness import RunningWorker, health, vram_figures

K = 512


def rows_with(value: float, rng: np.random.Generator, row: int = 1, col: int = 300,
              ) -> np.ndarray:
    x = rng.standard_normal((3, K)).astype(np.float32)
    x[row, col] = value
    return x


# One value from each regime: d overflows (2.7e8 .. ~1e12), the scale search overflows
# (~1e12 .. f32 max), and both signs.
@pytest.mark.parametrize("value", [2.7e8, -3e8, 1e10, 1e17, -1e18, 1e30, 3.4e38])
def test_unrepresentable_values_are_refused_with_row_column_and_value(value, rng):
    x = rows_with(value, rng)
    with pytest.raises(FormatError) as e:
        quantize_q6_k(x, "upload 'w'")
    msg = str(e.value)
    assert msg.startswith("upload 'w': ")
    assert "row 1, column 300" in msg
    assert f"{value:.6g}" in msg


@pytest.mark.parametrize("value", [2.6e8, -2.6e8, 1e5, 1.0, 1e-3, 1e-20])
def test_representable_values_quantize_and_round_trip(value, rng):
    x = rows_with(value, rng)
    blocks = quantize_q6_k(x)
    w = q6k.dequantize_aos(blocks, 3, K)
    assert np.isfinite(w).all()
    # the large value survives within Q6_K's relative error (a 6-bit level of its block)
    if abs(value) >= 1:
        assert abs(w[1, 300] - value) <= abs(value) / 16


def test_the_check_catches_blocks_from_elsewhere():
    """Given the input and blocks made by any quantizer (e.g. a client's), the same rule."""
    x = np.ones((2, 256), np.float32)
    blocks = quantize_q6_k(x)
    check_q6_k_representable(x, blocks)
    inf_d = blocks.copy()
    inf_d[1, 208:210] = np.array([np.inf], np.float16).view(np.uint8)
    with pytest.raises(FormatError, match=r"row 1, column 0 .*d=inf"):
        check_q6_k_representable(x, inf_d)
    zeroed = blocks.copy()
    zeroed[0] = 0
    with pytest.raises(FormatError, match=r"row 0, column 0 .*all zeros"):
        check_q6_k_representable(x, zeroed)


def test_bf16_input_above_the_f16_range_is_refused():
    import ml_dtypes

    x = np.zeros((1, 256), ml_dtypes.bfloat16)
    x[0, 5] = 1e20
    with pytest.raises(FormatError, match="row 0, column 5"):
        quantize_q6_k(x)


def test_nan_is_named_by_row_and_column():
    x = np.ones((4, 256), np.float16)
    x[2, 9] = np.inf
    with pytest.raises(FormatError, match=r"1 non-finite values \(first at row 2, column 9"):
        quantize_q6_k(x)


@pytest.fixture(scope="module")
def worker():
    rw = RunningWorker(WorkerConfig(port=0, vram_budget=Budget(nbytes=64 << 20)))
    yield rw
    rw.stop()


@pytest.mark.parametrize("value", [1e10, 1e20])
def test_upload_of_unrepresentable_f32_is_invalid_argument(worker, value, rng):
    c = worker.client()
    before = vram_figures(c)
    x = rows_with(value, rng)
    with pytest.raises(Q6ServeError) as e:
        c.upload("big", x, 3, K, fmt="f32")
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "upload 'big'" in e.value.message and "row 1, column 300" in e.value.message
    assert vram_figures(c) == before
    assert health(worker.target) == "SERVING"
    assert "big" not in [w.name for w in c.list()]
