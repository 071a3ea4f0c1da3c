"""Worker-wide admission of unary RPCs: calls beyond the limit wait, they never fail.

HTTP/2 lets a client open many streams on one connection before it has seen the worker's
MAX_CONCURRENT_STREAMS (a plain stub opening 3000 calls at once got 928 REFUSED_STREAM), so
the worker advertises a high stream limit and queues the calls itself instead. A call waits
here, in the interceptor, *before* gRPC reads its request message -- what a waiting call
holds is bounded by HTTP/2 flow control (its unread bytes stay in the transport windows) --
and keeps its place until its reply has been *written*, so at most ``limit`` requests and
their replies are in the worker at once, however slowly callers read.

Places are shared fairly between connections (the key: gRPC's peer address): round robin,
and each connection holds at most its share, ``min(per_key, max(floor, limit // active
connections))``, so a new connection gets places as soon as the others free any, until it
has as many as each of them; a caller that stops reading its replies stalls its own
connection, and holds at most its share. Streaming RPCs (MatmulStream, UploadWeight) are not
counted: a stream lives long and bounds itself (its window; uploads are accounted as they
arrive).

A place held by a reply its client does not take is taken back while other calls wait: a call
whose reply was computed more than ``timeout`` seconds ago and is still not written is
dropped (its RPC task cancelled: gRPC then resets the stream, the client sees CANCELLED, the
reply is freed and the place goes to the next). So callers that stop reading -- on as many
connections as they like -- hold places for at most ``reply_timeout`` while anyone else needs
them, and nothing is dropped while nobody waits.

The same class, with other limits, is the worker's *read* gate: the unary calls whose request
is being read at once (``--max-reading-rpcs``). gRPC's Python layer copies a request into
Python in one step of the event loop (~1 ms per MiB), so many big requests arriving together
queued a health check behind all their copies; through the read gate at most that many
complete together. A call whose request has not arrived ``--read-timeout`` s after its read
began, while others wait to be read, is cancelled (a client sending slowly cannot hold the
gate).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging

from . import gcfreeze

log = logging.getLogger("q6serve.admission")
LOG_EVERY_S = 10.0  # dropped replies are logged at most this often (a count)


class Admission:
    """Counting gate shared fairly between keys (connections): FIFO within a key, round robin
    across keys, and a key holds at most its *share* of the places,
    ``min(per_key, max(floor, limit // active))`` where ``active`` counts the keys holding or
    waiting for a place. The share shrinks as connections arrive, so a newcomer finds the
    others above it: every place they free goes to connections below their share (the
    newcomer first) until it has as many as each of them; it grows back as they leave."""

    def __init__(self, limit: int, per_key: int, floor: int = 1,
                 timeout: float = 2.0, what: str = "replies their clients did not take") -> None:
        self.limit = limit
        self.per_key = max(1, min(per_key, limit))
        self.floor = max(1, min(floor, self.per_key))
        self.timeout = timeout  # watched places (watch) held longer are taken back
        self.what = what  # what the log calls the calls dropped
        self.running = 0
        self.dropped = 0  # watched calls cancelled past the timeout
        self._held: dict[str, int] = {}
        self._waiting: dict[str, collections.deque[asyncio.Future[None]]] = {}
        self._ready: collections.deque[str] = collections.deque()  # keys that may go next
        self._active = 0  # keys in _held or _waiting
        # watched places (for the admission gate: reply computed, not yet written): token ->
        # (since, task), oldest first (a dict keeps insertion order)
        self._watched: dict[int, tuple[float, asyncio.Task[object]]] = {}
        self._tokens = itertools.count()
        self._sweep_at: asyncio.TimerHandle | None = None
        self._logged, self._log_at = 0, 0.0  # drops logged so far; loop time of the next line

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    @property
    def watched(self) -> int:
        """Places held by watched calls (:meth:`watch`)."""
        return len(self._watched)

    @property
    def active(self) -> int:
        """Keys (connections) holding or waiting for a place."""
        return self._active

    def share(self, active: int | None = None) -> int:
        """Places one key may hold now (with ``active`` keys: default, the current count)."""
        n = max(1, self._active if active is None else active)
        return min(self.per_key, max(self.floor, self.limit // n))

    def _known(self, key: str) -> bool:
        return key in self._held or key in self._waiting

    def _take(self, key: str) -> None:
        self.running += 1
        self._held[key] = self._held.get(key, 0) + 1

    async def enter(self, key: str) -> None:
        new = not self._known(key)
        if (self.running < self.limit and not self._ready and key not in self._waiting
                and self._held.get(key, 0) < self.share(self._active + new)):
            self._active += new
            self._take(key)
            return
        fut = asyncio.get_running_loop().create_future()
        self._active += new
        q = self._waiting.setdefault(key, collections.deque())
        q.append(fut)
        if len(q) == 1 and self._held.get(key, 0) < self.share():
            self._ready.append(key)
        self._dispatch()
        self._arm()
        try:
            await fut  # _dispatch took the place for us before waking us
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.leave(key)  # admitted as we were cancelled: pass the place on
            else:
                self._forget(key, fut)
            raise

    def _forget(self, key: str, fut: asyncio.Future[None]) -> None:
        q = self._waiting.get(key)
        if q is None:
            return
        if fut in q:
            q.remove(fut)
        if not q:
            del self._waiting[key]
            if key in self._ready:
                self._ready.remove(key)
            if key not in self._held:
                self._active -= 1
                self._dispatch()  # one key fewer: the others' shares may have grown

    def leave(self, key: str) -> None:
        self.running -= 1
        held = self._held[key] - 1
        if held:
            self._held[key] = held
        else:
            del self._held[key]
            if key not in self._waiting:
                self._active -= 1
        if key in self._waiting and held < self.share() and key not in self._ready:
            self._ready.append(key)
        self._dispatch()

    def _dispatch(self) -> None:
        while self.running < self.limit:
            if not self._ready and not self._refill():
                return
            key = self._ready.popleft()
            q = self._waiting[key]
            while q and q[0].done():  # cancelled while waiting
                q.popleft()
            if not q:
                del self._waiting[key]
                if key not in self._held:
                    self._active -= 1
                continue
            if self._held.get(key, 0) >= self.share():
                continue  # its share shrank since it queued: back when it is below it
            fut = q.popleft()
            self._take(key)
            fut.set_result(None)
            if not q:
                del self._waiting[key]
            elif self._held[key] < self.share():
                self._ready.append(key)  # round robin: behind the other connections

    def watch(self, task: asyncio.Task[object]) -> int:
        """From now the place ``task`` holds only waits on its client (the admission gate:
        the reply is computed and gRPC writes it in the RPC's task; the read gate: the request
        is being read): cancel the task if it still holds it ``timeout`` s from now while
        others wait. Returns the token for :meth:`unwatch`, called when that wait is over."""
        token = next(self._tokens)
        self._watched[token] = (asyncio.get_running_loop().time(), task)
        self._arm()
        return token

    def unwatch(self, token: int) -> None:
        self._watched.pop(token, None)

    def _arm(self) -> None:
        """Wake :meth:`_sweep` when the oldest watched place expires, while calls wait."""
        if self._sweep_at is not None or not self._waiting or not self._watched:
            return
        since, _ = next(iter(self._watched.values()))
        loop = asyncio.get_running_loop()
        self._sweep_at = loop.call_at(since + self.timeout, self._sweep)

    def _sweep(self) -> None:
        """Cancel the watched calls older than the timeout while calls wait for a place."""
        self._sweep_at = None
        if not self._waiting:
            return
        now = asyncio.get_running_loop().time()
        dropped = 0
        while self._watched:
            token, (since, task) = next(iter(self._watched.items()))
            if now - since < self.timeout:
                break
            del self._watched[token]
            dropped += task.cancel()  # its place comes back when the RPC is over
        self.dropped += dropped
        if dropped:
            gcfreeze.collect_soon()  # the cancelled calls' frames are in cycles
        if self.dropped > self._logged and now >= self._log_at:  # one line per LOG_EVERY_S
            log.warning("dropped %d calls: %s within %.3g s while other calls waited "
                        "(%d since start)", self.dropped - self._logged, self.what,
                        self.timeout, self.dropped)
            self._logged, self._log_at = self.dropped, now + LOG_EVERY_S
        self._arm()

    def _refill(self) -> bool:
        """Places are free and no key is ready: queue the waiting keys below their share
        (shares grow when keys go away). O(waiting keys), only when places would idle."""
        share = self.share()
        self._ready.extend(k for k in self._waiting if self._held.get(k, 0) < share)
        return bool(self._ready)


class StreamBudget:
    """Bytes held by all MatmulStream windows together (requests admitted and replies not yet
    written): at most ``total`` in the worker and ``per_key`` for one connection, so many
    streams that stop reading hold a bounded amount, and those of one connection stall
    that connection first. A connection holding nothing may still take one request larger
    than ``per_key``, and the worker holding nothing one larger than ``total`` (alone):
    every stream makes progress."""

    def __init__(self, total: int, per_key: int) -> None:
        self.total, self.per_key = total, per_key
        self.used = 0
        self._by_key: dict[str, int] = {}
        self._freed = asyncio.Event()  # replaced on every release: no missed wake-up

    def held(self, key: str) -> int:
        return self._by_key.get(key, 0)

    def _fits(self, key: str, nbytes: int) -> bool:
        if self.used == 0:
            return True
        mine = self._by_key.get(key, 0)
        return (self.used + nbytes <= self.total
                and (mine == 0 or mine + nbytes <= self.per_key))

    async def acquire(self, key: str, nbytes: int) -> None:
        while not self._fits(key, nbytes):
            await self._freed.wait()
        self.used += nbytes
        self._by_key[key] = self._by_key.get(key, 0) + nbytes

    def release(self, key: str, nbytes: int) -> None:
        self.used -= nbytes
        left = self._by_key[key] - nbytes
        if left:
            self._by_key[key] = left
        else:
            del self._by_key[key]
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()
