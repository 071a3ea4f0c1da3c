"""The tolerance of a data-plane test's y against ``svc_util.reference`` (float64 on exactly
dequantized weights), by the backend under test (``Q6SERVE_TEST_BACKEND``): so that the same
NumPy-first tests also cover the CUDA backend's region, lane and front-end paths on a GPU run
(``Q6SERVE_TEST_BACKEND=cuda pytest tests/dataplane``), which their NumPy tolerance failed."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.service.svc_util import auto_rtol, backend_name


def assert_ref(y: Any, want: Any, atol: float = 1e-4, rtol: float = 1e-5) -> None:
    """``y`` equals the reference ``want``: on NumPy within f32 rounding (``rtol`` 1e-5, the
    given ``atol``); on a GPU within what its AUTO precision may differ by (the f16 tiles or
    x quantized to q8_1: ~1e-2 of an element, ``auto_rtol``), plus 2% of ``want``'s largest
    value for elements near zero (q8_1's error of a sum is about |y|'s scale over sqrt(K), not
    relative to the element), which still tells a y of the wrong rows, offset or call (off by
    about |y| itself) from a right one. ``rtol``: NumPy's (a y rounded to f16 or bf16 needs
    its own), and at least that on a GPU."""
    want = np.asarray(want)
    if backend_name() == "numpy":
        np.testing.assert_allclose(y, want, rtol=rtol, atol=atol)
        return
    scale = float(np.abs(want).max()) if want.size else 0.0
    np.testing.assert_allclose(y, want, rtol=max(rtol, auto_rtol()),
                               atol=max(atol, 2e-2 * scale))


def assert_topk(top: Any, want: Any, k: int) -> None:
    """A top-k reply (``values``, ``indices`` [N, k]) is the top ``k`` of the reference y
    ``want``: on NumPy the reference's indices and values exactly (f32 rounding); on a GPU,
    whose y differs within :func:`assert_ref`'s tolerance (so a near tie may swap two
    indices), k distinct indices per row, each value ``want`` at its index, and the values
    the reference's top k, both within that tolerance."""
    from q6serve.kernels.epilogue import topk_reference

    want = np.asarray(want)
    ref = topk_reference(want, k)
    if backend_name() == "numpy":
        np.testing.assert_array_equal(top.indices, ref.indices)
        np.testing.assert_allclose(top.values, ref.values, rtol=1e-6)
        return
    idx = np.asarray(top.indices).astype(np.int64)
    assert idx.shape == (want.shape[0], k) and all(len(set(r)) == k for r in idx.tolist())
    assert_ref(top.values, np.take_along_axis(want, idx, axis=1))
    assert_ref(top.values, ref.values)
