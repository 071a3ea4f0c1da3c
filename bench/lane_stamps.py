"""Absolute times of the fast lane's round trips, for splitting one into its stages (issue 15
item 3; a bench diagnostic, never in the product).

Worker side, ``install(path)`` (through bench/trips_site/sitecustomize.py when
``Q6SERVE_LANE_STAMPS`` names the output file): per reply record, perf_counter() when the
lane's bytes were read (``_LaneConn.data_received``; a ring lane's: when the loop took its
ring's request, ``LaneServer._ring_take``, a loop trip after its selector saw it), when the last
device job before the reply
called ``launch_ieee`` or its region plan's launch (``lane._Plan.launch``: a repeated call's
graph; the job's start, give or take its Python before the launch) and when
the reply was written (``_LaneConn.write``), by the request's seq; written as JSON at exit
(the worker drains on SIGTERM, then exits: atexit sees it). Caller side, ``client_hooks(lane)``:
perf_counter() just before the request's write and after the read that completed the reply's
head, whichever client code the lane runs (a ``spin_us`` client's os.write/os.readv, or an
older client's socket methods); on a ring lane when the request's seq was stored (its
publication) and when the wait for the reply returned. perf_counter is CLOCK_MONOTONIC on
Linux, one clock for every process of the host, so the two sides subtract. Each stamp costs
~0.3-1 us.
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
    take = lane.LaneServer._ring_take
    launch, plan_launch = engine.launch_ieee, lane._Plan.launch

    def stamped_received(self: Any, data: bytes) -> None:
        self._t_read = now()
        received(self, data)

    def stamped_take(self: Any, got: list[tuple[Any, int]]) -> None:
        t = now()
        for conn, _ in got:
            conn._t_read = t
        take(self, got)

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
    lane.LaneServer._ring_take = stamped_take  # type: ignore[method-assign]
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
        # (the first write of a call: a ring lane's doorbell comes after its publication)
        self._marks.setdefault("send", now())
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


class _Seq:
    """client/lane.py's ring sequence struct, its store of a request's seq stamped ("send")."""

    def __init__(self, inner: Any, marks: dict[str, float], at: int) -> None:
        self._inner, self._marks, self._at = inner, marks, at
        self.unpack_from = inner.unpack_from  # (the wait's spin: not stamped, not slowed)

    def pack_into(self, buf: Any, offset: int, *v: Any) -> None:
        if offset == self._at:
            self._marks["send"] = now()
        self._inner.pack_into(buf, offset, *v)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def client_hooks(lane_obj: Any) -> dict[str, float]:
    """Stamp ``lane_obj``'s sends and reads (a ring lane's publications and the returns of
    its waits); returns the dict that gets "send" and "wake" (clear it before each call)."""
    import q6serve.client.lane as lane_mod

    marks: dict[str, float] = {}
    if getattr(lane_obj, "ring", False):
        seq = lane_mod.SEQ
        if isinstance(seq, _Seq):
            seq._marks = marks
        else:
            lane_mod.SEQ = _Seq(seq, marks, lane_mod.R_SEQ)  # type: ignore[attr-defined]
        wait = lane_obj._ring_wait

        def stamped_wait() -> None:
            wait()
            marks["wake"] = now()

        lane_obj._ring_wait = stamped_wait
        return marks
    os_mod = getattr(lane_mod, "os", None)  # (an older client imports no os)
    if isinstance(os_mod, _Os):
        os_mod._marks = marks
    elif os_mod is not None:
        lane_mod.os = _Os(os_mod, marks)  # type: ignore[attr-defined]
    lane_obj.sock = _Sock(lane_obj.sock, marks)
    return marks
