"""Clients that stop reading cannot starve the others (issue 18: admission places).

A unary call keeps its admission place until its reply is written, and a client that does
not read never lets it be written. While other calls wait for a place, a reply not taken
within ``--reply-timeout`` is dropped (the call ends CANCELLED) and its place goes on
(service/admission.py); nobody's reply is dropped while nobody waits. Here four connections
that never read (tests/reliability/stalling.py) ask for 2 MiB replies through a gate of 4
places; a clean caller is still answered, and everything comes back afterwards.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from q6serve.client.client import matmul_request
from q6serve.service.config import Budget, WorkerConfig
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc
from tests.reliability.harness import RunningWorker, health, random_q6k, vram_figures
from tests.reliability.stalling import StallingProxy, stop_all
from tests.service.svc_util import wait_until

K, ROWS = 256, 8192  # N = 64 replies are 2 MiB: far more than the sockets buffer



@pytest.fixture
def worker():
    rw = RunningWorker(WorkerConfig(
        port=0, vram_budget=Budget(nbytes=32 << 20), max_inflight_rpcs=4,
        max_inflight_rpcs_per_connection=4, min_inflight_rpcs_per_connection=1,
        reply_timeout_s=0.5))
    rw.client().upload("w", random_q6k(ROWS, K, 1), ROWS, K)
    yield rw
    rw.stop()


def test_connections_that_never_read_cannot_hold_every_place(worker):
    gate = worker.worker.admission
    c = worker.client()
    before = vram_figures(c)
    proxies = [StallingProxy(worker.target) for _ in range(4)]
    chans = [grpc.insecure_channel(p.target, options=[("grpc.use_local_subchannel_pool", 1)])
             for p in proxies]
    big = matmul_request("w", np.ones((64, K), np.float32))
    futs = [pb_grpc.Q6ServeStub(ch).Matmul.future(big, timeout=60)
            for ch in chans for _ in range(3)]
    try:
        # every place is held by a computed reply nobody takes, the others wait
        wait_until(lambda: worker.run(lambda: gate.watched == gate.limit and gate.waiting),
                   timeout=30)
        x = np.ones((1, K), np.float32)
        y = c.matmul("w", x, timeout=20)  # waits at most about reply_timeout for a place
        assert y.shape == (1, ROWS)
        assert worker.run(lambda: gate.dropped) >= 1
    finally:
        stop_all(futs, [*chans, *proxies])
    wait_until(lambda: worker.run(lambda: (gate.running, gate.waiting, gate.watched,
                                         gate.active)) == (0, 0, 0, 0))
    assert vram_figures(c) == before
    assert health(worker.target) == "SERVING"


def test_nothing_is_dropped_while_nobody_waits(worker):
    """A client that stops reading keeps what it holds while no one else needs a place."""
    gate = worker.worker.admission
    proxy = StallingProxy(worker.target)
    ch = grpc.insecure_channel(proxy.target)
    big = matmul_request("w", np.ones((64, K), np.float32))
    futs = [pb_grpc.Q6ServeStub(ch).Matmul.future(big, timeout=60) for _ in range(4)]
    try:  # the first replies fill the sockets' buffers, the others stay unwritten
        # every call has its reply computed: written (gone) or stuck (watched)
        wait_until(lambda: worker.run(lambda: gate.watched >= 2 and gate.running == gate.watched
                                      and not gate.waiting), timeout=30)
        stuck = worker.run(lambda: gate.watched)
        time.sleep(4 * gate.timeout)
        assert worker.run(lambda: (gate.watched, gate.waiting, gate.dropped)) == (stuck, 0, 0)
    finally:
        stop_all(futs, [ch, proxy])
    wait_until(lambda: worker.run(lambda: (gate.running, gate.watched)) == (0, 0))
