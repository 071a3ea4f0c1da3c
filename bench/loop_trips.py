"""Count an asyncio server's event-loop trips and the callbacks each trip runs (issue 14: how
many loop trips one MatmulStream round trip costs, and where the loop thread's time goes).

``install(path)`` patches asyncio's loop in this process; the counts are written to ``path``
as JSON when the process exits (atexit) or gets SIGTERM (``sigterm``: only where nothing else
handles it; the worker drains on SIGTERM and then exits, which atexit sees). The JSON also
holds a timeline of ``TIMELINE`` consecutive trips from the middle of the run: per trip, the
µs spent in the selector (the loop asleep, or polling) and each callback's name, µs and the
loop thread's CPU µs in it (thread_time: a callback preempted on a busy host shows a long wall
time but its own CPU); and each callback name's total CPU µs. Where bench/reply_stamps.py stamps
a reply in the callback that took its request (the direct path), :func:`mark` notes both times
and the JSON's ``request_steps`` gives the medians of that step's parts: its start -> the
request taken (gRPC's receive, the interceptor), -> the reply encoded (the handler's window),
-> the step's end (the write's submission: gRPC's send, the kernel's loopback), with its CPU.
Servers of bench/stream_overhead.py call it directly; the worker gets it through
bench/trips_site/sitecustomize.py (``PYTHONPATH=bench/trips_site Q6SERVE_LOOP_TRIPS=PATH``).
With ``Q6SERVE_STEP_MARKS=1`` :func:`install` also marks the worker's own steps inside that
callback (:func:`install_marks`: the request decoded, the direct job's start and end, the reply
handed to the interceptor's write) and ``request_steps["marks_us"]`` gives each mark's median
time from the step's start (and ``end_us``, the step's end): which part of the step outside the
handler's window is gRPC's and which ours.
A diagnostic only: the patch costs ~1-2 µs per callback (and per mark).
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
import statistics
import time
from pathlib import Path
from typing import Any

TIMELINE = 60  # trips kept for the timeline
RING = 4096  # recent trips kept (the timeline is cut from these at exit)
STEPS = 20000  # marked callbacks kept for their medians

# Marks set while a callback runs (:func:`mark`), taken by the counter when it returns: where
# inside its loop step a request was taken and its reply encoded (bench/reply_stamps.py).
MARKS: list[tuple[str, float, int | None]] = []
_INSTALLED: list[bool] = []  # [True] once install() ran: marks are taken (and cleared) only then


def mark(label: str, t: float | None = None) -> None:
    """Note ``label`` at perf_counter() time ``t`` (None: now, with the thread's CPU time) in
    the callback running now; nothing where no counter is installed."""
    if not _INSTALLED:
        return
    if t is None:
        MARKS.append((label, time.perf_counter(), time.thread_time_ns()))
    else:
        MARKS.append((label, t, None))


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
    # (pre, window, post, post CPU, step CPU) of each callback that took a request and encoded
    # its reply: pre = the step's start -> the request taken (RPC_START), post = the reply
    # encoded -> the step's end (its write submitted), all seconds or ns (CPU)
    steps: collections.deque[tuple[float, float, float, int | None, int]] = (
        collections.deque(maxlen=STEPS))
    # each such step's marks: label -> µs from the step's start ("end": the step's end)
    step_marks: collections.deque[dict[str, float]] = collections.deque(maxlen=STEPS)
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
        MARKS.clear()
        t0, c0 = now(), cpu()
        handle_run(self)
        t1, c1 = now(), cpu()
        cpu_ns[name] += c1 - c0
        entry: tuple[Any, ...] = (name, round((t1 - t0) * 1e6, 1), round((c1 - c0) * 1e-3, 1))
        if MARKS:
            marks = {label: (t, c) for label, t, c in MARKS}
            entry += (tuple((label, round((t - t0) * 1e6, 1)) for label, t, _ in MARKS),)
            if "taken" in marks and "encoded" in marks and marks["taken"][0] >= t0:
                # (a request taken in this step: the direct path; a queued one's reply is
                # encoded in a later callback)
                (taken, _), (enc, enc_c) = marks["taken"], marks["encoded"]
                steps.append((taken - t0, enc - taken, t1 - enc,
                              None if enc_c is None else c1 - enc_c, c1 - c0))
                step_marks.append({**{label: (t - t0) * 1e6 for label, (t, _) in marks.items()},
                                   "end": (t1 - t0) * 1e6})
        if ring:
            ring[-1].append(entry)

    _INSTALLED.append(True)
    if os.environ.get("Q6SERVE_STEP_MARKS"):
        install_marks()
    base_events.BaseEventLoop._run_once = counted_run_once  # type: ignore[attr-defined]
    events.Handle._run = counted_handle_run  # type: ignore[method-assign]
    selectors.EpollSelector.select = timed_select  # type: ignore[method-assign]

    def dump() -> None:
        trace = list(ring)
        mid = max(0, len(trace) // 2 - TIMELINE // 2)
        cut = trace[mid : mid + TIMELINE]
        timeline = [{"t_us": round((t[0] - cut[0][0]) * 1e6, 1), "slept": t[1],
                     "select_us": round(t[2], 1), "callbacks": t[3:]} for t in cut]
        marked = {}
        if steps:
            cols = list(zip(*steps, strict=True))
            med = [statistics.median(x for x in col if x is not None) if any(
                x is not None for x in col) else None for col in cols]
            marked = {"n": len(steps), "pre_us": med[0] * 1e6, "window_us": med[1] * 1e6,
                      "post_us": med[2] * 1e6,
                      "post_cpu_us": None if med[3] is None else med[3] * 1e-3,
                      "step_cpu_us": med[4] * 1e-3, "marks_us": _mark_medians(step_marks)}
        Path(path).write_text(json.dumps({
            **trips, "callbacks": dict(counts.most_common()),
            "callback_cpu_us": {k: v * 1e-3 for k, v in cpu_ns.most_common()},
            "request_steps": marked, "timeline": timeline}))

    atexit.register(dump)
    if sigterm:  # a terminated bench server: write, then go (no interpreter teardown)
        signal.signal(signal.SIGTERM, lambda *_: (dump(), os._exit(0)))


def _mark_medians(step_marks: Any) -> dict[str, float]:
    """Each label's median µs from its step's start, in the order of those medians (labels
    seen in fewer than half the steps are left out: another path's)."""
    by: dict[str, list[float]] = collections.defaultdict(list)
    for m in step_marks:
        for label, us in m.items():
            by[label].append(us)
    half = len(step_marks) / 2
    med = {label: statistics.median(v) for label, v in by.items() if len(v) >= half}
    return dict(sorted(med.items(), key=lambda kv: kv[1]))


def install_marks() -> None:
    """Mark the worker's steps inside a request's loop callback (see :func:`mark`):
    "decoded" when ``wire_requests.matmul_call`` returns, "job" and "job_end" around the direct job
    (``Device.run_now``: the backend's launch and wait), "send" when the handler hands its
    reply to the interceptor's write (``ErrorInterceptor._send_reply``; after it, up to the
    step's end: the write's submission to gRPC). Patches this process's classes and module
    (before any stream starts: it binds ``_send_reply`` at its start)."""
    from q6serve.service import device_thread, interceptor, wire_requests

    matmul_call = wire_requests.matmul_call

    def marked_call(*args: Any, **kwargs: Any) -> Any:
        try:
            return matmul_call(*args, **kwargs)
        finally:
            mark("decoded")

    wire_requests.matmul_call = marked_call
    run_now = device_thread.Device.run_now

    def marked_run_now(self: Any, fn: Any, *args: Any) -> Any:
        mark("job")
        try:
            return run_now(self, fn, *args)
        finally:
            mark("job_end")

    device_thread.Device.run_now = marked_run_now  # type: ignore[method-assign]
    send_reply = interceptor.ErrorInterceptor._send_reply

    def marked_send(self: Any, *args: Any) -> Any:
        mark("send")
        return send_reply(self, *args)  # (its coroutine, awaited by the caller)

    interceptor.ErrorInterceptor._send_reply = marked_send  # type: ignore[method-assign]
