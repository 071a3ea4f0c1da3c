"""Blocking work off the event loop, in daemon threads the process can always exit without.

``asyncio.to_thread`` runs on the loop's default executor, whose threads ``asyncio.run`` joins
at exit: a GGUF parse or a quantize still running then kept a stopping worker alive for as
long as it took (120 s seen). The long jobs run here instead; they also poll a cancellation
callable, so a drain past its grace period abandons them (docs/RELIABILITY.md, "Drain").
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from q6serve.kernels.errors import Unavailable

from . import envvars

T = TypeVar("T")


def settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    """A job's outcome to its waiter's future (a cancelled waiter is simply not answered)."""
    if not fut.done():
        if exc is None:
            fut.set_result(result)
        else:
            fut.set_exception(exc)


def outcome(fut: asyncio.Future[Any]) -> tuple[Any, BaseException | None]:
    """A done future's (result, None) or (None, exception), the inverse of :func:`settle`; a
    cancelled one reads as Unavailable (its caller is answered, not left waiting)."""
    if fut.cancelled():
        return None, Unavailable("the call was cancelled")
    exc = fut.exception()
    return (None, exc) if exc is not None else (fut.result(), None)


def run_in_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """Run ``fn(*args)`` in a new daemon thread; its outcome comes back on the loop."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def work() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (fn(*args), None)
        except BaseException as e:  # the waiter must hear of every failure
            outcome = (None, e)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(settle, fut, *outcome)

    name = getattr(fn, "__name__", "job")
    threading.Thread(target=work, name=f"q6serve-{name}", daemon=True).start()
    return fut


BUSY_POLL_ENV = envvars.BUSY_POLL_US.name  # > 0: the loop polls that long before it sleeps
# Without the env: the loop polls BUSY_POLL_US where the process may run on at least
# BUSY_POLL_MIN_CPUS cores, never on fewer (a spin takes a core gRPC's threads or a client on
# the same host need: on the 2-core VM it was worse, and a worker pinned to one core would
# starve its own gRPC threads). On the H200 host (16 cores), 1000 us took T1's p50 - kernel
# 646/652 -> 517/544 us and the 4-layer replay's step at S=1 18.4 -> 13.5 ms (bench/RESULTS.md,
# "session 8"): everything after a sleep runs slower there (a 100 us pause of the caller adds
# ~80 us to a bare echo's round trip; the direct job's host launch takes 57 us after 300 us
# asleep, 27 back to back), and a spinning loop thread does not sleep between a reply and the
# next request.
BUSY_POLL_US = 1000.0
BUSY_POLL_MIN_CPUS = envvars.SPIN_MIN_CPUS


def busy_poll_us(env: Mapping[str, str] | None = None) -> float:
    """The loop's spin before it sleeps, in us: ``Q6SERVE_BUSY_POLL_US`` when set (anything
    but a number >= 0 is refused: envvars), else BUSY_POLL_US on a process allowed
    BUSY_POLL_MIN_CPUS cores or more, else 0."""
    return envvars.spin_us(envvars.BUSY_POLL_US, BUSY_POLL_US, env)


class _BusyPoll:
    """The event loop's selector, polling without blocking for up to ``spin_s`` before a
    blocking select (busy polling, as SO_BUSY_POLL does for sockets): an event that comes
    within the spin (gRPC's poller thread writing its wake-up byte, the client's next
    request) is seen at once by a thread that is running, on warm caches and clocks, instead
    of by one woken from epoll (a thread wake-up: ~30 us on the H200 host). It spins only
    while every ``may_spin()`` says so (an Engine: no job in its device thread, whose
    hand-back needs the GIL this thread takes back after each poll), and never longer than
    the loop's own timeout. The rest of the selector is the wrapped one's."""

    def __init__(self, inner: Any, spin_s: float) -> None:
        self._inner = inner
        self.spin_s = spin_s
        self.may_spin: list[Callable[[], bool]] = []
        self.spun = 0  # selects that found an event while spinning
        self.rings: list[RingPoller] = []  # shared-memory rings polled with the selector
        # the last select was a ring sleep that ran to its cap and found nothing: the next
        # one sleeps at once, no spin (idle ring lanes: a wake-up every RING_SLEEP_MAX_S, not a
        # spin of spin_s after each: 1 ms of 5 on the H200's default, ~18% of a core idle)
        self.ring_idle = False

    def select(self, timeout: float | None = None) -> Any:
        rings = self.rings
        if rings and _polled(rings):
            self.ring_idle = False
            return []  # (the rings' work was scheduled on the loop: run in this trip)
        if timeout == 0 or self.ring_idle or not all(ok() for ok in self.may_spin):
            return self._sleep(timeout)
        now = time.perf_counter
        t0 = now()
        spin = self.spin_s if timeout is None else min(self.spin_s, timeout)
        while True:
            events = self._inner.select(0)
            if events:
                self.spun += 1
                return events
            if rings and _polled(rings):
                self.spun += 1
                return []
            if now() - t0 >= spin:
                break
        return self._sleep(None if timeout is None else max(0.0, timeout - spin))

    def _sleep(self, timeout: float | None) -> Any:
        """The blocking select. With rings: each ring's flag says this side sleeps (the
        other side then rings the doorbell: a byte on its socket), the rings re-checked for
        RING_RECHECK_S first (a request stored just before the flag was seen: x86 may let
        the other side's flag load pass its own store), and the sleep capped at
        RING_SLEEP_MAX_S (a doorbell missed all the same costs at most that)."""
        rings = self.rings
        if not rings or timeout == 0:
            self.ring_idle = False
            return self._inner.select(timeout)
        for r in rings:
            r.sleeping(True)
        try:
            now = time.perf_counter
            end = now() + RING_RECHECK_S
            while True:
                if _polled(rings):
                    self.ring_idle = False
                    return []
                if now() >= end:
                    break
            cap = RING_SLEEP_MAX_S
            events = self._inner.select(cap if timeout is None else min(timeout, cap))
            self.ring_idle = not events and (timeout is None or timeout > cap)
            return events
        finally:
            for r in rings:
                r.sleeping(False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class RingPoller(Protocol):
    """A shared-memory ring the event loop polls (service/lane.py's ring lanes)."""

    def poll(self) -> bool:
        """New work scheduled on the loop (``call_soon``)? Called in the selector."""
        ...

    def sleeping(self, on: bool) -> None:
        """The loop is about to block (True) / awake again (False)."""
        ...


RING_RECHECK_S = 20e-6  # the rings re-checked after the sleep flags are set
RING_SLEEP_MAX_S = 0.005  # the longest blocking select while rings are polled


def _polled(rings: list[RingPoller]) -> bool:
    found = False
    for r in rings:
        if r.poll():
            found = True
    return found


def ring_poll(loop: asyncio.AbstractEventLoop, ring: RingPoller) -> bool:
    """Poll ``ring`` in ``loop``'s selector (wrapped as :func:`busy_poll` does, without a
    spin where none was set); False: a loop without a selector to wrap."""
    selector = getattr(loop, "_selector", None)
    if selector is None:
        return False
    if not isinstance(selector, _BusyPoll):
        selector = loop._selector = _BusyPoll(selector, 0.0)  # type: ignore[attr-defined]
    if ring not in selector.rings:
        selector.rings.append(ring)
    return True


def ring_unpoll(loop: asyncio.AbstractEventLoop, ring: RingPoller) -> None:
    selector = getattr(loop, "_selector", None)
    if isinstance(selector, _BusyPoll) and ring in selector.rings:
        selector.rings.remove(ring)


def busy_poll(loop: asyncio.AbstractEventLoop, may_spin: Callable[[], bool],
              spin_us: float | None = None) -> _BusyPoll | None:
    """When ``spin_us`` (None: :func:`busy_poll_us`) > 0: make ``loop`` busy-poll (see
    :class:`_BusyPoll`; once per loop) while ``may_spin()`` and every earlier caller's say so;
    returns the poller (None: off, or a loop without a selector to wrap)."""
    if spin_us is None:
        spin_us = busy_poll_us()
    selector = getattr(loop, "_selector", None)  # asyncio's selector loops
    if spin_us <= 0 or selector is None:
        return None
    if not isinstance(selector, _BusyPoll):
        selector = loop._selector = _BusyPoll(selector, spin_us * 1e-6)  # type: ignore[attr-defined]
    selector.spin_s = max(selector.spin_s, spin_us * 1e-6)  # (a ring's wrapper: spinless)
    selector.may_spin.append(may_spin)
    return selector
