"""Batcher + Device without gRPC: deadlines are timers on the request's future, a request
dropped before launch never runs, the sink hears each outcome once (and nothing of an outside
cancel), and a batch's failure reaches every request in it."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from q6serve.kernels.api import KernelTiming, Layout, MatmulResult, Precision
from q6serve.kernels.errors import DeviceError, InvalidArgument, Unavailable
from q6serve.service.batcher import (
    Batcher,
    BatchKey,
    BatchSettings,
    DeadlineExceeded,
    Group,
    MatmulReply,
)
from q6serve.service.device_thread import Device

KEY = BatchKey("f32", Precision.EXACT, "f32")


class Gate:
    """A device job that waits until released (keeps the device busy), recording launches."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.launches: list[int] = []
        self.fail: BaseException | None = None

    def run(self, x: np.ndarray, key: BatchKey) -> MatmulResult:
        self.open.wait(10)
        self.launches.append(int(x.shape[0]))
        if self.fail is not None:
            raise self.fail
        return MatmulResult(x * 2, "gate", Layout.SOA, Precision.EXACT,
                            KernelTiming(host_seconds=1e-6))


def _x(n: int, v: float = 1.0) -> np.ndarray:
    return np.full((n, 4), v, np.float32)


async def _batcher(gate: Gate, delay_s: float = 0.0, dev: Device | None = None,
                   name: str = "w") -> tuple[Batcher, Device]:
    dev = dev or Device("t")
    return Batcher(name, dev, gate.run, BatchSettings(max_delay_s=delay_s), lambda: True,
                   lambda s: None), dev


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_deadline_fails_a_queued_request_which_then_never_runs() -> None:
    async def main() -> None:
        gate = Gate()
        b, dev = await _batcher(gate)
        first = b.enqueue(_x(1), KEY, None)  # occupies the device
        late = b.enqueue(_x(3), KEY, 0.05)
        with pytest.raises(DeadlineExceeded):
            await late
        gate.open.set()
        r = await first
        # the reply's kernel time is the backend's figure as is: nothing of the service's own
        assert r.y.shape == (1, 4) and r.kernel_seconds == 1e-6
        assert (await b.enqueue(_x(2), KEY, None)).batch_rows == 2
        assert 3 not in gate.launches
        await b.close()
        dev.close()

    run(main())


def test_sink_hears_results_and_errors_once_and_not_outside_cancels() -> None:
    async def main() -> None:
        gate = Gate()
        b, dev = await _batcher(gate)
        heard: list[tuple[str, Any]] = []

        def sink(tag: str):  # type: ignore[no-untyped-def]
            def fn(fut: asyncio.Future[MatmulReply]) -> None:
                heard.append((tag, fut.exception() or fut.result().y[0, 0]))
            return fn

        a = b.enqueue(_x(1, 1.0), KEY, None, sink("a"))  # launched at once (idle device)
        c = b.enqueue(_x(1, 2.0), KEY, None, sink("c"))  # queued behind it
        d = b.enqueue(_x(1, 3.0), KEY, 0.05, sink("d"))  # queued, then past its deadline
        c.cancel()  # the caller went away: no sink call, never run
        await asyncio.sleep(0.1)
        gate.open.set()
        await a
        await asyncio.sleep(0.05)  # let the loop settle the rest
        assert [t for t, _ in heard] == ["d", "a"]
        assert isinstance(heard[0][1], DeadlineExceeded) and heard[1][1] == 2.0
        assert d.done() and gate.launches == [1]
        await b.close()
        dev.close()

    run(main())


def test_a_batch_failure_reaches_every_request_and_close_fails_the_queue() -> None:
    async def main() -> None:
        gate = Gate()
        gate.fail = DeviceError("boom")
        b, dev = await _batcher(gate)
        first = b.enqueue(_x(1), KEY, None)  # runs alone
        rest = [b.enqueue(_x(1), KEY, None) for _ in range(3)]  # coalesce behind it
        gate.open.set()
        for f in [first, *rest]:
            with pytest.raises(DeviceError):
                await f
        assert len(gate.launches) == 2  # one launch alone, one for the three together
        gate.open.clear()
        gate.fail = None
        running = b.enqueue(_x(1), KEY, None)
        staged = b.enqueue(_x(2), KEY, None)  # launched behind it (two batches per weight)
        await asyncio.sleep(0.02)
        queued = b.enqueue(_x(3), KEY, None)  # waits: both launch slots are taken
        closing = asyncio.ensure_future(b.close())
        await asyncio.sleep(0.02)
        gate.open.set()  # launched batches finish; the queued request is refused
        await closing
        assert (await running).y.shape == (1, 4) and (await staged).y.shape == (2, 4)
        with pytest.raises(Unavailable):
            await queued
        assert gate.launches[2:] == [1, 2]  # the queued 3 rows never ran
        assert b.in_flight == 0
        dev.close()

    run(main())


def test_a_group_runs_as_one_device_job_and_each_part_batches_with_its_weight() -> None:
    """The parts of a multi-weight call (a Group) go to the device in one job, each with the
    other requests queued for its weight; a part refused by its weight's launch fails alone;
    a part whose weight has no free launch slot stays queued and runs later by itself."""
    async def main() -> None:
        gates = [Gate() for _ in range(3)]
        dev = Device("t")
        bs = [(await _batcher(g, dev=dev, name=f"w{i}"))[0] for i, g in enumerate(gates)]
        gates[2].fail = InvalidArgument("w2 refuses")
        busy = bs[0].enqueue(_x(1), KEY, None)  # holds the device
        other = bs[1].enqueue(_x(2, 5.0), KEY, None)  # another caller of w1, queued
        g = Group()
        parts = [b.enqueue(_x(1, 3.0), KEY, None, group=g) for b in bs]
        g.launch()  # the device is busy: not launched here
        await asyncio.sleep(0.02)  # w1's batcher launches (no delay): other + its part ...
        assert dev.jobs == 2  # ... and takes the parts of w0 and w2 into the same job
        for gate in gates:
            gate.open.set()
        assert (await busy).batch_rows == 1 and (await other).batch_rows == 3
        r0, r1 = await parts[0], await parts[1]
        assert r0.y[0, 0] == 6.0 and r1.y[0, 0] == 6.0 and r1.batch_requests == 2
        with pytest.raises(InvalidArgument, match="w2 refuses"):
            await parts[2]
        assert dev.jobs == 2
        assert gates[0].launches == [1, 1] and gates[1].launches == [3]

        # idle device: launched by launch(), before any loop trip, as one job
        gates[2].fail = None
        g = Group()
        parts = [b.enqueue(_x(2), KEY, None, group=g) for b in bs]
        g.launch()
        assert dev.jobs == 3 and dev.inflight == 1
        assert [(await f).batch_rows for f in parts] == [2, 2, 2]

        # w0 has both launch slots taken: its part waits and runs in a later job of its own
        for gate in gates:
            gate.open.clear()
        held = [bs[0].enqueue(_x(1), KEY, None) for _ in range(2)]
        await asyncio.sleep(0.02)  # the second is staged behind the first: no slot left
        g = Group()
        parts = [b.enqueue(_x(3), KEY, None, group=g) for b in bs[:2]]
        g.launch()
        await asyncio.sleep(0.02)
        for gate in gates:
            gate.open.set()
        assert [(await f).batch_rows for f in [*held, *parts]] == [1, 1, 3, 3]
        assert gates[0].launches[-3:] == [1, 1, 3] and gates[1].launches[-1] == 3
        for b in bs:
            await b.close()
        dev.close()

    run(main())


def test_handoff_yield_serves_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GIL yield on a hand-off to an idle device thread changes when a job starts, never
    what it returns; only CUDA devices yield by default, and the env switch turns it off."""
    from q6serve.service.device_thread import HANDOFF_ENV, handoff_yield_for

    assert handoff_yield_for("cuda") and not handoff_yield_for("numpy")
    monkeypatch.setenv(HANDOFF_ENV, "0")
    assert not handoff_yield_for("cuda")

    async def main() -> None:
        gate = Gate()
        gate.open.set()
        dev = Device("t", handoff_yield=True)
        b, _ = await _batcher(gate, dev=dev)
        for i in range(20):  # one at a time: each reaches an idle thread
            assert (await b.enqueue(_x(1, i), KEY, None)).y[0, 0] == 2 * i
        got = await asyncio.gather(*(b.enqueue(_x(1, i), KEY, None) for i in range(20)))
        assert [r.y[0, 0] for r in got] == [2 * i for i in range(20)]
        await b.close()
        dev.close()

    run(main())


def test_short_jobs_run_inline_on_an_idle_device_and_long_ones_on_its_thread() -> None:
    """Device(inline_s): a batch whose last like-sized job was short runs on the loop's own
    thread when the device thread is idle, its launch held to the end of the loop trip so
    requests of that trip join it; first-of-a-kind and long jobs, and anything queued behind
    a threaded job, run on the device thread; the outcomes are the same either way."""
    async def main() -> None:
        threads: list[str] = []
        gate = Gate()
        gate.open.set()

        def run(x: np.ndarray, key: BatchKey) -> MatmulResult:
            threads.append(threading.current_thread().name)
            return gate.run(x, key)

        dev = Device("t", inline_s=10.0)
        b = Batcher("w", dev, run, BatchSettings(), lambda: True, lambda s: None)
        loop_thread = threading.current_thread().name
        # expectations are per batch size rounded up to a power of two (a new size may mean
        # a new kernel to compile): 3 rows unknown -> the thread
        assert (await b.enqueue(_x(3, 1.0), KEY, None)).y[0, 0] == 2.0
        assert threads == ["q6serve-dev-t"] and dev.inline_jobs == 0
        # 1 row unknown -> deferred? no: the thread, and 1 row is known from then on
        await b.enqueue(_x(1, 1.0), KEY, None)
        assert threads == ["q6serve-dev-t"] * 2 and dev.inline_jobs == 0
        # known and short now: inline; three requests of one loop trip make one batch
        got = await asyncio.gather(*(b.enqueue(_x(1, v), KEY, None) for v in (2.0, 3.0, 4.0)))
        assert [r.y[0, 0] for r in got] == [4.0, 6.0, 8.0]
        assert [r.batch_rows for r in got] == [3, 3, 3]
        assert threads[2:] == [loop_thread] and dev.inline_jobs == 1
        # a short batch launched while the device thread runs a job (a load, say) is held,
        # then runs on the loop once the thread is done
        gate.open.clear()
        blocker = dev.submit(gate.open.wait, 10)
        behind = b.enqueue(_x(1, 5.0), KEY, None)
        await asyncio.sleep(0.01)  # the batcher has launched it (its delay is over): held
        assert len(threads) == 3 and dev.inflight == 2
        gate.open.set()
        assert await blocker
        assert (await behind).y[0, 0] == 10.0
        assert threads[3] == loop_thread
        # failures reach the waiter from an inline job as from the thread
        gate.fail = InvalidArgument("refused")
        with pytest.raises(InvalidArgument, match="refused"):
            await b.enqueue(_x(1), KEY, None)
        assert threads[-1] == loop_thread
        # a job longer than inline_s stays on the thread
        dev.inline_s = 0.0
        gate.fail = None
        await b.enqueue(_x(1), KEY, None)
        assert threads[-1] == "q6serve-dev-t"
        assert dev.inflight == 0
        await b.close()
        dev.close()

    run(main())


def test_a_long_batch_is_launched_on_the_loop_and_waited_for_on_the_device_thread() -> None:
    """A batch whose kernels took long last time (DEFER_KERNEL_S) is launched on the loop and
    its wait runs on the device thread; a batch submitted meanwhile is held and launched on the
    loop after it; a failure at the wait reaches the batch's requests."""
    from q6serve.kernels.api import Launched
    from q6serve.service.batcher import DEFER_KERNEL_S

    async def main() -> None:
        where: list[tuple[str, str]] = []
        release = threading.Event()
        fail: list[BaseException] = []

        def result(x: np.ndarray) -> MatmulResult:
            return MatmulResult(x * 2, "slow", Layout.SOA, Precision.EXACT,
                                KernelTiming(host_seconds=2 * DEFER_KERNEL_S))

        def launch(x: np.ndarray, key: BatchKey) -> Launched:
            where.append(("launch", threading.current_thread().name))

            def wait() -> MatmulResult:
                where.append(("wait", threading.current_thread().name))
                release.wait(10)
                if fail:
                    raise fail[0]
                return result(x)

            return Launched(wait)

        def run(x: np.ndarray, key: BatchKey) -> MatmulResult:
            return launch(x, key).wait()

        dev = Device("t", inline_s=10.0)
        b = Batcher("w", dev, run, BatchSettings(), lambda: True, lambda s: None,
                    launch=launch)
        me = threading.current_thread().name
        release.set()
        await b.enqueue(_x(1, 1.0), KEY, None)  # unknown: the whole job on the thread
        assert where == [("launch", "q6serve-dev-t"), ("wait", "q6serve-dev-t")]
        release.clear()
        first = b.enqueue(_x(1, 2.0), KEY, None)
        await asyncio.sleep(0.01)
        assert where[2:] == [("launch", me), ("wait", "q6serve-dev-t")]
        assert dev.deferred_jobs == 1 and not first.done()  # the loop is free meanwhile
        other = Batcher("v", dev, run, BatchSettings(), lambda: True, lambda s: None,
                        launch=launch)
        other._job_s[(KEY, 1)] = other._kernel_s[(KEY, 1)] = 1e-6  # known and short
        second = other.enqueue(_x(1, 3.0), KEY, None)
        await asyncio.sleep(0.01)
        assert len(where) == 4  # held behind the wait
        release.set()
        assert (await first).y[0, 0] == 4.0 and (await second).y[0, 0] == 6.0
        assert where[4:] == [("launch", me), ("wait", me)]  # run whole on the loop
        fail.append(DeviceError("lost"))
        with pytest.raises(DeviceError, match="lost"):
            await b.enqueue(_x(1, 4.0), KEY, None)
        assert where[-1] == ("wait", "q6serve-dev-t") and dev.inflight == 0
        await b.close()
        await other.close()
        dev.close()

    run(main())


def test_a_kernel_flag_flip_sends_the_next_batches_to_the_device_thread() -> None:
    """After a flip of a flag the kernels see, no batch runs inline on the loop until one like
    it has run on the device thread (the new kernels may still have to compile)."""
    from svc_util import numpy_engine

    from q6serve.service.engine_types import MatmulCall

    async def main() -> None:
        # (what is tested is the flip forgetting costs, not the inline limit)
        eng = await numpy_engine("w", 8, 256)
        x = np.ones((1, 256), np.float32)
        for _ in range(3):
            await eng.matmul(MatmulCall("w", x))
        assert eng.device.inline_jobs == 2  # the first ran on the thread
        eng.set_flags({"Q6SERVE_DECODE_MMQ": False})
        await eng.matmul(MatmulCall("w", x))
        assert eng.device.inline_jobs == 2  # on the thread again
        await eng.matmul(MatmulCall("w", x))
        assert eng.device.inline_jobs == 3
        eng.set_flags({"Q6SERVE_DYNAMIC_BATCHING": False})  # not a kernel flag: nothing forgotten
        await eng.matmul(MatmulCall("w", x))
        assert eng.device.inline_jobs == 4
        await eng.close()

    run(main())


def test_a_held_short_job_runs_before_long_jobs_that_come_after_it() -> None:
    """Other callers' long jobs, one after another, never leave the device thread idle: a
    short job held for the thread must not wait behind the long jobs queued after it."""
    order: list[str] = []
    release = threading.Event()

    def long_job(name: str) -> str:
        release.wait(10)
        order.append(name)
        return name

    def short_job() -> str:
        order.append("short")
        return "short"

    async def main() -> None:
        loop = asyncio.get_running_loop()
        dev = Device("t", inline_s=1.0)
        futs = [loop.create_future() for _ in range(4)]
        dev.call(loop, long_job, ("long1",), futs[0], expect_s=None)  # unknown: the thread
        dev.call(loop, short_job, (), futs[1], expect_s=1e-6)  # short: held behind long1
        dev.call(loop, long_job, ("long2",), futs[2], expect_s=None)
        dev.call(loop, long_job, ("long3",), futs[3], expect_s=None)
        release.set()
        await asyncio.wait_for(asyncio.gather(*futs), 10)
        assert order == ["long1", "short", "long2", "long3"]
        dev.close()

    asyncio.run(main())
