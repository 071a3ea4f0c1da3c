"""Scale-out test helpers: in-process NumPy workers on loopback (port 0), GGUF files, checks."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from q6serve.kernels.api import Backend
from q6serve.service.config import WorkerConfig
from q6serve.service.worker import Worker
from tests.service.svc_util import random_q6k as random_q6k  # re-exported
from tests.service.svc_util import reference as reference  # re-exported


def write_gguf(path: Path, tensors: dict[str, tuple[int, int, int]]) -> dict[str, np.ndarray]:
    """Write ``{name: (rows, k, seed)}`` random Q6_K tensors; return their AoS blocks."""
    from q6serve.kernels.gguf_io import write_q6k_gguf

    blocks = {n: random_q6k(r, k, s) for n, (r, k, s) in tensors.items()}
    write_q6k_gguf(path, {n: (blocks[n], r, k) for n, (r, k, _) in tensors.items()})
    return blocks


def assert_close(y: np.ndarray, want: np.ndarray, rtol: float = 1e-5) -> None:
    y = np.asarray(y, dtype=np.float64)
    assert y.shape == want.shape, (y.shape, want.shape)
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(y - want).max())
    assert err <= rtol * scale, f"max error {err:.3g} > {rtol:.1g} x scale {scale:.3g}"


class LoopWorker:
    """A Worker (or any object with start/stop/target) on a private event-loop thread."""

    def __init__(self, config: WorkerConfig, backend: Backend | None = None,
                 worker: Any = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        if worker is None:
            from q6serve.kernels.backends import make_backend

            worker = Worker(config, backend or make_backend("numpy"), CollectorRegistry())
        self.worker = worker
        self.call(self.worker.start())
        self.target = self.worker.target

    def call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace: float = 0.5) -> None:
        if self.loop.is_closed():
            return
        self.call(self.worker.stop(grace))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
