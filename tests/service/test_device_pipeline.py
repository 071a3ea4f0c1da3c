"""Device.launch_slots: a short job with a ``launch`` is launched on the loop behind launched
batches the device thread is only waiting for (fewer than the slots), so the GPU starts it as
soon as the previous one ends; waits run on the thread in launch order; more than the slots are
held; ``Q6SERVE_PIPELINE=0`` turns it off."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from q6serve.kernels.api import KernelTiming, Launched, Layout, MatmulResult, Precision
from q6serve.service import batcher
from q6serve.service.batcher import DEFER_KERNEL_S, Batcher, BatchKey, BatchSettings
from q6serve.service.device_thread import Device

KEY = BatchKey("f32", Precision.EXACT, "f32")


class Launches:
    """A backend's launch/wait pair whose waits block until released, recording where each
    launch and wait ran and the order the waits ended."""

    def __init__(self) -> None:
        self.where: list[tuple[str, float, str]] = []
        self.release = threading.Event()

    def launch(self, x: np.ndarray, key: BatchKey) -> Launched:
        v = float(x[0, 0])
        self.where.append(("launch", v, threading.current_thread().name))

        def wait() -> MatmulResult:
            self.release.wait(10)
            self.where.append(("wait", v, threading.current_thread().name))
            return MatmulResult(x * 2, "slow", Layout.SOA, Precision.EXACT,
                                KernelTiming(host_seconds=2 * DEFER_KERNEL_S))

        return Launched(wait)

    def run(self, x: np.ndarray, key: BatchKey) -> MatmulResult:
        return self.launch(x, key).wait()


def _x(v: float) -> np.ndarray:
    return np.full((1, 4), v, np.float32)


def _batcher(name: str, dev: Device, lz: Launches) -> Batcher:
    b = Batcher(name, dev, lz.run, BatchSettings(), lambda: True, lambda s: None,
                launch=lz.launch)
    b._job_s[(KEY, 1)] = 1e-4  # a like job was short (runs on the loop) ...
    b._kernel_s[(KEY, 1)] = 2 * DEFER_KERNEL_S  # ... and its kernels long (deferred wait)
    return b


async def _three_batches(dev: Device) -> tuple[Launches, list[str]]:
    lz = Launches()
    me = threading.current_thread().name
    bs = [_batcher(n, dev, lz) for n in ("a", "b", "c")]
    futs = [bs[0].enqueue(_x(1.0), KEY, None)]
    await asyncio.sleep(0.02)
    futs.append(bs[1].enqueue(_x(2.0), KEY, None))
    await asyncio.sleep(0.02)
    futs.append(bs[2].enqueue(_x(3.0), KEY, None))
    await asyncio.sleep(0.02)
    launched = [v for what, v, where in lz.where if what == "launch" and where == me]
    assert not any(f.done() for f in futs)
    lz.release.set()
    ys = [float((await f).y[0, 0]) for f in futs]
    assert ys == [2.0, 4.0, 6.0]
    waits = [v for what, v, _ in lz.where if what == "wait"]
    assert waits == [1.0, 2.0, 3.0]  # in launch order
    assert dev.inflight == 0
    for b in bs:
        await b.close()
    return lz, [str(v) for v in launched]


def test_a_second_launch_goes_behind_a_launched_batch_and_a_third_is_held() -> None:
    async def main() -> None:
        dev = Device("t", inline_s=10.0, launch_slots=2)
        lz, launched = await _three_batches(dev)
        # before any wait ended: batch 1 launched, batch 2 launched behind it, batch 3 held
        assert launched == ["1.0", "2.0"], lz.where
        # and once the first wait ended, batch 3 went behind batch 2 (not after it)
        assert dev.behind_jobs == 2 and dev.deferred_jobs == 3
        dev.close()

    asyncio.run(main())


def test_pipeline_off_holds_the_second_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("Q6SERVE_PIPELINE", "0")

    async def main() -> None:
        dev = Device("t", inline_s=10.0, launch_slots=2)
        assert dev.launch_slots == 1
        lz, launched = await _three_batches(dev)
        assert launched == ["1.0"], lz.where
        assert dev.behind_jobs == 0
        dev.close()

    asyncio.run(main())


def test_a_job_without_launch_is_never_put_behind() -> None:
    """A job that is not a launched batch (a load, a group) waits for the thread as before."""

    async def main() -> None:
        dev = Device("t", inline_s=10.0, launch_slots=2)
        lz = Launches()
        b = _batcher("a", dev, lz)
        first = b.enqueue(_x(1.0), KEY, None)
        await asyncio.sleep(0.02)
        ran: list[str] = []
        other = dev.submit(lambda: ran.append(threading.current_thread().name))
        await asyncio.sleep(0.02)
        assert not ran and not other.done()  # behind the wait, on the thread, not launched
        lz.release.set()
        await first
        await other
        assert ran == ["q6serve-dev-t"]
        await b.close()
        dev.close()

    asyncio.run(main())


def test_defer_slots_takes_a_third_deferred_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q6SERVE_DEFER_SLOTS=3 (on a backend with three launch slots): a third deferred batch is
    launched behind two, not held; capped at the backend's own (now_slots)."""
    monkeypatch.setenv("Q6SERVE_DEFER_SLOTS", "3")

    async def main() -> None:
        dev = Device("t", inline_s=10.0, launch_slots=2, now_slots=3)
        assert dev.defer_slots == 3
        lz, launched = await _three_batches(dev)
        assert launched == ["1.0", "2.0", "3.0"], lz.where
        dev.close()
        assert Device("u", launch_slots=2, now_slots=2).defer_slots == 2  # the cap

    asyncio.run(main())


async def _one_weight(dev: Device, n: int) -> tuple[Launches, list[tuple[float, bool]], int]:
    """``n`` requests on one weight, each a full batch (max_rows 1); what was launched before
    any wait ended (value, launched from the batcher's task), and how many launches of the
    value 3.0 or later were made outside any task (Batcher._finish's trip)."""
    lz = Launches()
    tasks: list[tuple[float, bool]] = []
    launch = lz.launch

    def spy(x: np.ndarray, key: BatchKey) -> Launched:
        tasks.append((float(x[0, 0]), asyncio.current_task() is not None))
        return launch(x, key)

    b = Batcher("w", dev, lz.run, BatchSettings(max_rows=1), lambda: True, lambda s: None,
                launch=spy)
    b._job_s[(KEY, 1)] = 1e-4
    b._kernel_s[(KEY, 1)] = 2 * DEFER_KERNEL_S
    futs = [b.enqueue(_x(float(i + 1)), KEY, None) for i in range(n)]
    await asyncio.sleep(0.05)
    before = len(tasks)
    lz.release.set()
    ys = [float((await f).y[0, 0]) for f in futs]
    assert ys == [2.0 * (i + 1) for i in range(n)]
    waits = [v for what, v, _ in lz.where if what == "wait"]
    assert waits == [float(i + 1) for i in range(n)]  # in launch order
    assert dev.inflight == 0 and b._unfinished == 0
    await b.close()
    return lz, tasks[:before], sum(1 for v, in_task in tasks if v >= 3.0 and not in_task)


def test_one_weight_keeps_two_deferred_batches_unless_defer_slots_says_more(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def main(expect: int) -> None:
        dev = Device("t", inline_s=10.0, launch_slots=2, now_slots=3)
        _, first, _ = await _one_weight(dev, 5)
        assert [v for v, _ in first] == [float(i + 1) for i in range(expect)], first
        dev.close()

    asyncio.run(main(2))
    monkeypatch.setenv("Q6SERVE_DEFER_SLOTS", "3")
    asyncio.run(main(3))


def test_defer_now_launches_the_next_batch_in_the_finishing_trip(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Q6SERVE_DEFER_NOW (on by default): once a deferred batch ends, the next queued one is
    launched from Batcher._finish (no task), not by the batcher's task a trip later (=0)."""
    async def main() -> int:
        dev = Device("t", inline_s=10.0, launch_slots=2, now_slots=3)
        _, first, outside = await _one_weight(dev, 5)
        assert len(first) == 2
        dev.close()
        return outside

    assert asyncio.run(main()) == 3  # the default
    monkeypatch.setenv("Q6SERVE_DEFER_NOW", "0")
    assert asyncio.run(main()) == 0


def test_defer_now_does_not_wake_the_task_while_no_batch_may_launch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With Q6SERVE_DEFER_NOW (the default) a request queued behind two unfinished batches of
    its weight does not wake the batcher's task (it could launch nothing); with =0, it does."""
    async def main() -> list[bool]:
        dev = Device("t", inline_s=10.0, launch_slots=2, now_slots=3)
        lz = Launches()
        b = Batcher("w", dev, lz.run, BatchSettings(max_rows=1), lambda: True, lambda s: None,
                    launch=lz.launch)
        b._job_s[(KEY, 1)] = 1e-4
        b._kernel_s[(KEY, 1)] = 2 * DEFER_KERNEL_S
        futs = [b.enqueue(_x(1.0), KEY, None), b.enqueue(_x(2.0), KEY, None)]
        await asyncio.sleep(0.05)
        assert b._unfinished == 2
        woken = []
        for v in (3.0, 4.0):
            futs.append(b.enqueue(_x(v), KEY, None))
            woken.append(b._wake.is_set())
            await asyncio.sleep(0.01)
        lz.release.set()
        assert [float((await f).y[0, 0]) for f in futs] == [2.0, 4.0, 6.0, 8.0]
        await b.close()
        dev.close()
        return woken

    assert asyncio.run(main()) == [False, False]  # the default
    monkeypatch.setenv("Q6SERVE_DEFER_NOW", "0")
    assert asyncio.run(main()) == [True, True]


def test_deferred_successors_skip_cancelled_and_expired_requests() -> None:
    """With DEFER_NOW (the default) the batches launched from Batcher._finish drop what was
    cancelled or whose deadline passed while queued, as the task's launches do: those never
    launch, the rest run in order, nothing stays unfinished."""
    async def main() -> None:
        dev = Device("t", inline_s=10.0, launch_slots=2, now_slots=3)
        assert dev.defer_now
        lz = Launches()
        b = Batcher("w", dev, lz.run, BatchSettings(max_rows=1), lambda: True, lambda s: None,
                    launch=lz.launch)
        b._job_s[(KEY, 1)] = 1e-4
        b._kernel_s[(KEY, 1)] = 2 * DEFER_KERNEL_S
        first = [b.enqueue(_x(1.0), KEY, None), b.enqueue(_x(2.0), KEY, None)]
        await asyncio.sleep(0.05)
        cancelled = b.enqueue(_x(3.0), KEY, None)
        expired = b.enqueue(_x(4.0), KEY, 0.01)
        last = b.enqueue(_x(5.0), KEY, None)
        cancelled.cancel()
        await asyncio.sleep(0.05)  # the deadline passes while both batches still run
        assert expired.done() and isinstance(expired.exception(), batcher.DeadlineExceeded)
        lz.release.set()
        assert [float((await f).y[0, 0]) for f in (*first, last)] == [2.0, 4.0, 10.0]
        launched = [v for what, v, _ in lz.where if what == "launch"]
        assert launched == [1.0, 2.0, 5.0], lz.where
        assert b._unfinished == 0 and b.queued_rows == 0 and dev.inflight == 0
        await b.close()
        dev.close()

    asyncio.run(main())
