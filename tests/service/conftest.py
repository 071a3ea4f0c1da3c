"""Fixtures: a worker on port 0 with a model dir, started per test and stopped at teardown."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from svc_util import RunningWorker

from q6serve.kernels.api import Backend
from q6serve.service.config import Budget, WorkerConfig


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
