"""gRFC A17 client-side health checking: a plain grpcio channel with round_robin and a
healthCheckConfig routes to workers whose Health/Watch says SERVING and stops routing to one
that drains (NOT_SERVING), while it still accepts calls. Before Watch worked through the
interceptor (it failed with INTERNAL) such a channel routed to no worker at all.

grpcio needs nothing but the service config for this: client-side health checking is on
unless the channel option grpc.inhibit_health_checking is set."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import grpc
import pytest

from q6serve.service.config import Budget, WorkerConfig
from q6serve.v1 import q6serve_pb2 as pb
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc
from tests.service.svc_util import RunningWorker

Q6 = "q6serve.v1.Q6Serve"
ROUND_ROBIN = {"loadBalancingConfig": [{"round_robin": {}}]}
HEALTH_CHECKED = {**ROUND_ROBIN, "healthCheckConfig": {"serviceName": Q6}}


@pytest.fixture
def workers() -> Iterator[list[RunningWorker]]:
    ws = [RunningWorker(WorkerConfig(host="127.0.0.1", port=0,
                                     vram_budget=Budget(nbytes=16 << 20), grace_period_s=1.0))
          for _ in range(2)]
    yield ws
    for w in ws:
        w.stop(grace=0.5)


def _served(w: RunningWorker) -> float:
    return w.registry.get_sample_value(
        "q6serve_requests_total", {"service": Q6, "method": "GetStatus", "code": "OK"}) or 0.0


def _channel(workers: list[RunningWorker], config: dict) -> grpc.Channel:
    target = "ipv4:" + ",".join(w.target for w in workers)
    return grpc.insecure_channel(target, options=[("grpc.service_config", json.dumps(config))])


def _calls(stub: pb_grpc.Q6ServeStub, n: int) -> None:
    for _ in range(n):
        stub.GetStatus(pb.GetStatusRequest(), timeout=10, wait_for_ready=True)


def _skips(stub: pb_grpc.Q6ServeStub, w: RunningWorker) -> bool:
    """Six calls in a row, none on ``w`` (round_robin would alternate if it were in)."""
    before = _served(w)
    _calls(stub, 6)
    return _served(w) == before


def _route_until(stub: pb_grpc.Q6ServeStub, cond: object, what: str) -> None:
    deadline = time.monotonic() + 10  # health updates reach the channel asynchronously
    while not cond() and time.monotonic() < deadline:  # type: ignore[operator]
        _calls(stub, 2)
    assert cond(), what  # type: ignore[operator]


def test_round_robin_with_health_checking_follows_drain(workers: list[RunningWorker]) -> None:
    a, b = workers
    with _channel(workers, HEALTH_CHECKED) as checked, _channel(workers, ROUND_ROBIN) as plain:
        stub, plain_stub = pb_grpc.Q6ServeStub(checked), pb_grpc.Q6ServeStub(plain)
        _route_until(stub, lambda: _served(a) and _served(b), "round_robin reaches both")
        _route_until(plain_stub, lambda: _served(a) >= 2 and _served(b) >= 2, "plain too")

        # First step of a drain (what SIGTERM does before the grace period): health says
        # NOT_SERVING while the server still takes calls, so only health checking moves traffic.
        a.call(a.worker._health.enter_graceful_shutdown())
        _route_until(stub, lambda: _skips(stub, a), "the health-checked channel leaves a")
        before = _served(a), _served(b)
        _calls(stub, 20)
        assert _served(a) == before[0], "the health-checked channel still routes to a"
        assert _served(b) == before[1] + 20

        # Control: without healthCheckConfig the same channel keeps sending to a.
        before_plain = _served(a)
        _calls(plain_stub, 20)
        assert _served(a) > before_plain

        # The full drain (server stopping): every call still succeeds, on b.
        a.stop(grace=0.5)
        before_b = _served(b)
        _calls(stub, 10)
        assert _served(b) == before_b + 10
