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
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def run_in_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """Run ``fn(*args)`` in a new daemon thread; its outcome comes back on the loop."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def done(result: Any, exc: BaseException | None) -> None:
        if fut.done():  # the waiter went away
            return
        if exc is None:
            fut.set_result(result)
        else:
            fut.set_exception(exc)

    def work() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (fn(*args), None)
        except BaseException as e:  # the waiter must hear of every failure
            outcome = (None, e)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(done, *outcome)

    name = getattr(fn, "__name__", "job")
    threading.Thread(target=work, name=f"q6serve-{name}", daemon=True).start()
    return fut
