"""Unload racing matmuls, flags toggled under load, drain on shutdown."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from svc_util import (
    InstrumentedBackend,
    RunningWorker,
    assert_close,
    backend_name,
    random_q6k,
    reference,
    verified_callers,
    wait_until,
)

from q6serve.client.client import Client, Q6ServeError

ROWS, K = 32, 512


def test_unload_racing_matmuls(worker: RunningWorker) -> None:
    c = worker.client()
    blocks = random_q6k(ROWS, K, 1)
    c.upload("w", blocks, ROWS, K)
    base_weights = 0
    callers = verified_callers(worker.target, blocks, ROWS, K, {grpc.StatusCode.NOT_FOUND},
                               timeout=20, precision="exact")
    try:
        for _ in range(40):
            time.sleep(0.005)
            c.unload("w")
            c.upload("w", blocks, ROWS, K)
    finally:
        callers.join()
    assert not callers.errors, callers.errors[:3]
    assert sum(callers.ok) > 0
    c.unload("w")
    v = c.status().vram
    assert v.weights_bytes == base_weights and v.scratch_bytes == 0 and v.staging_bytes == 0
    if backend_name() == "numpy":
        assert worker.engine.backend.memory().pool_used == 0


def test_unload_waits_for_in_flight_requests(start_worker) -> None:  # type: ignore[no-untyped-def]
    backend = InstrumentedBackend(matmul_delay=0.3)
    worker = start_worker(backend=backend)
    c = worker.client()
    blocks = random_q6k(ROWS, K, 2)
    c.upload("w", blocks, ROWS, K)
    x = np.ones((2, K), np.float32)
    result: list[np.ndarray] = []
    t = threading.Thread(target=lambda: result.append(c.matmul("w", x)))
    t.start()
    wait_until(lambda: backend.launches == [2], what="the request to run")
    c.unload("w")  # returns once the running request let go and the memory is freed
    t.join(10)
    assert_close(result[0], reference(blocks, ROWS, K, x))
    assert c.status().vram.weights_bytes == 0


def test_flags_toggled_under_load(worker: RunningWorker) -> None:
    c = worker.client()
    blocks = random_q6k(ROWS, K, 3)
    c.upload("w", blocks, ROWS, K)
    callers = verified_callers(worker.target, blocks, ROWS, K, set(), timeout=20,
                               precision="exact")
    try:
        for i in range(12):
            c.flags({"Q6SERVE_Q6K_SOA": i % 2 == 1,
                     "Q6SERVE_DYNAMIC_BATCHING": i % 3 != 0,
                     "Q6SERVE_DECODE_MMQ": i % 4 != 0})
            time.sleep(0.03)
        c.flags({"Q6SERVE_Q6K_SOA": False, "Q6SERVE_DYNAMIC_BATCHING": True})
        deadline = time.monotonic() + 10
        while c.get("w").layout != "aos" or c.status().relayout_in_progress:
            assert time.monotonic() < deadline, "relayout did not finish"
            time.sleep(0.02)
    finally:
        callers.join()
    assert not callers.errors, callers.errors[:3]
    assert all(n > 0 for n in callers.ok), callers.ok
    out = c.matmul_full("w", np.ones((1, K), np.float32))
    assert out.layout == "aos"
    assert c.get("w").nbytes == c.status().vram.weights_bytes


def test_env_flags_at_start(start_worker) -> None:  # type: ignore[no-untyped-def]
    from q6serve.service.flags import FlagState

    worker = start_worker(flags=FlagState.from_env({"Q6SERVE_Q6K_SOA": "0",
                                                    "Q6SERVE_DYNAMIC_BATCHING": "0"}))
    c = worker.client()
    assert c.flags() == {"Q6SERVE_Q6K_SOA": False, "Q6SERVE_DECODE_MMQ": True,
                         "Q6SERVE_DYNAMIC_BATCHING": False}
    assert c.upload("w", random_q6k(8, 256, 4), 8, 256).layout == "aos"


def test_drain_on_shutdown(start_worker) -> None:  # type: ignore[no-untyped-def]
    backend = InstrumentedBackend(matmul_delay=0.4)
    worker = start_worker(backend=backend, max_batch_delay_us=0, max_batch_rows=1)
    c = worker.client()
    blocks = random_q6k(ROWS, K, 5)
    c.upload("w", blocks, ROWS, K)
    xs = [np.full((1, K), i, np.float32) for i in range(3)]
    results: dict[int, object] = {}

    def call(i: int) -> None:
        with Client(worker.target) as cl:
            try:
                results[i] = cl.matmul("w", xs[i], timeout=20)
            except Q6ServeError as e:
                results[i] = e

    ts = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    wait_until(lambda: worker.run(lambda: worker.engine.get("w").in_flight) == 3,
               what="3 requests in flight")
    stopper = threading.Thread(target=worker.stop, kwargs={"grace": 10.0})
    stopper.start()
    wait_until(lambda: not worker.run(lambda: worker.engine.serving), what="draining")
    # draining: health is no longer SERVING and new work is refused
    with Client(worker.target) as late:
        with pytest.raises(Q6ServeError) as e:
            late.matmul("w", xs[0], timeout=5)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        try:
            assert not late.health(timeout=2)
        except Q6ServeError as he:
            assert he.code == grpc.StatusCode.UNAVAILABLE
    for t in ts:
        t.join(20)
    stopper.join(20)
    for i in range(3):  # every in-flight request finished correctly
        assert isinstance(results[i], np.ndarray), results[i]
        assert_close(results[i], reference(blocks, ROWS, K, xs[i]))


@pytest.mark.parametrize("precision", ["auto", "f16"])
def test_device_error_turns_health_not_serving(start_worker, precision, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Also on the direct path's job for a precision that never resolves to q8_1 (f16: the
    engine calls the backend's launch itself, not through launch_ieee)."""
    from q6serve.kernels.errors import DeviceError
    from q6serve.service import batcher

    # NumPy's kernel here may take longer than DEFER_KERNEL_S (a job never run directly)
    monkeypatch.setattr(batcher, "DEFER_KERNEL_S", 1.0)

    backend = InstrumentedBackend()
    worker = start_worker(backend=backend)
    c = worker.client()
    c.upload("w", random_q6k(8, 256, 6), 8, 256)
    assert c.health()
    if precision != "auto":  # like calls first: the failing one runs on the direct path
        for _ in range(3):
            c.matmul("w", np.ones((1, 256), np.float32), precision=precision)
        direct = worker.run(lambda: worker.engine.device.direct_jobs)
        assert direct >= 1

    def broken(*a: object, **kw: object) -> None:
        raise DeviceError("injected: illegal memory access")

    backend.inner.matmul = broken
    with pytest.raises(Q6ServeError) as e:
        c.matmul("w", np.ones((1, 256), np.float32), precision=precision)
    if precision != "auto":
        assert worker.run(lambda: worker.engine.device.direct_jobs) == direct + 1
    assert e.value.code == grpc.StatusCode.INTERNAL
    deadline = time.monotonic() + 5
    while c.health():
        assert time.monotonic() < deadline, "health stayed SERVING after a device error"
        time.sleep(0.02)
    assert not c.health("q6serve.v1.Q6Serve")
    assert c.status().serving is False
    with pytest.raises(Q6ServeError) as e:  # no new work on a failed device
        c.matmul("w", np.ones((1, 256), np.float32))
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "device failed" in e.value.message
    assert [w.name for w in c.list()] == ["w"]  # read-only RPCs still answer
