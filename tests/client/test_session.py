"""Closed-loop sessions (client/session.py): Client.session() and AsyncClient.session() make
each call one request and its reply on one MatmulStream -- the same results as the unary
calls, an error reply raised without ending the stream, nothing sent as a unary Matmul."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from svc_util import random_q6k

from q6serve.client.async_client import AsyncClient
from q6serve.client.client import Client, Q6ServeError

K = 512
SHAPES = {"q": (48, 1), "k": (32, 2), "v": (16, 3)}
SVC = "q6serve.v1.Q6Serve"


def _count(worker: Any, method: str, code: str = "OK") -> float:
    return worker.registry.get_sample_value(
        "q6serve_requests_total", {"service": SVC, "method": method, "code": code}) or 0.0


@pytest.fixture
def loaded(worker: Any) -> Iterator[Client]:
    c = Client(worker.target)
    for name, (rows, seed) in SHAPES.items():
        c.upload(name, random_q6k(rows, K, seed), rows, K)
    yield c
    c.close()


def _x(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, K)).astype(np.float32)


@pytest.mark.parametrize("thread", [True, False])
def test_sync_session_matches_the_unary_calls(worker: Any, loaded: Client, thread: bool) -> None:
    x = _x(3)
    want_q = loaded.matmul("q", x)
    want_qkv = loaded.matmul_multi(["q", "k", "v"], x, out_dtype="f16")
    want_top = loaded.matmul_topk("q", x, 5)
    unary = _count(worker, "Matmul")
    threads = threading.active_count()
    with loaded.session(thread=thread) as s:
        assert threading.active_count() == threads + thread  # the session's loop's thread
        for _ in range(3):  # closed loop on one stream: each call its own reply
            np.testing.assert_array_equal(s.matmul("q", x), want_q)
            for got, want in zip(s.matmul_multi(["q", "k", "v"], x, out_dtype="f16"), want_qkv,
                                 strict=True):
                assert got.dtype == np.float16
                np.testing.assert_array_equal(got, want)
            top = s.matmul_topk("q", x, 5)
            np.testing.assert_array_equal(top.indices, want_top.indices)
            np.testing.assert_array_equal(top.values, want_top.values)
        with pytest.raises(Q6ServeError) as e:  # an error reply: the stream goes on
            s.matmul("nope", x)
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        np.testing.assert_array_equal(s.matmul("q", x), want_q)
    assert threading.active_count() == threads  # closed: the thread is gone
    with pytest.raises(ValueError, match="closed"):
        s.matmul("q", x)
    assert _count(worker, "Matmul") == unary  # nothing went as a unary call
    assert _count(worker, "MatmulStream/request") == 3 * 3 + 1
    assert _count(worker, "MatmulStream/request", "NOT_FOUND") == 1


@pytest.mark.parametrize("thread", [True, False])
def test_sync_session_from_several_threads(loaded: Client, thread: bool) -> None:
    """Calls from several threads take turns on the one stream (thread=False: on the loop,
    which one caller runs at a time): each gets its own reply."""
    xs = [_x(1, seed) for seed in range(8)]
    want = [loaded.matmul("k", x) for x in xs]
    got: list[Any] = [None] * len(xs)
    with loaded.session(thread=thread) as s:
        def run(i: int) -> None:
            for _ in range(3):
                got[i] = s.matmul("k", xs[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_sync_session_without_a_thread_from_async_code(loaded: Client) -> None:
    """thread=False called where an event loop runs (a blocking call from async code): the
    session's loop cannot run in that thread, so a helper thread runs it for the call."""
    x = _x(2, 7)
    want = loaded.matmul("v", x)
    with loaded.session(thread=False) as s:
        np.testing.assert_array_equal(s.matmul("v", x), want)  # in this thread

        async def inside() -> np.ndarray:
            return s.matmul("v", x)

        np.testing.assert_array_equal(asyncio.run(inside()), want)
        np.testing.assert_array_equal(s.matmul("v", x), want)  # and back in this thread


def test_async_session_matches_the_unary_calls(worker: Any, loaded: Client) -> None:
    x = _x(2, 4)
    want = loaded.matmul_multi(["q", "v"], x)
    unary = _count(worker, "Matmul")

    async def go() -> None:
        async with AsyncClient(worker.target) as c, c.session() as s:
            got = await asyncio.gather(*(s.matmul_multi(["q", "v"], x) for _ in range(4)))
            for ys in got:  # concurrent calls of one session: each its own reply
                for y, w in zip(ys, want, strict=True):
                    np.testing.assert_array_equal(y, w)
            with pytest.raises(Q6ServeError) as e:
                await s.matmul_full(["q", "nope"], x)
            assert e.value.code == grpc.StatusCode.NOT_FOUND
            np.testing.assert_array_equal(await s.matmul("v", x), want[1])
        with pytest.raises(ValueError, match="not open"):
            await s.matmul("v", x)

    asyncio.run(go())
    assert _count(worker, "Matmul") == unary
    assert _count(worker, "MatmulStream/request") == 4 + 1


def test_async_session_ends_when_a_call_is_cancelled_before_its_reply(loaded: Client) -> None:
    """A call cancelled after its request went out (a caller's own timeout) leaves a reply on
    the stream that the next call would read as its own: the session ends the stream instead,
    so the next call raises (CANCELLED) and never returns the stale y."""
    x_q, x_v = _x(2, 1), _x(2, 2)

    async def go() -> None:
        async with AsyncClient(loaded.target) as c, c.session() as s:
            task = asyncio.ensure_future(s.matmul("q", x_q))
            await asyncio.sleep(0)  # the call starts: its request is being written
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert task.cancelled()
            with pytest.raises(Q6ServeError) as e:
                await s.matmul("v", x_v)
            assert e.value.code == grpc.StatusCode.CANCELLED

    asyncio.run(go())


@pytest.mark.parametrize("thread", [True, False])
def test_sync_session_spinning(loaded: Client, thread: bool) -> None:
    """Client.session(spin_us=...): the session's loop polls without sleeping before it
    blocks, so a reply that comes within the spin (a second here, far above a NumPy call) is
    found while spinning; the results are the unary calls'. No spin: the loop's own selector."""
    x = _x(2)
    want = loaded.matmul_multi(["q", "k", "v"], x)
    with loaded.session(thread=thread, spin_us=1e6) as s:
        for _ in range(3):
            for got, w in zip(s.matmul_multi(["q", "k", "v"], x), want, strict=True):
                np.testing.assert_array_equal(got, w)
        assert s._loop._selector.spun >= 3  # type: ignore[attr-defined]
    with loaded.session(thread=thread, spin_us=0) as s:
        np.testing.assert_array_equal(s.matmul("q", x), want[0])
        assert not hasattr(s._loop._selector, "spun")  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="spin_us"):
        loaded.session(spin_us=-1.0)


def test_session_spin_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocking session's default spin: SESSION_SPIN_US where the process may run on
    SPIN_MIN_CPUS cores or more, none on fewer; $Q6SERVE_SESSION_SPIN_US overrides (0: never),
    and a bad value is refused naming the variable."""
    from q6serve.client import session

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(16)))
    assert session.session_spin_us({}) == session.SESSION_SPIN_US == 2000.0
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1})
    assert session.session_spin_us({}) == 0.0
    assert session.session_spin_us({"Q6SERVE_SESSION_SPIN_US": "300"}) == 300.0
    assert session.session_spin_us({"Q6SERVE_SESSION_SPIN_US": " 0 "}) == 0.0
    for bad in ("-1", "fast", "nan", "inf"):
        with pytest.raises(ValueError, match="Q6SERVE_SESSION_SPIN_US"):
            session.session_spin_us({"Q6SERVE_SESSION_SPIN_US": bad})


def test_sync_session_defaults(loaded: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """Client.session() with no arguments: the session's loop run by the calling thread (no
    thread of its own) and spinning as session_spin_us says (bundle B, session 22: faster
    than the threaded session at S = 1 and 8 on the H200)."""
    monkeypatch.setenv("Q6SERVE_SESSION_SPIN_US", "1000000")
    x = _x(1)
    want = loaded.matmul("v", x)
    threads = threading.active_count()
    with loaded.session() as s:
        assert threading.active_count() == threads
        assert s.spin_us == 1e6
        np.testing.assert_array_equal(s.matmul("v", x), want)
        assert s._loop._selector.spun >= 1  # type: ignore[attr-defined]
    with loaded.session(thread=True) as s:  # its loop thread does not spin by default
        assert s.spin_us == 0 and not hasattr(s._loop._selector, "spun")  # type: ignore[attr-defined]
    monkeypatch.setenv("Q6SERVE_SESSION_SPIN_US", "0")
    with loaded.session() as s:
        assert s.spin_us == 0 and not hasattr(s._loop._selector, "spun")  # type: ignore[attr-defined]
