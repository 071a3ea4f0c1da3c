"""Thousands of concurrent calls on one connection wait, they never fail (issue 18, item 6).

The worker advertises a high HTTP/2 stream limit (a burst opened before the client has seen
the limit was refused: REFUSED_STREAM) and lets gRPC hold many unmatched calls; it queues
unary calls in its admission gate before reading their requests (service/admission.py).
"""

from __future__ import annotations

import asyncio
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


def outcomes(futs: list[grpc.Future]) -> collections.Counter[str]:
    """How the calls ended: "OK" or "CODE: details", counted."""
    codes: collections.Counter[str] = collections.Counter()
    for f in futs:
        try:
            f.result()
            codes["OK"] += 1
        except grpc.RpcError as e:
            codes[f"{e.code().name}: {e.details()}"] += 1
    return codes


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
            codes = outcomes([stub.Matmul.future(req, timeout=120) for _ in range(1500)])
    finally:
        stop.set()
        watcher.join()
    assert codes == {"OK": 1500}
    assert 1 <= most[0] <= INFLIGHT  # the rest waited in the gate, before being read
    wait_until(lambda: worker.run(lambda: (gate.running, gate.waiting)) == (0, 0),
               what="every place given back")  # released as each handler ends, after its reply
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


# -- the gate itself ----------------------------------------------------------------------------
def test_one_connection_cannot_take_every_place():
    from q6serve.service.admission import Admission

    async def go() -> None:
        gate = Admission(limit=4, per_key=2)
        await gate.enter("a")
        await gate.enter("a")
        blocked = asyncio.ensure_future(gate.enter("a"))  # a's third waits for a's own places
        await asyncio.sleep(0)
        assert not blocked.done()
        await gate.enter("b")  # another connection still gets in
        await gate.enter("b")
        assert (gate.running, gate.waiting) == (4, 1)
        gate.leave("b")  # a place is free, but not for a (at its cap): nobody moves
        await asyncio.sleep(0)
        assert not blocked.done() and gate.running == 3
        gate.leave("a")  # now a may go
        await asyncio.wait_for(blocked, 1)
        assert (gate.running, gate.waiting) == (3, 0)

    asyncio.run(go())


def test_waiters_are_served_round_robin_and_cancelled_ones_skipped():
    from q6serve.service.admission import Admission

    async def go() -> None:
        gate = Admission(limit=1, per_key=1)
        await gate.enter("x")
        order: list[str] = []

        async def call(key: str) -> None:
            await gate.enter(key)
            order.append(key)
            gate.leave(key)

        tasks = [asyncio.ensure_future(call(k)) for k in ("a", "a", "b", "c", "b")]
        await asyncio.sleep(0)
        tasks[2].cancel()  # b's first call gives up while waiting
        await asyncio.sleep(0)
        gate.leave("x")
        await asyncio.gather(*tasks, return_exceptions=True)
        # a, then the other connections in arrival order (b with its second call: its first
        # was cancelled), then a again
        assert order == ["a", "b", "c", "a"]
        assert (gate.running, gate.waiting) == (0, 0)

    asyncio.run(go())


def test_a_new_connection_gets_its_fair_share_first():
    """Eight places, one connection holding them all (alone, its share is all of them): a
    second connection is first in line for every place the first frees until both hold four;
    then they alternate. A third shrinks both shares to the floor... of 8 // 3 = 2."""
    from q6serve.service.admission import Admission

    async def go() -> None:
        gate = Admission(limit=8, per_key=8, floor=1)
        for _ in range(8):
            await gate.enter("a")
        a_more = [asyncio.ensure_future(gate.enter("a")) for _ in range(8)]
        b = [asyncio.ensure_future(gate.enter("b")) for _ in range(8)]
        await asyncio.sleep(0)
        assert gate.share() == 4 and gate.running == 8
        for i in range(4):  # a frees places: b takes each until it holds its share
            gate.leave("a")
            await asyncio.sleep(0)
            assert sum(f.done() for f in b) == i + 1 and not any(f.done() for f in a_more)
        gate.leave("a")  # a holds 3 < 4: its turn
        await asyncio.sleep(0)
        assert sum(f.done() for f in a_more) == 1 and sum(f.done() for f in b) == 4
        c = asyncio.ensure_future(gate.enter("c"))
        await asyncio.sleep(0)
        assert gate.share() == 2 and not c.done()
        gate.leave("b")  # b holds 3, a 4: both above 2, c goes first
        await asyncio.sleep(0)
        assert c.done()
        for f in a_more + b:
            f.cancel()
        await asyncio.sleep(0)
        assert gate.waiting == 0

    asyncio.run(go())


def test_the_share_grows_back_when_connections_go():
    from q6serve.service.admission import Admission

    async def go() -> None:
        gate = Admission(limit=4, per_key=4, floor=1)
        await gate.enter("a")
        await gate.enter("b")
        assert gate.share() == 2
        a = [asyncio.ensure_future(gate.enter("a")) for _ in range(3)]
        await asyncio.sleep(0)
        assert sum(f.done() for f in a) == 1  # a at its share of 2; two places idle
        gate.leave("b")  # b gone: a alone, share 4, the idle places are a's
        await asyncio.sleep(0)
        assert all(f.done() for f in a) and gate.running == 4 and gate.active == 1
        for _ in range(4):
            gate.leave("a")
        assert (gate.running, gate.waiting, gate.active) == (0, 0, 0)

    asyncio.run(go())


def test_many_connections_share_the_gate_and_all_calls_succeed():
    """Eight connections, 60 calls each at once, eight places: every call succeeds, and no
    connection ever holds more than its share at the moment it takes a place."""
    from q6serve.service.admission import Admission

    rw = RunningWorker(WorkerConfig(port=0, vram_budget=Budget(nbytes=64 << 20),
                                    max_inflight_rpcs=8, max_inflight_rpcs_per_connection=8,
                                    min_inflight_rpcs_per_connection=1),
                       FaultyBackend(matmul_delay_s=0.002))
    try:
        rw.client().upload("w", random_q6k(ROWS, K, 1), ROWS, K)
        gate: Admission = rw.worker.admission
        over: list[tuple[str, int, int]] = []
        keys: set[str] = set()
        take = gate._take

        def checked(key: str) -> None:  # on the loop: the invariant at every admission
            take(key)
            keys.add(key)
            if gate._held[key] > gate.share():
                over.append((key, gate._held[key], gate.share()))

        gate._take = checked  # type: ignore[method-assign]
        req = matmul_request("w", np.ones((1, K), np.float32), "auto", "f32")
        # a subchannel pool each: else gRPC shares one connection between equal channels
        chans = [grpc.insecure_channel(rw.target,
                                       options=[("grpc.use_local_subchannel_pool", 1)])
                 for _ in range(8)]
        try:
            codes = outcomes([pb_grpc.Q6ServeStub(ch).Matmul.future(req, timeout=120)
                              for ch in chans for _ in range(60)])
        finally:
            for ch in chans:
                ch.close()
        assert codes == {"OK": 480}
        assert len(keys) == 8 and not over, over[:5]
        # a place is given back when the handler ends, which may come just after its reply
        # reached the caller (seen in CI: (3, 0, 1) right after the last reply)
        wait_until(lambda: rw.run(lambda: (gate.running, gate.waiting, gate.active))
                   == (0, 0, 0), what="every place given back")
    finally:
        rw.stop()
