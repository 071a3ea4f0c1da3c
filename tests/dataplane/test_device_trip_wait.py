"""Q6SERVE_DEVICE_PIPELINE: the device process launches each call of a trip (a merged batch, a
lone call, bytes or region) at the trip's end behind the launches out, and waits for them a loop
trip later (``FrontendsWorker._tick``) or, in the next trip that reads calls, after launching
those (``_flush_calls``): the loop reads, merges and launches the next calls while the GPU runs.
Each call still gets its own rows, a refusal only its own caller, a lone region call takes the
route into its y region (the fault that turned the switch off in session 15), and a job that
comes while a launch is out (``Device.call``) is held until it is waited for. Run in-process on
NumPy, as tests/dataplane/test_device_direct.py."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from q6serve.kernels.api import Launched, Precision
from q6serve.kernels.errors import InvalidArgument
from q6serve.service import batcher, envvars
from q6serve.service.engine import MatmulCall
from tests.dataplane.test_device_direct import Device, Staged
from tests.dataplane.test_device_merge import BAD, ROWS, K
from tests.dataplane.test_frontends import (
    callers_get_their_own_rows,
    start,  # noqa: F401  (the fixture)
)
from tests.dataplane.test_pinned_regions import DmaBackend, Recorder
from tests.service.svc_util import assert_close, random_q6k, reference


class Ordered(Staged):
    """Two launches may be out (as the CUDA backend's slots); records each launch and each
    wait, by the launch's rows, in order."""

    launch_slots = 2

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int]] = []

    def launch(self, w: Any, x: np.ndarray, **kw: Any) -> Any:
        done = super().launch(w, x, **kw)  # (computed now: NumPy)
        n = int(x.shape[0])
        self.events.append(("launch", n))
        return Launched(lambda: self.events.append(("wait", n)) or done.wait())


@pytest.fixture(autouse=True)
def _pipelined(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batcher, "DEFER_KERNEL_S", 1e9)  # (as test_device_direct)
    monkeypatch.setenv(envvars.DEVICE_PIPELINE.name, "1")


def _check(d: Device, xs: list[np.ndarray], answers: dict[int, Any], rid0: int) -> None:
    for slot, x in enumerate(xs):
        np.testing.assert_allclose(d.y(slot, answers[rid0 + slot]),
                                   reference(d.blocks, ROWS, K, x), rtol=1e-5, atol=1e-4)


def test_the_switch_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(envvars.DEVICE_PIPELINE.name)
    assert envvars.DEVICE_PIPELINE.read({}) is False
    assert Device(1, pipeline=True).worker.pipeline is True
    assert Device(1).worker.pipeline is False  # (the inline path's tests: test_device_direct)


def test_a_merged_batch_is_answered_a_trip_later(rng: np.random.Generator) -> None:
    """Launched in the trip that merged it (the direct path), not answered there, nor at the
    start of the next trip (whose reads come first); when that trip read no calls, its
    answers leave in the trip after (one write), each call with its rows."""
    xs = [rng.standard_normal((n, K)).astype(np.float32) for n in (1, 2, 1)]

    async def main() -> None:
        d = Device(len(xs), pipeline=True)
        await d.start()
        w = d.worker
        dev = w.engine.device  # type: ignore[union-attr]
        assert w.pipeline
        await d.measured(xs)
        writes = d.count_writes()
        d.conn.data_received(d.frames(xs, 20))  # (merged at the end of this trip)
        seen: list[tuple[list[int], int, int]] = []
        loop = asyncio.get_running_loop()

        def look(trips: int) -> None:
            seen.append((sorted(d.out.answers), dev.inflight, w.pipelined[0]))
            if trips:
                loop.call_soon(look, trips - 1)

        loop.call_soon(look, 2)  # (runs in the merge's trip, after it, then in the next two)
        await asyncio.sleep(0.05)
        assert seen == [([], 1, 1), ([], 1, 1), ([20, 21, 22], 0, 1)]
        assert dev.direct_jobs == 1 and len(writes) == 1 and w._pending == 0
        assert w.merged == [2, 6]  # (requests that merged calls, and those calls)
        _check(d, xs, d.out.answers, 20)
        assert d.out.answers[21][2][5] == 4  # the batch's rows
        await d.close()

    asyncio.run(main())


def test_the_next_trips_calls_launch_before_the_earlier_wait(rng: np.random.Generator) -> None:
    """Calls read while a launch is out are launched behind it before it is waited for
    (the backend has two slots): the GPU always has the next call; both answered."""
    a = [rng.standard_normal((n, K)).astype(np.float32) for n in (1, 2)]
    b = [rng.standard_normal((n, K)).astype(np.float32) for n in (2, 2)]

    async def main() -> None:
        backend = Ordered()
        d = Device(4, backend, pipeline=True)
        await d.start()
        await d.measured(a)
        await d.trip(b, 1, 2)  # (each batch's like job measured now)
        backend.events.clear()
        d.out.answers.clear()
        loop = asyncio.get_running_loop()
        d.conn.data_received(d.frames(a, 20))  # (launched at this trip's end)
        loop.call_soon(d.conn.data_received, d.frames(b, 30, 2))  # (read in the next trip)
        for _ in range(400):
            if len(d.out.answers) == 4:
                break
            await asyncio.sleep(0.005)
        assert backend.events == [("launch", 3), ("launch", 4), ("wait", 3), ("wait", 4)]
        _check(d, a, d.out.answers, 20)
        for slot, x in enumerate(b, 2):
            np.testing.assert_allclose(d.y(slot, d.out.answers[28 + slot]),
                                       reference(d.blocks, ROWS, K, x), rtol=1e-5, atol=1e-4)
        assert d.worker._pending == 0 and not d.worker._out
        assert d.worker.engine.device.inflight == 0  # type: ignore[union-attr]
        await d.close()

    asyncio.run(main())


def test_a_lone_call_and_repeated_trips(rng: np.random.Generator) -> None:
    async def main() -> None:
        d = Device(1, pipeline=True)
        await d.start()
        w = d.worker
        x = rng.standard_normal((3, K)).astype(np.float32)
        await d.trip([x], 1)
        for i in range(5):
            xi = x * (i + 2)
            answers = await d.trip([xi], 10 + i)
            _check(d, [xi], answers, 10 + i)
        assert w.pipelined[0] == 5 and w.pipelined[1] >= 0.0 and w._pending == 0
        assert w.engine.device.inflight == 0  # type: ignore[union-attr]
        await d.close()

    asyncio.run(main())


def test_a_refused_pipelined_merge_reaches_only_the_bad_caller(
        rng: np.random.Generator) -> None:
    xs = [rng.standard_normal((n, K)).astype(np.float32) for n in (2, 1, 2)]

    async def main() -> None:
        d = Device(len(xs), pipeline=True)
        await d.start()
        await d.trip(xs, 1)  # measured
        bad = [x.copy() for x in xs]
        bad[1][0, 5] = BAD
        answers = await d.trip(bad, 10)
        assert answers[11][0] == "err" and isinstance(answers[11][2], InvalidArgument)
        _check(d, [bad[0]], answers, 10)
        np.testing.assert_allclose(d.y(2, answers[12]), reference(d.blocks, ROWS, K, bad[2]),
                                   rtol=1e-5, atol=1e-4)
        assert d.worker._pending == 0
        await d.close()

    asyncio.run(main())


def test_a_call_is_put_off_while_its_weights_queue_drains(rng: np.random.Generator) -> None:
    """A call read while a request of its weight is queued (to run at the trip's end) is not
    queued behind it: put off a trip, it is launched once the queue has run (the first calls
    of a kind, queued, left a queue that each trip's calls refilled: nothing was pipelined
    again)."""
    x, q = (rng.standard_normal((3, K)).astype(np.float32) for _ in range(2))

    async def main() -> None:
        d = Device(1, pipeline=True)
        await d.start()
        w = d.worker
        engine = w.engine
        assert engine is not None
        await d.measured([x])
        before = w.pipelined[0]
        d.out.answers.clear()
        d.conn.data_received(d.frames([x], 40))  # (its launch at this trip's end)...
        queued = engine.start_matmul(MatmulCall("w", q, Precision.EXACT))  # ...after this
        assert engine.queued("w")  # (one request queued, its batch started at trip's end)
        for _ in range(400):
            if 40 in d.out.answers and queued.done():
                break
            await asyncio.sleep(0.005)
        assert w.pipelined[0] == before + 1  # launched, not queued
        _check(d, [x], d.out.answers, 40)
        np.testing.assert_allclose(queued.result().y, reference(d.blocks, ROWS, K, q),
                                   rtol=1e-5, atol=1e-4)
        assert w._deferred_trips == 0 and not engine.queued("w") and w._pending == 0
        await d.close()

    asyncio.run(main())


@pytest.mark.parametrize("slots", [1, 2])
def test_two_batches_of_one_trip(rng: np.random.Generator, slots: int) -> None:
    """More rows than a batch takes: the trip's second batch is launched behind its first
    where the backend has two slots, else after its first was waited for; both answered."""
    xs = [rng.standard_normal((3, K)).astype(np.float32) for _ in range(4)]

    async def main() -> None:
        backend = Ordered()
        backend.launch_slots = slots
        d = Device(len(xs), backend, pipeline=True)
        d.worker._merge_rows = 6  # (two calls of 3 rows a batch)
        await d.start()
        w = d.worker
        await d.trip(xs, 1)
        await d.trip(xs, 10)  # (each batch's like job measured now)
        before = w.pipelined[0]
        backend.events.clear()
        xs2 = [x * 2 for x in xs]
        answers = await d.trip(xs2, 20)
        assert w.pipelined[0] - before == 2
        assert backend.events == ([("launch", 6), ("launch", 6), ("wait", 6), ("wait", 6)]
                                  if slots == 2 else [("launch", 6), ("wait", 6)] * 2)
        _check(d, xs2, answers, 20)
        assert w._pending == 0
        await d.close()

    asyncio.run(main())


def test_a_job_that_comes_while_a_launch_is_out_is_held() -> None:
    """``Device.call`` holds jobs while a launch_now launch is out, across loop trips; the wait
    of the last one runs them, in order."""

    async def main() -> None:
        dev = batcher.Device("t", inline_s=1.0)
        loop = asyncio.get_running_loop()
        ran: list[str] = []
        finish = dev.launch_now(lambda: Launched(lambda: ran.append("wait") or "r"))
        got: list[Any] = []
        dev.call(loop, lambda: ran.append("job") or 7, (), lambda r, e: got.append(r),
                 expect_s=1e-6)
        await asyncio.sleep(0)  # a loop trip later: still held
        assert ran == [] and dev.inflight == 2
        assert finish() == "r"
        assert ran == ["wait", "job"]
        await asyncio.sleep(0)
        assert got == [7] and dev.inflight == 0
        dev.close()

    asyncio.run(main())


def test_callers_through_front_ends_get_their_own_rows(
        start: Any, rng: np.random.Generator) -> None:  # noqa: F811
    """Through two front-end processes, with the switch on: every caller gets its own x's
    result, and the device process took the pipelined path."""
    w = start()
    callers_get_their_own_rows(w, 8, 25, rng)
    assert w.worker.pipeline and w.worker.pipelined[0] > 0
    assert not w.worker._out and w.worker._pending == 0


def test_lone_region_calls_through_front_ends_write_y_into_their_region(
        start: Any, rng: np.random.Generator) -> None:  # noqa: F811
    """With the switch on, a lone region call (x and y in a page-locked region) is launched
    as ``_start_alone``'s would be: x read where it is, y written by the backend into the
    caller's region (the route), for a call of a few rows (merged with nothing) and a full
    one (T3's); every y is the call's own. Session 15's fault: such a call took the merged
    path, x copied into the upload buffer and y not routed (test_pinned_gpu, frontends-2)."""
    backend = DmaBackend(Recorder())
    w = start(backend=backend)
    c = w.client()
    blocks = random_q6k(96, 512, 5)
    c.upload("w", blocks, 96, 512)
    region = c.register_shm("r", 1 << 20)
    calls = 0
    for n in (4, 64):
        for i in range(6):
            x = rng.standard_normal((n, 512)).astype(np.float32) * (i + 1)
            poison = region.ndarray(1 << 19, np.uint8, (1 << 18,))
            poison[...] = 0xFF  # y is written every call
            del poison
            got = c.matmul("w", x, x_region=region, y_region=(region, 1 << 19))
            assert_close(got, reference(blocks, 96, 512, x))
            del got
            calls += 1
    assert backend.direct_x == calls and backend.direct_y == calls
    assert w.worker.pipelined[0] >= calls - 2  # (the first of each size is measured)
    assert not w.worker._out and w.worker._pending == 0
    region.close()
