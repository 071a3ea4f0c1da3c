"""Streams that are opened and never used hold a bounded place (issue 18: a client that opens
streams and never sends).

A stream costs the worker ~25-35 KiB (gRPC's call, the handler's task, its queue) whether or
not its client ever sends, and HTTP/2 lets one connection open 65,536 of them: 20,000 idle
MatmulStreams held 490 MiB. Now at most ``MAX_STREAMS_PER_CONNECTION`` per connection and
``MAX_STREAMS`` in the worker are open (service/admission.py, StreamSlots); a connection
below its fair share takes the place of the longest-idle stream of the connection holding
the most. Limits made small here (--max-streams, --max-streams-per-connection).
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from q6serve.client.client import matmul_request
from q6serve.service.config import Budget, WorkerConfig
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc
from tests.reliability.harness import RunningWorker, health, random_q6k
from tests.reliability.stalling import stop_all
from tests.service.svc_util import wait_until

K, ROWS = 256, 64


@pytest.fixture
def worker():
    rw = RunningWorker(WorkerConfig(port=0, vram_budget=Budget(nbytes=16 << 20),
                                    max_streams=8, max_streams_per_connection=4))
    rw.client().upload("w", random_q6k(ROWS, K, 1), ROWS, K)
    slots = rw.worker._interceptor.streams
    assert (slots.total, slots.per_key) == (8, 4)  # --max-streams[-per-connection]
    yield rw, slots
    rw.stop()


def test_idle_streams_are_capped_and_give_way_to_other_connections(worker):
    rw, slots = worker
    stop = threading.Event()

    def nothing():
        stop.wait()
        return
        yield

    opts = [("grpc.use_local_subchannel_pool", 1)]
    chans = [grpc.insecure_channel(rw.target, options=opts) for _ in range(3)]
    calls = []
    try:
        # the first connection: 4 open, the 2 more refused at once
        calls += [pb_grpc.Q6ServeStub(chans[0]).MatmulStream(nothing(), timeout=8)
                  for _ in range(6)]
        wait_until(lambda: rw.run(lambda: (slots.open_streams, slots.refused)) == (4, 2),
                   what="4 open, 2 refused")
        # the refusals reach their callers a moment after the worker counted them
        wait_until(lambda: sum(c.done() for c in calls) == 2, what="2 calls refused")
        refused = [c for c in calls if c.done()]
        assert len(refused) == 2
        assert all(c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for c in refused)
        # the second fills the worker
        calls += [pb_grpc.Q6ServeStub(chans[1]).MatmulStream(nothing(), timeout=8)
                  for _ in range(4)]
        wait_until(lambda: rw.run(lambda: slots.open_streams) == 8, what="8 open")
        time.sleep(1.2)  # every one of them idle for IDLE_S
        # a third connection below its share: an idle stream of the biggest holder goes
        x = np.ones((2, K), np.float32)
        outs = list(pb_grpc.Q6ServeStub(chans[2]).MatmulStream(
            iter([matmul_request("w", x, request_id="a")]), timeout=20))
        assert [o.request_id for o in outs] == ["a"]
        assert rw.run(lambda: slots.evicted) >= 1
    finally:
        stop.set()
        stop_all(calls, chans)
    wait_until(lambda: rw.run(lambda: (slots.open_streams, slots.lingering)) == (0, {}),
               timeout=20, what="every place back")
    assert health(rw.target) == "SERVING"
