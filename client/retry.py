"""The one retry policy of every client: exponential backoff on UNAVAILABLE only, inside the
caller's deadline.

UNAVAILABLE means the worker did not run the call (no connection, or draining and refusing new
work), so a retry cannot apply it twice. Every other code is the worker's answer and is raised
at once. The deadline covers all attempts together: each attempt gets the time that is left,
and no backoff sleep runs past it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

T = TypeVar("T")

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in all (1 = no retries); sleeps grow from ``initial_backoff`` by
    ``multiplier`` up to ``max_backoff`` seconds, with full jitter (uniform in [0, cap])."""

    attempts: int = 4
    initial_backoff: float = 0.05
    max_backoff: float = 1.0
    multiplier: float = 2.0
    jitter: bool = True

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts={self.attempts} must be >= 1")
        if self.initial_backoff < 0 or self.max_backoff < 0 or self.multiplier < 1:
            raise ValueError("backoffs must be >= 0 and the multiplier >= 1")

    def backoff(self, retry: int, rand: Callable[[], float] = random.random) -> float:
        """Seconds to sleep before retry number ``retry`` (0-based)."""
        cap = min(self.max_backoff, self.initial_backoff * self.multiplier**retry)
        return cap * rand() if self.jitter else cap


NO_RETRY = RetryPolicy(attempts=1)


def _retryable(e: BaseException) -> bool:
    return isinstance(e, grpc.RpcError) and e.code() in RETRYABLE  # type: ignore[attr-defined]


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def pause_or_raise(e: grpc.RpcError, attempt: int, policy: RetryPolicy,
                    deadline: float | None) -> float:
    """The pause before the next attempt after failure ``e``; re-raises ``e`` when it is not
    retryable, the attempts are spent, or the pause would pass the deadline."""
    if not _retryable(e) or attempt + 1 == policy.attempts:
        raise e
    pause = policy.backoff(attempt)
    left = _remaining(deadline)
    if left is not None and pause >= left:
        raise e
    return pause


def call_with_retry(fn: Callable[[float | None], T], policy: RetryPolicy,
                    timeout: float | None, sleep: Callable[[float], None] = time.sleep) -> T:
    """``fn(time_left)`` until it succeeds, fails with a non-retryable error, runs out of
    attempts, or the next sleep would pass the deadline (then the last error is raised)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for attempt in range(policy.attempts):
        try:
            return fn(_remaining(deadline))
        except grpc.RpcError as e:
            sleep(pause_or_raise(e, attempt, policy, deadline))
    raise AssertionError("unreachable")  # the loop returns or raises


async def acall_with_retry(fn: Callable[[float | None], Awaitable[T]], policy: RetryPolicy,
                           timeout: float | None) -> T:
    """:func:`call_with_retry` for coroutines (sleeps without blocking the event loop)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for attempt in range(policy.attempts):
        try:
            return await fn(_remaining(deadline))
        except grpc.RpcError as e:
            await asyncio.sleep(pause_or_raise(e, attempt, policy, deadline))
    raise AssertionError("unreachable")


CORE_RACE_DETAILS = "Internal error from Core"


def core_race(e: grpc.RpcError) -> bool:
    """Whether ``e`` is grpc.aio's status of a client stream whose failed write was handled after
    the worker's early status (grpc/grpc issue 36066): INTERNAL "Internal error from Core"."""
    return (e.code() == grpc.StatusCode.INTERNAL  # type: ignore[attr-defined]
            and e.details() == CORE_RACE_DETAILS)  # type: ignore[attr-defined]
