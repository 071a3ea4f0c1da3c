"""Q6SERVE_DEVICE_PIPELINE: the device process launches a trip's merged batch on the direct path
and waits for it at the start of the next loop trip (``FrontendsWorker._settle``), so the loop
reads and merges the next messages while the GPU runs. Each call still gets its own rows, a
refusal only its own caller, and a job that comes while the batch is out (``Device.call``) is
held until it is waited for. Run in-process on NumPy, as tests/dataplane/test_device_direct.py."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from q6serve.kernels.api import Launched
from q6serve.kernels.errors import InvalidArgument
from q6serve.service import batcher, envvars
from tests.dataplane.test_device_direct import Device
from tests.dataplane.test_device_merge import BAD, ROWS, K
from tests.dataplane.test_frontends import (
    callers_get_their_own_rows,
    start,  # noqa: F401  (the fixture)
)
from tests.service.svc_util import reference


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


def test_a_merged_batch_is_answered_in_the_next_trip(rng: np.random.Generator) -> None:
    """Launched in the trip that merged it (the direct path), not answered there; its answers
    leave in the next trip's first handle (one write), each call with its rows."""
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

        def after_merge() -> None:  # (runs in the merge's trip, after it)
            seen.append((sorted(d.out.answers), dev.inflight, w.pipelined[0]))
            loop.call_soon(lambda: seen.append((sorted(d.out.answers), dev.inflight,
                                                w.pipelined[0])))

        loop.call_soon(after_merge)
        await asyncio.sleep(0.05)
        assert seen == [([], 1, 1), ([20, 21, 22], 0, 1)]
        assert dev.direct_jobs == 1 and len(writes) == 1 and w._pending == 0
        assert w.merged == [2, 6]  # (requests that merged calls, and those calls)
        _check(d, xs, d.out.answers, 20)
        assert d.out.answers[21][2][5] == 4  # the batch's rows
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


def test_two_batches_of_one_trip_one_out_at_a_time(rng: np.random.Generator) -> None:
    """More rows than a batch takes: the trip's second batch waits for its first before it is
    launched (at most one is out), and both are answered."""
    xs = [rng.standard_normal((3, K)).astype(np.float32) for _ in range(4)]

    async def main() -> None:
        d = Device(len(xs), pipeline=True)
        d.worker._merge_rows = 6  # (two calls of 3 rows a batch)
        await d.start()
        w = d.worker
        await d.trip(xs, 1)
        await d.trip(xs, 10)  # (each batch's like job measured now)
        before = w.pipelined[0]
        xs2 = [x * 2 for x in xs]
        answers = await d.trip(xs2, 20)
        assert w.pipelined[0] - before == 2
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
    assert w.worker._out_batch is None and w.worker._pending == 0
