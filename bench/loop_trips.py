"""Count an asyncio server's event-loop trips and the callbacks each trip runs (issue 14: how
many loop trips one MatmulStream round trip costs, and where the loop thread's time goes).

``install(path)`` patches asyncio's loop in this process; the counts are written to ``path``
as JSON when the process exits (atexit) or gets SIGTERM (``sigterm``: only where nothing else
handles it; the worker drains on SIGTERM and then exits, which atexit sees). The JSON also
holds a timeline of ``TIMELINE`` consecutive trips from the middle of the run: per trip, the
µs spent in the selector (the loop asleep, or polling) and each callback's name, µs and the
loop thread's CPU µs in it (thread_time: a callback preempted on a busy host shows a long wall
time but its own CPU); and each callback name's total CPU µs.
Servers of bench/stream_overhead.py call it directly; the worker gets it through
bench/trips_site/sitecustomize.py (``PYTHONPATH=bench/trips_site Q6SERVE_LOOP_TRIPS=PATH``).
A diagnostic only: the patch costs ~1-2 µs per callback.
"""

from __future__ import annotations

import asyncio.base_events as base_events
import asyncio.events as events
import atexit
import collections
import json
import os
import selectors
import signal
import time
from pathlib import Path
from typing import Any

TIMELINE = 60  # trips kept for the timeline
RING = 4096  # recent trips kept (the timeline is cut from these at exit)


def _name(cb: Any) -> str:
    func = getattr(cb, "func", None)  # functools.partial
    if func is not None:
        return "partial:" + getattr(func, "__qualname__", type(func).__name__)
    return getattr(cb, "__qualname__", None) or type(cb).__name__


def install(path: str, sigterm: bool = False) -> None:
    """Count trips (and those that found nothing ready: the loop slept in epoll first) and
    callbacks by name, keep a timeline; write them as JSON to ``path`` at exit."""
    counts: collections.Counter[str] = collections.Counter()
    trips = {"trips": 0, "slept": 0}
    ring: collections.deque[list[Any]] = collections.deque(maxlen=RING)
    now = time.perf_counter
    cpu = time.thread_time_ns  # the loop thread's CPU (user + system): no preemption in it
    cpu_ns: collections.Counter[str] = collections.Counter()
    run_once = base_events.BaseEventLoop._run_once  # type: ignore[attr-defined]
    handle_run = events.Handle._run
    select = selectors.EpollSelector.select

    def counted_run_once(self: Any) -> None:
        trips["trips"] += 1
        slept = not self._ready
        if slept:
            trips["slept"] += 1
        ring.append([now(), slept, 0.0])  # [start, slept, select µs, (name, µs)...]
        run_once(self)

    def timed_select(self: Any, timeout: float | None = None) -> Any:
        t0 = now()
        try:
            return select(self, timeout)
        finally:
            if ring:
                ring[-1][2] += (now() - t0) * 1e6

    def counted_handle_run(self: Any) -> None:
        name = _name(self._callback)
        counts[name] += 1
        t0, c0 = now(), cpu()
        handle_run(self)
        c = cpu() - c0
        cpu_ns[name] += c
        if ring:
            ring[-1].append((name, round((now() - t0) * 1e6, 1), round(c * 1e-3, 1)))

    base_events.BaseEventLoop._run_once = counted_run_once  # type: ignore[attr-defined]
    events.Handle._run = counted_handle_run  # type: ignore[method-assign]
    selectors.EpollSelector.select = timed_select  # type: ignore[method-assign]

    def dump() -> None:
        trace = list(ring)
        mid = max(0, len(trace) // 2 - TIMELINE // 2)
        cut = trace[mid : mid + TIMELINE]
        timeline = [{"t_us": round((t[0] - cut[0][0]) * 1e6, 1), "slept": t[1],
                     "select_us": round(t[2], 1), "callbacks": t[3:]} for t in cut]
        Path(path).write_text(json.dumps({
            **trips, "callbacks": dict(counts.most_common()),
            "callback_cpu_us": {k: v * 1e-3 for k, v in cpu_ns.most_common()},
            "timeline": timeline}))

    atexit.register(dump)
    if sigterm:  # a terminated bench server: write, then go (no interpreter teardown)
        signal.signal(signal.SIGTERM, lambda *_: (dump(), os._exit(0)))
