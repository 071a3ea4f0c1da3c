"""Client fixtures: the service tests' in-process worker on port 0 (reused, not copied) and
``client``, parametrized over the sync Client and the AsyncClient behind one blocking facade,
so every call is tested once for both."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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

    made: list[Any] = []

    def make(target: str, **kw: Any) -> Any:
        c = Client(target, **kw) if request.param == "sync" else AsyncFacade(target, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def client(worker: Any, make_client: Callable[..., Any]) -> Any:
    return make_client(worker.target)
