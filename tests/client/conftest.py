"""Client fixtures: the service tests' in-process worker on port 0 (reused, not copied) and
``client``, parametrized over the sync Client and the AsyncClient behind one blocking facade,
so every call is tested once for both."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import pytest

_SERVICE_TESTS = Path(__file__).resolve().parents[1] / "service"
if str(_SERVICE_TESTS) not in sys.path:
    sys.path.insert(0, str(_SERVICE_TESTS))  # svc_util, importable as the service conftest does


def _service_conftest() -> Any:
    spec = importlib.util.spec_from_file_location("q6serve_tests_service_conftest",
                                                  _SERVICE_TESTS / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_svc = _service_conftest()
base_config = _svc.base_config
start_worker = _svc.start_worker
worker = _svc.worker


class AsyncFacade:
    """AsyncClient methods run to completion on a private loop (async iterators -> lists)."""

    def __init__(self, target: str, **kw: Any) -> None:
        from q6serve.client.async_client import AsyncClient

        self.loop = asyncio.new_event_loop()

        async def make() -> AsyncClient:
            return AsyncClient(target, **kw)

        self.inner = self.loop.run_until_complete(make())

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.inner, name)

        def call(*args: Any, **kw: Any) -> Any:
            if name == "matmul_stream":
                async def collect() -> list[Any]:
                    return [item async for item in method(*args, **kw)]

                return self.loop.run_until_complete(collect())
            return self.loop.run_until_complete(method(*args, **kw))

        return call

    def close(self) -> None:
        self.loop.run_until_complete(self.inner.close())
        self.loop.close()


@pytest.fixture(params=["sync", "async"])
def make_client(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """``make_client(target, **kw)`` -> a Client or an AsyncFacade, closed at teardown."""
    from q6serve.client.client import Client

    with ExitStack() as made:
        def make(target: str, **kw: Any) -> Any:
            c = Client(target, **kw) if request.param == "sync" else AsyncFacade(target, **kw)
            made.callback(c.close)
            return c

        yield make


@pytest.fixture
def client(worker: Any, make_client: Callable[..., Any]) -> Any:
    return make_client(worker.target)


from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # noqa: E402

from q6serve.v1 import q6serve_pb2 as pb  # noqa: E402
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc  # noqa: E402


class FlakyServicer(pb_grpc.Q6ServeServicer):
    """Fails the first ``failures`` calls of each method (the health service's Check too) with
    ``code``; records each call's authorization metadata in ``tokens``."""

    def __init__(self, failures: int, code: grpc.StatusCode) -> None:
        self.failures, self.code = failures, code
        self.calls: dict[str, int] = {}
        self.headers: list[str] = []
        self.tokens: list[str | None] = []

    def _maybe_fail(self, method: str, context: grpc.ServicerContext) -> None:
        self.tokens.append(dict(context.invocation_metadata()).get("authorization"))
        self.calls[method] = self.calls.get(method, 0) + 1
        if self.calls[method] <= self.failures:
            context.abort(self.code, f"{method} attempt {self.calls[method]} refused")

    def GetStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._maybe_fail("GetStatus", context)
        return pb.GetStatusResponse(backend="fake", serving=True)

    def UploadWeight(self, request_iterator: Any, context: grpc.ServicerContext) -> Any:
        msgs = list(request_iterator)
        self.headers.append(msgs[0].header.name)
        self._maybe_fail("UploadWeight", context)
        size = sum(len(m.chunk) for m in msgs[1:])
        return pb.UploadWeightResponse(weight=pb.WeightInfo(name=msgs[0].header.name,
                                                            nbytes=size))


class FlakyHealth(health.HealthServicer):
    """The health service of a FlakyServicer: its failures, counted as "Check"."""

    def __init__(self, flaky: FlakyServicer) -> None:
        super().__init__()
        self.flaky = flaky

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.flaky._maybe_fail("Check", context)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture
def flaky() -> Iterator[Callable[[int, grpc.StatusCode], tuple[str, FlakyServicer]]]:
    servers: list[grpc.Server] = []

    def start(failures: int, code: grpc.StatusCode) -> tuple[str, FlakyServicer]:
        servicer = FlakyServicer(failures, code)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_Q6ServeServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(FlakyHealth(servicer), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}", servicer

    yield start
    for s in servers:
        s.stop(None)
