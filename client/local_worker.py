"""An in-process worker on its own event-loop thread, for ``q6serve demo`` and ``bench --local``.

The worker's asyncio loop runs in a daemon thread, so the caller's code (sync or its own
asyncio loop) talks to it over real gRPC on loopback exactly as a remote host would.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from q6serve.kernels.api import Backend
from q6serve.service.config import WorkerConfig
from q6serve.service.worker import Worker


class LocalWorker:
    """``with LocalWorker(config, backend) as w: Client(w.target) ...`` (port 0 works)."""

    def __init__(self, config: WorkerConfig, backend: Backend) -> None:
        self.config = config
        self.backend = backend
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="q6serve-worker",
                                       daemon=True)
        self.worker: Worker | None = None

    def _run(self, coro: Any, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def target(self) -> str:
        assert self.worker is not None, "not started"
        return self.worker.target

    def start(self) -> LocalWorker:
        self.thread.start()
        self.worker = Worker(self.config, self.backend)
        try:
            self._run(self.worker.start())
        except BaseException:
            self._close_loop()
            raise
        return self

    def stop(self, grace: float = 5.0) -> None:
        if self.worker is not None and not self.loop.is_closed():
            self._run(self.worker.stop(grace))
        self._close_loop()

    def _close_loop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def __enter__(self) -> LocalWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
