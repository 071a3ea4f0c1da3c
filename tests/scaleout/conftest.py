"""Fixtures: NumPy workers on loopback port 0 sharing one model dir, stopped at teardown."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from scaleout_util import LoopWorker

from q6serve.service.config import Budget, WorkerConfig


@pytest.fixture
def base_config(model_dir: Path) -> WorkerConfig:
    return WorkerConfig(host="127.0.0.1", port=0, model_dir=model_dir,
                        vram_budget=Budget(nbytes=64 << 20), grace_period_s=0.5,
                        max_batch_delay_us=0)


@pytest.fixture
def start_worker(base_config: WorkerConfig) -> Iterator[Callable[..., LoopWorker]]:
    """``start_worker(**config_overrides)`` -> LoopWorker, stopped at teardown."""
    started: list[LoopWorker] = []

    def start(**overrides: Any) -> LoopWorker:
        w = LoopWorker(dataclasses.replace(base_config, **overrides))
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()
