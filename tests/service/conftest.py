"""Fixtures: an in-process worker on its own event-loop thread (port 0), random Q6_K weights."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from q6serve.client.client import Client
from q6serve.kernels import q6k
from q6serve.kernels.api import Backend
from q6serve.service.config import Budget, WorkerConfig
from q6serve.service.worker import Worker


def random_q6k(rows: int, k: int, seed: int) -> np.ndarray:
    """Valid random Q6_K AoS blocks ``[rows*k/256, 210]`` with small finite scales."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * k // q6k.QK_K, q6k.BLOCK_BYTES), dtype=np.uint8)
    d = (rng.random(blocks.shape[0]) * 1e-3 + 1e-4).astype(np.float16)
    blocks[:, 208:210] = d.view(np.uint8).reshape(-1, 2)
    return blocks


def reference(blocks: np.ndarray, rows: int, k: int, x: np.ndarray) -> np.ndarray:
    """float64 ``x @ W.T`` on exactly dequantized weights."""
    w = q6k.dequantize_aos(blocks, rows, k).astype(np.float64)
    return np.asarray(x, dtype=np.float64) @ w.T


def make_backend() -> Backend:
    from q6serve.kernels.backends import make_backend as mk

    return mk("numpy")


class RunningWorker:
    """A Worker on a private event loop thread; ``call`` runs coroutines on that loop."""

    def __init__(self, config: WorkerConfig, backend: Backend | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.registry = CollectorRegistry()
        self.worker = Worker(config, backend or make_backend(), self.registry)
        self.call(self.worker.start())
        self.target = self.worker.target
        self.clients: list[Client] = []

    def call(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run(self, fn: Callable[[], Any]) -> Any:
        """Run a plain callable on the loop thread (e.g. to read engine state)."""
        async def wrap() -> Any:
            return fn()

        return self.call(wrap())

    @property
    def engine(self) -> Any:
        return self.worker.engine

    def client(self, **kw: Any) -> Client:
        c = Client(self.target, **kw)
        self.clients.append(c)
        return c

    def stop(self, grace: float = 5.0) -> None:
        if self.loop.is_closed():
            return
        for c in self.clients:
            c.close()
        self.call(self.worker.stop(grace))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "models"
    d.mkdir()
    return d


@pytest.fixture
def base_config(model_dir: Path) -> WorkerConfig:
    return WorkerConfig(host="127.0.0.1", port=0, model_dir=model_dir,
                        vram_budget=Budget(nbytes=256 << 20), grace_period_s=5.0)


@pytest.fixture
def start_worker(base_config: WorkerConfig) -> Iterator[Callable[..., RunningWorker]]:
    """``start_worker(**config_overrides)`` -> RunningWorker, stopped at teardown."""
    started: list[RunningWorker] = []

    def start(backend: Backend | None = None, **overrides: Any) -> RunningWorker:
        w = RunningWorker(dataclasses.replace(base_config, **overrides), backend)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


@pytest.fixture
def worker(start_worker: Callable[..., RunningWorker]) -> RunningWorker:
    return start_worker()
