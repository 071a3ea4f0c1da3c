"""The tolerance of a data-plane test's y against ``svc_util.reference`` (float64 on exactly
dequantized weights), by the backend under test (``Q6SERVE_TEST_BACKEND``): so that the same
NumPy-first tests also cover the CUDA backend's region, lane and front-end paths on a GPU run
(``Q6SERVE_TEST_BACKEND=cuda pytest tests/dataplane``), which their NumPy tolerance failed."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.service.svc_util import auto_rtol, backend_name


def assert_ref(y: Any, want: Any, atol: float = 1e-4) -> None:
    """``y`` equals the reference ``want``: on NumPy within f32 rounding (``rtol`` 1e-5, the
    given ``atol``); on a GPU within what its AUTO precision may differ by (the f16 tiles or
    x quantized to q8_1: ~1e-2 of an element, ``auto_rtol``), plus 2% of ``want``'s largest
    value for elements near zero (q8_1's error of a sum is about |y|'s scale over sqrt(K), not
    relative to the element), which still tells a y of the wrong rows, offset or call (off by
    about |y| itself) from a right one."""
    want = np.asarray(want)
    if backend_name() == "numpy":
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=atol)
        return
    scale = float(np.abs(want).max()) if want.size else 0.0
    np.testing.assert_allclose(y, want, rtol=auto_rtol(), atol=max(atol, 2e-2 * scale))
