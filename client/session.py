"""Closed-loop matmul sessions: one MatmulStream kept open, one request and its reply at a time.

A decode host calls the worker once per matmul of a step, each call needing the previous one's
output. Measured on the H200's 28-layer replay (session 21, docs/SERVICE.md "The caller's
gRPC"), the cheapest way to make such calls from Python is grpc.aio on one MatmulStream: at S=1
a step took 105 ms so, 154-175 ms through the sync stub's stream (its request-iterator thread
and the channel's poller hand each message over) and 259 ms through the sync stub's unary
calls (what :meth:`Client.matmul` makes: each call a new HTTP/2 stream).

    async with client.session() as s:              # AsyncClient
        q, k, v = await s.matmul_multi(["q", "k", "v"], x)
    with client.session() as s:                     # Client: the same stream, run on a
        y = s.matmul("down", x)                     # private event loop thread

The blocking client's session runs its event loop in the calling thread during each call
(``thread=False``, the default) and, on a host where this process may use SPIN_MIN_CPUS cores or
more, polls for the reply without sleeping for up to ``SESSION_SPIN_US`` before it blocks (the
worker's and the fast lane's busy-polling rule): the reply is then read by a thread that is
running, not one woken from epoll. H200, session 22 bundle B (docs/SERVICE.md "The caller's
side, session 22"): a step of the 4-layer replay at S=1 / S=8, 10.3 / 14.5 ms so against
13.6 / 19.5 through the session's own loop thread (session 21's default) and 11.1 / 16.3 for
grpc.aio on the host's own loop. ``Q6SERVE_SESSION_SPIN_US`` (microseconds, 0: never) or
``spin_us=`` override; ``thread=True`` hands each call to a loop thread of the session's own.

Calls of one session are made one at a time (concurrent ones wait their turn); a reply that is
an error raises :class:`Q6ServeError` and the stream goes on. Not retried: a request already
sent may have run. ``timeout`` bounds the whole session, as for ``matmul_stream``; a stream
that failed (the worker gone, the deadline passed, a call cancelled before its reply, e.g. by
``asyncio.wait_for``) fails every later call: open a new session.
Why it is not what ``Client.matmul`` does by default: unary calls have a deadline each and are
retried on UNAVAILABLE (client/retry.py), which a call on an open stream cannot be.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import numpy as np

from . import core
from .core import MatmulOutput, Q6ServeError, TopK, Weights
from .spin import caller_spin_us

T = TypeVar("T")
SPIN_ENV = "Q6SERVE_SESSION_SPIN_US"
# the blocking session's default spin where the caller may run on SPIN_MIN_CPUS cores or more:
# a reply of the replay comes 0.4-1.3 ms after its request on the H200 (S = 1-8), within it
SESSION_SPIN_US = 2000.0


def session_spin_us(env: Mapping[str, str] | None = None) -> float:
    """A blocking session's spin before it blocks for a reply, in us: ``Q6SERVE_SESSION_SPIN_US``
    when set, else SESSION_SPIN_US on a process allowed SPIN_MIN_CPUS cores or more, else 0
    (client/spin.py)."""
    return caller_spin_us(SPIN_ENV, SESSION_SPIN_US, "a session's caller", env)


class AsyncMatmulSession:
    """One MatmulStream of an :class:`~.async_client.AsyncClient`'s channel (``stub``: its
    bytes stub), used closed-loop: :meth:`matmul_full` writes one request and reads its
    reply. Open with ``async with`` (or :meth:`open`), end with :meth:`close`."""

    def __init__(self, stub: Any, metadata: Any, timeout: float | None) -> None:
        self._stub, self._metadata, self._timeout = stub, metadata, timeout
        self._call: Any = None
        self._lock: asyncio.Lock | None = None
        self._cut = False  # a call was cancelled between its write and its reply

    async def open(self) -> AsyncMatmulSession:
        self._lock = asyncio.Lock()
        self._call = self._stub.MatmulStream(metadata=self._metadata, timeout=self._timeout)
        return self

    async def __aenter__(self) -> AsyncMatmulSession:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """End the stream: half-close, then its end (no reply is pending); cancelled if the
        worker does not end it."""
        call, self._call = self._call, None
        if call is None:
            return
        if self._cut:  # already cancelled: nothing to half-close
            return
        try:
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass
        except grpc.RpcError:
            pass  # the stream failed or was cancelled: nothing left to end
        finally:
            call.cancel()

    async def exchange(self, request: bytes) -> bytes:
        """One serialized MatmulRequest out, its serialized MatmulStreamResponse back."""
        if self._call is None or self._lock is None:
            raise ValueError("the session is not open (use it inside `async with`)")
        async with self._lock:  # a write and its read together: replies come in order
            if self._cut:
                raise Q6ServeError(grpc.StatusCode.CANCELLED,
                                   "an earlier call of this session was cancelled before its "
                                   "reply, which ended the stream: open a new session")
            try:
                with core.rpc_errors():
                    await self._call.write(request)
                    raw = await self._call.read()
            except asyncio.CancelledError:
                # interrupted (a caller's own timeout) between its write and its reply: that
                # reply would be read as the next call's, so the stream ends here and later
                # calls fail as on a failed stream (open a new session)
                self._cut = True
                self._call.cancel()
                raise
        if raw is grpc.aio.EOF:
            raise Q6ServeError(grpc.StatusCode.UNAVAILABLE, "the stream ended before its reply")
        return raw

    async def matmul_full(self, weight: Weights, x: np.ndarray, *, precision: str = "auto",
                          out_dtype: str = "f32", topk: int | None = None) -> MatmulOutput:
        """As :meth:`Client.matmul_full` (no shared-memory regions)."""
        raw = await self.exchange(core.matmul_request_bytes(weight, x, precision, out_dtype,
                                                            topk=topk))
        return _result(raw)

    async def matmul(self, weight: str, x: np.ndarray, *, precision: str = "auto",
                     out_dtype: str = "f32") -> np.ndarray:
        return core.y_of(await self.matmul_full(core.one_weight(weight), x,
                                                precision=precision, out_dtype=out_dtype))

    async def matmul_multi(self, weights: Sequence[str], x: np.ndarray, *,
                           precision: str = "auto", out_dtype: str = "f32") -> list[np.ndarray]:
        return core.ys_of(await self.matmul_full(core.weight_list(weights), x,
                                                 precision=precision, out_dtype=out_dtype))

    async def matmul_topk(self, weight: str, x: np.ndarray, k: int, *,
                          precision: str = "auto") -> TopK:
        return core.topk_of(await self.matmul_full(weight, x, precision=precision, topk=k))


def _result(raw: bytes) -> MatmulOutput:
    out = core.stream_outcome(raw, {})
    if isinstance(out, Q6ServeError):
        raise out
    return out


class _SpinSelector:
    """An event loop's selector that polls without blocking for up to ``spin_s`` before it
    blocks: the reply's wake-up (gRPC's poller thread writing a byte to the loop's socket) is
    then seen by a thread that is running instead of one woken from epoll. The worker's loop
    does the same (service/threads.py's busy poll; the client library does not import the
    service, hence this copy). Each non-blocking poll releases the GIL in its system call."""

    def __init__(self, inner: Any, spin_s: float) -> None:
        self._inner = inner
        self.spin_s = spin_s
        self.spun = 0  # selects that found an event while spinning

    def select(self, timeout: float | None = None) -> Any:
        if timeout == 0:
            return self._inner.select(0)
        now = time.perf_counter
        t0 = now()
        spin = self.spin_s if timeout is None else min(self.spin_s, timeout)
        while True:
            events = self._inner.select(0)
            if events:
                self.spun += 1
                return events
            if now() - t0 >= spin:
                break
        return self._inner.select(None if timeout is None else max(0.0, timeout - spin))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class MatmulSession:
    """:class:`AsyncMatmulSession` for the blocking :class:`~.client.Client`, on a grpc.aio
    channel of its own to the client's target (``channel_kw``: the client's channel
    arguments) and an event loop of its own; each call blocks its caller until the reply.

    ``thread=True``: the loop runs in a daemon thread and each call is handed to it (usable
    from any thread, async code included). ``thread=False``: each call runs the loop in the
    calling thread, one caller at a time (no hand-off; called from a thread whose own event
    loop is running, in a helper thread for that call). ``spin_us`` > 0: the session's loop
    polls without sleeping for up to that long before it blocks (:class:`_SpinSelector`),
    burning a core meanwhile (None: :func:`session_spin_us` without a thread, 0 with one).
    ``with`` (or :meth:`close`) ends the stream, the channel (and the thread)."""

    def __init__(self, target: str, channel_kw: dict[str, Any], metadata: Any,
                 timeout: float | None, *, thread: bool = False,
                 spin_us: float | None = None) -> None:
        if spin_us is None:  # (a spinning loop thread would hold the GIL its callers need)
            spin_us = 0.0 if thread else session_spin_us()
        self.spin_us = spin_us
        if not spin_us >= 0:
            raise ValueError(f"spin_us {spin_us!r}: a number of microseconds >= 0")
        self._loop = asyncio.new_event_loop()
        selector = getattr(self._loop, "_selector", None)  # asyncio's selector loops
        if spin_us > 0 and selector is not None:
            self._loop._selector = _SpinSelector(selector, spin_us * 1e-6)  # type: ignore[attr-defined]
        self._closed = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # thread=False: one caller runs the loop at a time
        if thread:
            self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                            name="q6serve-session")
            self._thread.start()
        try:
            self._channel, self._session = self._run(self._open(target, channel_kw, metadata,
                                                                timeout))
        except BaseException:
            self._stop()
            raise

    @staticmethod
    async def _open(target: str, channel_kw: dict[str, Any], metadata: Any,
                    timeout: float | None) -> tuple[Any, AsyncMatmulSession]:
        from .channel import aio_channel

        channel = aio_channel(target, **channel_kw)
        session = AsyncMatmulSession(core.BytesStub(channel), metadata, timeout)
        return channel, await session.open()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise ValueError("the session is closed")
        if self._thread is not None:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        with self._lock:
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no loop runs here: ours runs in this thread for the call
                return self._loop.run_until_complete(coro)
            # this thread's own loop is running (a blocking call from async code): ours
            # cannot run here, so a helper thread runs it for this call
            with ThreadPoolExecutor(1) as helper:
                return helper.submit(self._loop.run_until_complete, coro).result()

    def __enter__(self) -> MatmulSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return

        async def end() -> None:
            await self._session.close()
            await self._channel.close()

        try:
            self._run(end())
        finally:
            self._stop()

    def _stop(self) -> None:
        self._closed = True
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()

    def exchange(self, request: bytes) -> bytes:
        """As :meth:`AsyncMatmulSession.exchange`, blocking."""
        return self._run(self._session.exchange(request))

    def matmul_full(self, weight: Weights, x: np.ndarray, *, precision: str = "auto",
                    out_dtype: str = "f32", topk: int | None = None) -> MatmulOutput:
        """As :meth:`Client.matmul_full` (no shared-memory regions)."""
        return _result(self.exchange(core.matmul_request_bytes(weight, x, precision,
                                                               out_dtype, topk=topk)))

    def matmul(self, weight: str, x: np.ndarray, *, precision: str = "auto",
               out_dtype: str = "f32") -> np.ndarray:
        return core.y_of(self.matmul_full(core.one_weight(weight), x, precision=precision,
                                          out_dtype=out_dtype))

    def matmul_multi(self, weights: Sequence[str], x: np.ndarray, *, precision: str = "auto",
                     out_dtype: str = "f32") -> list[np.ndarray]:
        return core.ys_of(self.matmul_full(core.weight_list(weights), x, precision=precision,
                                           out_dtype=out_dtype))

    def matmul_topk(self, weight: str, x: np.ndarray, k: int, *,
                    precision: str = "auto") -> TopK:
        return core.topk_of(self.matmul_full(weight, x, precision=precision, topk=k))
