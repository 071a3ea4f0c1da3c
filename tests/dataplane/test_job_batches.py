"""Several batches of one weight as one device job (issue 15, T3: ``Q6SERVE_JOB_BATCHES=N``):
under load, a batcher's next full batches, up to N, run as one job on the device thread, each
launched behind the previous one in the backend's launch slots and waited for in order, with
one hand-back for all; a lone request on an idle device still runs inline. CPU: backends with
the CUDA backend's launch contract (tests/dataplane/test_pipeline_short.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from q6serve.client.client import Q6ServeError
from q6serve.kernels.api import Launched
from q6serve.kernels.errors import InvalidArgument
from q6serve.service.batcher import Batcher, BatchKey, BatchSettings, Device
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
    _setup,
    _x,
)
from tests.dataplane.test_regions import K, ROWS
from tests.service.svc_util import reference


@pytest.fixture
def job4(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("Q6SERVE_JOB_BATCHES", "4")


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
    async def main() -> None:
        dev = Device("t", inline_s=10.0, launch_slots=2)
        lz = Launches()
        real = lz.launch

        def launch(x: np.ndarray, key: BatchKey) -> Launched:
            if x[0, 0] == 3.0:
                raise InvalidArgument("values this kernel cannot take")
            return real(x, key)

        b = _batcher(dev, lz, launch)
        lz.release.clear()
        futs = [b.enqueue(_x(v), KEY, None) for v in (1.0, 2.0, 3.0, 4.0)]
        late = b.enqueue(_x(5.0), KEY, 0.01)  # its deadline passes while it waits
        await asyncio.sleep(0.05)
        lz.release.set()
        outs = await asyncio.gather(*futs, late, return_exceptions=True)
        assert [float(o.y[0, 0]) for i, o in enumerate(outs) if i in (0, 1, 3)] == [2.0, 4.0,
                                                                                    8.0]
        assert isinstance(outs[2], InvalidArgument)
        assert type(outs[4]).__name__ == "DeadlineExceeded"
        assert dev.inflight == 0 and b._unfinished == 0 and b.queued_rows == 0
        await b.close()
        dev.close()

    asyncio.run(main())


# -- the device process of a --frontends worker: region calls of many callers --------------
def test_region_calls_through_frontends_run_several_to_a_job(
        job4: None, start: Any, rng: np.random.Generator) -> None:  # noqa: F811
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
    blocks, clients, regions = _setup(w, 24, 8, "j")
    x = rng.standard_normal((4, K)).astype(np.float32)
    for c, r in zip(clients, regions, strict=True):
        c.matmul("w", x, x_region=r, y_region=(r, 16384))  # like jobs measured: short
    victim = w.worker.frontend_pids[0]

    def caller(i: int) -> list[str]:
        out = []
        for _ in range(6):
            try:
                clients[i].matmul("w", x, x_region=regions[i], y_region=(regions[i], 16384))
                out.append("OK")
            except Q6ServeError as e:
                out.append(e.code.name)
        return out

    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(caller, i) for i in range(8)]
        time.sleep(0.2)
        os.kill(victim, signal.SIGKILL)
        outcomes = [o for f in futs for o in f.result(60)]
    assert set(outcomes) <= {"OK", "UNAVAILABLE"}, outcomes
    assert outcomes.count("OK") > 0
    deadline = time.monotonic() + 30
    while True:
        inflight, _, _, pending, queued = w.call(_device(w))
        if (inflight, pending, queued) == (0, 0, 0):
            break
        assert time.monotonic() < deadline, (inflight, pending, queued)
        time.sleep(0.05)
    assert backend.launched > w.worker.engine.device.jobs  # several batches to a job
    assert w.call(_held(w)) == [0] * len(regions) and backend.hostio.routes == 0
    fresh = w.client()
    np.testing.assert_allclose(fresh.matmul("w", x), reference(blocks, ROWS, K, x),
                               rtol=1e-5, atol=1e-4)
