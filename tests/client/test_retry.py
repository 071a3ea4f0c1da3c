"""Retries: backoff schedule, UNAVAILABLE only, inside the deadline; against a flaky server."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

from q6serve.client.client import Q6ServeError
from q6serve.client.retry import NO_RETRY, RetryPolicy, call_with_retry, core_race


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


def failing(codes: list[grpc.StatusCode], calls: list[float | None]) -> Callable[..., str]:
    """Raises ``codes`` one per call, then returns "ok"; records each call's time left."""
    def fn(left: float | None) -> str:
        calls.append(left)
        if len(calls) <= len(codes):
            raise FakeRpcError(codes[len(calls) - 1])
        return "ok"

    return fn


def test_backoff_grows_and_caps() -> None:
    p = RetryPolicy(initial_backoff=0.1, max_backoff=0.3, multiplier=2.0, jitter=False)
    assert [p.backoff(i) for i in range(4)] == [0.1, 0.2, 0.3, 0.3]
    jittered = RetryPolicy(initial_backoff=0.1, max_backoff=0.3)
    assert jittered.backoff(1, rand=lambda: 0.5) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)


def test_retries_unavailable_then_succeeds() -> None:
    calls: list[float | None] = []
    sleeps: list[float] = []
    fn = failing([grpc.StatusCode.UNAVAILABLE] * 2, calls)
    policy = RetryPolicy(attempts=3, initial_backoff=0.01, jitter=False)
    assert call_with_retry(fn, policy, timeout=10.0, sleep=sleeps.append) == "ok"
    assert len(calls) == 3 and sleeps == [0.01, 0.02]
    assert all(c is not None and 0 < c <= 10.0 for c in calls)  # each attempt: time left


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.INVALID_ARGUMENT])
def test_other_codes_are_not_retried(code: grpc.StatusCode) -> None:
    calls: list[float | None] = []
    with pytest.raises(FakeRpcError):
        call_with_retry(failing([code], calls), RetryPolicy(), timeout=None,
                        sleep=lambda s: None)
    assert len(calls) == 1


def test_gives_up_after_attempts_and_before_the_deadline() -> None:
    calls: list[float | None] = []
    with pytest.raises(FakeRpcError):
        call_with_retry(failing([grpc.StatusCode.UNAVAILABLE] * 9, calls),
                        RetryPolicy(attempts=4, jitter=False), None, sleep=lambda s: None)
    assert len(calls) == 4
    calls.clear()
    # a 0.5 s pause does not fit a 0.1 s deadline: raise at once instead of sleeping past it
    with pytest.raises(FakeRpcError):
        call_with_retry(failing([grpc.StatusCode.UNAVAILABLE] * 9, calls),
                        RetryPolicy(initial_backoff=0.5, jitter=False), 0.1,
                        sleep=lambda s: pytest.fail("slept past the deadline"))
    assert len(calls) == 1


FAST = RetryPolicy(attempts=3, initial_backoff=0.01, jitter=False)


def test_clients_retry_unavailable(flaky: Any, make_client: Callable[..., Any]) -> None:
    target, servicer = flaky(2, grpc.StatusCode.UNAVAILABLE)
    c = make_client(target, retry=FAST)
    assert c.status().backend == "fake"
    assert servicer.calls["GetStatus"] == 3
    # an upload retried resends the whole stream from its header
    w = c.upload("w", np.zeros(3 * 210, np.uint8), 1, 768)
    assert (w.name, w.nbytes) == ("w", 630) and servicer.headers == ["w"] * 3


def test_clients_do_not_retry_other_codes(flaky: Any, make_client: Callable[..., Any]) -> None:
    target, servicer = flaky(1, grpc.StatusCode.INTERNAL)
    c = make_client(target, retry=FAST)
    with pytest.raises(Q6ServeError) as e:
        c.status()
    assert e.value.code is grpc.StatusCode.INTERNAL and "attempt 1" in e.value.message
    assert servicer.calls["GetStatus"] == 1


def test_retry_can_be_disabled(flaky: Any, make_client: Callable[..., Any]) -> None:
    target, servicer = flaky(1, grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(Q6ServeError) as e:
        make_client(target, retry=NO_RETRY).status()
    assert e.value.code is grpc.StatusCode.UNAVAILABLE and servicer.calls["GetStatus"] == 1


def test_core_race_is_only_grpc_aio_internal_from_core() -> None:
    class E(grpc.RpcError):
        def __init__(self, code: grpc.StatusCode, details: str) -> None:
            self._c, self._d = code, details

        def code(self) -> grpc.StatusCode:
            return self._c

        def details(self) -> str:
            return self._d

    assert core_race(E(grpc.StatusCode.INTERNAL, "Internal error from Core"))
    assert not core_race(E(grpc.StatusCode.INTERNAL, "boom"))
    assert not core_race(E(grpc.StatusCode.ALREADY_EXISTS, "Internal error from Core"))
