"""A worker on its own event-loop thread (port 0, loopback), plus the invariants every
reliability test checks afterwards: still SERVING, VRAM accounting unchanged."""

from __future__ import annotations

from typing import Any

import grpc

from q6serve.client.client import Client
from q6serve.kernels.api import Backend
from q6serve.kernels.backends import make_backend
from q6serve.service.config import WorkerConfig
from tests.service.svc_util import RunningWorker as ServiceRunningWorker
from tests.service.svc_util import random_q6k as random_q6k  # re-exported
from tests.service.svc_util import reference as reference  # re-exported


class RunningWorker(ServiceRunningWorker):
    """The service tests' in-process worker, on the NumPy backend unless one is given (the
    fault tests pass a wrapping backend)."""

    def __init__(self, config: WorkerConfig, backend: Backend | None = None) -> None:
        super().__init__(config, backend or make_backend("numpy"))


def vram_figures(c: Client) -> dict[str, int]:
    """The accounting figures that must not move. Device free/total and the allocator pool
    are left out: on CUDA the pool keeps the reused launch workspace (grown to the largest
    call, by design) and CuPy's cached blocks, which no attack can make grow past the
    accounted scratch."""
    v = c.status().vram
    return {"weights": v.weights_bytes, "scratch": v.scratch_bytes,
            "staging": v.staging_bytes, "reserved": v.reserved_bytes}


def health(target: str, service: str = "", **channel_kw: Any) -> str:
    """The grpc.health.v1 status name of ``target`` ("SERVING", "NOT_SERVING", ...)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
