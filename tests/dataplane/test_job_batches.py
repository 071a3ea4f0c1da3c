"""Several batches of one weight as one device job (issue 15, T3: ``Q6SERVE_JOB_BATCHES=N``):
under load, a batcher's next full batches, up to N, run as one job on the device thread, each
launched behind the previous one in the backend's launch slots and waited for in order, with
one hand-back for all; a lone request on an idle device still runs inline. CPU: backends with
the CUDA backend's launch contract (tests/dataplane/test_pipeline_short.py)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from q6serve.service.batcher import Batcher, BatchSettings
from q6serve.service.device_thread import Device, job_batches
from tests.dataplane.test_frontends import start  # noqa: F401  (fixture)
from tests.dataplane.test_pinned_regions import Recorder
from tests.dataplane.test_pipeline_short import (
    KEY,
    SHORT,
    Launches,
    SlotBackend,
    _device,
    _held,
    _region_load,
    _x,
    front_end_killed_under_region_load,
    refused_and_expired_reach_only_their_callers,
)


@pytest.fixture
def job4(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("Q6SERVE_JOB_BATCHES", "4")
    # full region calls through the batcher's jobs (the device process's pipeline takes them
    # by default: tests/dataplane/test_sys_pipe.py)
    monkeypatch.setenv("Q6SERVE_DP_SYS_PIPE", "0")


def _batcher(dev: Device, lz: Launches, launch: Any = None) -> Batcher:
    b = Batcher("w", dev, lz.run, BatchSettings(max_rows=1, max_delay_s=0.0), lambda: True,
                lambda s: None, launch=launch or lz.launch)
    b._job_s[(KEY, 1)] = 1e-4  # a like job was short: runs on the loop when alone
    b._kernel_s[(KEY, 1)] = SHORT.host_seconds
    return b


def test_queued_batches_run_as_one_job_launched_behind_each_other(job4: None) -> None:
    async def main() -> None:
        me = threading.current_thread().name
        dev = Device("t", inline_s=10.0, launch_slots=2)
        assert dev.job_batches == 4
        lz = Launches()
        b = _batcher(dev, lz)
        assert float((await b.enqueue(_x(1.0), KEY, None)).y[0, 0]) == 2.0
        assert dev.jobs == 1 and dev.inline_jobs == 1  # alone on an idle device: inline
        assert lz.where == [("launch", 1.0, me), ("wait", 1.0, me)]
        lz.where.clear()
        lz.release.clear()
        # five full batches read in one loop trip: the first four in one job, the fifth
        # (the device busy) in a job of its own queued behind it on the device thread
        futs = [b.enqueue(_x(v), KEY, None) for v in (2.0, 3.0, 4.0, 5.0, 6.0)]
        await asyncio.sleep(0.05)
        # launched behind each other, two in flight at most: the third waits for the first
        assert [(what, v) for what, v, _ in lz.where] == [("launch", 2.0), ("launch", 3.0)]
        assert not any(f.done() for f in futs)
        lz.release.set()
        assert [float((await f).y[0, 0]) for f in futs] == [4.0, 6.0, 8.0, 10.0, 12.0]
        assert [(what, v) for what, v, _ in lz.where] == [
            ("launch", 2.0), ("launch", 3.0), ("wait", 2.0), ("launch", 4.0), ("wait", 3.0),
            ("launch", 5.0), ("wait", 4.0), ("wait", 5.0), ("launch", 6.0), ("wait", 6.0)]
        assert all(where != me for _, _, where in lz.where)  # all on the device thread
        assert dev.jobs == 3 and dev.inline_jobs == 1
        assert dev.inflight == 0 and b._unfinished == 0 and b.in_flight == 0
        await b.close()
        dev.close()

    asyncio.run(main())


@pytest.mark.parametrize("raw", ["abc", "0", "-3", "2.5"])
def test_a_bad_job_batches_value_is_refused_by_name(raw: str) -> None:
    with pytest.raises(ValueError, match=f"Q6SERVE_JOB_BATCHES={raw!r}"):
        job_batches({"Q6SERVE_JOB_BATCHES": raw})
    assert job_batches({}) == 1 and job_batches({"Q6SERVE_JOB_BATCHES": " 4 "}) == 4


def test_batches_are_one_job_each_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("Q6SERVE_JOB_BATCHES", raising=False)

    async def main() -> None:
        dev = Device("t", inline_s=10.0, launch_slots=2)
        assert dev.job_batches == 1
        lz = Launches()
        b = _batcher(dev, lz)
        futs = [b.enqueue(_x(v), KEY, None) for v in (1.0, 2.0, 3.0)]
        assert [float((await f).y[0, 0]) for f in futs] == [2.0, 4.0, 6.0]
        assert dev.jobs == 3 and dev.inline_jobs == 3
        await b.close()
        dev.close()

    asyncio.run(main())


def test_a_refused_or_expired_request_in_a_job_reaches_only_its_caller(job4: None) -> None:
    # five batches: the first alone, then the rest as one job (or queued behind it)
    assert refused_and_expired_reach_only_their_callers() < 5


# -- the device process of a --frontends worker: region calls of many callers --------------
def test_region_calls_through_frontends_run_several_to_a_job(
        job4: None, start: Any, rng: np.random.Generator,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("Q6SERVE_DP_PIN_ARENA", "0")  # (the pins counted are the regions')
    backend = SlotBackend(Recorder(), wait_s=0.01)
    # calls of 4 rows are full batches (as T3's N=64 calls are at the default 64)
    w = start(backend=backend, inline_device_us=100_000, max_batch_rows=4)
    regions = _region_load(w, callers=6, calls=12, rng=rng)
    inflight, _, _, pending, queued = w.call(_device(w))
    dev = w.worker.engine.device
    assert dev.job_batches == 4
    assert backend.peak == 2 and backend.in_flight == 0  # two in flight, never more
    assert backend.launched > dev.jobs  # several batches to a job
    assert backend.direct_x > 0 and backend.direct_y > 0  # page-locked paths kept
    assert (inflight, pending, queued) == (0, 0, 0)
    assert w.call(_held(w)) == [0] * len(regions) and backend.hostio.routes == 0
    for r in regions:
        r.close()
    assert backend.hostio.pinned == 0


def test_front_end_killed_while_region_calls_run_several_to_a_job(
        job4: None, start: Any, rng: np.random.Generator) -> None:  # noqa: F811
    """SIGKILL a front end while region calls run several to a job: its calls fail
    UNAVAILABLE or complete, the device process serves on, and every call's regions, routes
    and counts go back to zero."""
    backend = SlotBackend(Recorder(), wait_s=0.02)
    w = start(backend=backend, inline_device_us=100_000, max_batch_rows=4)
    front_end_killed_under_region_load(w, rng, 24, "j")
    assert backend.launched > w.worker.engine.device.jobs  # several batches to a job
