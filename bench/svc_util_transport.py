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

The sync calls are wrapped as coroutines that never suspend: awaiting one runs the blocking call
in place (no loop trip), which is what a caller with nothing else to do on its thread pays.
"""

from __future__ import annotations

import queue
from typing import Any

TRANSPORTS = ("aio", "sync")


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


class Channel:
    """An async context manager giving ``unary(method)`` / ``stream(method)`` of one transport
    on one channel to ``target`` (the client's channel options)."""

    def __init__(self, transport: str, target: str, options: list[tuple[str, Any]]) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r}: one of {TRANSPORTS}")
        self.transport, self.target, self.options = transport, target, options
        self._ch: Any = None

    async def __aenter__(self) -> Channel:
        import grpc

        if self.transport == "aio":
            self._ch = grpc.aio.insecure_channel(self.target, options=self.options)
            await self._ch.channel_ready()
        else:
            self._ch = grpc.insecure_channel(self.target, options=self.options)
            grpc.channel_ready_future(self._ch).result(timeout=60)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.transport == "aio":
            await self._ch.close()
        else:
            self._ch.close()

    def unary(self, method: str) -> Any:
        return self._ch.unary_unary(method) if self.transport == "aio" else SyncUnary(
            self._ch, method)

    def stream(self, method: str) -> Any:
        return self._ch.stream_stream(method)() if self.transport == "aio" else SyncStream(
            self._ch, method)
