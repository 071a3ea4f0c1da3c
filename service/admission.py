"""Worker-wide admission of unary-request RPCs: calls beyond the limit wait, they never fail.

HTTP/2 lets a client open many streams on one connection before it has seen the worker's
MAX_CONCURRENT_STREAMS (a plain stub opening 3000 calls at once got 928 REFUSED_STREAM), so
the worker advertises a high stream limit and queues the calls itself instead: a call waits
here, in the interceptor, *before* gRPC reads its request message, so what a waiting call
holds is bounded by HTTP/2 flow control (its unread bytes stay in the transport windows), and
at most ``limit`` requests are read and in the worker at once. FIFO, so nobody starves.
Streaming-request RPCs (MatmulStream, UploadWeight) are not counted: a stream lives long and
bounds itself (its window; uploads are accounted as they arrive).
"""

from __future__ import annotations

import asyncio
import collections


class Admission:
    """A FIFO counting gate; ``waiting`` and ``running`` are plain figures for status/tests."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.running = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def enter(self) -> None:
        if self.running < self.limit and not self._waiters:
            self.running += 1
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # leave() hands its place to us (running stays counted)
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.leave()  # admitted as we were cancelled: pass the place on
            else:
                self._waiters.remove(fut)
            raise

    def leave(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1
