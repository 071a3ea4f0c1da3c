"""Short batches launched behind each other (issue 15, T3: ``Q6SERVE_PIPELINE_SHORT=1``): under
load a batch whose kernels are short is launched on the loop and waited for on the device
thread, the next one launched behind it (the backend's two launch slots), so the loop never
waits for the GPU inline; a lone request on an idle device still runs inline. CPU: a backend
with the CUDA backend's launch contract (computed at launch, handed out by a ``wait`` that
blocks, two slots) and its page-locked regions (tests/dataplane/test_pinned_regions.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest

from q6serve.client.client import Q6ServeError
from q6serve.client.retry import RetryPolicy
from q6serve.kernels.api import KernelTiming, Launched, MatmulResult, Precision
from q6serve.kernels.errors import InvalidArgument
from q6serve.service.batcher import Batcher, BatchKey, BatchSettings
from q6serve.service.device_thread import Device
from tests.dataplane.test_frontends import start  # noqa: F401  (fixture)
from tests.dataplane.test_pinned_regions import DmaBackend, Recorder
from tests.dataplane.test_regions import ROWS, K, code_of
from tests.dataplane.tol import assert_ref
from tests.service.svc_util import random_q6k, reference
from tests.service.test_device_pipeline import Launches as LongLaunches

KEY = BatchKey("f32", Precision.EXACT, "f32")
SHORT = KernelTiming(host_seconds=20e-6)  # a kernel well under DEFER_KERNEL_S


class SlotBackend(DmaBackend):
    """:class:`DmaBackend` with two launch slots: ``launch`` computes now and returns a wait
    that blocks ``wait_s`` (the GPU's work), reporting a short kernel. Counts launches in
    flight (launched, wait not returned) and their peak; a launch with a row of x starting
    with ``refuse`` raises INVALID_ARGUMENT, as a kernel refusing a caller's input does (a
    merged or batched launch then runs each caller alone)."""

    launch_slots = 2

    def __init__(self, rec: Recorder, wait_s: float = 0.01, refuse: float | None = None,
                 ) -> None:
        super().__init__(rec)
        self.wait_s, self.refuse = wait_s, refuse
        self.lock = threading.Lock()
        self.in_flight = self.peak = self.launched = 0
        self.waited_on: set[str] = set()

    def launch(self, w: Any, x: np.ndarray, **kw: Any) -> Launched:
        if self.refuse is not None and bool((x[:, 0] == self.refuse).any()):
            raise InvalidArgument("refused: this caller's values")
        r = self.matmul(w, x, **kw)
        r = MatmulResult(r.y, r.kernel, r.layout, r.precision, SHORT, r.topk)
        with self.lock:
            self.in_flight += 1
            self.launched += 1
            self.peak = max(self.peak, self.in_flight)
            assert self.in_flight <= self.launch_slots

        def wait() -> MatmulResult:
            time.sleep(self.wait_s)
            with self.lock:
                self.in_flight -= 1
                self.waited_on.add(threading.current_thread().name)
            return r

        return Launched(wait)


@pytest.fixture
def pipelined(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("Q6SERVE_PIPELINE_SHORT", "1")


# -- the batcher and device alone ----------------------------------------------------------
class Launches(LongLaunches):
    """tests/service/test_device_pipeline.py's launch/wait pair (waits block until
    ``release``; where each ran), reporting a short kernel; released from the start."""

    def __init__(self) -> None:
        super().__init__()
        self.release.set()

    def launch(self, x: np.ndarray, key: BatchKey) -> Launched:
        inner = super().launch(x, key)
        return Launched(lambda: dataclasses.replace(inner.wait(), timing=SHORT))


def _x(v: float, n: int = 1) -> np.ndarray:
    return np.full((n, 4), v, np.float32)


def _batcher(dev: Device, lz: Launches, **kw: Any) -> Batcher:
    b = Batcher("w", dev, lz.run, BatchSettings(max_rows=1, max_delay_s=0.0, **kw),
                lambda: True, lambda s: None, launch=lz.launch)
    b._job_s[(KEY, 1)] = 1e-4  # a like job was short: runs on the loop
    b._kernel_s[(KEY, 1)] = SHORT.host_seconds  # and so were its kernels
    return b


def test_a_lone_short_batch_runs_inline_and_a_queue_is_launched_behind(pipelined: None,
                                                                       ) -> None:
    async def main() -> None:
        me = threading.current_thread().name
        dev = Device("t", inline_s=10.0, launch_slots=2)
        assert dev.pipeline_short
        lz = Launches()
        b = _batcher(dev, lz)
        assert float((await b.enqueue(_x(1.0), KEY, None)).y[0, 0]) == 2.0
        # alone on an idle device: inline, its wait on the loop too (no thread hand-off)
        assert dev.deferred_jobs == 0 and lz.where == [("launch", 1.0, me), ("wait", 1.0, me)]
        lz.where.clear()
        lz.release.clear()
        futs = [b.enqueue(_x(v), KEY, None) for v in (2.0, 3.0, 4.0, 5.0)]
        await asyncio.sleep(0.05)
        # one row per batch: the first launched (more queued behind it), the second behind
        # it, the rest held: two launches in flight at most, none waited for on the loop
        assert [v for what, v, _ in lz.where if what == "launch"] == [2.0, 3.0]
        assert not any(f.done() for f in futs)
        lz.release.set()
        assert [float((await f).y[0, 0]) for f in futs] == [4.0, 6.0, 8.0, 10.0]
        waits = [(v, where) for what, v, where in lz.where if what == "wait"]
        assert [v for v, _ in waits] == [2.0, 3.0, 4.0, 5.0]  # in launch order
        assert all(where != me for _, where in waits[:2])  # on the device thread
        assert dev.deferred_jobs >= 2 and dev.behind_jobs >= 1
        assert dev.inflight == 0 and b._unfinished == 0 and b.in_flight == 0
        await b.close()
        dev.close()

    asyncio.run(main())


def test_full_batches_under_pipelining_start_without_the_batchers_task(pipelined: None,
                                                                        ) -> None:
    """A full batch queued while another is on the device is started from ``enqueue`` or
    from the previous batch's end (``Batcher._start_behind``), not by the batcher's task:
    once two are in flight, with the task stopped, every request still runs, two launches
    in flight at most."""

    async def main() -> None:
        dev = Device("t", inline_s=10.0, launch_slots=2)
        lz = Launches()
        b = _batcher(dev, lz)
        lz.release.clear()
        futs = [b.enqueue(_x(float(v)), KEY, None) for v in (1, 2)]
        await asyncio.sleep(0.05)
        launched = [v for what, v, _ in lz.where if what == "launch"]
        assert launched == [1.0, 2.0]
        b._task.cancel()
        futs += [b.enqueue(_x(float(v)), KEY, None) for v in range(3, 7)]
        await asyncio.sleep(0.02)
        assert [v for what, v, _ in lz.where if what == "launch"] == launched  # slots full
        lz.release.set()
        ys = [float((await asyncio.wait_for(f, 5)).y[0, 0]) for f in futs]
        assert ys == [2.0 * v for v in range(1, 7)]
        assert dev.behind_jobs >= 4 and dev.inflight == 0 and b._unfinished == 0
        await b.close()
        dev.close()

    asyncio.run(main())


def test_short_batches_are_not_pipelined_unless_asked(monkeypatch: pytest.MonkeyPatch,
                                                      ) -> None:
    monkeypatch.delenv("Q6SERVE_PIPELINE_SHORT", raising=False)

    async def main() -> None:
        dev = Device("t", inline_s=10.0, launch_slots=2)
        assert not dev.pipeline_short
        lz = Launches()
        b = _batcher(dev, lz)
        futs = [b.enqueue(_x(v), KEY, None) for v in (1.0, 2.0, 3.0)]
        assert [float((await f).y[0, 0]) for f in futs] == [2.0, 4.0, 6.0]
        assert dev.deferred_jobs == 0 and dev.behind_jobs == 0
        assert len({where for *_, where in lz.where}) == 1  # all on the loop
        await b.close()
        dev.close()

    asyncio.run(main())


def test_one_slot_never_pipelines_short_batches(pipelined: None) -> None:
    dev = Device("t", inline_s=10.0, launch_slots=1)
    assert not dev.pipeline_short
    dev.close()


def test_a_refused_or_expired_request_under_pipelining_reaches_only_its_caller(
        pipelined: None) -> None:
    refused_and_expired_reach_only_their_callers()


def refused_and_expired_reach_only_their_callers() -> int:
    """Five one-row batches queued on a busy device (a Device as the env configures it), the
    third refused by its launch, the fifth past its deadline while it waits: each outcome
    reaches its own caller only, every count back to zero. Returns the device's jobs."""
    async def main() -> int:
        dev = Device("t", inline_s=10.0, launch_slots=2)
        lz = Launches()
        real = lz.launch

        def launch(x: np.ndarray, key: BatchKey) -> Launched:
            if x[0, 0] == 3.0:
                raise InvalidArgument("values this kernel cannot take")
            return real(x, key)

        b = Batcher("w", dev, lz.run, BatchSettings(max_rows=1, max_delay_s=0.0),
                    lambda: True, lambda s: None, launch=launch)
        b._job_s[(KEY, 1)] = 1e-4
        b._kernel_s[(KEY, 1)] = SHORT.host_seconds
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
        # the expired caller hears of it from its deadline, while its batch may still be in
        # the device (a loaded machine: inflight 1 here, 1 run in 5): counts once it is idle
        if not dev.idle:
            idle = asyncio.get_running_loop().create_future()
            dev.notify_when_idle(lambda: idle.done() or idle.set_result(None))
            await asyncio.wait_for(idle, 10)
        assert dev.inflight == 0 and b._unfinished == 0 and b.queued_rows == 0
        await b.close()
        dev.close()
        return dev.jobs

    return asyncio.run(main())


# -- the device process of a --frontends worker: region calls of many callers --------------
def _setup(w: Any, seed: int, callers: int, prefix: str,
           ) -> tuple[np.ndarray, list[Any], list[Any]]:
    """The weight uploaded; ``callers`` clients (no retries) with a region each."""
    blocks = random_q6k(ROWS, K, seed)
    w.client().upload("w", blocks, ROWS, K)
    clients = [w.client(retry=RetryPolicy(attempts=1)) for _ in range(callers)]
    return blocks, clients, [c.register_shm(f"{prefix}{i}", 1 << 16)
                             for i, c in enumerate(clients)]


def _region_load(w: Any, callers: int, calls: int, rng: np.random.Generator) -> list[Any]:
    blocks, clients, regions = _setup(w, 21, callers, "p")
    xs = [rng.standard_normal((4, K)).astype(np.float32) for _ in clients]

    def caller(i: int) -> list[np.ndarray]:
        return [clients[i].matmul("w", xs[i], x_region=regions[i],
                                  y_region=(regions[i], 16384)).copy() for _ in range(calls)]

    with ThreadPoolExecutor(callers) as pool:
        outs = list(pool.map(caller, range(callers)))
    for i, ys in enumerate(outs):
        for y in ys:
            assert_ref(y, reference(blocks, ROWS, K, xs[i]))
    return regions


async def _device(w: Any) -> tuple[int, int, int, int, int]:
    dev = w.worker.engine.device
    return (dev.inflight, dev.deferred_jobs, dev.behind_jobs, w.worker._pending,
            sum(v.in_flight for v in w.worker.engine.list()))


async def _held(w: Any) -> list[int]:
    return [r.users for r in w.worker.regions._regions.values()]


def test_region_calls_through_frontends_are_launched_behind_each_other(
        pipelined: None, start: Any, rng: np.random.Generator,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("Q6SERVE_DP_PIN_ARENA", "0")  # (the pins counted are the regions')
    backend = SlotBackend(Recorder(), wait_s=0.01)
    w = start(backend=backend, inline_device_us=100_000)
    regions = _region_load(w, callers=6, calls=12, rng=rng)
    # and one call alone (under the load every call may have joined a batch, whose x is
    # concatenated elsewhere: a loaded CI VM ran it so once): its x and y stay in the region
    lone = rng.standard_normal((4, K)).astype(np.float32)
    w.clients[1].matmul("w", lone, x_region=regions[1], y_region=(regions[1], 16384))
    inflight, deferred, behind, pending, queued = w.call(_device(w))
    assert backend.peak == 2 and backend.in_flight == 0  # two in flight, never more
    assert deferred > 0 and behind > 0  # launched on the loop, the next behind it
    assert any(name.startswith("q6serve-dev") for name in backend.waited_on)
    assert backend.direct_x > 0 and backend.direct_y > 0  # page-locked paths kept
    # every call answered: nothing in flight, held, routed or pending
    assert (inflight, pending, queued) == (0, 0, 0)
    assert w.call(_held(w)) == [0] * len(regions) and backend.hostio.routes == 0
    # bad regions keep their statuses under load
    c = w.clients[1]
    x = rng.standard_normal((4, K)).astype(np.float32)
    got_code, msg = code_of(lambda: c.matmul("w", x, x_region=regions[0],
                                             y_region=(regions[0], 65500)))
    assert got_code == grpc.StatusCode.INVALID_ARGUMENT and "overruns" in msg
    assert w.call(_held(w)) == [0] * len(regions) and backend.hostio.routes == 0
    for r in regions:
        r.close()
    assert backend.hostio.pinned == 0


def test_a_refused_launch_under_pipelining_reaches_only_its_caller(
        pipelined: None, start: Any, rng: np.random.Generator) -> None:  # noqa: F811
    backend = SlotBackend(Recorder(), wait_s=0.01, refuse=7.0)
    w = start(backend=backend, inline_device_us=100_000)
    blocks, clients, regions = _setup(w, 22, 4, "q")
    good = rng.standard_normal((4, K)).astype(np.float32)
    bad = np.full((4, K), 7.0, np.float32)

    def caller(i: int) -> list[str]:
        out = []
        for j in range(10):
            x = bad if (i == 2 and j % 3 == 0) else good
            try:
                y = clients[i].matmul("w", x, x_region=regions[i], y_region=(regions[i], 16384))
                assert_ref(y, reference(blocks, ROWS, K, x))
                out.append("OK")
            except Q6ServeError as e:
                out.append(e.code.name)
        return out

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(caller, range(4)))
    assert outs[2].count("INVALID_ARGUMENT") == 4 and outs[2].count("OK") == 6
    assert all(o == ["OK"] * 10 for i, o in enumerate(outs) if i != 2)
    inflight, _, _, pending, queued = w.call(_device(w))
    assert (inflight, pending, queued) == (0, 0, 0)
    assert w.call(_held(w)) == [0] * 4 and backend.hostio.routes == 0
    for r in regions:
        r.close()


def test_front_end_killed_while_region_calls_are_launched_behind(
        pipelined: None, start: Any, rng: np.random.Generator) -> None:  # noqa: F811
    """SIGKILL a front end while region calls run pipelined: its calls fail UNAVAILABLE or
    complete, the device process serves on, and every call's regions, routes and counts go
    back to zero."""
    backend = SlotBackend(Recorder(), wait_s=0.05)
    w = start(backend=backend, inline_device_us=100_000)
    assert front_end_killed_under_region_load(w, rng, 23, "k", wait_behind=True) > 0


def front_end_killed_under_region_load(w: Any, rng: np.random.Generator, seed: int,
                                       prefix: str, wait_behind: bool = False) -> int:
    """8 callers' region calls, a front end SIGKILLed among them: every outcome OK or
    UNAVAILABLE, some OK; then nothing in flight, held or routed, and a fresh call right.
    Returns the device's ``behind_jobs``. ``wait_behind``: the kill waits (up to 20 s) until a
    call has been launched behind another, instead of 0.2 s."""
    blocks, clients, regions = _setup(w, seed, 8, prefix)
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
        # (with wait_behind the kill lands once a call has been launched behind another: a
        # fixed 0.2 s missed that window on a loaded 2-core CI machine, fresh-clone run 69)
        deadline = time.monotonic() + (20 if wait_behind else 0.2)
        while time.monotonic() < deadline and not (wait_behind and w.call(_device(w))[2]):
            time.sleep(0.01)
        os.kill(victim, signal.SIGKILL)
        outcomes = [o for f in futs for o in f.result(60)]
    assert set(outcomes) <= {"OK", "UNAVAILABLE"}, outcomes
    assert outcomes.count("OK") > 0
    deadline = time.monotonic() + 30
    while True:
        inflight, _, behind, pending, queued = w.call(_device(w))
        if (inflight, pending, queued) == (0, 0, 0):
            break
        assert time.monotonic() < deadline, (inflight, pending, queued)
        time.sleep(0.05)
    assert w.call(_held(w)) == [0] * len(regions) and w.worker.backend.hostio.routes == 0
    fresh = w.client()
    assert_ref(fresh.matmul("w", x), reference(blocks, ROWS, K, x))
    return behind
