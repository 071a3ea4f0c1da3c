"""Big requests are read a few at a time; slow senders cannot hold the reading (issue 18:
health within 100 ms while many big requests arrive at once).

gRPC's Python layer copies a request into the worker in one step of the event loop (~1 ms per
MiB), so many big requests arriving together queued health checks behind all their copies.
A host that sent a request of BIG_REQUEST_BYTES or more has its unary requests read through
the read gate (``--max-reading-rpcs``); one not arrived ``--read-timeout`` s after its read
began while others wait is cancelled. Other hosts' reads are not gated: a client that only
sends slowly holds no slot. Here every client is 127.0.0.1, so a first big request marks it.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from q6serve.client.client import matmul_request
from q6serve.service.config import Budget, WorkerConfig
from q6serve.service.interceptor import BIG_REQUEST_BYTES
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc
from tests.reliability.harness import RunningWorker, health, random_q6k, vram_figures
from tests.reliability.stalling import StallingProxy, stop_all
from tests.service.svc_util import wait_until

K = 2048
BIG = matmul_request("w", np.ones((BIG_REQUEST_BYTES // (4 * K) + 8, K), np.float32))



@pytest.fixture
def worker():
    rw = RunningWorker(WorkerConfig(port=0, vram_budget=Budget(nbytes=32 << 20),
                                    max_reading_rpcs=1, read_timeout_s=0.5))
    rw.client().upload("w", random_q6k(8, K, 1), 8, K)
    yield rw
    rw.stop()


def slow_big_call(rw: RunningWorker) -> tuple[StallingProxy, grpc.Channel, grpc.Future]:
    """A big Matmul whose client stops sending after its first 64 KiB."""
    proxy = StallingProxy(rw.target, pass_bytes=64 << 10, upstream=True)
    ch = grpc.insecure_channel(proxy.target)
    return proxy, ch, pb_grpc.Q6ServeStub(ch).Matmul.future(BIG, timeout=60)


def test_a_slow_sender_of_a_big_host_is_cancelled_while_others_wait(worker):
    reads = worker.worker.reads
    c = worker.client()
    before = vram_figures(c)
    with grpc.insecure_channel(worker.target) as ch:
        stub = pb_grpc.Q6ServeStub(ch)
        assert tuple(stub.Matmul(BIG, timeout=30).y.shape) == (BIG.x.shape[0], 8)  # marks
        proxy, pch, slow = slow_big_call(worker)
        try:
            wait_until(lambda: worker.run(lambda: reads.running) == 1)  # the slow one reads
            # the next big request waits for the gate, then the slow one is cancelled
            assert tuple(stub.Matmul(BIG, timeout=30).y.shape) == (BIG.x.shape[0], 8)
            assert worker.run(lambda: reads.dropped) == 1  # (its client, stalled behind
            # the proxy, may not hear of it before its deadline: the worker is done with it)
        finally:
            stop_all([slow], [pch, proxy])
    gate = worker.worker.admission
    wait_until(lambda: worker.run(lambda: (reads.running, reads.waiting, reads.watched,
                                         gate.running, gate.waiting)) == (0, 0, 0, 0, 0))
    assert vram_figures(c) == before
    assert health(worker.target) == "SERVING"


def test_slow_senders_of_other_hosts_hold_no_slot(worker):
    """No big request came from this host yet: a slow sender is not gated, and others'
    requests (small and big) are read beside it."""
    reads = worker.worker.reads
    proxy, pch, slow = slow_big_call(worker)
    try:
        time.sleep(0.3)  # its first bytes are in
        assert worker.run(lambda: (reads.running, reads.watched)) == (0, 0)
        c = worker.client()
        assert c.matmul("w", np.ones((2, K), np.float32)).shape == (2, 8)
        with grpc.insecure_channel(worker.target) as ch:
            assert pb_grpc.Q6ServeStub(ch).Matmul(BIG, timeout=30).y.shape[0] == BIG.x.shape[0]
        assert worker.run(lambda: reads.dropped) == 0 and not slow.done()
    finally:
        stop_all([slow], [pch, proxy])


def test_a_big_read_keeps_its_place_for_a_gap(worker, monkeypatch):
    """After a big request of a gated host is read, its place stays taken for
    GAP_S_PER_MIB per MiB, so the next big copy does not follow at once (health checks find
    the loop free between copies); small requests of other hosts are not held by it."""
    from q6serve.service import interceptor

    monkeypatch.setattr(interceptor, "GAP_S_PER_MIB", 0.5)  # ~0.5 s for BIG: observable
    reads = worker.worker.reads
    with grpc.insecure_channel(worker.target) as ch:
        stub = pb_grpc.Q6ServeStub(ch)
        stub.Matmul(BIG, timeout=30)  # marks the host (not gated yet: no gap)
        assert worker.run(lambda: reads.running) == 0
        stub.Matmul(BIG, timeout=30)  # gated: the gap follows its read
        t0 = time.monotonic()
        assert worker.run(lambda: reads.running) == 1
        # a small request of this host waits for the gap; the reply comes after it
        stub.Matmul(matmul_request("w", np.ones((1, K), np.float32)), timeout=30)
        assert time.monotonic() - t0 > 0.2
    wait_until(lambda: worker.run(lambda: reads.running) == 0, timeout=5)


def test_the_defaults_bound_one_copy():
    """One request (--max-request-bytes) and one big read at a time (--max-reading-rpcs):
    what a big-request host can cost the loop in one step and in a row (see RELIABILITY.md,
    "Big requests": 32 MiB copies took 60-110 ms on the loaded CI VM)."""
    cfg = WorkerConfig()
    assert cfg.receive_limit == 16 << 20
    assert cfg.max_reading_rpcs == 1


def test_small_callers_go_first_through_the_read_gate():
    """A connection whose last request was small waits for the read in progress, not for
    every big-request connection queued before it (Admission.first)."""
    import asyncio

    from q6serve.service.admission import Admission

    async def run() -> list[str]:
        gate = Admission(limit=1, per_key=1)
        gate.first = lambda key: key.startswith("small")
        order: list[str] = []

        async def one(key: str) -> None:
            await gate.enter(key)
            order.append(key)
            await asyncio.sleep(0.01)
            gate.leave(key)

        await gate.enter("big0")  # a big read in progress
        tasks = [asyncio.create_task(one(k)) for k in ("big1", "big2", "big3", "small")]
        await asyncio.sleep(0.01)
        gate.leave("big0")
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(run())[0] == "small"
