"""The fast lane's shared-memory ring (a small object of the lane's own; the default on both
sides, Q6SERVE_LANE_RING=0 turns it off) on the NumPy backend: answers equal the socket lane's
and the whole region is the caller's, a sleeping worker and a sleeping caller are woken by the
doorbell alone, a closed caller or an unlinked region leaks nothing (no ring object left in
/dev/shm either), hostile ring contents and bad setups are refused with a status (the worker
and the lane go on), and a worker without the option refuses a ring (the default lane falls
back to the socket)."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import struct
import time
from collections.abc import Iterator
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import pytest

from q6serve.client import core
from q6serve.client import lane as clane
from q6serve.client.lane import REPLY, REQUEST, Lane
from q6serve.service import lane as slane
from q6serve.service import threads
from tests.dataplane.test_lane import BASE, ROWS, C, K, code_of
from tests.service.svc_util import RunningWorker, random_q6k

SEQ = struct.Struct("<Q")


SERVERS: list[slane.LaneServer] = []  # the lane servers started (a plain Worker keeps none)


@pytest.fixture
def ring_worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[RunningWorker, Any]]:
    monkeypatch.setenv("Q6SERVE_LANE_RING", "1")
    start = slane.LaneServer.start

    async def kept(self: slane.LaneServer) -> None:
        SERVERS.append(self)
        await start(self)

    monkeypatch.setattr(slane.LaneServer, "start", kept)
    w = RunningWorker(dataclasses.replace(BASE, token="u-secret", admin_token="a-secret"))
    c = w.client(token="a-secret")
    c.upload("w", random_q6k(ROWS, K, 3), ROWS, K)
    try:
        yield w, c
    finally:
        w.stop()


def _lane(c: Any, region: Any, **kw: Any) -> Lane:
    path, ticket = c._run(core.open_lane_call(region.name), 10)
    return Lane(region, path, ticket, **kw)


def _held(w: RunningWorker) -> list[int]:
    return w.run(lambda: [r.users for r in w.worker.regions._regions.values()])


def test_the_config_is_the_same_on_both_sides() -> None:
    for name in ("R_SEQ", "R_REQ", "R_CSLEEP", "R_RSEQ", "R_REP", "R_WSLEEP", "R_NAME",
                 "R_MSG", "RING_BYTES", "RING_ENV", "RING_SETUP"):
        assert getattr(clane, name) == getattr(slane, name), name


@pytest.mark.parametrize("spin_us", [0.0, 2000.0])
def test_ring_answers_equal_the_socket_lane(ring_worker: Any, rng: np.random.Generator,
                                            spin_us: float) -> None:
    w, c = ring_worker
    with c.register_shm("io", 1 << 16) as region, c.register_shm("io2", 1 << 16) as r2, \
            c.open_lane(region) as ring, _lane(c, r2, ring=False, spin_us=spin_us) as sock:
        ring.spin_us = spin_us
        assert ring.ring and not sock.ring
        for dtype, out in ((np.float16, "f32"), (np.float32, "f16"), (np.float32, "bf16")):
            for n in (1, 3):
                x = rng.standard_normal((n, K)).astype(dtype)
                np.testing.assert_array_equal(ring.matmul("w", x, out_dtype=out),
                                              sock.matmul("w", x, out_dtype=out))
                assert ring.last is not None and ring.last.batch_rows >= n
        # errors with the socket lane's status and message; the ring lane goes on
        assert code_of(lambda: ring.matmul("nope", x)) == code_of(lambda: sock.matmul("nope",
                                                                                       x))
        code, msg = code_of(lambda: ring.matmul("w", x, y_offset=(1 << 16) - 64))
        assert code == C.INVALID_ARGUMENT and "overruns region 'io'" in msg, msg
        # the region's last 2 KiB held the ring until session 29: x and y there now work
        tail = (1 << 16) - 2048
        x1 = rng.standard_normal((1, K)).astype(np.float32)
        for x_off, y_off in ((tail, 0), (0, tail), (tail - 64, (1 << 16) - ROWS * 4)):
            np.testing.assert_array_equal(ring.matmul("w", x1, x_offset=x_off, y_offset=y_off),
                                          sock.matmul("w", x1))
        np.testing.assert_array_equal(ring.matmul("w", x), sock.matmul("w", x))
        server = SERVERS[-1]
        assert server is not None and server.rung == 12
    assert _held(w) == []  # (unregistered; nothing held)


def test_a_sleeping_worker_and_caller_are_woken_by_the_doorbell(
        ring_worker: Any, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the sleep caps far beyond the lane's timeout only the doorbells can wake either
    side: every call answers at once (a lost doorbell would wait for the lane's timeout)."""
    _w, c = ring_worker
    monkeypatch.setattr(threads, "RING_SLEEP_MAX_S", 600.0)
    monkeypatch.setattr(clane, "RING_WAKE_MS", 600_000)
    x = rng.standard_normal((2, K)).astype(np.float32)
    with c.register_shm("io", 1 << 16) as region, _lane(c, region, timeout=5.0,
                                                         spin_us=0.0) as lane:
        want = c.matmul("w", x)
        for i in range(12):
            if i % 3 == 0:
                time.sleep(0.05)  # the worker blocks: its flag says so
                assert slane.FLAG.unpack_from(lane._ring, slane.R_WSLEEP)[0] == 1
            t0 = time.perf_counter()
            np.testing.assert_array_equal(lane.matmul("w", x), want)
            assert time.perf_counter() - t0 < 2.0  # (not the lane's timeout: woken)
        assert lane.slept >= 1  # (the caller blocked, woken by the worker's doorbell)
        assert slane.FLAG.unpack_from(lane._ring, slane.R_CSLEEP)[0] == 0


def test_hostile_ring_contents_are_refused(ring_worker: Any,
                                           rng: np.random.Generator) -> None:
    w, c = ring_worker
    x = rng.standard_normal((1, K)).astype(np.float32)
    with c.register_shm("io", 1 << 16) as region, c.open_lane(region) as lane:

        def raw(rec: bytes, name: bytes = b"w") -> tuple[Any, ...]:
            lane._seq += 1
            lane._ring_name = b""
            return lane._ring_call(rec[:REQUEST.size], name)

        # a name longer than the ring's room
        got = raw(REQUEST.pack(1, 1, K, 0, 4096, 2, 1, 0, 0, 5000, 0))
        assert got[1] == C.INVALID_ARGUMENT.value[0] and "weight name" in got[-1], got
        # x or y beyond the region, sizes that overflow, bad dtype / precision codes
        for rec in (REQUEST.pack(1, 1, K, 1 << 40, 4096, 2, 1, 0, 0, 1, 0),
                    REQUEST.pack(1, 1, K, 0, (1 << 16) - 8, 2, 1, 0, 0, 1, 0),
                    REQUEST.pack(1, 1 << 31, 1 << 31, 0, 4096, 2, 1, 0, 0, 1, 0),
                    REQUEST.pack(1, 1, K, 0, 4096, 99, 1, 0, 0, 1, 0),
                    REQUEST.pack(1, 1, K, 0, 4096, 2, 1, 77, 0, 1, 0)):
            got = raw(rec)
            assert got[0] == lane._seq and got[1] == C.INVALID_ARGUMENT.value[0], got
        # random records: each answered with a status, none crashes the worker
        for _ in range(200):
            got = raw(rng.bytes(REQUEST.size), rng.bytes(int(rng.integers(0, 40))))
            assert got[0] == lane._seq and got[1] != 0, got
        # the reply area scribbled on by the caller: the next call's reply is whole again
        lane._ring[slane.R_REP : slane.R_MSG] = rng.bytes(slane.R_MSG - slane.R_REP)
        np.testing.assert_array_equal(lane.matmul("w", x), c.matmul("w", x))
    assert _held(w) == []


def test_bad_ring_setups_and_a_worker_without_the_option(ring_worker: Any,
                                                         rng: np.random.Generator,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         ) -> None:
    w, c = ring_worker
    x = rng.standard_normal((1, K)).astype(np.float32)
    mine = shared_memory.SharedMemory(name="q6ring_big00000", create=True,
                                      size=slane.RING_BYTES)
    link = slane.regions.SHM_DIR / "q6ring_link0000"
    rd, wr = os.pipe()
    tmp = os.open("/tmp", os.O_RDONLY)
    big = clane.ring_memfd()  # (sealed, the ring's size: a memfd twice that size is made below)
    os.close(big)
    big = os.memfd_create("big", os.MFD_ALLOW_SEALING)
    os.ftruncate(big, 2 * slane.RING_BYTES)
    fcntl.fcntl(big, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    with c.register_shm("io", 1 << 16) as region:
        rkey = region.shm.name.lstrip("/")
        link.symlink_to(slane.regions.SHM_DIR / rkey)  # (O_NOFOLLOW: not followed)
        try:
            with _lane(c, region, ring=False) as lane:
                # (a passed memfd's refusals: tests/dataplane/test_lane_passed_ring.py)
                for key, code_want, want in (
                        ("", C.INVALID_ARGUMENT, "must be 'fd'"),
                        (rkey, C.INVALID_ARGUMENT, "must be 'fd'"),
                        ("../../etc/passwd", C.INVALID_ARGUMENT, "must be 'fd'"),
                        ("fd:../../x", C.INVALID_ARGUMENT, "must be 'fd'"),
                        ("fd:-1", C.INVALID_ARGUMENT, "must be 'fd'"),
                        # a /dev/shm object by name (the ring until session 30), or a link
                        (mine.name, C.INVALID_ARGUMENT, "must be 'fd'"),
                        (link.name, C.INVALID_ARGUMENT, "must be 'fd'"),
                        # a descriptor named (the /proc way until session 30): not opened
                        (f"fd:{rd}", C.INVALID_ARGUMENT, "must be 'fd'"),
                        (f"fd:{big}", C.INVALID_ARGUMENT, "must be 'fd'"),
                        # no descriptor passed (not the first record after the ticket)
                        ("fd", C.INVALID_ARGUMENT, "no descriptor came")):
                    raw = key.encode()
                    lane.sock.sendall(REQUEST.pack(0, 0, 0, 0, 0, 0, 0, 0, slane.RING_SETUP,
                                                   len(raw), 0) + raw)
                    lane._read_into(lane._head)
                    seq, code, msg_len, *_ = REPLY.unpack(lane._head)
                    msg = lane._read(msg_len).decode()
                    assert seq == 0 and code == code_want.value[0] and want in msg, (key, msg)
                # the old setup (flags 1: a ring at x_off in the region) is no setup any more:
                # answered as a request (a bad one), the lane still a socket lane
                lane.sock.sendall(REQUEST.pack(0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0))
                lane._read_into(lane._head)
                seq, code, msg_len, *_ = REPLY.unpack(lane._head)
                msg = lane._read(msg_len).decode()
                assert seq == 0 and code == C.INVALID_ARGUMENT.value[0], msg
                # still a socket lane; the refused objects are where they were (not unlinked)
                np.testing.assert_array_equal(lane.matmul("w", x), c.matmul("w", x))
                assert (slane.regions.SHM_DIR / mine.name.lstrip("/")).exists()
                assert (slane.regions.SHM_DIR / rkey).exists()
        finally:
            link.unlink()
            mine.close()
            mine.unlink()
            for fd in (rd, wr, tmp, big):
                os.close(fd)
    # a region too small for the old tail ring takes a ring lane: the region is all the caller's
    with c.register_shm("tiny", 4096) as small, _lane(c, small, ring=True) as lane:
        assert lane.ring
        np.testing.assert_array_equal(lane.matmul("w", x, y_offset=4096 - ROWS * 4),
                                      c.matmul("w", x))
    assert _held(w) == []
    monkeypatch.setenv("Q6SERVE_LANE_RING", "0")  # (off whatever envvars' default is)
    off = RunningWorker(dataclasses.replace(BASE))
    try:
        c2 = off.client()
        c2.upload("w", random_q6k(ROWS, K, 3), ROWS, K)
        with c2.register_shm("io", 1 << 16) as region:
            code, msg = code_of(lambda: _lane(c2, region, ring=True))
            assert code == C.FAILED_PRECONDITION and "Q6SERVE_LANE_RING=1" in msg, msg
            with c2.open_lane(region) as lane:  # (the env off here too: a socket lane)
                assert not lane.ring and lane.matmul("w", x).shape == (1, ROWS)
            # this process's default (env unset): asks for the ring, falls back to the socket
            monkeypatch.delenv("Q6SERVE_LANE_RING")
            with c2.open_lane(region) as lane:
                assert not lane.ring and lane.matmul("w", x).shape == (1, ROWS)
    finally:
        off.stop()


def test_a_gone_caller_or_unlinked_region_leaks_nothing(ring_worker: Any,
                                                        rng: np.random.Generator) -> None:
    w, c = ring_worker
    x = rng.standard_normal((1, K)).astype(np.float32)
    table = w.worker.regions
    # a caller gone without a word (its socket closed, the region left registered)
    region = c.register_shm("io", 1 << 16)
    lane = c.open_lane(region)
    lane.matmul("w", x)
    server = SERVERS[-1]
    assert lane.ring and w.run(lambda: len(server._rings)) == 1
    # the ring is a memfd (no name anywhere; the two mappings are all there is: a killed
    # caller or worker leaves nothing in /dev/shm), and holds no region
    assert lane._ring_mm is not None
    assert not list(slane.regions.SHM_DIR.glob("q6ring*"))
    assert _held(w) == [0]
    lane.sock.close()
    deadline = time.monotonic() + 10
    while w.run(lambda: len(server._rings)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.run(lambda: len(server._rings)) == 0 and _held(w) == [0]
    lane._ring.release()  # (this side's view: let go without the socket)
    lane._ring = None
    lane._ring_mm.close()
    region.close()  # unregistered: unmapped in the worker
    assert w.run(lambda: table.mapped_bytes) == 0
    # the region's object unlinked under an open ring lane: a clear status, then no leak
    region = c.register_shm("io", 1 << 16)
    lane = c.open_lane(region)
    lane.matmul("w", x)
    region.shm.unlink()
    region.owned = False
    code, msg = code_of(lambda: lane.matmul("w", x))
    assert code == C.FAILED_PRECONDITION and "unlinked" in msg, msg
    lane.close()
    region.close()
    deadline = time.monotonic() + 10
    while w.run(lambda: table.mapped_bytes) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.run(lambda: table.mapped_bytes) == 0 and _held(w) == []


def _polled_rings(w: RunningWorker) -> int:
    """How many ring pollers the worker loop's selector looks at (each caps its sleeps)."""
    import asyncio

    return w.run(lambda: len(getattr(asyncio.get_running_loop()._selector, "rings", [])))


def test_the_loop_stops_polling_when_the_last_ring_lane_closes(
        ring_worker: Any, rng: np.random.Generator) -> None:
    w, c = ring_worker
    x = rng.standard_normal((1, K)).astype(np.float32)
    assert _polled_rings(w) == 0
    with c.register_shm("io", 1 << 16) as r1, c.register_shm("io2", 1 << 16) as r2:
        a, b = c.open_lane(r1), c.open_lane(r2)
        a.matmul("w", x)
        b.matmul("w", x)
        assert _polled_rings(w) == 1  # (one poller, the lane server, for all its rings)
        a.close()
        deadline = time.monotonic() + 10
        while w.run(lambda: len(SERVERS[-1]._rings)) != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _polled_rings(w) == 1  # (b's ring still open: still polled)
        ref = b.matmul("w", x).copy()
        b.close()
        deadline = time.monotonic() + 10
        while _polled_rings(w) and time.monotonic() < deadline:
            time.sleep(0.01)
        # no ring lane open: the selector sleeps uncapped again (an idle worker stays idle)
        assert _polled_rings(w) == 0
        with c.open_lane(r2) as again:  # a new ring lane: polled again, answered as before
            assert again.ring and _polled_rings(w) == 1
            np.testing.assert_array_equal(again.matmul("w", x), ref)


class _Inner:
    """A selector stand-in: select(0) finds nothing; a blocking select returns ``events``."""

    def __init__(self) -> None:
        self.polls = 0  # select(0): the spin's looks
        self.blocks: list[float | None] = []
        self.events: list[Any] = []

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout == 0:
            self.polls += 1
            return []
        self.blocks.append(timeout)
        got, self.events = self.events, []
        return got


class _IdleRing:
    def __init__(self) -> None:
        self.flags: list[bool] = []

    def poll(self) -> bool:
        return False

    def sleeping(self, on: bool) -> None:
        self.flags.append(on)


def test_an_idle_ring_sleep_is_not_followed_by_a_spin() -> None:
    """A loop polling rings wakes every RING_SLEEP_MAX_S; a wake that found nothing sleeps
    again at once: no busy-poll spin after it (the H200's 1 ms spin made 8 idle ring lanes
    cost ~18% of a core); an event (or ring work) brings the spin back."""
    inner, ring = _Inner(), _IdleRing()
    sel = threads._BusyPoll(inner, 0.002)
    sel.rings.append(ring)
    assert sel.select(None) == [] and inner.polls > 0  # (spun, then slept to the cap)
    assert inner.blocks == [threads.RING_SLEEP_MAX_S] and sel.ring_idle
    for _ in range(3):  # idle: straight to the capped sleep, flags set and cleared each time
        polls = inner.polls
        assert sel.select(None) == [] and inner.polls == polls
    assert len(inner.blocks) == 4 and ring.flags == [True, False] * 4
    inner.events = ["ev"]  # woken by an event: the next select spins again
    assert sel.select(None) == ["ev"] and not sel.ring_idle
    polls = inner.polls
    sel.select(None)
    assert inner.polls > polls
    # a sleep cut short by the loop's own timeout (a timer) is not an idle ring's
    sel.ring_idle = False
    sel.select(threads.RING_SLEEP_MAX_S / 10)
    assert not sel.ring_idle


def test_ring_lanes_through_frontends_and_drain(rng: np.random.Generator,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A --frontends worker's device process serves ring lanes as the socket's; drained, a
    ring lane's call is UNAVAILABLE (the socket closed), not left waiting."""
    from tests.dataplane.test_frontends import Running

    monkeypatch.setenv("Q6SERVE_LANE_RING", "1")
    w = Running(dataclasses.replace(BASE, frontends=2))
    try:
        c = w.client()
        c.upload("w", random_q6k(ROWS, K, 4), ROWS, K)
        region = c.register_shm("io", 1 << 16)
        lane = c.open_lane(region)
        assert lane.ring
        for n in (1, 4, 1):
            x = rng.standard_normal((n, K)).astype(np.float32)
            np.testing.assert_array_equal(lane.matmul("w", x), c.matmul("w", x))
        assert code_of(lambda: lane.matmul("nope", x))[0] == C.NOT_FOUND
        assert w.worker.plane.lanes is not None and w.worker.plane.lanes.rung == 4
        w.stop()
        assert code_of(lambda: lane.matmul("w", x))[0] == C.UNAVAILABLE
        lane.close()
        region.on_close = None  # the worker is gone: nothing to unregister
        region.close()
    finally:
        w.stop()


def test_open_lane_chooses_the_ring_over_the_callers_variable(
        ring_worker: Any, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Client.open_lane(region, ring=...)`` decides the lane's way whatever this process's
    Q6SERVE_LANE_RING says; None leaves it to the variable (the fixture sets it to 1)."""
    _w, c = ring_worker
    x = rng.standard_normal((1, K)).astype(np.float32)
    with c.register_shm("io", 1 << 16) as r1, c.register_shm("io2", 1 << 16) as r2, \
            c.register_shm("io3", 1 << 16) as r3, c.open_lane(r1, ring=False) as sock, \
            c.open_lane(r2) as by_env:
        assert not sock.ring and by_env.ring
        monkeypatch.setenv("Q6SERVE_LANE_RING", "0")
        with c.open_lane(r3, ring=True) as ring:
            assert ring.ring
            np.testing.assert_array_equal(ring.matmul("w", x), sock.matmul("w", x))


def test_a_host_that_may_reorder_stores_takes_no_ring(monkeypatch: pytest.MonkeyPatch,
                                                     rng: np.random.Generator) -> None:
    """The ring publishes a record by storing its sequence last: only on x86-64 (ordered
    stores) does the worker take ring lanes, even with Q6SERVE_LANE_RING=1; elsewhere the setup
    is refused with a message that says why and the lane stays a socket lane."""
    monkeypatch.setenv("Q6SERVE_LANE_RING", "1")
    monkeypatch.setattr(slane, "ORDERED_STORES", False)
    monkeypatch.setattr(slane.platform, "machine", lambda: "aarch64")
    assert not slane.ring_allowed()
    w = RunningWorker(dataclasses.replace(BASE))
    try:
        c = w.client()
        c.upload("w", random_q6k(ROWS, K, 3), ROWS, K)
        x = rng.standard_normal((1, K)).astype(np.float32)
        with c.register_shm("io", 1 << 16) as region:
            code, msg = code_of(lambda: _lane(c, region, ring=True))
            assert code == C.FAILED_PRECONDITION and "aarch64" in msg, msg
            with c.open_lane(region, ring=False) as lane:
                np.testing.assert_array_equal(lane.matmul("w", x), c.matmul("w", x))
        assert _held(w) == []
    finally:
        w.stop()


def test_a_killed_caller_leaves_no_ring_behind(ring_worker: Any) -> None:
    """A caller process killed (SIGKILL) with a ring lane open: the worker drops the ring (its
    mapping closed) and nothing of the ring is left in /dev/shm (a memfd has no name). (The
    child's resource tracker warns of its region's object, which it
    unlinks: the region's, not the ring's.)"""
    import signal
    import subprocess
    import sys
    import textwrap

    w, _c = ring_worker
    code = textwrap.dedent(f"""
        import time
        from q6serve.client.client import Client
        c = Client({w.target!r}, token="a-secret")
        r = c.register_shm("killed", 1 << 16)
        lane = c.open_lane(r)
        print(lane.ring, lane._ring_mm is not None, flush=True)
        time.sleep(120)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        took, mapped = p.stdout.readline().split()
        assert took == mapped == "True"
        server = SERVERS[-1]  # (started by the child's OpenLane)
        assert w.run(lambda: len(server._rings)) == 1
        assert not list(slane.regions.SHM_DIR.glob("q6ring*"))
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 10
        while w.run(lambda: len(server._rings)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.run(lambda: len(server._rings)) == 0
        assert not list(slane.regions.SHM_DIR.glob("q6ring*"))
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
