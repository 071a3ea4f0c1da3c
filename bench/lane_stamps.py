"""Absolute times of the fast lane's round trips, for splitting one into its stages (issue 15
item 3; a bench diagnostic, never in the product).

Worker side, ``install(path)`` (through bench/trips_site/sitecustomize.py when
``Q6SERVE_LANE_STAMPS`` names the output file): per reply record, perf_counter() when the
lane's bytes were read (``_LaneConn.data_received``), when the last device job before the reply
called ``launch_ieee`` or its region plan's launch (``lane._Plan.launch``: a repeated call's
graph; the job's start, give or take its Python before the launch) and when
the reply was written (``_LaneConn.write``), by the request's seq; written as JSON at exit
(the worker drains on SIGTERM, then exits: atexit sees it). Caller side, ``client_hooks(lane)``:
perf_counter() just before the request's write and after the read that completed the reply's
head, whichever client code the lane runs (a ``spin_us`` client's os.write/os.readv, or an
older client's socket methods). perf_counter is CLOCK_MONOTONIC on Linux, one clock for every
process of the host, so the two sides subtract. Each stamp costs ~0.3-1 us.
"""

from __future__ import annotations

import atexit
import json
import time
from typing import Any

now = time.perf_counter


def install(path: str) -> None:
    from q6serve.service import engine, lane

    stamps: dict[int, tuple[float, float, float]] = {}
    launched = [0.0]
    conn_cls = lane._LaneConn
    received, write = conn_cls.data_received, conn_cls.write
    launch, plan_launch = engine.launch_ieee, lane._Plan.launch

    def stamped_received(self: Any, data: bytes) -> None:
        self._t_read = now()
        received(self, data)

    def stamped_launch(*args: Any, **kw: Any) -> Any:
        launched[0] = now()
        return launch(*args, **kw)

    def stamped_plan_launch(self: Any, *args: Any) -> Any:
        # a repeated call's region plan launches without launch_ieee (session 11): without
        # this stamp its pre-job and post-job read the last launch_ieee's time
        launched[0] = now()
        return plan_launch(self, *args)

    def stamped_write(self: Any, rec: bytes) -> None:
        t = now()
        write(self, rec)
        stamps[int.from_bytes(rec[:8], "little")] = (getattr(self, "_t_read", 0.0),
                                                      launched[0], t)

    conn_cls.data_received = stamped_received
    conn_cls.write = stamped_write
    engine.launch_ieee = stamped_launch
    lane._Plan.launch = stamped_plan_launch  # type: ignore[method-assign]

    def dump() -> None:
        if not stamps:  # a child that inherited the variable (the caller's resource tracker)
            return
        with open(path, "w") as f:
            json.dump({str(k): v for k, v in stamps.items()}, f)

    atexit.register(dump)


def load(path: str) -> dict[int, tuple[float, float, float]]:
    with open(path) as f:
        return {int(k): tuple(v) for k, v in json.load(f).items()}  # type: ignore[misc]


class _Os:
    """The os module as client/lane.py sees it, with its write and readv stamped."""

    def __init__(self, inner: Any, marks: dict[str, float]) -> None:
        self._inner, self._marks = inner, marks

    def write(self, fd: int, data: Any) -> int:
        self._marks["send"] = now()
        return self._inner.write(fd, data)

    def readv(self, fd: int, bufs: Any) -> int:
        n = self._inner.readv(fd, bufs)
        self._marks["wake"] = now()
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Sock:
    """A lane's socket with its sends and reads stamped (an older client's path)."""

    def __init__(self, inner: Any, marks: dict[str, float]) -> None:
        self._inner, self._marks = inner, marks

    def sendall(self, data: Any) -> None:
        self._marks.setdefault("send", now())  # (a partial os.write's rest: not the start)
        self._inner.sendall(data)

    def recv_into(self, buf: Any, *args: Any) -> int:
        n = self._inner.recv_into(buf, *args)
        self._marks["wake"] = now()
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def client_hooks(lane_obj: Any) -> dict[str, float]:
    """Stamp ``lane_obj``'s sends and reads; returns the dict that gets "send" and "wake"
    (clear it before each call)."""
    import q6serve.client.lane as lane_mod

    marks: dict[str, float] = {}
    os_mod = getattr(lane_mod, "os", None)  # (an older client imports no os)
    if isinstance(os_mod, _Os):
        os_mod._marks = marks
    elif os_mod is not None:
        lane_mod.os = _Os(os_mod, marks)  # type: ignore[attr-defined]
    lane_obj.sock = _Sock(lane_obj.sock, marks)
    return marks
