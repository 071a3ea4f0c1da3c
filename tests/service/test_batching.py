"""Dynamic batching: coalescing, splitting, queue bounds, deadlines and cancellation."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from svc_util import (
    InstrumentedBackend,
    RunningWorker,
    assert_close,
    random_q6k,
    reference,
    wait_until,
)

from q6serve.client.client import Client, Q6ServeError, matmul_request
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc

ROWS, K = 64, 512


def _concurrent(worker: RunningWorker, blocks: np.ndarray, callers: int, n_of=lambda i: 1):  # type: ignore[no-untyped-def]
    """``callers`` threads, released together, each one Matmul; returns (xs, outputs)."""
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((n_of(i), K)).astype(np.float32) for i in range(callers)]
    clients = [Client(worker.target) for _ in range(4)]
    gate = threading.Barrier(callers)

    def call(i: int):  # type: ignore[no-untyped-def]
        gate.wait(10)
        return clients[i % 4].matmul_full("w", xs[i])

    try:
        with ThreadPoolExecutor(callers) as pool:
            outs = list(pool.map(call, range(callers)))
    finally:
        for c in clients:
            c.close()
    return xs, outs


def test_64_concurrent_callers_coalesce_and_get_their_rows(start_worker) -> None:  # type: ignore[no-untyped-def]
    backend = InstrumentedBackend(matmul_delay=0.02)  # keep the device busy so rows pile up
    worker = start_worker(backend=backend)
    blocks = random_q6k(ROWS, K, 1)
    worker.client().upload("w", blocks, ROWS, K)
    xs, outs = _concurrent(worker, blocks, 64, n_of=lambda i: 1 + i % 3)
    assert max(o.batch_rows for o in outs) > 3, [o.batch_rows for o in outs]
    assert max(o.batch_requests for o in outs) > 1
    assert all(o.batch_rows <= 64 for o in outs)
    assert max(backend.launches) <= 64 and sum(backend.launches) == sum(x.shape[0] for x in xs)
    assert len(backend.launches) < 64
    for x, o in zip(xs, outs, strict=True):
        assert o.y.shape == (x.shape[0], ROWS)
        assert_close(o.y, reference(blocks, ROWS, K, x))


def test_dynamic_batching_off_runs_one_request_per_launch(start_worker) -> None:  # type: ignore[no-untyped-def]
    backend = InstrumentedBackend(matmul_delay=0.01)
    worker = start_worker(backend=backend)
    blocks = random_q6k(ROWS, K, 2)
    c = worker.client()
    c.upload("w", blocks, ROWS, K)
    c.flags({"Q6SERVE_DYNAMIC_BATCHING": False})
    xs, outs = _concurrent(worker, blocks, 16, n_of=lambda i: 2)
    assert all(o.batch_rows == 2 and o.batch_requests == 1 for o in outs)
    assert backend.launches == [2] * 16
    for x, o in zip(xs, outs, strict=True):
        assert_close(o.y, reference(blocks, ROWS, K, x))


def test_max_batch_rows_caps_launches(start_worker) -> None:  # type: ignore[no-untyped-def]
    backend = InstrumentedBackend(matmul_delay=0.02)
    worker = start_worker(backend=backend, max_batch_rows=8)
    blocks = random_q6k(ROWS, K, 3)
    worker.client().upload("w", blocks, ROWS, K)
    xs, outs = _concurrent(worker, blocks, 32, n_of=lambda i: 3)
    assert max(backend.launches) <= 8 and max(o.batch_rows for o in outs) == 6
    for x, o in zip(xs, outs, strict=True):
        assert_close(o.y, reference(blocks, ROWS, K, x))


def test_idle_device_adds_no_delay(start_worker) -> None:  # type: ignore[no-untyped-def]
    worker = start_worker(max_batch_delay_us=500_000)  # a huge delay must not be waited out
    c = worker.client()
    c.upload("w", random_q6k(ROWS, K, 4), ROWS, K)
    x = np.ones((1, K), np.float32)
    c.matmul("w", x)
    t0 = time.perf_counter()
    for _ in range(5):
        out = c.matmul_full("w", x)
        assert out.queue_seconds < 0.1
    assert time.perf_counter() - t0 < 1.0


def test_queue_full_is_resource_exhausted(start_worker) -> None:  # type: ignore[no-untyped-def]
    backend = InstrumentedBackend(matmul_delay=0.3)
    worker = start_worker(backend=backend, max_queue_rows=4, max_batch_delay_us=0)
    worker.client().upload("w", random_q6k(8, 256, 5), 8, 256)
    x = np.ones((2, 256), np.float32)
    codes: list[str] = []
    lock = threading.Lock()

    def call() -> None:
        with Client(worker.target) as c:
            try:
                c.matmul("w", x)
                code = "OK"
            except Q6ServeError as e:
                code = e.code.name
        with lock:
            codes.append(code)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert "RESOURCE_EXHAUSTED" in codes and "OK" in codes, codes
    assert worker.client().health()


def test_deadline_expires_while_queued(start_worker) -> None:  # type: ignore[no-untyped-def]
    backend = InstrumentedBackend(matmul_delay=0.5)
    worker = start_worker(backend=backend, max_batch_delay_us=0)
    c = worker.client()
    c.upload("w", random_q6k(8, 256, 6), 8, 256)
    first = threading.Thread(target=lambda: c.matmul("w", np.ones((1, 256), np.float32)))
    first.start()
    wait_until(lambda: backend.launches == [1], what="the first launch")  # device now busy
    with pytest.raises(Q6ServeError) as e:
        c.matmul("w", np.ones((5, 256), np.float32), timeout=0.15)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    first.join(10)
    backend.matmul_delay = 0
    c.matmul("w", np.ones((3, 256), np.float32))
    assert 5 not in backend.launches and 8 not in backend.launches, backend.launches


def test_cancelled_while_queued_never_runs(start_worker) -> None:  # type: ignore[no-untyped-def]
    backend = InstrumentedBackend(matmul_delay=0.5)
    worker = start_worker(backend=backend, max_batch_delay_us=0)
    c = worker.client()
    c.upload("w", random_q6k(8, 256, 7), 8, 256)
    stub = pb_grpc.Q6ServeStub(grpc.insecure_channel(worker.target))
    first = stub.Matmul.future(matmul_request("w", np.ones((1, 256), np.float32)), timeout=10)
    wait_until(lambda: backend.launches == [1], what="the first launch")
    doomed = stub.Matmul.future(matmul_request("w", np.ones((7, 256), np.float32)), timeout=10)
    wait_until(lambda: c.get("w").in_flight == 2, what="the second request queued")
    assert doomed.cancel()
    first.result()
    backend.matmul_delay = 0
    c.matmul("w", np.ones((2, 256), np.float32))
    assert 7 not in backend.launches and 9 not in backend.launches, backend.launches
    assert c.get("w").in_flight == 0


def test_stream_requests_coalesce(start_worker) -> None:  # type: ignore[no-untyped-def]
    backend = InstrumentedBackend(matmul_delay=0.02)
    worker = start_worker(backend=backend)
    blocks = random_q6k(ROWS, K, 8)
    c = worker.client()
    c.upload("w", blocks, ROWS, K)
    rng = np.random.default_rng(9)
    xs = {f"r{i}": rng.standard_normal((1, K)).astype(np.float32) for i in range(32)}
    outs = {o.request_id: o for o in c.matmul_stream((rid, "w", x) for rid, x in xs.items())}
    assert set(outs) == set(xs)
    assert max(o.batch_requests for o in outs.values()) > 1
    assert len(backend.launches) < 32
    for rid, x in xs.items():
        assert_close(outs[rid].y, reference(blocks, ROWS, K, x))
