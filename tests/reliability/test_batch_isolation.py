"""One caller can never fail another's request in a shared batch (issue 18, item 2).

Two layers: non-finite activations are not errors in any precision (q8_1 included: such rows
run exact, see kernels.api.matmul_ieee), and whatever input a kernel still refuses, the
batcher retries the batch request by request, so the refusal reaches only its own caller.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from q6serve.client.client import Q6ServeError
from q6serve.kernels import reference as ref
from q6serve.kernels.api import Layout, Precision, iter_aos_chunks, matmul_ieee
from q6serve.kernels.errors import FormatError
from q6serve.kernels.numpy_backend import NumpyBackend
from q6serve.service.config import Budget, WorkerConfig
from tests.reliability.faulty import FaultyBackend
from tests.reliability.harness import RunningWorker, health, random_q6k, vram_figures
from tests.service.svc_util import assert_close, backend_name, make_backend

ROWS, K = 64, 512
POISON = 12345.0  # an activation value the refusing backend below will not take
Q8_RTOL = 1e-5 if backend_name() == "numpy" else 1e-3


class RefusingBackend(FaultyBackend):
    """Refuses (InvalidArgument) any launch whose activations hold POISON, as a kernel
    refuses an input it cannot take; slow enough that concurrent callers share batches."""

    def __init__(self) -> None:
        super().__init__(matmul_delay_s=0.02)
        self.mixed_launches = 0  # launches that held POISON and other requests' rows

    def matmul(self, w: Any, x: np.ndarray, **kw: Any) -> Any:
        poisoned = np.asarray(x, np.float32)[:, 0] == POISON
        if poisoned.any():
            if not poisoned.all():
                self.mixed_launches += 1
            self.launches.append(int(x.shape[0]))
            raise FormatError(f"activation value {POISON} refused")
        return super().matmul(w, x, **kw)


@pytest.fixture
def start() -> Iterator[Callable[..., RunningWorker]]:
    started: list[RunningWorker] = []

    def go(backend: Any = None) -> RunningWorker:
        rw = RunningWorker(WorkerConfig(port=0, vram_budget=Budget(nbytes=64 << 20),
                                        max_batch_delay_us=5000), backend or make_backend())
        started.append(rw)
        return rw

    yield go
    for rw in started:
        rw.stop()


def hammer(rw: RunningWorker, n_callers: int, calls: int,
           request: Callable[[int], tuple[np.ndarray, str]],
           check: Callable[[int, np.ndarray | Q6ServeError], None]) -> None:
    """``n_callers`` threads (one channel each) making ``calls`` calls; caller i sends
    ``request(i) = (x, precision)`` and hands the outcome to ``check(i, outcome)``."""
    errors: list[BaseException] = []

    def caller(i: int) -> None:
        c = rw.client()
        x, precision = request(i)
        try:
            for _ in range(calls):
                try:
                    out: np.ndarray | Q6ServeError = c.matmul("w", x, precision=precision)
                except Q6ServeError as e:
                    out = e
                check(i, out)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(n_callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nan_callers_at_q8_1_do_not_fail_clean_ones(start, rng):
    """The issue's attack: NaN/Inf activations at q8_1 among clean q8_1 callers. Clean
    callers get q8_1 results, the others IEEE rows; nobody gets an error."""
    rw = start()
    c = rw.client()
    blocks = random_q6k(ROWS, K, 5)
    c.upload("w", blocks, ROWS, K)
    before = vram_figures(c)
    clean = rng.standard_normal((2, K)).astype(np.float32)
    want = ref.matmul_q8_1(clean, blocks, ROWS)
    bad = rng.standard_normal((2, K)).astype(np.float32)
    bad[0, 3], bad[1, 4] = np.nan, np.inf
    outcomes = {"clean": 0, "bad": 0}

    def request(i: int) -> tuple[np.ndarray, str]:
        return (bad if i % 3 == 0 else clean), "q8_1"

    def check(i: int, out: np.ndarray | Q6ServeError) -> None:
        assert not isinstance(out, Q6ServeError), f"caller {i}: {out}"
        if i % 3 == 0:
            assert np.isnan(out[0]).all() and not np.isfinite(out[1]).any()
            outcomes["bad"] += 1
        else:
            # the NumPy backend runs the q8_1 reference; a GPU's int8 kernel sums in
            # another order
            np.testing.assert_allclose(out, want, rtol=Q8_RTOL, atol=Q8_RTOL)
            outcomes["clean"] += 1

    hammer(rw, 12, 8, request, check)
    assert outcomes == {"clean": 64, "bad": 32}
    assert vram_figures(c) == before and health(rw.target) == "SERVING"


def test_a_refused_request_fails_only_its_caller(start, rng):
    """A kernel refusing one request's input in a shared batch: the batch is rerun request
    by request, the clean callers get exact results, only the poisoned ones the error."""
    backend = RefusingBackend()
    rw = start(backend)
    c = rw.client()
    blocks = random_q6k(ROWS, K, 6)
    c.upload("w", blocks, ROWS, K)
    clean = rng.standard_normal((3, K)).astype(np.float32)
    want = ref.matmul_float64(clean, blocks, ROWS)
    poisoned = clean.copy()
    poisoned[1, 0] = POISON
    counts = {"ok": 0, "refused": 0}

    def request(i: int) -> tuple[np.ndarray, str]:
        return (poisoned if i % 4 == 0 else clean), "exact"

    def check(i: int, out: np.ndarray | Q6ServeError) -> None:
        if i % 4 == 0:
            assert isinstance(out, Q6ServeError), f"caller {i} got a result"
            assert out.code is grpc.StatusCode.INVALID_ARGUMENT
            assert f"activation value {POISON} refused" in out.message
            counts["refused"] += 1
        else:
            assert not isinstance(out, Q6ServeError), f"clean caller {i} failed: {out}"
            assert_close(out, want, 1e-5)
            counts["ok"] += 1

    hammer(rw, 8, 6, request, check)
    assert counts == {"ok": 36, "refused": 12}
    assert backend.mixed_launches > 0  # poisoned and clean requests really shared batches
    assert health(rw.target) == "SERVING"


class SharedStagingBackend(NumpyBackend):
    """A NumPy backend whose staging buffer is shared between calls and overwritten by each
    call's upload, as the CUDA backend's pinned upload buffer is."""

    def __init__(self) -> None:
        super().__init__()
        self.buf = np.zeros(1 << 16, np.uint8)

    def staging(self, n: int, k: int, dtype: np.dtype) -> np.ndarray:
        return self.buf[: n * k * np.dtype(dtype).itemsize].view(dtype).reshape(n, k)

    def matmul(self, w: Any, x: np.ndarray, **kw: Any) -> Any:
        self.staging(*x.shape, x.dtype)[...] = x  # the upload: copies x in (or onto itself)
        return super().matmul(w, x.copy(), **kw)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_q8_1_rows_split_out_of_a_staged_batch_are_not_overwritten(rng) -> None:
    """matmul_ieee's q8_1 split runs two calls on parts of a batch concatenated into the
    backend's staging buffer; the first call's upload must not change the second's rows."""
    be = SharedStagingBackend()
    blocks = random_q6k(ROWS, K, 7)
    w = be.load(iter_aos_chunks(blocks, ROWS, K, 1 << 20), ROWS, K, Layout.SOA, 1 << 20)
    x = be.staging(4, K, np.dtype(np.float32))
    x[...] = rng.standard_normal((4, K)).astype(np.float32)
    x[1, 5] = np.nan
    want_clean = ref.matmul_q8_1(x[[0, 2, 3]].copy(), blocks, ROWS)
    out = matmul_ieee(be, w, x, precision=Precision.Q8_1).y
    assert np.isnan(out[1]).all()
    np.testing.assert_allclose(out[[0, 2, 3]], want_clean, rtol=Q8_RTOL, atol=Q8_RTOL)
