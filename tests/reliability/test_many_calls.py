"""Thousands of concurrent calls on one connection wait, they never fail (issue 18, item 6).

The worker advertises a high HTTP/2 stream limit (a burst opened before the client has seen
the limit was refused: REFUSED_STREAM) and lets gRPC hold many unmatched calls; it queues
unary calls in its admission gate before reading their requests (service/admission.py).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from q6serve.client.client import matmul_request
from q6serve.service.config import Budget, WorkerConfig
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc
from tests.reliability.faulty import FaultyBackend
from tests.reliability.harness import RunningWorker, health, random_q6k
from tests.service.svc_util import wait_until

ROWS, K = 64, 256
INFLIGHT = 8



@pytest.fixture
def worker() -> Iterator[RunningWorker]:
    rw = RunningWorker(WorkerConfig(port=0, vram_budget=Budget(nbytes=64 << 20),
                                    max_inflight_rpcs=INFLIGHT),
                       FaultyBackend(matmul_delay_s=0.001))
    rw.client().upload("w", random_q6k(ROWS, K, 1), ROWS, K)
    yield rw
    rw.stop()


def test_a_burst_of_calls_on_one_connection_all_succeed(worker):
    gate = worker.worker.admission
    most = [0]
    stop = threading.Event()

    def watch() -> None:  # the gate's figure, read from the loop's thread
        while not stop.is_set():
            most[0] = max(most[0], worker.run(lambda: gate.running))

    watcher = threading.Thread(target=watch)
    watcher.start()
    x = np.ones((1, K), np.float32)
    req = matmul_request("w", x, "auto", "f32")
    try:
        with grpc.insecure_channel(worker.target) as ch:
            stub = pb_grpc.Q6ServeStub(ch)
            futs = [stub.Matmul.future(req, timeout=120) for _ in range(1500)]
            codes = collections.Counter()
            for f in futs:
                try:
                    f.result()
                    codes["OK"] += 1
                except grpc.RpcError as e:
                    codes[f"{e.code().name}: {e.details()}"] += 1
    finally:
        stop.set()
        watcher.join()
    assert codes == {"OK": 1500}
    assert 1 <= most[0] <= INFLIGHT  # the rest waited in the gate, before being read
    assert worker.run(lambda: (gate.running, gate.waiting)) == (0, 0)
    assert health(worker.target) == "SERVING"


def test_calls_abandoned_while_waiting_give_their_places_back(worker):
    x = np.ones((1, K), np.float32)
    req = matmul_request("w", x, "auto", "f32")
    gate = worker.worker.admission
    with grpc.insecure_channel(worker.target) as ch:
        stub = pb_grpc.Q6ServeStub(ch)
        futs = [stub.Matmul.future(req, timeout=0.05) for _ in range(300)]
        for f in futs:
            try:
                f.result()
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for f in [stub.Matmul.future(req, timeout=10) for _ in range(20)]:
            f.cancel()
    wait_until(lambda: worker.run(lambda: (gate.running, gate.waiting)) == (0, 0),
               what="the gate to empty")
    assert worker.client().matmul("w", x).shape == (1, ROWS)
