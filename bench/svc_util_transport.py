"""The caller's gRPC transport of the decode replay and of its bare-echo floor (issue 14, session
21): grpc.aio (asyncio, what the replay ran up to session 20) or the sync stub (C-core calls
from the calling thread, no event loop), behind one awaitable interface so that one step loop
drives either and the floor is measured with the transport the replay used.

- ``aio``: ``await unary(req)`` / ``await stream.write(req)``, ``await stream.read()`` on a
  grpc.aio channel: every call goes through the event loop and gRPC's completion-queue thread.
- ``sync``: a blocking unary call (``grpc.Channel.unary_unary``: the calling thread waits on the
  call's own completion queue), or a bidi stream fed by a queue: sync gRPC consumes a stream's
  request iterator on a thread of its own, so each write is a hand-off to that thread, and each
  read waits for the channel's polling thread to hand the reply over.

- ``session`` / ``asession``: the q6serve client's closed-loop sessions on the worker's
  MatmulStream (client/session.py): ``Client.session()`` with the product's defaults (since
  session 22: its loop run by the host's thread in each call, spinning for the reply as
  ``session_spin_us`` says: 2000 us on 8+ cores) and ``AsyncClient.session()`` (on the host's
  loop), each exchange the product's code; ``tsession``: ``Client.session(thread=True)``
  (grpc.aio on a loop thread of its own, each call a blocking hand-off to it: session 21's
  default); ``isession``: ``Client.session(thread=False)`` without a spin (the host's own
  asyncio loop set aside meanwhile: what a host without one does). A sync session's spin is
  ``host.spin`` where given (> 0). Stream mode, the worker's MatmulStream only (the floor's
  echo caller: grpc.aio's stream, spinning as the session's loop does: :func:`caller_spin_us`).

The sync calls are wrapped as coroutines that never suspend: awaiting one runs the blocking call
in place (no loop trip), which is what a caller with nothing else to do on its thread pays.
"""

from __future__ import annotations

import queue
from typing import Any

TRANSPORTS = ("aio", "sync", "session", "tsession", "isession", "asession")
# the client's sessions: MatmulStream on a q6serve worker
SESSIONS = ("session", "tsession", "isession", "asession")
# the blocking client's sessions: their calls run the session's own loop, not the host's
SYNC_SESSIONS = ("session", "tsession", "isession")


def caller_spin_us(transport: str, spin_us: float) -> float:
    """How long the caller's loop polls for a reply before it sleeps (us), for a replay host
    of ``transport`` given ``spin_us`` (its host.spin / --replay-spins): that, or for the
    product's default session where none is given, the session's own default spin
    (client/session.session_spin_us). The floor's echo caller spins as long: like for like."""
    if transport == "session" and spin_us <= 0:
        from q6serve.client.session import session_spin_us

        return session_spin_us()
    return spin_us


class SyncUnary:
    """A blocking unary call of raw bytes, awaitable."""

    def __init__(self, channel: Any, method: str) -> None:
        self._fn = channel.unary_unary(method)

    async def __call__(self, req: bytes, timeout: float | None = None) -> bytes:
        return self._fn(req, timeout=timeout)


class SyncStream:
    """A sync bidi stream of raw bytes with aio's write / read / done_writing, awaitable: the
    requests go through a queue that gRPC's request-consuming thread drains."""

    def __init__(self, channel: Any, method: str) -> None:
        self._q: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._call = channel.stream_stream(method)(iter(self._q.get, None))

    async def write(self, req: bytes) -> None:
        self._q.put(req)

    async def read(self) -> bytes:
        return next(self._call)

    async def done_writing(self) -> None:
        self._q.put(None)
        for _ in self._call:  # the server's end of the stream (no reply is pending)
            pass


def outside_loop(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` with this thread's running asyncio loop set aside: a sync session that
    runs its own loop in the calling thread, called from the replay host's coroutine (which
    never yields meanwhile), as a host with no loop of its own would call it."""
    import asyncio

    outer = asyncio.events._get_running_loop()
    asyncio.events._set_running_loop(None)
    try:
        return fn(*args)
    finally:
        asyncio.events._set_running_loop(outer)


def floor_transport(transport: str) -> str:
    """The echo caller's transport for a replay host's: a session's stream is grpc.aio's."""
    return "aio" if transport in SESSIONS else transport


class SessionStream:
    """A client session's exchange behind aio's write / read: write keeps the request, read
    sends it and returns its reply (``exchange``: a blocking or async callable)."""

    def __init__(self, exchange: Any, is_async: bool) -> None:
        self._exchange, self._async, self._req = exchange, is_async, b""

    async def write(self, req: bytes) -> None:
        self._req = req

    async def read(self) -> bytes:
        got = self._exchange(self._req)
        return await got if self._async else got

    async def done_writing(self) -> None:
        pass  # the session's close ends the stream


class Channel:
    """An async context manager giving ``unary(method)`` / ``stream(method)`` of one transport
    on one channel to ``target`` (the client's channel options)."""

    def __init__(self, transport: str, target: str, options: list[tuple[str, Any]],
                 session_spin_us: float = 0.0) -> None:
        """``session_spin_us`` > 0: a sync session's own loop busy-polls that long before it
        sleeps (``Client.session(spin_us=...)``); 0: ``session`` spins as the product's
        default does, ``tsession`` / ``isession`` not at all."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r}: one of {TRANSPORTS}")
        self.transport, self.target, self.options = transport, target, options
        self.session_spin_us = session_spin_us
        self._ch: Any = None
        self._client: Any = None

    async def __aenter__(self) -> Channel:
        import grpc

        spin = self.session_spin_us if self.session_spin_us > 0 else None
        if self.transport == "tsession":
            from q6serve.client.client import Client

            self._client = Client(self.target)
            self._ch = self._client.session(thread=True, spin_us=spin or 0.0)
        elif self.transport in ("session", "isession"):
            from q6serve.client.client import Client

            self._client = Client(self.target)
            # session: the product's defaults (its own spin unless one is given)
            kw = ({"spin_us": spin} if self.transport == "session" else
                  {"thread": False, "spin_us": spin or 0.0})
            self._ch = outside_loop(lambda: self._client.session(**kw))
        elif self.transport == "asession":
            from q6serve.client.async_client import AsyncClient

            self._client = AsyncClient(self.target)
            self._ch = await self._client.session().open()
        elif self.transport == "aio":
            self._ch = grpc.aio.insecure_channel(self.target, options=self.options)
            await self._ch.channel_ready()
        else:
            self._ch = grpc.insecure_channel(self.target, options=self.options)
            grpc.channel_ready_future(self._ch).result(timeout=60)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.transport == "tsession":
            self._ch.close()
            self._client.close()
        elif self.transport in ("session", "isession"):
            outside_loop(self._ch.close)
            self._client.close()
        elif self.transport == "asession":
            await self._ch.close()
            await self._client.close()
        elif self.transport == "aio":
            await self._ch.close()
        else:
            self._ch.close()

    def unary(self, method: str) -> Any:
        if self.transport in SESSIONS:
            raise ValueError(f"{self.transport}: a session is a stream (no unary calls)")
        return self._ch.unary_unary(method) if self.transport == "aio" else SyncUnary(
            self._ch, method)

    def stream(self, method: str) -> Any:
        if self.transport in SESSIONS:
            if not method.endswith("/MatmulStream"):
                raise ValueError(f"{self.transport}: the worker's MatmulStream only, not {method}")
            if self.transport in ("session", "isession"):
                return SessionStream(lambda req: outside_loop(self._ch.exchange, req), False)
            return SessionStream(self._ch.exchange, self.transport == "asession")
        return self._ch.stream_stream(method)() if self.transport == "aio" else SyncStream(
            self._ch, method)
