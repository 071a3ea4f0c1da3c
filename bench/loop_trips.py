"""Count an asyncio server's event-loop trips and the callbacks each trip runs (issue 14: how
many loop trips one MatmulStream round trip costs; each is ~10-30 µs of interpreter and an
epoll call, and the bare gRPC echo needs ~4).

``install(path)`` patches asyncio's loop in this process; the counts are written to ``path``
when the process exits (atexit) or gets SIGTERM (only where nothing else handles it: the
worker drains on SIGTERM and then exits, which atexit sees). Servers of bench/stream_overhead.py
call it directly; the worker gets it through bench/trips_site/sitecustomize.py
(``PYTHONPATH=bench/trips_site Q6SERVE_LOOP_TRIPS=PATH``). A diagnostic only: the patch costs
~1 µs per callback.
"""

from __future__ import annotations

import asyncio.base_events as base_events
import asyncio.events as events
import atexit
import collections
import json
import os
import signal
from pathlib import Path
from typing import Any


def _name(cb: Any) -> str:
    func = getattr(cb, "func", None)  # functools.partial
    if func is not None:
        return "partial:" + getattr(func, "__qualname__", type(func).__name__)
    return getattr(cb, "__qualname__", None) or type(cb).__name__


def install(path: str, sigterm: bool = False) -> None:
    """Count trips (and those that found nothing ready: the loop slept in epoll first) and
    callbacks by name; write them as JSON to ``path`` at exit (``sigterm``: also on SIGTERM)."""
    counts: collections.Counter[str] = collections.Counter()
    trips = {"trips": 0, "slept": 0}
    run_once = base_events.BaseEventLoop._run_once  # type: ignore[attr-defined]
    handle_run = events.Handle._run

    def counted_run_once(self: Any) -> None:
        trips["trips"] += 1
        if not self._ready:
            trips["slept"] += 1
        run_once(self)

    def counted_handle_run(self: Any) -> None:
        counts[_name(self._callback)] += 1
        handle_run(self)

    base_events.BaseEventLoop._run_once = counted_run_once  # type: ignore[attr-defined]
    events.Handle._run = counted_handle_run  # type: ignore[method-assign]

    def dump() -> None:
        Path(path).write_text(json.dumps({**trips, "callbacks": dict(counts.most_common())}))

    atexit.register(dump)
    if sigterm:  # a terminated bench server: write, then go (no interpreter teardown)
        signal.signal(signal.SIGTERM, lambda *_: (dump(), os._exit(0)))
