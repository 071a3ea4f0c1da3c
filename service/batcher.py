"""Per-weight dynamic batching on one device executor.

Concurrent requests for one weight with the same (activation dtype, precision, output dtype)
are concatenated along N and run as one kernel call, then split back. A batch launches when
 - it reaches ``max_rows``, or
 - the device is idle (no added delay when nothing is running), or
 - its oldest request has waited ``max_delay_s`` (0: never wait),
and fewer than ``max_inflight_batches`` of this weight's batches are unfinished. While the
device is busy, requests accumulate, which is where coalescing comes from.
The queue is bounded in rows (RESOURCE_EXHAUSTED); a request whose caller cancelled or whose
deadline passed while queued is dropped before launch. Device work runs in the device's single
worker thread (service/device_thread.py), never on the event loop.

The parts of one multi-weight call (service/multi.py) are queued as a :class:`Group`: each
part waits in its own weight's queue (so it still batches with other callers' requests for that
weight), and whichever of the group's batchers launches first takes its siblings' batches too,
so the parts run back to back in **one** device job (one hand-off to the device thread and one
back) instead of one job each, serially.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from q6serve.kernels.api import Launched, Layout, MatmulResult, Precision
from q6serve.kernels.epilogue import TopK
from q6serve.kernels.errors import (
    FailedPrecondition,
    InvalidArgument,
    Q6Error,
    ResourceExhausted,
    Unavailable,
)

from . import envvars
from .device_thread import Deferred, Device


class DeadlineExceeded(Q6Error):
    grpc_code = "DEADLINE_EXCEEDED"


class DirectCall:
    """One weight's direct-path call of one :class:`BatchKey` (``Batcher.direct``), made once
    and reused by every such request: its job with the key's fields bound (``job(x)``, the
    batcher's ``bind``: no ``run(x, key)`` -> ``launch(x, key)`` layers and lookups per call)
    and what the engine's checks passed for it (``Engine.run_now``: the request sizes ``rows``
    checked under flag state ``state``; what passed once passes again while the state is the
    same). Dropped with its batcher (a weight's reload or retired batcher starts afresh)."""

    __slots__ = ("job", "key", "rows", "state")

    def __init__(self, key: BatchKey, job: Callable[[np.ndarray], MatmulResult]) -> None:
        self.key = key
        self.job = job
        self.state: object = None
        self.rows: set[int] = set()


class BatchKey(NamedTuple):
    """What requests must share to run in one batch (a tuple: hashed per request and
    batch on the loop, where a frozen dataclass's hash is a Python call)."""

    x_dtype: str
    precision: Precision
    out_dtype: str
    topk: int = 0  # the top-k epilogue's k (0: y); only equal k batch together


@dataclass(frozen=True)
class BatchSettings:
    max_rows: int = 64
    max_delay_s: float = 200e-6
    max_queue_rows: int = 8192
    # Launched batches per weight not yet finished (one running, one staged behind it): the
    # rest wait in the bounded queue, where they also coalesce.
    max_inflight_batches: int = 2


@dataclass(slots=True)  # (not frozen: made per request on the loop, and a frozen init of its
class MatmulReply:      # ten fields took 4.0 us on the VM, a plain one 1.0; never changed)
    """What one request gets back from its batch (built once per request, on the loop)."""

    y: np.ndarray | None  # this request's rows of the batch's output (a view); None
    #                       with the top-k epilogue (BatchKey.topk), whose rows are in topk
    kernel: str
    layout: Layout
    precision: Precision
    queue_seconds: float  # enqueued -> its batch's device job started
    kernel_seconds: float | None  # the batch's kernel (device events; None: not ready)
    batch_rows: int
    batch_requests: int
    device_seconds: float | None = None  # wall time of the batch's job in the device thread
    topk: TopK | None = None  # this request's rows of the batch's epilogue result


@dataclass(slots=True)  # (per batch on the loop: a frozen init costs 3x; never changed)
class BatchStats:
    """Plain stats of one launched batch, for the metrics module."""

    result: MatmulResult
    rows: int
    requests: int
    queue_seconds: tuple[float, ...]


@dataclass(eq=False, slots=True)
class _Pending:
    x: np.ndarray
    key: BatchKey
    fut: asyncio.Future[MatmulReply]
    t_enqueue: float
    deadline: float | None  # perf_counter() time
    timer: asyncio.TimerHandle | None = None  # fails ``fut`` at the deadline
    sink: Callable[[asyncio.Future[MatmulReply]], None] | None = None  # see Batcher.enqueue
    group: Group | None = None  # the multi-weight call this request is a part of
    taken: bool = False  # left its queue (launched or dropped)

    def dead(self, now: float) -> bool:
        """Cancelled by its caller, or past its deadline (read from the device thread too:
        a stale answer only costs running a row that is then dropped)."""
        return self.fut.done() or (self.deadline is not None and now >= self.deadline)

    @property
    def rows(self) -> int:
        return int(self.x.shape[0])


class Group:
    """The parts of one multi-weight call on one device: queued one by one (``Batcher.enqueue``
    with ``group``), then launched together (:meth:`launch`). Launching any part's batch takes every
    sibling's batch that can launch into the same device job (``Batcher._start``)."""

    __slots__ = ("left", "parts")

    def __init__(self) -> None:
        self.parts: list[tuple[Batcher, _Pending]] = []
        self.left = 0  # parts that have left their queues (``_left``)

    def launch(self) -> None:
        """Call after the last part is queued. On an idle device the group's job is submitted
        now (no loop trip, no delay); otherwise the parts' batchers decide, as for any request,
        and the first to launch takes the others along."""
        for b, p in self.parts:
            if not p.taken and b._can_start_now():
                b._kick()
                break
        for b, p in self.parts:
            if not p.taken:
                b._wake.set()


def _left(p: _Pending) -> None:
    """``p`` leaves its queue (launched or dropped). Once every part of its group has, the
    group lets go of them: a group and its parts refer to each other, and that cycle (with
    each part's x, and its sink, whose multi-weight future holds every part's y) waited for
    the cyclic GC otherwise (the replay at S=64 held ~30-50 replies' y that way). The list is
    replaced, not cleared: ``_with_siblings`` and ``Group.launch`` may be iterating it."""
    p.taken = True
    g = p.group
    if g is not None:
        g.left += 1
        if g.left == len(g.parts):
            g.parts = []


RunBatch = Callable[[np.ndarray, BatchKey], MatmulResult]
# (live requests, their concatenated x, the batch's result or per-request outcomes, the device
# job's start (a group's job runs several batches), this batch's start and end)
_Done = tuple[list[_Pending], np.ndarray | None, Any, float, float, float]


def _bucket(rows: int) -> int:
    """Rows rounded up to a power of two: batches expected to cost alike."""
    return 1 << max(rows - 1, 0).bit_length()


# _bucket by list index for the rows a request or batch usually has: the direct path looks a
# bucket up twice per request on the loop (the call, max and bit_length were ~0.5 us each)
_BUCKETS = [_bucket(r) for r in range(1025)]


Staging = Callable[[int, int, np.dtype], np.ndarray]  # Backend.staging
LaunchBatch = Callable[[np.ndarray, BatchKey], Launched]  # RunBatch without the wait
# x on several batchers' weights as one backend call (Engine._launch_many, asked on the loop):
# the function that makes the call for an x (its Launched waits for one result per batcher,
# in order), or None: not as one call (the parts run each as usual)
ManyCall = Callable[[np.ndarray], Launched]
LaunchMany = Callable[[Sequence["Batcher"], BatchKey], "ManyCall | None"]
# A batch whose kernels are expected to take longer than this is only launched on the loop
# and waited for on the device thread (Device: ``launch``); a shorter one runs whole there.
# Env Q6SERVE_DEFER_KERNEL_US sets it (benches A/B it; a huge value: never deferred).
DEFER_ENV = envvars.DEFER_KERNEL_US.name
DEFER_KERNEL_S = float(envvars.DEFER_KERNEL_US.read()) * 1e-6
MAX_DIRECTS = 64  # a batcher's DirectCalls kept (one per key used on the direct path)


class Batcher:
    def __init__(self, name: str, device: Device, run: RunBatch, settings: BatchSettings,
                 dynamic: Callable[[], bool], on_batch: Callable[[BatchStats], None],
                 staging: Staging | None = None, launch: LaunchBatch | None = None,
                 bind: Callable[[BatchKey], Callable[[np.ndarray], MatmulResult]] | None = None,
                 many: LaunchMany | None = None, entry: Any = None) -> None:
        self.name = name
        self._device = device
        # one backend call for the same x on several weights (a multi-weight call's parts:
        # _start's group job, run_direct_many); ``entry``: this weight's, for ``many``
        self.many = many
        self.entry = entry
        self._run_batch = run
        # run with a key's fields bound (DirectCall.job); without one, run(x, key) itself
        self._bind = bind
        self._directs: dict[BatchKey, DirectCall] = {}  # by key (bounded: MAX_DIRECTS)
        self._launch_batch = launch
        # where a batch of several requests is concatenated (the backend's upload buffer:
        # the CUDA backend then skips its own host copy of x; a T2 batch is 2.4 MB)
        self._staging = staging
        self._s = settings
        self._dynamic = dynamic
        # a batch's stats, given to ``on_batch`` as its replies are resolved: the callee keeps
        # its own work off the replies' path (the engine's _defer_batch: one later loop trip
        # for every batch of a trip)
        self._on_batch = on_batch
        self._queue: collections.deque[_Pending] = collections.deque()
        self.queued_rows = 0
        self._wake = asyncio.Event()
        self._loop_ = asyncio.get_running_loop()
        # asyncio's ready queue (direct_cost looks at it per request; made once per loop and
        # never replaced: base_events), or () on a loop without one
        self._ready: collections.deque[Any] | tuple[()] = getattr(self._loop_, "_ready", ())
        self._unfinished = 0  # launched batches not yet finished
        self._running = 0  # requests in launched batches not yet finished
        self._drained: asyncio.Future[None] | None = None  # close() waits for launches
        self._closed = False
        # device-job seconds last measured per (key, rows rounded up to a power of two): what
        # a batch like it is expected to keep the device busy (Device.call's expect_s)
        self._job_s: dict[tuple[BatchKey, int], float] = {}
        self._kernel_s: dict[tuple[BatchKey, int], float] = {}  # and its kernels (events)
        self._kick_pending = False
        self._task = self._loop_.create_task(self._loop(), name=f"batch-{name}")

    @property
    def in_flight(self) -> int:
        """Requests queued or running."""
        return len(self._queue) + self._running

    async def submit(self, x: np.ndarray, key: BatchKey, timeout: float | None,
                     ) -> MatmulReply:
        """Queue ``x`` and wait for its rows of the result (``timeout``: the caller's deadline)."""
        return await self.enqueue(x, key, timeout)

    def enqueue(self, x: np.ndarray, key: BatchKey, timeout: float | None,
                sink: Callable[[asyncio.Future[MatmulReply]], None] | None = None,
                group: Group | None = None) -> asyncio.Future[MatmulReply]:
        """Queue ``x`` now; the future gets its rows of the result, or DeadlineExceeded after
        ``timeout`` seconds. Cancelling the future drops the request before it runs. On an
        idle device the batch is launched before this returns (no loop trip, no delay).
        ``sink(fut)`` is called right after the batcher resolves the future, in the same loop
        trip (a done callback would run one trip later): a stream queues its reply from there.
        It is not called when the future is cancelled from outside. With ``group`` nothing is
        launched here: the caller calls ``group.launch()`` after queueing every part."""
        if self._closed:
            raise Unavailable(f"weight {self.name!r} is shutting down")
        n = int(x.shape[0])
        if self.queued_rows + n > self._s.max_queue_rows:
            raise ResourceExhausted(
                f"queue of weight {self.name!r} is full: {self.queued_rows} rows queued, "
                f"{n} more would exceed {self._s.max_queue_rows}")
        loop = self._loop_
        now = time.perf_counter()
        p = _Pending(x, key, loop.create_future(), now,
                     None if timeout is None else now + timeout, sink=sink, group=group)
        if timeout is not None:  # a timer, not wait_for: no extra future, no extra loop trip
            p.timer = loop.call_later(timeout, self._expire, p, timeout)
        self._queue.append(p)
        self.queued_rows += n
        if group is not None:
            group.parts.append((self, p))
        elif len(self._queue) == 1 and self._can_start_now():
            self._kick()  # idle device, nothing queued: launch now
        elif not self._start_behind() and not (self._device.defer_now and self._full()):
            # (DEFER_NOW: no wake while no batch may launch; the next end wakes the task)
            self._wake.set()
        return p.fut

    def _start_behind(self) -> bool:
        """With short batches pipelined (``Device.pipeline_short``) and another batch on the
        device: a full batch at the head of the queue is started now (launched behind that
        batch, or held by the device), as the batcher's task would do at once, without its
        two task steps per batch (~25 us of the loop per pipelined region call). Not on an
        idle device, where the job may run inline: there it waits for the task, after the
        work the replies' sinks scheduled (test_reply_order)."""
        if (not self._device.pipeline_short or self._device.idle
                or self._unfinished >= self._s.max_inflight_batches):
            return False
        self._drop_dead_head()
        if not self._queue or self._ready_rows(self._queue[0].key) < self._s.max_rows:
            return False
        self._start(self._take())
        return True

    def can_run_now(self, rows: int, key: BatchKey, own: object = None) -> bool:
        """Whether a request of ``rows`` would, if queued now, launch at once as a lone inline
        job on this thread and settle in the same trip (``enqueue`` -> ``_kick`` -> ``_kicked``
        -> ``Device.call`` inline, ``settle_now``): :meth:`direct_cost` is not None."""
        return self.direct_cost(rows, key, own) is not None

    def direct_cost(self, rows: int, key: BatchKey, own: object = None) -> float | None:
        """The seconds a like job last took, if a request of ``rows`` may take the direct
        path now (:meth:`run_now`), else None: the device idle, nothing of this weight
        queued or running, a like batch's job measured and short enough to inline and not
        one to defer (DEFER_KERNEL_S), and no task waiting to run in this loop trip, which
        could queue a request that would join the batch (``_kicked`` runs after the
        callbacks ready now, and before what they schedule: only a task woken now, e.g.
        another stream's reader, can join; ``own``, the caller's task, cannot).
        :meth:`run_now` does the queued path's work without the queue, future, timer and
        loop trips."""
        dev = self._device
        if self._queue or self._unfinished or self._closed or dev.inflight:  # (not idle)
            return None
        kb = (key, _BUCKETS[rows] if 0 <= rows < len(_BUCKETS) else _bucket(rows))
        cost = self._job_s.get(kb)
        if not dev.inlines(cost):  # (the inline rule stays Device's alone)
            return None
        if self._launch_batch is not None and self._kernel_s.get(kb, 0.0) > DEFER_KERNEL_S:
            return None
        for h in self._ready:  # asyncio's ready queue: a few handles
            task = getattr(h._callback, "__self__", None)
            if isinstance(task, asyncio.Task) and task is not own:
                return None
        return cost

    def run_now(self, x: np.ndarray, key: BatchKey) -> MatmulReply:
        """The direct path: run ``x`` alone now (after :meth:`can_run_now` said yes) and return
        its reply; a refusal or failure raises. The bookkeeping is a batch's: launch slot,
        expected costs, batch metrics (after the reply, as ``_hand_out``)."""
        return self.run_direct(self.direct(key), x)

    def direct(self, key: BatchKey) -> DirectCall:
        """The :class:`DirectCall` of ``key`` on this weight (made on its first use)."""
        d = self._directs.get(key)
        if d is None:
            if len(self._directs) >= MAX_DIRECTS:  # (top-k's k spans many keys: bounded)
                self._directs.clear()
            run = self._run_batch
            job = (self._bind(key) if self._bind is not None
                   else lambda x: run(x, key))
            d = self._directs[key] = DirectCall(key, job)
        return d

    def run_direct(self, d: DirectCall, x: np.ndarray,
                   launch: LaunchBatch | None = None) -> MatmulReply:
        """:meth:`run_now` of ``d``'s key, ``d`` in hand (``Engine.run_now``); ``launch``: the
        launch in place of the key's job (:meth:`launch_now`'s)."""
        self._unfinished += 1
        self._running += 1
        t0 = time.perf_counter()
        job = d.job if launch is None else lambda x: launch(x, d.key).wait()
        try:
            result = self._device.run_now(job, x)
        finally:
            self._now_end()
        return self._now_reply(result, int(x.shape[0]), d.key, t0)

    def run_direct_many(self, ds: Sequence[tuple[Batcher, DirectCall]], x: np.ndarray,
                        ) -> list[MatmulReply] | None:
        """:meth:`run_direct` of the same ``x`` on several weights (a multi-weight call's
        parts, each ``(batcher, DirectCall)`` of one key, this batcher's first) as one
        backend call (``many``) in one direct device job; one reply each, in order, each with
        its own result and an equal share of the job's time as its device seconds (and as the
        cost its batcher expects of a like call). None: ``many`` declined (nothing was done:
        run the parts each as usual). A refusal or failure raises (``e.part``, where the
        backend set it: the index of the part it is about)."""
        key = ds[0][1].key
        go = self.many([b for b, _ in ds], key)  # type: ignore[misc]
        if go is None:
            return None
        for b, _ in ds:
            b._unfinished += 1
            b._running += 1
        t0 = time.perf_counter()
        try:
            results = self._device.run_now(_wait_launched, go, x)
        finally:
            for b, _ in ds:
                b._now_end()
        share = (time.perf_counter() - t0) / len(ds)
        rows = int(x.shape[0])
        return [b._now_reply(r, rows, key, t0, share)
                for (b, _), r in zip(ds, results, strict=True)]

    def _now_end(self) -> None:
        """A direct job (run_now, launch_now) is over: its place given back."""
        self._unfinished -= 1
        self._running -= 1
        if self._drained is not None and self._unfinished == 0 and not self._drained.done():
            self._drained.set_result(None)
        if self._queue:
            self._wake.set()

    def _now_reply(self, result: MatmulResult, rows: int, key: BatchKey, t0: float,
                   job_s: float | None = None) -> MatmulReply:
        """A direct job's reply, and a batch's bookkeeping: expected costs, batch metrics
        (after the reply, as ``_hand_out``). ``job_s``: this call's share of the job's time
        (one backend call for several weights: ``run_direct_many``), else since ``t0``."""
        if job_s is None:
            job_s = time.perf_counter() - t0
        kernel_s = result.timing.seconds()
        kb = (key, _BUCKETS[rows] if rows < len(_BUCKETS) else _bucket(rows))
        self._job_s[kb] = job_s
        if kernel_s is not None:
            self._kernel_s[kb] = kernel_s
        self._on_batch(BatchStats(result, rows, 1, (0.0,)))
        return MatmulReply(result.y, result.kernel, result.layout, result.precision, 0.0,
                           kernel_s, rows, 1, job_s, result.topk)

    def can_launch_now(self, rows: int, key: BatchKey) -> bool:
        """Whether a request of ``rows`` may be launched now by :meth:`launch_now`: a full
        batch (no other request could join it: it need not wait for the trip's others, nor
        for the queue, which the batcher's task still serves in the next trip), the device
        free for it (``Device.may_launch_now``: at most launch_now's own launches in flight),
        and a like job measured, short enough to inline and not one to defer."""
        if (rows < self._s.max_rows or self._closed or self._launch_batch is None
                or not self._device.may_launch_now()):
            return False
        kb = (key, _BUCKETS[rows] if rows < len(_BUCKETS) else _bucket(rows))
        return (self._device.inlines(self._job_s.get(kb))
                and self._kernel_s.get(kb, 0.0) <= DEFER_KERNEL_S)

    def launch_now(self, x: np.ndarray, key: BatchKey,
                   launch: LaunchBatch | None = None) -> Callable[[], MatmulReply]:
        """:meth:`run_now` in two halves (after :meth:`can_launch_now`; ``Device.launch_now``
        says how the caller waits): ``x`` launched now, alone; the function returned waits for
        it and returns its reply (a failure raises), with run_now's bookkeeping. Its job time
        spans launch to wait, what the loop did meanwhile included. ``launch``: the launch in
        place of this weight's own (the fast lane's region call: ``Engine.launch_now``)."""
        self._unfinished += 1
        self._running += 1
        t0 = time.perf_counter()
        try:
            wait = self._device.launch_now(launch or self._launch_batch,  # type: ignore[arg-type]
                                           x, key)
        except BaseException:
            self._now_end()
            raise

        def finish() -> MatmulReply:
            try:
                result = wait()
            finally:
                self._now_end()
            return self._now_reply(result, int(x.shape[0]), key, t0)

        return finish

    def _expect(self, key: BatchKey, rows: int) -> float | None:
        return self._job_s.get((key, _bucket(rows)))

    def forget_costs(self) -> None:
        """Drop what batches are expected to cost (their kernels changed: a flag flip)."""
        self._job_s.clear()
        self._kernel_s.clear()

    def _kick(self) -> None:
        """Launch on the idle device: now, or - when the job would run inline on the loop
        (``Device.inline_s``) - at the end of this loop trip, so that the requests the trip
        is still handling (other callers' messages read with this one) join the batch
        instead of waiting behind it. No timer: the launch is one loop trip away at most."""
        head = self._queue[0]
        if not self._device.inlines(self._expect(head.key, head.rows)):
            self._start(self._take())
        elif not self._kick_pending:
            self._kick_pending = True
            self._loop_.call_soon(self._kicked)

    def _kicked(self) -> None:
        self._kick_pending = False
        if self._can_start_now():
            self._start(self._take())
        elif self._queue:
            self._wake.set()

    def _can_start_now(self) -> bool:
        return (bool(self._queue) and self._device.idle
                and self._unfinished < self._s.max_inflight_batches)

    def _defers(self, p: _Pending) -> bool:
        """A batch headed by ``p`` is one whose kernels are deferred (launched on the loop,
        waited for on the device thread): a like batch's kernels took over DEFER_KERNEL_S."""
        return (self._launch_batch is not None
                and self._kernel_s.get((p.key, _bucket(p.rows)), 0.0) > DEFER_KERNEL_S)

    def _full(self) -> bool:
        """No further batch of this weight may launch now: ``max_inflight_batches`` are
        unfinished or, when the head's batch is one to defer and the device takes more of
        those (``Device.defer_slots``, Q6SERVE_DEFER_SLOTS), that many."""
        n = self._unfinished
        if n < self._s.max_inflight_batches:
            return False
        return (n >= self._device.defer_slots or not self._queue
                or not self._defers(self._queue[0]))

    def _start_deferred(self) -> bool:
        """``Device.defer_now`` (Q6SERVE_DEFER_NOW, on by default): in the loop trip that hears
        of a batch's end, the next batch, if it is one to defer and may launch now, is started
        here, as the batcher's task would do a trip later (the GPU gets it a trip sooner).
        Only where the task would not wait to fill it (no delay, an idle device or a full
        batch). With it, :meth:`enqueue` does not wake the task while :meth:`_full` (it would
        only find that and sleep again: one task step a request under the lm-head's load);
        the end of a batch wakes it (here or in ``_finish``)."""
        if not self._device.defer_now or self._closed:
            return False
        self._drop_dead_head()
        if not self._queue or self._full() or not self._defers(self._queue[0]):
            return False
        head = self._queue[0]
        if (self._dynamic() and self._s.max_delay_s > 0 and not self._device.idle
                and self._ready_rows(head.key) < self._s.max_rows):
            return False
        self._start(self._take())
        return True

    def _expire(self, p: _Pending, timeout: float) -> None:
        p.timer = None
        self._resolve(p, DeadlineExceeded(
            f"deadline of {timeout:.6f} s passed before weight {self.name!r} "
            f"answered ({self.queued_rows} rows queued)"))

    @staticmethod
    def _untime(p: _Pending) -> None:
        if p.timer is not None:
            p.timer.cancel()
            p.timer = None

    def _resolve(self, p: _Pending, outcome: MatmulReply | BaseException) -> None:
        """Settle ``p`` once: its deadline timer off, its future resolved, its sink told."""
        self._untime(p)
        if p.fut.done():
            return
        if isinstance(outcome, BaseException):
            p.fut.set_exception(outcome)
        else:
            p.fut.set_result(outcome)
        if p.sink is not None:
            p.sink(p.fut)

    def _take(self) -> list[_Pending]:
        """Pop the head request plus same-key followers that fit in max_rows."""
        head = self._queue.popleft()
        batch, rows = [head], head.rows
        if self._dynamic():
            keep: list[_Pending] = []
            while self._queue:
                p = self._queue.popleft()
                if p.key == head.key and rows + p.rows <= self._s.max_rows:
                    batch.append(p)
                    rows += p.rows
                else:
                    keep.append(p)
                    if rows >= self._s.max_rows:
                        break
            self._queue.extendleft(reversed(keep))
        for p in batch:
            self.queued_rows -= p.rows
            _left(p)
        now = time.perf_counter()
        return [p for p in batch if not p.dead(now)]

    def _drop_dead_head(self) -> None:
        while self._queue and self._queue[0].fut.done():
            p = self._queue.popleft()
            _left(p)
            self.queued_rows -= p.rows

    def _ready_rows(self, key: BatchKey) -> int:
        rows = 0
        for p in self._queue:
            if p.key == key and not p.fut.done():
                rows += p.rows
                if rows >= self._s.max_rows:
                    break
        return rows

    async def _loop(self) -> None:
        while not self._closed:
            self._drop_dead_head()
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._full():
                self._wake.clear()
                await self._wake.wait()
                continue
            head = self._queue[0]
            if self._dynamic() and self._s.max_delay_s > 0 and not self._device.idle:
                waited = time.perf_counter() - head.t_enqueue
                if (waited < self._s.max_delay_s
                        and self._ready_rows(head.key) < self._s.max_rows):
                    # device busy: gather more until it goes idle, the batch fills or delay ends
                    self._wake.clear()
                    self._device.notify_when_idle(self._wake.set)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self._s.max_delay_s - waited)
                    continue
            self._start(self._take())
            await asyncio.sleep(0)  # let new arrivals in before forming the next batch

    def _start(self, batch: list[_Pending]) -> None:
        """Submit ``batch`` to the device now (nothing if every request in it is dead); its
        outcome is split in the loop trip that hears of the job's end (``_finish``). Batches
        of the multi-weight siblings of its requests go into the same device job."""
        if not batch:
            return
        jobs = self._with_siblings(batch)
        expect: float | None = 0.0
        for b, bt in jobs:
            b._unfinished += 1
            b._running += len(bt)
            rows = sum(p.rows for p in bt)
            e = b._expect(bt[0].key, rows)
            expect = None if e is None or expect is None else expect + e
        if len(jobs) == 1 and (more := self._more_batches(batch)) is not None:
            batches = [batch, *more]
            self._running += sum(len(bt) for bt in more)  # (one job: _unfinished counts 1)
            self._device.call(self._loop_, self._run_batches, (batches, batch[0].key),
                              lambda done, exc: self._finish_batches(batches, done, exc))
        elif len(jobs) == 1:  # (self, batch): ``rows`` are this batch's
            key = batch[0].key
            kernel_s = self._kernel_s.get((key, _bucket(rows)), 0.0)
            launch = (self._launch_job if self._launch_batch is not None
                      and (kernel_s > DEFER_KERNEL_S or self._pipelined()) else None)
            # nothing queued behind it: its replies' work cannot be overtaken by a launch
            # of this batcher (test_reply_order), so an inline job settles in this trip
            self._device.call(self._loop_, self._job, (batch, key),
                              lambda done, exc: self._finish(batch, done, exc), expect, launch,
                              settle_now=not self._queue)
        else:
            go = (self.many([b for b, _ in jobs], batch[0].key)
                  if self.many is not None and _same_rows(jobs) else None)
            self._device.call(self._loop_, _run_jobs if go is None else _run_many,
                              (jobs,) if go is None else (jobs, go),
                              lambda done, exc: _finish_jobs(jobs, done, exc), expect)

    def _more_batches(self, batch: list[_Pending]) -> list[list[_Pending]] | None:
        """With ``Device.job_batches`` > 1 and the device busy or requests of ``batch``'s key
        queued behind it: the further batches (up to that many in all) that run in
        ``batch``'s job (``_run_batches``); None: ``batch`` runs as usual (a lone request on an
        idle device stays inline, as on the direct path)."""
        dev = self._device
        if dev.job_batches < 2 or self._launch_batch is None or batch[0].group is not None:
            return None
        key = batch[0].key
        more: list[list[_Pending]] = []
        while len(more) + 1 < dev.job_batches:
            self._drop_dead_head()
            if not self._queue or self._queue[0].key != key or self._queue[0].group is not None:
                break
            if bt := self._take():
                more.append(bt)
        return more if more or not dev.idle else None

    def _run_batches(self, batches: list[list[_Pending]], key: BatchKey,
                     ) -> list[tuple[_Done | None, BaseException | None]]:
        """In the device thread: ``batches`` as one job, each launched behind the previous
        one (at most the device's launch slots launched and not yet waited for), waited for
        in order; one outcome per batch (a failure reaches only its own batch's requests)."""
        t_job = time.perf_counter()
        out: list[tuple[_Done | None, BaseException | None]] = [(None, None)] * len(batches)
        waits: collections.deque[tuple[int, Deferred]] = collections.deque()

        def wait_oldest() -> None:
            i, d = waits.popleft()
            try:
                out[i] = (d.wait(), None)
            except BaseException as e:  # every waiter must hear of a failure
                out[i] = (None, e)

        for i, bt in enumerate(batches):
            if len(waits) >= self._device.launch_slots:
                wait_oldest()
            try:
                got = self._job(bt, key, t_job, defer=True)
            except BaseException as e:
                out[i] = (None, e)
                continue
            if isinstance(got, Deferred):
                waits.append((i, got))
            else:
                out[i] = (got, None)
        while waits:
            wait_oldest()
        return out

    def _finish_batches(self, batches: list[list[_Pending]],
                        done: list[tuple[_Done | None, BaseException | None]] | None,
                        exc: BaseException | None) -> None:
        """On the loop: each batch of a ``_run_batches`` job split as its own (``_finish``)."""
        self._unfinished += len(batches) - 1  # the job counted once; each _finish takes one
        for i, bt in enumerate(batches):
            if done is None:
                self._finish(bt, None, exc)
            else:
                self._finish(bt, *done[i])

    def _pipelined(self) -> bool:
        """Whether a short batch is launched on the loop and waited for on the device thread
        (``Device.call``'s ``launch``), as a long one always is: under load, with pipelining
        of short batches on (``Device.pipeline_short``): more requests queued behind it, or
        another job still on the device. The loop then takes the next calls while the GPU
        works, and the next batch is launched behind this one (``Device.launch_slots``),
        instead of the loop waiting for every batch's copies and kernels inline (T3 with
        regions: ~130 of the loop's ~360 us per call on the H200). A lone request on an idle
        device still runs inline (no thread hand-off on its way back)."""
        return self._device.pipeline_short and (bool(self._queue) or not self._device.idle)

    def _with_siblings(self, batch: list[_Pending]) -> list[tuple[Batcher, list[_Pending]]]:
        """``batch`` plus, for every group among its requests (and theirs, transitively), the
        batch each sibling's batcher would launch next, if it may launch one now."""
        jobs: list[tuple[Batcher, list[_Pending]]] = [(self, batch)]
        if not any(p.group is not None for p in batch):
            return jobs
        seen = {self}
        i = 0
        while i < len(jobs):
            for p in jobs[i][1]:
                if p.group is None:
                    continue
                for b, q in p.group.parts:
                    if b in seen or q.taken:
                        continue
                    seen.add(b)
                    if (b._queue and b._unfinished < b._s.max_inflight_batches
                            and (bt := b._take())):
                        jobs.append((b, bt))
            i += 1
        return jobs

    def _launch_job(self, batch: list[_Pending], key: BatchKey) -> _Done | Deferred:
        """:meth:`_job` with the device's work launched, not waited for (Device.call)."""
        return self._job(batch, key, defer=True)

    def _job(self, batch: list[_Pending], key: BatchKey, t_job: float | None = None,
             defer: bool = False) -> _Done | Deferred:
        """In the device thread (or on the loop: Device.inline_s): concatenate the live
        requests and run them as one launch (``t_job``: when the device job holding this batch
        started, if not now). ``defer``: launch it and return what waits for it."""
        t0 = time.perf_counter()
        t_job = t0 if t_job is None else t_job
        live = [p for p in batch if not p.dead(t0)]  # dropped while staged: skip rows
        if not live:
            return live, None, None, t_job, t0, t0
        x = self._concat(live)
        try:
            if defer and self._launch_batch is not None:
                launched = self._launch_batch(x, key)
                if not launched.finished:  # (NumPy computes at launch: no hand-off then)
                    return Deferred(lambda: (live, x, launched.wait(), t_job, t0,
                                             time.perf_counter()))
                result: Any = launched.wait()
            else:
                result = self._run_batch(x, key)
        except (InvalidArgument, FailedPrecondition):
            if len(live) == 1:
                raise
            result = self._run_each(live, key)  # isolate the request that failed it
        return live, x, result, t_job, t0, time.perf_counter()

    def _concat(self, live: list[_Pending]) -> np.ndarray:
        """The x of a batch of ``live`` requests: one's own, or theirs concatenated into the
        backend's staging buffer (where it has one)."""
        if len(live) == 1:
            return live[0].x
        xs = [p.x for p in live]
        out = None if self._staging is None else self._staging(
            sum(len(a) for a in xs), xs[0].shape[1], xs[0].dtype)
        return np.concatenate(xs, out=out)

    def _run_each(self, live: list[_Pending], key: BatchKey,
                  ) -> list[MatmulResult | Q6Error]:
        """A batch whose launch refused its input (one caller's bad request, e.g. values a
        kernel cannot take): run each request alone so the refusal reaches only the caller
        whose input caused it. Device errors still fail everyone (the device is gone)."""
        out: list[MatmulResult | Q6Error] = []
        for p in live:
            try:
                out.append(self._run_batch(p.x, key))
            except (InvalidArgument, FailedPrecondition) as e:
                out.append(e)
        return out

    def _finish(self, batch: list[_Pending], done: _Done | None,
                exc: BaseException | None) -> None:
        """On the loop: hand each request its rows (or the batch's failure), then wake the
        batcher for what waits (a launch slot is free). The wake comes last so that what the
        replies' sinks scheduled (stream writes, a front end's reply message) runs before the
        batcher's next launch, which may run its job on this thread (Device.inline_s)."""
        try:
            self._hand_out(batch, done, exc)
        finally:
            # (a deferred start leaves the task asleep unless a further batch may launch)
            if (self._queue and not self._start_behind()
                    and not (self._start_deferred() and self._full())):
                self._wake.set()

    def _hand_out(self, batch: list[_Pending], done: _Done | None,
                  exc: BaseException | None) -> None:
        self._unfinished -= 1
        self._running -= len(batch)
        if self._drained is not None and self._unfinished == 0 and not self._drained.done():
            self._drained.set_result(None)
        if exc is not None or done is None:
            err = exc if isinstance(exc, Exception) else Unavailable(
                "the worker is shutting down")
            for p in batch:
                self._resolve(p, err)
            return
        # queue: until the device job started (in a group's job, the siblings' batches that
        # ran before this one count as device time of the call, not as queueing)
        live, x, result, t_job, t0, t1 = done
        if x is None or result is None:  # every request was dropped: only timers to stop
            for p in batch:
                self._untime(p)
            return
        if isinstance(result, list):  # run request by request (see _run_each)
            for p, r in zip(live, result, strict=True):
                q = t_job - p.t_enqueue
                if isinstance(r, Q6Error):
                    self._resolve(p, r)
                else:
                    self._resolve(p, MatmulReply(r.y, r.kernel, r.layout, r.precision, q,
                                                 r.timing.seconds(), p.rows, 1, t1 - t0,
                                                 r.topk))
                    self._on_batch(BatchStats(r, p.rows, 1, (q,)))
            return
        rows = int(x.shape[0])
        kernel_s = result.timing.seconds()  # once per batch; None until device events are done
        # what the next batch like this one is expected to hold the device (Device.call): the
        # whole job's wall, not its kernel (an inline job blocks the loop for all of it); in
        # the device thread that wall includes its GIL waits, so it errs on the safe side
        self._job_s[(live[0].key, _bucket(rows))] = t1 - t0
        if kernel_s is not None:
            self._kernel_s[(live[0].key, _bucket(rows))] = kernel_s
        queued = tuple(t_job - p.t_enqueue for p in live)
        off = 0
        for p, q in zip(live, queued, strict=True):
            if not p.fut.done():
                y = None if result.y is None else result.y[off : off + p.rows]
                top = None if result.topk is None else result.topk.rows(off, off + p.rows)
                self._resolve(p, MatmulReply(y, result.kernel, result.layout,
                                             result.precision, q, kernel_s, rows, len(live),
                                             t1 - t0, top))
            else:
                self._untime(p)  # cancelled or expired while its batch ran
            off += p.rows
        # after the replies: their handlers are woken first (on_batch defers the metrics)
        self._on_batch(BatchStats(result, rows, len(live), queued))

    async def close(self) -> None:
        """Finish launched batches; fail what is still queued."""
        self._closed = True
        self._wake.set()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        while self._queue:
            p = self._queue.popleft()
            _left(p)
            self._resolve(p, Unavailable(f"weight {self.name!r} was unloaded"))
        self.queued_rows = 0
        if self._unfinished:
            self._drained = self._loop_.create_future()
            await asyncio.shield(self._drained)


_Jobs = list[tuple[Batcher, list[_Pending]]]


def _run_jobs(jobs: _Jobs) -> list[tuple[_Done | None, BaseException | None]]:
    """In the device thread: several batchers' batches back to back, one outcome each (a
    failure of one batch reaches only its own requests; a device error fails the rest too,
    each on its own launch)."""
    out: list[tuple[_Done | None, BaseException | None]] = []
    t_job = time.perf_counter()
    for b, batch in jobs:
        try:
            out.append((b._job(batch, batch[0].key, t_job), None))
        except BaseException as e:  # every waiter must hear of a failure
            out.append((None, e))
    return out


def _wait_launched(go: ManyCall, x: np.ndarray) -> Any:
    return go(x).wait()


def _same_rows(jobs: _Jobs) -> bool:
    """Whether every batch of a group job holds the same requests' x, in the same order, of
    one key (each caller's multi-weight parts, and nothing else: their concatenated x is the
    same for every weight), so one backend call can run them all (``_run_many``)."""
    b0, first = jobs[0]
    key = first[0].key
    return all(b.many == b0.many and len(bt) == len(first)
               and all(p.x is q.x and p.key == key for p, q in zip(bt, first, strict=True))
               for b, bt in jobs[1:])


def _run_many(jobs: _Jobs, go: ManyCall) -> list[tuple[_Done | None, BaseException | None]]:
    """``_run_jobs`` as one backend call (``Batcher.many``: x concatenated and uploaded once,
    every weight's kernel launched behind the others, one wait), where ``_same_rows`` held at
    the start: one outcome per batch, each with its own result (kernel name, kernel time) and
    a share of the job's time as its own (its device seconds, the cost its batcher expects of
    a like batch). Falls back to ``_run_jobs`` when the batches' live requests no longer match
    (one expired since), or when the launch
    refuses its input (each batch then runs alone and isolates the request that caused it).
    ``go``: the call (``Batcher.many``'s, asked on the loop by ``_start``)."""
    t0 = time.perf_counter()
    b0 = jobs[0][0]
    lives = [[p for p in bt if not p.dead(t0)] for _, bt in jobs]
    live = lives[0]
    if not live or any(len(lv) != len(live)
                       or any(p.x is not q.x for p, q in zip(lv, live, strict=False))
                       for lv in lives[1:]):
        return _run_jobs(jobs)
    x = b0._concat(live)
    try:
        results = go(x).wait()
    except (InvalidArgument, FailedPrecondition):
        return _run_jobs(jobs)
    except BaseException as e:  # every waiter must hear of a failure
        return [(None, e)] * len(jobs)
    t1 = time.perf_counter()
    share = (t1 - t0) / len(jobs)
    return [((lv, x, r, t0, t0 + i * share, t0 + (i + 1) * share), None)
            for i, (lv, r) in enumerate(zip(lives, results, strict=True))]


def _finish_jobs(jobs: _Jobs, done: list[tuple[_Done | None, BaseException | None]] | None,
                 exc: BaseException | None) -> None:
    """On the loop: each batcher splits its own batch's outcome (``Batcher._finish``)."""
    for i, (b, batch) in enumerate(jobs):
        if done is None:
            b._finish(batch, None, exc)
        else:
            b._finish(batch, *done[i])
