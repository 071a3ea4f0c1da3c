"""Clients that stop reading cannot starve the others (issue 18: admission places).

A unary call keeps its admission place until its reply is written, and a client that does
not read never lets it be written. While other calls wait for a place, a reply not taken
within ``--reply-timeout`` is dropped (the call ends CANCELLED) and its place goes on
(service/admission.py); nobody's reply is dropped while nobody waits. Here four connections
that never read (tests/reliability/stalling.py) ask for 2 MiB replies through a gate of 4
places; a clean caller is still answered, and everything comes back afterwards.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from q6serve.client.channel import channel_options
from q6serve.client.client import matmul_request
from q6serve.service.config import Budget, WorkerConfig
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc
from tests.reliability.harness import RunningWorker, health, random_q6k, vram_figures
from tests.reliability.stalling import StallingProxy, stop_all
from tests.service.svc_util import wait_until

K, ROWS = 256, 8192  # N = 64 replies are 2 MiB: far more than the sockets buffer
ATTACK_S = 8.0  # the attackers' deadline



def stalling_calls(target: str, per: int) -> tuple[list, list, list]:
    """(proxies, channels, calls): 4 connections that never read, ``per`` calls each for
    2 MiB replies, with the attackers' deadline."""
    proxies = [StallingProxy(target) for _ in range(4)]
    chans = [grpc.insecure_channel(p.target, options=[("grpc.use_local_subchannel_pool", 1)])
             for p in proxies]
    big = matmul_request("w", np.ones((64, K), np.float32))
    # their deadline bounds how long gRPC keeps a dropped call (and its place lingers)
    futs = [pb_grpc.Q6ServeStub(ch).Matmul.future(big, timeout=ATTACK_S)
            for ch in chans for _ in range(per)]
    return proxies, chans, futs


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
    proxies, chans, futs = stalling_calls(worker.target, 3)
    try:
        # every place is held by a computed reply nobody takes, the others wait
        wait_until(lambda: worker.run(lambda: gate.watched == gate.limit and gate.waiting),
                   timeout=30)
        x = np.ones((1, K), np.float32)
        y = c.matmul("w", x, timeout=20)  # waits at most about reply_timeout for a place
        assert y.shape == (1, ROWS)
        assert worker.run(lambda: gate.dropped) >= 1
        # a dropped call's place stays its connection's while gRPC keeps the call
        assert worker.run(lambda: sum(gate.lingering.values())) >= 1
    finally:
        stop_all(futs, [*chans, *proxies])
    wait_until(lambda: worker.run(lambda: (gate.running, gate.waiting, gate.watched,
                                         gate.active, gate.lingering)) == (0, 0, 0, 0, {}),
               timeout=ATTACK_S + 10)
    assert vram_figures(c) == before
    assert health(worker.target) == "SERVING"


def unbufferable_rows() -> int:
    """Rows of a weight whose N=64 f32 reply (256 B a row) is at least twice the most a TCP
    socket may buffer for sending here (tcp_wmem's max, which loopback autotuning reaches; the
    stalling proxy's side takes 4 KiB more), and at least 16 MiB: a reply that cannot be
    written while its client does not read."""
    try:
        wmem = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, ValueError, IndexError):
        wmem = 4 << 20  # Linux's default
    return max(65536, -(-2 * wmem // 256))


def test_nothing_is_dropped_while_nobody_waits():
    """A client that stops reading keeps what it holds while no one else needs a place.

    Its four calls all fit the gate (nobody ever waits) and ask for replies larger than the
    sockets between the worker and the client can buffer (:func:`unbufferable_rows`), so none
    can be written (with 2 MiB replies one in four was, on a 4 MiB tcp_wmem): once
    the four are computed, four places are watched (replies not taken) and stay so, undropped,
    for four reply timeouts. (Watched also counts a request being read; the wait is for the
    four replies computed -- q6serve_requests_total -- not for a number of watched places,
    which read 2 while the requests were read, 0 while computed, then 3.)"""
    rows = unbufferable_rows()
    worker = RunningWorker(WorkerConfig(  # the fixture's, with room for the wide weight
        port=0, vram_budget=Budget(nbytes=rows * 1536 + (32 << 20)), max_inflight_rpcs=4,
        max_inflight_rpcs_per_connection=4, min_inflight_rpcs_per_connection=1,
        reply_timeout_s=0.5))
    gate = worker.worker.admission
    worker.client().upload("wide", random_q6k(rows, K, 2), rows, K)
    proxy = StallingProxy(worker.target)
    # (a client's default 4 MiB receive limit would refuse the reply on its first bytes)
    ch = grpc.insecure_channel(proxy.target, options=channel_options())
    big = matmul_request("wide", np.ones((64, K), np.float32))
    futs = [pb_grpc.Q6ServeStub(ch).Matmul.future(big, timeout=60) for _ in range(4)]

    def computed() -> float:  # replies returned by the handler (then watched until written)
        return worker.registry.get_sample_value("q6serve_requests_total", {
            "service": "q6serve.v1.Q6Serve", "method": "Matmul", "code": "OK"}) or 0.0

    try:
        wait_until(lambda: worker.run(computed) == 4, timeout=30, what="the 4 replies")
        assert worker.run(lambda: (gate.running, gate.watched, gate.waiting)) == (4, 4, 0)
        time.sleep(4 * gate.timeout)
        assert worker.run(lambda: (gate.running, gate.watched, gate.waiting,
                                   gate.dropped)) == (4, 4, 0, 0)
        assert not any(f.done() for f in futs)  # none answered, none cancelled
    finally:
        stop_all(futs, [ch, proxy])
    wait_until(lambda: worker.run(lambda: (gate.running, gate.watched)) == (0, 0))
    worker.stop()


def test_a_clean_caller_waits_for_a_stall_not_for_the_reply_timeout():
    """Four connections that never read hold the four places of the gate. A clean caller on
    another connection gets its place once the oldest stuck reply has waited
    ``admission.STALL_S`` with nothing written on its connection -- not the reply timeout
    (10 s here; before, each of these calls waited that long) -- and the dropped calls'
    places stay their connections' (they stall only themselves) until their deadline."""
    rw = RunningWorker(WorkerConfig(
        port=0, vram_budget=Budget(nbytes=32 << 20), max_inflight_rpcs=4,
        max_inflight_rpcs_per_connection=4, min_inflight_rpcs_per_connection=1,
        reply_timeout_s=10.0))
    gate = rw.worker.admission
    c = rw.client()
    c.upload("w", random_q6k(ROWS, K, 1), ROWS, K)
    before = vram_figures(c)
    proxies, chans, futs = stalling_calls(rw.target, 3)
    took = []
    try:  # (they may have taken places from each other already)
        wait_until(lambda: rw.run(lambda: gate.watched == gate.limit or gate.dropped),
                   timeout=30, what="the non-readers to hold every place")
        x = np.ones((1, K), np.float32)
        for _ in range(6):
            t0 = time.perf_counter()
            assert c.matmul("w", x, timeout=20).shape == (1, ROWS)
            took.append(time.perf_counter() - t0)
    finally:
        stop_all(futs, [*chans, *proxies])
    # bounded for a loaded 2-core CI machine: far below the 10 s reply timeout
    assert max(took) < 4.0, [round(t, 3) for t in took]
    assert sorted(took)[len(took) // 2] < 2.0, [round(t, 3) for t in took]
    wait_until(lambda: rw.run(lambda: (gate.running, gate.waiting, gate.watched, gate.active,
                                       gate.lingering)) == (0, 0, 0, 0, {}),
               timeout=ATTACK_S + 10, what="the gate to empty")
    assert vram_figures(c) == before
    assert health(rw.target) == "SERVING"
    rw.stop()


def test_calls_that_never_send_their_request_cannot_hold_every_place(worker):
    """Four connections open two Matmul calls each and never send the message: before, they
    held every place for as long as they liked (a clean caller timed out). A read not done
    ``admission.READ_STALL_S`` after it began, on a connection that completed nothing
    meanwhile, is dropped while a connection below its fair share waits."""
    gate = worker.worker.admission
    c = worker.client()
    stop = threading.Event()

    def nothing():
        stop.wait()
        return
        yield

    chans = [grpc.insecure_channel(worker.target, options=[("grpc.use_local_subchannel_pool", 1)])
             for _ in range(4)]
    futs = [ch.stream_unary("/q6serve.v1.Q6Serve/Matmul").future(nothing(), timeout=ATTACK_S)
            for ch in chans for _ in range(2)]
    try:
        wait_until(lambda: worker.run(lambda: gate.running) == gate.limit, timeout=20,
                   what="the silent calls to hold every place")
        t0 = time.perf_counter()
        assert c.matmul("w", np.ones((1, K), np.float32), timeout=20).shape == (1, ROWS)
        assert time.perf_counter() - t0 < 6.0  # READ_STALL_S (1 s) on a loaded machine
        assert worker.run(lambda: gate.dropped) >= 1
    finally:
        stop.set()
        stop_all(futs, chans)
    wait_until(lambda: worker.run(lambda: (gate.running, gate.waiting, gate.watched,
                                         gate.active)) == (0, 0, 0, 0), timeout=ATTACK_S + 10)
    assert health(worker.target) == "SERVING"
