"""Q6SERVE_BUSY_POLL_US (service/threads.py): the loop polls before it sleeps, only while the
engine's device thread has no job, and serves the same; without the env, on processes allowed
enough cores only."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest

from q6serve.service import threads


def test_busy_poll_sees_events_while_spinning_and_only_when_allowed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        monkeypatch.setenv(threads.BUSY_POLL_ENV, "0")
        assert threads.busy_poll(loop, lambda: True) is None  # off
        monkeypatch.setenv(threads.BUSY_POLL_ENV, "1000000")  # 1 s: long enough to see
        allowed = [True]
        poller = threads.busy_poll(loop, lambda: allowed[0])
        assert poller is not None and loop._selector is poller  # type: ignore[attr-defined]
        assert threads.busy_poll(loop, lambda: True) is poller  # once per loop
        a, b = socket.socketpair()
        got = asyncio.Event()
        loop.add_reader(a.fileno(), lambda: (a.recv(1), got.set()))
        try:
            # a byte written from another thread while the loop spins is seen spinning
            threading.Timer(0.02, b.send, (b"x",)).start()
            t0 = time.perf_counter()
            await asyncio.wait_for(got.wait(), 5)
            assert poller.spun >= 1 and time.perf_counter() - t0 < 1
            # not allowed (a device-thread job): a plain blocking select
            allowed[0] = False
            got.clear()
            spun = poller.spun
            threading.Timer(0.02, b.send, (b"y",)).start()
            await asyncio.wait_for(got.wait(), 5)
            assert poller.spun == spun
            # timers still fire on time (the spin never outlasts the loop's timeout)
            allowed[0] = True
            t0 = time.perf_counter()
            await asyncio.sleep(0.01)
            assert time.perf_counter() - t0 < 0.1
        finally:
            loop.remove_reader(a.fileno())
            a.close()
            b.close()

    asyncio.run(main())


def test_busy_poll_default_depends_on_the_cores_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    many = set(range(threads.BUSY_POLL_MIN_CPUS))
    few = set(range(threads.BUSY_POLL_MIN_CPUS - 1))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: many)
    assert threads.busy_poll_us({}) == threads.BUSY_POLL_US > 0
    assert threads.busy_poll_us({threads.BUSY_POLL_ENV: "  "}) == threads.BUSY_POLL_US
    assert threads.busy_poll_us({threads.BUSY_POLL_ENV: "0"}) == 0  # the env wins
    assert threads.busy_poll_us({threads.BUSY_POLL_ENV: "250"}) == 250
    for bad in ("-5", "soon"):  # refused by name (envvars), not read as off
        with pytest.raises(ValueError, match=f"{threads.BUSY_POLL_ENV}={bad!r}"):
            threads.busy_poll_us({threads.BUSY_POLL_ENV: bad})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: few)  # pinned, small host
    assert threads.busy_poll_us({}) == 0
    assert threads.busy_poll_us({threads.BUSY_POLL_ENV: "250"}) == 250


def test_outcome_reads_a_done_future_back() -> None:
    """threads.outcome, settle's inverse: a result, an exception, and a cancelled future
    (read as Unavailable, so its caller is answered)."""
    from q6serve.kernels.errors import Unavailable

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ok, bad, gone = loop.create_future(), loop.create_future(), loop.create_future()
        threads.settle(ok, 7, None)
        err = ValueError("x")
        threads.settle(bad, None, err)
        gone.cancel()
        assert threads.outcome(ok) == (7, None)
        assert threads.outcome(bad) == (None, err)
        res, exc = threads.outcome(gone)
        assert res is None and isinstance(exc, Unavailable), exc
        assert "cancelled" in str(exc)

    asyncio.run(main())
