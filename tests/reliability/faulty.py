"""A wrapping backend for fault injection: it forwards everything to a real NumPy backend and
can slow matmuls down, fail a load part-way through its chunks, or fail matmuls like a
faulting device. Faults are injected through this object, never by patching module globals."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from q6serve.kernels.api import AosChunks, Layout, ResidentWeight
from q6serve.kernels.backends import make_backend
from tests.service.svc_util import ForwardingBackend


class FaultyBackend(ForwardingBackend):
    def __init__(self, matmul_delay_s: float = 0.0) -> None:
        super().__init__(make_backend("numpy"))
        self.matmul_delay_s = matmul_delay_s
        # load number -> (chunks to pass before failing, exception factory)
        self.fail_load: dict[int, tuple[int, Callable[[], Exception]]] = {}
        self.fail_matmul: Callable[[], Exception] | None = None
        self.loads = 0
        self.rows_computed = 0
        self.launches: list[int] = []
        self.running = threading.Event()  # set while a matmul runs (for "mid-batch" timing)
        self._lock = threading.Lock()

    # -- the faults ---------------------------------------------------------------------------
    def load(self, chunks: AosChunks, rows: int, k: int, layout: Layout,
             chunk_bytes: int) -> ResidentWeight:
        with self._lock:
            self.loads += 1
            fault = self.fail_load.get(self.loads)
        if fault is None:
            return self.inner.load(chunks, rows, k, layout, chunk_bytes)
        after, make = fault

        def failing() -> Iterator[Any]:
            for i, c in enumerate(chunks):
                if i == after:  # the inner backend already holds the earlier chunks
                    raise make()
                yield c

        return self.inner.load(failing(), rows, k, layout, chunk_bytes)

    def matmul(self, w: ResidentWeight, x: np.ndarray, **kw: Any) -> Any:
        self.launches.append(int(x.shape[0]))
        self.running.set()
        try:
            if self.matmul_delay_s:
                time.sleep(self.matmul_delay_s)
            if self.fail_matmul is not None:
                raise self.fail_matmul()
            out = self.inner.matmul(w, x, **kw)
            self.rows_computed += int(x.shape[0])
            return out
        finally:
            self.running.clear()

    def device_name(self) -> str:
        return f"faulty({self.inner.device_name()})"
