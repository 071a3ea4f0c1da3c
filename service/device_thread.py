"""The device thread: one single-thread executor per device for all its work (batches,
loads, relayouts, frees), which knows when the device is idle and may run a short job on the
loop's own thread instead (:class:`Device`). Made by the engine, one per device; used by its
batchers (service/batcher.py), the lane and CUDA-region calls.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from q6serve.kernels.api import Launched, MatmulResult

from . import envvars
from .threads import settle

T = TypeVar("T")



# The Device's variables (envvars): HANDOFF_YIELD=0 never yields the GIL on a hand-off;
# PIPELINE=0 launches one batch at a time (Device.launch_slots); PIPELINE_SHORT=1 launches and
# waits for short batches under load on the thread too (Device.pipeline_short); JOB_BATCHES=N > 1
# runs up to N batches of one weight as one device-thread job under load (Device.job_batches).
HANDOFF_ENV = envvars.HANDOFF_YIELD.name
JOB_BATCHES_ENV = envvars.JOB_BATCHES.name


def job_batches(env: Any = None) -> int:
    """``Q6SERVE_JOB_BATCHES``: batches of one weight per device-thread job (1, the default:
    one each); anything but a positive count is refused, naming the variable (envvars)."""
    return int(envvars.JOB_BATCHES.read(env))


def handoff_yield_for(backend_name: str) -> bool:
    """Whether a Device of this backend yields the GIL on a hand-off (see :class:`Device`):
    CUDA jobs release the GIL at their device sync, so the loop gets it back early; a NumPy
    job holds it to the end (the loop would wait for the whole job: in process, no-op kernel,
    submit -> result 84 -> 150 us). Env Q6SERVE_HANDOFF_YIELD=0 turns it off."""
    return backend_name == "cuda" and bool(envvars.HANDOFF_YIELD.read())


class Device:
    """One single-thread executor for all work on one device; knows when it is idle.

    ``handoff_yield``: a job handed to an idle device thread is followed by ``time.sleep(0)``
    on the loop, which releases the GIL while the woken device thread wants it: the job's host
    path (copies, launch) starts now rather than when the loop next blocks in epoll, and the
    loop's rest of the trip runs while the device works (once the job releases the GIL at its
    sync) instead of delaying its start. Only for jobs reaching an idle thread: under load the
    thread is busy, jobs queue behind it and nothing is yielded.

    ``inline_s`` > 0: a job that its caller expects to keep the device busy for at most this
    long (``Device.call(..., expect_s=...)``: a like batch's whole job, as last measured) runs on
    the calling (loop) thread itself when the device thread has nothing queued or running.
    The job's Python holds the GIL either way, so the loop loses only the kernel's wait, and
    the call saves two thread wake-ups and the GIL hand-backs at each CUDA call that releases
    it (on the H200 those, not the kernels, held a 32-row batch's job ~1 ms around a 54 us
    kernel: bench/RESULTS.md). Longer or first-of-a-kind jobs (kernel compiles, loads,
    relayouts, frees) run on the device thread; a short job submitted while the thread is
    busy is held and runs on the loop when the thread is done (in order with other held
    jobs). A job that comes with a ``launch`` (a batch whose kernels take long: the lm-head)
    is only *launched* on the loop: ``launch`` returns a :class:`Deferred` whose ``wait`` runs
    on the device thread, so the loop is free while the GPU works and the device thread needs
    the GIL only to hear of the end.

    ``launch_slots`` > 1 (the backend's, unless ``Q6SERVE_PIPELINE=0``): while the device thread
    only waits for launched batches, fewer than that many, a short job that comes with a
    ``launch`` is launched on the loop now, behind them, instead of being held: the GPU starts
    it the moment the previous batch ends, rather than after that end has reached the loop and
    the next launch has run (an lm-head batch's GPU sat idle ~half of each job that way). The
    waits run on the thread in launch order.

    ``pipeline_short`` (``Q6SERVE_PIPELINE_SHORT=1``, off by default; needs two slots): short
    batches under load are launched and waited for on the thread too (``Batcher._pipelined``,
    ``Batcher._start_behind``; CUDA-region calls: ``CudaSupport._launch``), and a wait handed
    to the thread is not followed by the hand-off yield. Measured on the H200 (bench/RESULTS.md,
    issue 15 session 7): no gain for T3 with regions, 5-8% loss with one process; since the
    lane's Protocol connections 6-17% slower on the lane too (session 8).

    ``job_batches`` (``Q6SERVE_JOB_BATCHES=N``, off by default: 1): under load (the device
    busy, or more batches of the weight queued), one batcher's next batches, up to N, run as
    **one** job on the device thread (``Batcher._run_batches``): each launched behind the
    previous one in the launch slots, waited for in order, one hand-back and one completion
    sweep on the loop for all of them, instead of one job (an inline run on the loop, or a
    hand-off and a hand-back) per batch. Meant for T3's shape, where every call is a full
    batch (8 hosts x N=64, issue 15). Measured on the H200 (bench/RESULTS.md, issue 15 session
    8): the lane with 2 calls in flight per caller +20-51%; with 1, even on the lane and 9-12%
    slower through front ends (a lone batch handed to the thread pays the hand-off)."""

    def __init__(self, name: str, handoff_yield: bool = False, inline_s: float = 0.0,
                 launch_slots: int = 1, now_slots: int | None = None) -> None:
        self.name = name
        self.handoff_yield = handoff_yield
        self.inline_s = inline_s
        pipeline = bool(envvars.PIPELINE.read())
        self.launch_slots = max(1, launch_slots) if pipeline else 1
        # launch_now's own limit (a pipeline on the loop's thread: the lane's full batches):
        # the backend's slots, which may be more than its batcher pipelines take
        self.now_slots = (max(1, launch_slots if now_slots is None else now_slots)
                          if pipeline else 1)
        # batches whose kernels are deferred (a launch, Batcher._start) launched behind each
        # other: launch_slots, or Q6SERVE_DEFER_SLOTS (off by default; at most now_slots, the
        # launcher's own): more of them queued on the GPU, so a late loop leaves it idle less
        ds = envvars.DEFER_SLOTS.read()
        self.defer_slots = (self.launch_slots if ds is None or not pipeline
                            else max(1, min(int(ds), self.now_slots)))
        # Q6SERVE_DEFER_NOW (on by default; 0: off): Batcher._finish launches the next such
        # batch, and Batcher.enqueue does not wake the batcher's task while no batch may launch
        # (H200, session 13: the lm-head target's p50 5.49/5.76 -> 4.09 ms, a second call
        # mixed, 5.20/5.32 -> 4.68/5.41: bench/RESULTS.md)
        self.defer_now = bool(envvars.DEFER_NOW.read())
        # short batches under load launched like long ones (Batcher._pipelined)
        self.pipeline_short = (self.launch_slots > 1
                               and bool(envvars.PIPELINE_SHORT.read()))
        self.job_batches = job_batches()
        self._waits = 0  # of the jobs in the thread, waits of launched batches (Deferred)
        self.behind_jobs = 0  # jobs launched behind a launched batch (see launch_slots)
        self._held: collections.deque[tuple[Any, ...]] = collections.deque()
        self.deferred_jobs = 0  # inline jobs launched on the loop and waited for on the thread
        # One thread fed by a SimpleQueue, answering through call_soon_threadsafe: one loop
        # trip less per job than run_in_executor (submit -> result 67 -> 52 us, issue 9).
        self._jobs: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=f"q6serve-dev-{name}",
                                        daemon=True)
        self._thread.start()
        self.inflight = 0
        self.jobs = 0  # device jobs queued so far (tests and benches count launches with it)
        self.inline_jobs = 0  # of which run on the calling thread (see ``inline_s``)
        self.direct_jobs = 0  # of which run by ``run_now`` (the direct path)
        self._in_thread = 0  # jobs handed to the device thread and not yet done
        self._now = 0  # launch_now's launches not yet waited for (all on the loop's thread)
        self._settling = 0  # inline jobs done, their outcomes handed on in the next trip
        # One-shot: only batchers waiting for the device right now are woken (with hundreds of
        # resident weights, waking every batcher on each idle edge would cost milliseconds).
        self._idle_waiters: list[Callable[[], None]] = []

    @property
    def idle(self) -> bool:
        return self.inflight == 0

    def thread_idle(self) -> bool:
        """No job in the device thread (its hand-back would need the GIL)."""
        return self._in_thread == 0

    def notify_when_idle(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once, on the loop, when the device next goes idle."""
        self._idle_waiters.append(fn)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` in the device thread. The job finishes even if the awaiting task is
        cancelled (device work is never abandoned half-way): the wait is shielded."""
        return await asyncio.shield(self.submit(fn, *args))

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Queue ``fn`` on the device thread now (the device counts as busy from here). The
        job runs even if the future is cancelled: device work is never abandoned half-way."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self.call(loop, fn, args, fut)
        return fut

    def _short(self, expect_s: float | None) -> bool:
        """A job expected to take ``expect_s`` (None: unknown) may run on the loop."""
        return expect_s is not None and expect_s <= self.inline_s

    def inlines(self, expect_s: float | None) -> bool:
        """Whether a job expected to take ``expect_s`` (None: unknown) would run inline now."""
        return self._short(expect_s) and self._in_thread == 0

    def call(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., T], args: tuple[Any, ...],
             done: asyncio.Future[T] | Callable[[Any, BaseException | None], None],
             expect_s: float | None = None, launch: Callable[..., Any] | None = None,
             settle_now: bool = False) -> None:
        """Queue ``fn(*args)`` on the device thread; its outcome goes to ``done`` on the loop:
        a future is resolved, a callable is called as ``done(result, exception)`` in the same
        loop trip that hears of the job's end (no future in between, so no extra trip).
        ``expect_s``: the device time the caller expects the job to take; a short one runs
        here, on the loop's thread, when the device thread is idle, or is held until it is
        (see ``inline_s``); its outcome still reaches ``done`` in a later loop trip, as a
        threaded job's would. ``launch(*args)``: run instead of ``fn`` on the loop, returning
        the outcome or a :class:`Deferred` to wait for on the device thread. ``settle_now``:
        an inline job's outcome may reach ``done`` before this returns (the caller knows that
        nothing can launch ahead of what ``done`` schedules: one loop trip saved)."""
        self.inflight += 1
        self.jobs += 1
        short = self._short(expect_s)
        if not self._held and self._behind(launch, short):
            self._run_here(loop, fn, args, done, launch, False)
        elif self._held or self._now or (short and self._in_thread):
            # held until the thread is free, in order: a job that comes later never goes
            # ahead of a held one (a held short job waited for ever behind other callers'
            # stream of long jobs: the device thread was never idle); and while launch_now's
            # launches are out, until the last of them is waited for
            self._held.append((loop, fn, args, done, launch, False, short))
        elif short:
            self._run_here(loop, fn, args, done, launch, settle_now)
        else:
            self._to_thread(loop, fn, args, done)

    def run_now(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` here, on the loop's thread, as an inline job whose outcome the
        caller takes at once (returned or raised): the direct path (``Batcher.run_now``).
        Only when the device is idle; the job counts as device work while it runs."""
        self.inflight += 1
        self.jobs += 1
        self.inline_jobs += 1
        self.direct_jobs += 1
        try:
            return fn(*args)
        finally:
            self._direct_done()

    def _direct_done(self) -> None:
        """A job of run_now or launch_now is over: the device idle again, if it is."""
        self.inflight -= 1
        if self.inflight == 0 and self._idle_waiters:
            waiters, self._idle_waiters = self._idle_waiters, []
            for w in waiters:
                w()

    def may_launch_now(self) -> bool:
        """Whether :meth:`launch_now` may launch here now: nothing on or held for the device
        thread, and no device work but launch_now's own launches, fewer than the slots (and
        inline jobs that are over, their outcomes not yet handed on)."""
        return (self._in_thread == 0 and not self._held and self._now < self.now_slots
                and self.inflight == self._now + self._settling)

    def launch_now(self, launch: Callable[..., Launched], *args: Any,
                   ) -> Callable[[], MatmulResult]:
        """:meth:`run_now` in two halves, for a pipeline of full batches on the loop's thread
        (the fast lane's, service/lane.py): ``launch(*args)`` runs here; the function returned
        waits for it, ends the job and returns its result (or raises). Only after
        :meth:`may_launch_now`, and the caller waits for each launch, in launch order, before
        its loop callback returns: no other launch (this thread's or the device thread's) can
        come between, so launch i + 1 runs on the GPU while the loop answers launch i. Until
        the last wait, :meth:`call` holds every job, and that wait runs the held ones
        (``_run_held``), so nothing else launches meanwhile either."""
        self.inflight += 1
        self._now += 1
        self.jobs += 1
        self.inline_jobs += 1
        self.direct_jobs += 1
        try:
            launched = launch(*args)
        except BaseException:
            self._now_done()
            raise

        def finish() -> MatmulResult:
            try:
                return launched.wait()
            finally:
                self._now_done()

        return finish

    def _now_done(self) -> None:
        self._now -= 1
        self._direct_done()
        if not self._now and self._held:  # (held while launch_now's launches were out)
            self._run_held()

    def _behind(self, launch: Callable[..., Any] | None, short: bool) -> bool:
        """A short job with a ``launch`` may be launched now behind the launched batches that
        are all the device thread has (fewer than ``defer_slots``: ``launch_slots`` unless
        Q6SERVE_DEFER_SLOTS says more)."""
        if launch is None or not short or not self._in_thread:
            return False
        if self._in_thread == self._waits < self.defer_slots:
            self.behind_jobs += 1
            return True
        return False

    def _to_thread(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any],
                   args: tuple[Any, ...], done: Any, wait: bool = False) -> None:
        self._in_thread += 1
        self._waits += wait
        self._jobs.put((loop, done, fn, args, wait))
        if self.inflight == 1 and self.handoff_yield and not (wait and self.pipeline_short):
            time.sleep(0)  # the GIL to the woken device thread now (see the class docstring)

    def _run_here(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any],
                  args: tuple[Any, ...], done: Any, launch: Callable[..., Any] | None,
                  settle_now: bool) -> None:
        self.inline_jobs += 1
        try:
            out: Any = (launch or fn)(*args)
        except Exception as e:  # the waiter hears of it, as from the device thread
            self._settling += 1
            loop.call_soon(self._settled, done, None, e)
            return
        except BaseException:
            self.inflight -= 1
            raise
        if isinstance(out, Deferred):
            self.deferred_jobs += 1
            self._to_thread(loop, out.wait, (), done, wait=True)
        elif settle_now:
            self._done(done, out, None)
        else:
            self._settling += 1
            loop.call_soon(self._settled, done, out, None)

    def _settled(self, done: Any, result: Any, exc: BaseException | None) -> None:
        """An inline job's outcome, a trip after it ran (the device was free meanwhile)."""
        self._settling -= 1
        self._done(done, result, exc)

    def _work(self) -> None:
        """The device thread: run jobs in order, hand each outcome back to its loop."""
        while (job := self._jobs.get()) is not None:
            loop, done, fn, args, wait = job
            try:
                outcome: tuple[Any, BaseException | None] = (fn(*args), None)
            except BaseException as e:  # every waiter must hear of a failure
                outcome = (None, e)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(self._threaded_done, done, wait, *outcome)
            # drop this job's arrays now, not at the next job: activations may view a
            # shared-memory region that must unmap when its request is done (regions.py)
            job = done = fn = args = outcome = None  # type: ignore[assignment]

    def _threaded_done(self, done: Any, wait: bool, result: Any,
                       exc: BaseException | None) -> None:
        self._in_thread -= 1
        self._waits -= wait
        self._done(done, result, exc)
        self._run_held()

    def _run_held(self) -> None:
        """Held jobs, in order: when the thread is free and no launch_now launch is out, or
        behind launches."""
        while self._held:
            loop, fn, args, done, launch, settle, short = self._held[0]
            if self._in_thread == 0 and not self._now:
                self._held.popleft()
                if short:
                    self._run_here(loop, fn, args, done, launch, settle)
                else:
                    self._to_thread(loop, fn, args, done)
            elif self._behind(launch, short):
                self._held.popleft()
                self._run_here(loop, fn, args, done, launch, False)
            else:
                break

    def _done(self, done: Any, result: Any, exc: BaseException | None) -> None:
        self.inflight -= 1
        if isinstance(done, asyncio.Future):
            settle(done, result, exc)
        else:
            done(result, exc)
        if self.inflight == 0 and self._idle_waiters:
            waiters, self._idle_waiters = self._idle_waiters, []
            for fn in waiters:
                fn()

    def close(self) -> None:
        """Finish the queued jobs, then stop the thread."""
        self._jobs.put(None)
        self._thread.join()



class Deferred:
    """A job launched from the loop (``Device.call``'s ``launch``): ``wait()``, run on the
    device thread, blocks until the device is done and returns the job's outcome."""

    __slots__ = ("wait",)

    def __init__(self, wait: Callable[[], Any]) -> None:
        self.wait = wait

