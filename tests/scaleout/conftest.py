"""Fixtures: NumPy workers on loopback port 0 sharing one model dir, stopped at teardown."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from scaleout_util import LoopWorker

from q6serve.kernels.numpy_backend import NumpyBackend
from q6serve.service.config import Budget, WorkerConfig
from q6serve.service.devices import DevicesWorker


@pytest.fixture
def base_config(model_dir: Path) -> WorkerConfig:
    return WorkerConfig(host="127.0.0.1", port=0, model_dir=model_dir,
                        vram_budget=Budget(nbytes=64 << 20), grace_period_s=0.5,
                        max_batch_delay_us=0)


@pytest.fixture
def start_worker(base_config: WorkerConfig) -> Iterator[Callable[..., LoopWorker]]:
    """``start_worker(**config_overrides)`` -> LoopWorker, stopped at teardown."""
    with ExitStack() as started:
        def start(**overrides: Any) -> LoopWorker:
            w = LoopWorker(dataclasses.replace(base_config, **overrides))
            started.callback(w.stop)
            return w

        yield start


@pytest.fixture
def start_devices(base_config: WorkerConfig) -> Iterator[Callable[..., LoopWorker]]:
    """``start_devices(placement="shard", devices=2, **config_overrides)`` -> a multi-device
    worker over ``devices`` NumPy "devices" (``--devices``), stopped at teardown."""
    with ExitStack() as started:
        def start(placement: str = "shard", devices: int = 2, **overrides: Any) -> LoopWorker:
            cfg = dataclasses.replace(base_config, **overrides)
            worker = DevicesWorker(cfg, [NumpyBackend(threads=1) for _ in range(devices)],
                                   placement, registry=CollectorRegistry())
            w = LoopWorker(cfg, worker=worker)
            started.callback(w.stop)
            return w

        yield start
