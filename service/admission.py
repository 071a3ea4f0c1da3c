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
import contextlib
import itertools
import logging
import weakref
from collections.abc import Callable, Iterable

from . import gcfreeze

log = logging.getLogger("q6serve.admission")
LOG_EVERY_S = 10.0  # dropped replies are logged at most this often (a count)
# A connection counts as *stalled* once one of its replies (a unary reply or a MatmulStream's
# write) has waited this long to be written and none of its writes completed meanwhile. While
# a connection below its fair share waits, the stalled places of connections above it are
# taken back at once, not after the reply timeout (Admission._sweep, StreamBudget.acquire).
STALL_S = 0.25
# ... and a request that has not arrived this long after its read began (a client that opened
# the call and sends nothing holds a place as surely as one that stops reading; a legitimate
# big request may need a while over a slow link)
READ_STALL_S = 1.0
# A call the worker drops while gRPC writes its reply is not over for gRPC: grpcio's asyncio
# server cannot reset a stream, so its core keeps the call, with the reply it was writing,
# until the client's deadline or the connection's end. Such a call keeps its place charged
# to its connection (not to the worker's limit) until its deadline, at most this long: a
# connection that stops reading holds at most its share, dropped calls included, and it
# cannot turn places into replies stuck in gRPC faster than one share per LINGER_S.
LINGER_S = 60.0


def _decrement(counts: dict[str, int], key: str, n: int = 1) -> int:
    """``counts[key] -= n``, the key dropped at 0; what is left."""
    left = counts[key] - n
    if left:
        counts[key] = left
    else:
        del counts[key]
    return left


class Admission:
    """Counting gate shared fairly between keys (connections): FIFO within a key, round robin
    across keys, and a key holds at most its *share* of the places,
    ``min(per_key, max(floor, limit // active))`` where ``active`` counts the keys holding or
    waiting for a place. The share shrinks as connections arrive, so a newcomer finds the
    others above it: every place they free goes to connections below their share (the
    newcomer first) until it has as many as each of them; it grows back as they leave."""

    def __init__(self, limit: int, per_key: int, floor: int = 1,
                 timeout: float = 2.0, what: str = "replies their clients did not take",
                 stall: float | None = STALL_S) -> None:
        self.limit = limit
        self.per_key = max(1, min(per_key, limit))
        self.floor = max(1, min(floor, self.per_key))
        self.timeout = timeout  # watched places (watch) held longer are taken back
        # ... and those of stalled connections above their fair share after this long, while
        # a connection below it waits (None: only the timeout)
        self.stall = None if stall is None else min(stall, timeout)
        self.what = what  # what the log calls the calls dropped
        self.running = 0
        self.dropped = 0  # watched calls cancelled past the timeout
        self._held: dict[str, int] = {}
        self._waiting: dict[str, collections.deque[asyncio.Future[None]]] = {}
        # keys that may go next: those below their fair share (limit // active) first, then
        # those between it and the floor's share
        self._ready: collections.deque[str] = collections.deque()
        self._ready_floor: collections.deque[str] = collections.deque()
        # or, when set, the keys for which this is true first (the read gate: connections
        # whose last request was small go before those that send big ones)
        self.first: Callable[[str], bool] | None = None
        self._active = 0  # keys in _held or _waiting
        # watched places (for the admission gate: reply computed, not yet written): token ->
        # (since, task, key, linger, stall), oldest first (a dict keeps insertion order)
        self._watched: dict[int, tuple[float, asyncio.Task[object], str, float,
                                       float | None]] = {}
        self._progress: dict[str, float] = {}  # key -> when a watched place of it last ended
        # dropped calls: token -> how long the place stays charged to its key (see LINGER_S);
        # key -> places so charged now
        self._dropping: dict[int, float] = {}
        self.lingering: dict[str, int] = {}
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

    def _share_of(self, key: str) -> int:
        """``key``'s share now: a connection with dropped calls lingering (it stopped reading)
        gets no more than the fair share, without the floor, so connections that stop
        reading cannot take every place again as soon as one is given back."""
        return self._fair() if key in self.lingering else self.share()

    def _known(self, key: str) -> bool:
        return key in self._held or key in self._waiting

    def _take(self, key: str) -> None:
        self.running += 1
        self._held[key] = self._held.get(key, 0) + 1

    def _fair(self) -> int:
        """A key's fair share without the floor: what every active key can hold at once."""
        return max(1, self.limit // max(1, self._active))

    def _is_ready(self, key: str) -> bool:
        return key in self._ready or key in self._ready_floor

    def _queue(self, key: str) -> None:
        """Make a waiting key ready: behind the others of its tier (round robin)."""
        if self.first is not None:
            (self._ready if self.first(key) else self._ready_floor).append(key)
        elif self._held.get(key, 0) < self._fair():
            self._ready.append(key)
        else:
            self._ready_floor.append(key)

    async def enter(self, key: str) -> None:
        new = not self._known(key)
        if (self.running < self.limit and not self._ready and not self._ready_floor
                and key not in self._waiting
                and self._held.get(key, 0) < self.share(self._active + new)):
            self._active += new
            self._take(key)
            return
        fut = asyncio.get_running_loop().create_future()
        self._active += new
        q = self._waiting.setdefault(key, collections.deque())
        q.append(fut)
        if len(q) == 1 and self._held.get(key, 0) < self._share_of(key):
            self._queue(key)
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
            for ready in (self._ready, self._ready_floor):
                if key in ready:
                    ready.remove(key)
            if key not in self._held:
                self._active -= 1
                self._dispatch()  # one key fewer: the others' shares may have grown

    def leave(self, key: str) -> None:
        self.running -= 1
        self._release(key)

    def _release(self, key: str) -> None:
        held = self._held[key] - 1
        if held:
            self._held[key] = held
        else:
            del self._held[key]
            self._progress.pop(key, None)
            if key not in self._waiting:
                self._active -= 1
        if key in self._waiting and held < self._share_of(key) and not self._is_ready(key):
            self._queue(key)
        self._dispatch()

    def _dispatch(self) -> None:
        while self.running < self.limit:
            if not self._ready and not self._ready_floor and not self._refill():
                return
            key = (self._ready or self._ready_floor).popleft()
            q = self._waiting[key]
            while q and q[0].done():  # cancelled while waiting
                q.popleft()
            if not q:
                del self._waiting[key]
                if key not in self._held:
                    self._active -= 1
                continue
            if self._held.get(key, 0) >= self._share_of(key):
                continue  # its share shrank since it queued: back when it is below it
            fut = q.popleft()
            self._take(key)
            fut.set_result(None)
            if not q:
                del self._waiting[key]
            elif self._held[key] < self._share_of(key):
                self._queue(key)  # round robin: behind the other connections

    def watch(self, task: asyncio.Task[object], key: str = "",
              linger: float | None = None, stall: float | None = None) -> int:
        """From now the place ``task`` holds (for connection ``key``) only waits on its
        client (the admission gate: the reply is computed and gRPC writes it in the RPC's
        task; the read gate: the request is being read): cancel the task if it still holds it
        ``timeout`` s from now while others wait -- or ``stall`` s from now when its
        connection is above its fair share, has completed no watched place meanwhile, and a
        connection below its share waits. Returns the token for :meth:`unwatch`, called when
        that wait is over (before :meth:`leave`). A dropped call's place stays charged to
        ``key`` for ``linger`` s (the call's time to its deadline), at most LINGER_S.
        ``stall``: this place's own stall time, if longer than the gate's."""
        token = next(self._tokens)
        own = self.stall if stall is None or self.stall is None else max(stall, self.stall)
        self._watched[token] = (asyncio.get_running_loop().time(), task, key,
                                LINGER_S if linger is None else min(linger, LINGER_S), own)
        self._arm()
        return token

    def unwatch(self, token: int, key: str = "") -> None:
        loop = asyncio.get_running_loop()
        got = self._watched.pop(token, None)
        if got is not None and got[2] in self._held:  # ended by itself: the key progresses
            self._progress[got[2]] = loop.time()
        linger = self._dropping.pop(token, None)
        if linger is not None and linger > 0:  # dropped: gRPC still holds the call and its
            self._held[key] += 1  # reply; the place stays the key's (leave() follows)
            self.lingering[key] = self.lingering.get(key, 0) + 1
            loop.call_later(linger, self._unlinger, key)

    def _unlinger(self, key: str) -> None:
        _decrement(self.lingering, key)
        self._release(key)

    def _drop(self, token: int) -> int:
        """Cancel a watched call (its place comes back when the RPC is over, or stays its
        key's a while: :meth:`unwatch`); 1 if it was cancelled."""
        _, task, _, linger, _ = self._watched.pop(token)
        if not task.cancel():
            return 0
        self._dropping[token] = linger
        return 1

    def _arm(self, later: bool = False) -> None:
        """Wake :meth:`_sweep` when the oldest watched place expires (``stall`` or
        ``timeout``), while calls wait; ``later``: not before ``stall`` s from now."""
        if self._sweep_at is not None or not self._waiting or not self._watched:
            return
        since = next(iter(self._watched.values()))[0]
        loop = asyncio.get_running_loop()
        at = since + (self.timeout if self.stall is None else self.stall)
        if later and self.stall is not None:
            at = max(at, loop.time() + self.stall)
        due = max(at, loop.time())
        self._sweep_at = loop.call_at(due, self._sweep, due)

    def _sweep(self, due: float) -> None:
        """Cancel the watched calls older than the timeout while calls wait for a place, and
        those of stalled connections above their fair share while one below it waits."""
        self._sweep_at = None
        if not self._waiting:
            return
        now = asyncio.get_running_loop().time()
        dropped = 0
        while self._watched:
            token, (since, *_) = next(iter(self._watched.items()))
            if now - since < self.timeout:
                break
            dropped += self._drop(token)
        # A loop that woke us late may not have run the writes that completed meanwhile: a
        # connection looks stalled only when we are on time.
        if self.stall is not None and now - due < self.stall / 2:
            dropped += self._take_back_stalled(now)
        self.dropped += dropped
        if dropped:
            gcfreeze.collect_soon()  # the cancelled calls' frames are in cycles
        if self.dropped > self._logged and now >= self._log_at:  # one line per LOG_EVERY_S
            log.warning("dropped %d calls: %s within %.3g s while other calls waited "
                        "(%d since start)", self.dropped - self._logged, self.what,
                        self.timeout, self.dropped)
            self._logged, self._log_at = self.dropped, now + LOG_EVERY_S
        self._arm(later=True)

    def _take_back_stalled(self, now: float) -> int:
        """While a key below its fair share waits: drop the watched calls ``stall`` s old
        or more of the keys at or above it that completed none for as long (stalled: their
        places stay theirs while gRPC keeps the calls, see :meth:`unwatch`, and they get no
        new ones beyond the fair share). A connection that stopped reading makes the others
        wait ``stall``, not ``timeout``. O(watched + waiting keys), only while calls wait."""
        assert self.stall is not None
        fair = self._fair()
        needy = sum(len(q) for k, q in self._waiting.items()
                    if self._held.get(k, 0) < fair and k not in self.lingering)
        if not needy:  # (a key with dropped calls lingering is stalled itself)
            return 0
        taken = 0
        for token, (since, _, key, _, stall) in list(self._watched.items()):
            if now - since < self.stall:
                break
            assert stall is not None
            if (now - since >= stall and self._held.get(key, 0) >= fair
                    and now - self._progress.get(key, since) >= stall):
                taken += self._drop(token)
        return taken

    def _refill(self) -> bool:
        """Places are free and no key is ready: queue the waiting keys below their share
        (shares grow when keys go away). O(waiting keys), only when places would idle."""
        for k in self._waiting:
            if self._held.get(k, 0) < self._share_of(k):
                self._queue(k)
        return bool(self._ready or self._ready_floor)


class Writers:
    """The MatmulStreams of one event loop whose reply write is blocked now, by connection:
    key -> {the RPC's task: since when}. The interceptor marks each write (its stream
    wrapper, around the yield that returns once gRPC has written the reply); a
    :class:`StreamBudget` that cannot serve a connection below its fair share cancels the
    longest-blocked stream of a connection above it (see :meth:`StreamBudget.acquire`)."""

    def __init__(self) -> None:
        # key -> {task: (since, seconds to the call's deadline then, or None)}
        self.blocked: dict[str, dict[asyncio.Task[object], tuple[float, float | None]]] = {}

    def begin(self, key: str, task: asyncio.Task[object], left: float | None) -> None:
        self.blocked.setdefault(key, {})[task] = (asyncio.get_running_loop().time(), left)

    def end(self, key: str, task: asyncio.Task[object]) -> None:
        mine = self.blocked.get(key)
        if mine is not None:
            mine.pop(task, None)
            if not mine:
                del self.blocked[key]

    def longest(self, keys: Iterable[str],
                ) -> tuple[float, asyncio.Task[object] | None, str, float]:
        """(since, task, key, seconds its call may still live) of the write blocked longest
        among ``keys``' streams (task None: none)."""
        best: tuple[float, asyncio.Task[object] | None, str, float] = (
            float("inf"), None, "", 0.0)
        for key in keys:
            for task, (since, left) in self.blocked.get(key, {}).items():
                if since < best[0] and not task.done():
                    life = LINGER_S if left is None else left - (
                        asyncio.get_running_loop().time() - since)
                    best = (since, task, key, min(max(life, 0.0), LINGER_S))
        return best


_WRITERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Writers] = \
    weakref.WeakKeyDictionary()


def writers() -> Writers:
    """The running loop's :class:`Writers` (a worker, or a front end, has one loop)."""
    loop = asyncio.get_running_loop()
    got = _WRITERS.get(loop)
    if got is None:
        got = _WRITERS[loop] = Writers()
    return got


class StreamBudget:
    """Bytes held by all MatmulStream windows together (requests admitted and replies not yet
    written): at most ``total`` in the worker and ``per_key`` for one connection, so many
    streams that stop reading hold a bounded amount, and those of one connection stall
    that connection first. A connection holding nothing may still take one request larger
    than ``per_key``, and the worker holding nothing one larger than ``total`` (alone):
    every stream makes progress.

    Streams that stop reading must not hold the worker's total from the others: a
    connection below its fair share (``total`` / connections holding bytes) that does not fit
    waits at most ``stall`` s at a time; then the stream of a connection above its share
    whose reply write has been blocked longest (at least ``stall`` s) is cancelled and what
    its window held comes back to the total. A connection within its share, or a stream whose
    writes complete, is never cancelled. gRPC keeps the cancelled call (grpcio's asyncio
    server cannot reset a stream; its client hears nothing until its deadline) with the reply
    it was writing, so the bytes its connection held stay charged to that connection (not to
    the total: ``lingering``) until the call's deadline, at most LINGER_S: a connection that
    stops reading stalls itself, and holds at most ``per_key`` that way."""

    def __init__(self, total: int, per_key: int, stall: float | None = STALL_S) -> None:
        self.total, self.per_key = total, per_key
        self.stall = stall
        self.used = 0
        self.dropped = 0  # streams cancelled for a connection below its share
        self.lingering: dict[str, int] = {}  # key -> bytes charged for its cancelled streams
        self._log_at = 0.0
        self._by_key: dict[str, int] = {}
        self._freed = asyncio.Event()  # replaced on every release: no missed wake-up

    def held(self, key: str) -> int:
        return self._by_key.get(key, 0)

    def _fits(self, key: str, nbytes: int) -> bool:
        mine = self._by_key.get(key, 0) + self.lingering.get(key, 0)
        if self.used == 0 and mine == 0:
            return True
        return (self.used + nbytes <= self.total
                and (mine == 0 or mine + nbytes <= self.per_key))

    def _fair(self, key: str) -> int:
        return self.total // (len(self._by_key) + (key not in self._by_key))

    def _starved(self, key: str, nbytes: int) -> bool:
        """Only the total keeps ``key`` (below its fair share, and not stalled itself) from
        ``nbytes``."""
        mine = self._by_key.get(key, 0)
        return (key not in self.lingering and mine + nbytes <= self._fair(key)
                and (mine == 0 or mine + nbytes <= self.per_key))

    def take(self, key: str, nbytes: int) -> bool:
        """:meth:`acquire` when it would not wait (no coroutine): True if taken."""
        if not self._fits(key, nbytes):
            return False
        self.used += nbytes
        self._by_key[key] = self._by_key.get(key, 0) + nbytes
        return True

    async def acquire(self, key: str, nbytes: int) -> None:
        loop = asyncio.get_running_loop()
        while not self._fits(key, nbytes):
            freed = self._freed
            if self.stall is None or not self._starved(key, nbytes):
                await freed.wait()
                continue
            if self._take_back(key):
                await freed.wait()  # the cancelled stream's window comes back
                continue
            due = loop.time() + self.stall
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(freed.wait(), self.stall)
                continue
            if loop.time() - due < self.stall / 2:  # on time: writes that completed have run
                self._take_back(key)
        self.used += nbytes
        self._by_key[key] = self._by_key.get(key, 0) + nbytes

    def _take_back(self, key: str) -> bool:
        """Cancel the longest-blocked stream (``stall`` s at least) of a connection above
        ``key``'s fair share; True if one was."""
        fair = self._fair(key)
        over = [k for k, n in self._by_key.items() if n > fair and k != key]
        since, task, victim, life = writers().longest(over)
        loop = asyncio.get_running_loop()
        if task is not None and loop.time() - since >= self.stall:
            if not task.cancel():
                return False
            self.dropped += 1  # its window goes back when the RPC is over
            charge = self._by_key[victim]
            if life > 0:
                self.lingering[victim] = self.lingering.get(victim, 0) + charge
                loop.call_later(life, self._unlinger, victim, charge)
            gcfreeze.collect_soon()
            now = asyncio.get_running_loop().time()
            if now >= self._log_at:
                log.warning("cancelled a MatmulStream whose reply waited %.2f s to be "
                            "written: its connection held more than its share of "
                            "--max-stream-bytes-total while another waited (%d since start)",
                            now - since, self.dropped)
                self._log_at = now + LOG_EVERY_S
            return True
        return False

    def _unlinger(self, key: str, nbytes: int) -> None:
        _decrement(self.lingering, key, nbytes)
        self._wake()

    def release(self, key: str, nbytes: int) -> None:
        self.used -= nbytes
        _decrement(self._by_key, key, nbytes)
        self._wake()

    def _wake(self) -> None:
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()


class StreamSlots:
    """Streaming calls (MatmulStream, UploadWeight, health Watch) open at once: at most
    ``per_key`` per connection and ``total`` in the worker. A stream costs the worker ~25 KiB
    (gRPC's call, the handler's task and queue) whether or not its client ever sends: 20,000
    idle MatmulStreams held 490 MiB, and HTTP/2 lets one connection open 65,536.

    Beyond ``per_key`` a connection's new stream is refused (RESOURCE_EXHAUSTED). When the
    worker holds ``total``, a connection below its fair share (``total`` / connections with
    streams) takes the place of the longest-idle stream (no message either way for IDLE_S or
    more) of the connection holding the most: that stream is cancelled, and it stays charged
    to its connection until its deadline, at most LINGER_S (gRPC keeps the call until then).
    Otherwise the new stream is refused."""

    IDLE_S = 1.0

    def __init__(self, total: int, per_key: int) -> None:
        self.total, self.per_key = total, per_key
        self.open_streams = 0
        self.refused = 0
        self.evicted = 0
        # key -> {task: (last message either way, its deadline in loop time or None)}
        self._by_key: dict[str, dict[asyncio.Task[object], tuple[float, float | None]]] = {}
        self.lingering: dict[str, int] = {}

    def held(self, key: str) -> int:
        return len(self._by_key.get(key, ())) + self.lingering.get(key, 0)

    def open(self, key: str, task: asyncio.Task[object], left: float | None) -> bool:
        """Take a place for ``task``'s stream; False: refuse it."""
        if self.held(key) >= self.per_key or (self.open_streams >= self.total
                                              and not self._evict_for(key)):
            self.refused += 1
            return False
        now = asyncio.get_running_loop().time()
        self._by_key.setdefault(key, {})[task] = (now, None if left is None else now + left)
        self.open_streams += 1
        return True

    def touch(self, key: str, task: asyncio.Task[object]) -> None:
        mine = self._by_key.get(key)
        if mine is not None and task in mine:
            mine[task] = (asyncio.get_running_loop().time(), mine[task][1])

    def close(self, key: str, task: asyncio.Task[object]) -> None:
        mine = self._by_key.get(key)
        if mine is None or mine.pop(task, None) is None:
            return
        self.open_streams -= 1
        if not mine:
            del self._by_key[key]

    def _evict_for(self, key: str) -> bool:
        fair = self.total // (len(self._by_key) + (key not in self._by_key))
        if len(self._by_key.get(key, ())) >= fair or not self._by_key:
            return False
        victim = max(self._by_key, key=lambda k: len(self._by_key[k]))
        if len(self._by_key[victim]) <= fair:
            return False
        loop = asyncio.get_running_loop()
        task, (last, deadline) = min(self._by_key[victim].items(), key=lambda kv: kv[1][0])
        if loop.time() - last < self.IDLE_S or not task.cancel():
            return False
        self.close(victim, task)
        self.evicted += 1
        life = LINGER_S if deadline is None else min(LINGER_S, deadline - loop.time())
        if life > 0:
            self.lingering[victim] = self.lingering.get(victim, 0) + 1
            loop.call_later(life, _decrement, self.lingering, victim)
        return True
