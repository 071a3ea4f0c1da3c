"""Page-locked system regions on a GPU (``-m gpu``; skipped without CuPy or a GPU): a region
registered with a CUDA worker is ``cudaHostRegister``ed; a call whose x and y are in it is
DMA'd straight from and into it (``Launcher.launch_host``: no staging copy, no host copy of
y), direct and through the captured graph; results equal the bytes path's; unregister and
drain unpin; one process and --frontends 2."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from q6serve.client.client import Client
from q6serve.service.config import Budget, WorkerConfig
from tests.dataplane.test_cuda_ipc_gpu import _gpus, same
from tests.service.svc_util import RunningWorker, random_q6k

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_gpus() == 0, reason="needs CuPy and a CUDA GPU")]

ROWS, K = 2048, 3584


@pytest.fixture(autouse=True)
def _regions_pins_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The front ends' arenas stay pageable here (Q6SERVE_DP_PIN_ARENA, on by default): the
    pins these tests count are the regions' (test_pinned_arena.py has the arenas')."""
    monkeypatch.setenv("Q6SERVE_DP_PIN_ARENA", "0")


@pytest.fixture(scope="module")
def backend() -> Any:
    from q6serve.kernels.cuda_backend import CudaBackend

    return CudaBackend()


class Counted:
    """Counts ``Launcher.launch_host`` calls (the direct path taken, not a silent staging)."""

    def __init__(self, backend: Any) -> None:
        self.n = 0
        inner = backend.launcher.launch_host

        def launch_host(*a: Any, **kw: Any) -> Any:
            self.n += 1
            return inner(*a, **kw)

        backend.launcher.launch_host = launch_host


@pytest.fixture(params=[1, 2], ids=["one-process", "frontends-2"])
def worker(request: pytest.FixtureRequest, backend: Any) -> Iterator[tuple[Any, Client]]:
    cfg = WorkerConfig(host="127.0.0.1", port=0, vram_budget=Budget(nbytes=2 << 30),
                       grace_period_s=2.0, allow_shm=True)
    if request.param == 1:
        w: Any = RunningWorker(cfg, backend)
    else:
        from tests.dataplane.test_frontends import Running

        w = Running(dataclasses.replace(cfg, frontends=2, frontend_shm_bytes=8 << 20),
                    backend)
    c = w.client()
    c.upload("w", random_q6k(ROWS, K, 1), ROWS, K)
    try:
        yield w, c
    finally:
        w.stop()
    assert backend.hostio.pinned == 0 and backend.hostio.routes == 0  # drain unpinned all


def test_x_and_y_dma_from_and_into_the_region(worker: tuple[Any, Client], backend: Any,
                                              rng: np.random.Generator) -> None:
    _w, c = worker
    counted = Counted(backend)
    try:
        with c.register_shm("r", 4 << 20) as region:
            assert backend.hostio.pinned == 1 and backend.hostio.pinned_bytes >= 4 << 20
            for n in (1, 8, 64):
                x = rng.standard_normal((n, K)).astype(np.float16)
                for out_dtype in ("f32", "f16", "bf16"):
                    want = c.matmul_full("w", x, precision="f16", out_dtype=out_dtype)
                    before, planned = counted.n, _planned(_w)
                    for _ in range(3):  # direct, then captured, then the graph
                        yv = region.ndarray(1 << 20, np.uint8, (1 << 20,))
                        yv[...] = 0xFF  # poison: y is written every call
                        got = c.matmul("w", x, precision="f16", out_dtype=out_dtype,
                                       x_region=region, y_region=(region, 1 << 20))
                        same(np.array(got), want.y)
                        del got, yv
                    # each call DMA'd from and into the region: by launch_host, or (a full
                    # batch through front ends, repeated) by its region's plan
                    assert counted.n - before + _planned(_w) - planned == 3, (n, out_dtype)
            assert backend.hostio.routes == 0
            # y alone in the region (x in the message): staged upload, y copied in, as before
            x = rng.standard_normal((4, K)).astype(np.float16)
            got = c.matmul("w", x, precision="f16", y_region=(region, 1 << 20))
            same(np.array(got), c.matmul("w", x, precision="f16"))
            del got
        assert backend.hostio.pinned == 0  # unregistered: unpinned
    finally:
        del backend.launcher.launch_host  # (the instance attribute: the method again)


def _planned(w: Any) -> int:
    """Calls a --frontends worker's device process launched by a region's plan (the backend's
    RegionCall: not ``launch_host``); 0 for one process."""
    return int(getattr(getattr(w, "worker", None), "sys_planned", 0))


def test_region_calls_launched_behind_each_other(backend: Any, rng: np.random.Generator,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``Q6SERVE_PIPELINE_SHORT=1`` on the GPU: 8 callers' 64-row region calls through two
    front ends are launched behind each other (two launch slots, waits on the device thread)
    and every result equals the bytes path's; nothing is left held, routed or pinned."""
    monkeypatch.setenv("Q6SERVE_PIPELINE_SHORT", "1")
    dev, _ = _region_calls_equal_the_bytes_path(backend, rng)
    assert dev.pipeline_short and dev.behind_jobs > 0 and dev.deferred_jobs > 0


def test_region_calls_run_several_to_a_job(backend: Any, rng: np.random.Generator,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``Q6SERVE_JOB_BATCHES=4`` on the GPU: the same load, queued 64-row batches run several
    to a device job (launched behind each other in the launch slots), every result equal to
    the bytes path's; nothing is left held, routed or pinned."""
    monkeypatch.setenv("Q6SERVE_JOB_BATCHES", "4")
    dev, jobs = _region_calls_equal_the_bytes_path(backend, rng)
    assert dev.job_batches == 4 and jobs < 200  # fewer device jobs than calls


def _region_calls_equal_the_bytes_path(backend: Any, rng: np.random.Generator,
                                       ) -> tuple[Any, int]:
    """8 callers x 25 calls of 64 rows, x and y in each caller's page-locked region, through
    two front ends, each result checked against the bytes path; returns the device and the
    device jobs the 200 calls took."""
    from concurrent.futures import ThreadPoolExecutor


    w, clients, xs, wants, regions = _eight_callers(backend, rng, 2)
    try:
        def caller(i: int) -> int:
            for _ in range(25):
                got = clients[i].matmul("w", xs[i], precision="f16", x_region=regions[i],
                                        y_region=(regions[i], 1 << 20))
                same(np.array(got), wants[i])
                del got
            return 25

        dev = w.worker.engine.device
        jobs = dev.jobs
        with ThreadPoolExecutor(8) as pool:
            assert sum(pool.map(caller, range(8))) == 200
        jobs = dev.jobs - jobs
        assert dev.inflight == 0 and backend.hostio.routes == 0
        for r in regions:
            r.close()
        assert backend.hostio.pinned == 0
        return dev, jobs
    finally:
        w.stop()


def test_lane_full_batches_pipelined(backend: Any, rng: np.random.Generator) -> None:
    """T3's shape on lanes (8 callers of 64-row calls, x and y in each caller's page-locked
    region, through two front ends): full batches read together run as the lane's pipeline
    (``Engine.launch_now``, two launch slots), every y equal to the bytes path's; nothing is
    left held, routed or pinned."""
    from concurrent.futures import ThreadPoolExecutor

    w, clients, xs, wants, regions = _eight_callers(backend, rng, 3)
    try:
        lanes = [c.open_lane(r) for c, r in zip(clients, regions, strict=True)]

        def caller(i: int) -> int:
            for _ in range(25):
                got = lanes[i].matmul("w", xs[i], y_offset=1 << 20, precision="f16")
                same(np.array(got), wants[i])
                del got
            return 25

        with ThreadPoolExecutor(8) as pool:
            assert sum(pool.map(caller, range(8))) == 200
        server = w.worker.plane.lanes
        assert server is not None and server.piped > 0 and server.planned > 0
        _nothing_left(w, backend, lanes, regions)
    finally:
        w.stop()


def _nothing_left(w: Any, backend: Any, lanes: list[Any], regions: list[Any]) -> None:
    """Nothing in flight or routed; the lanes and regions closed, nothing left pinned."""
    assert w.worker.engine.device.inflight == 0 and backend.hostio.routes == 0
    for lane in lanes:
        lane.close()
    for r in regions:
        r.close()
    assert backend.hostio.pinned == 0


def test_lane_plans_replay_one_graph(backend: Any, rng: np.random.Generator) -> None:
    """A lane request repeated at the same places runs by its region's plan, the CUDA
    backend's ``RegionCall`` (x's DMA, the kernels, y's f16 conversion and y's DMA as one
    captured graph per launch slot): y equal to the bytes path's for a new x each call, f32
    and f16 out, a full batch (the lane's pipeline) and a lone row (the direct path); after
    an unpin elsewhere the plan is remade; nothing is left held, routed or pinned."""
    from q6serve.kernels.cuda.launch import RegionCall

    w, clients, xs, wants, regions = _eight_callers(backend, rng, 5)
    try:
        c, region = clients[0], regions[0]
        lane = c.open_lane(region)
        server = w.worker.plane.lanes
        assert server is not None
        held = w.worker.regions._regions["r5_0"]

        def graphed() -> bool:  # every plan's region call replays a captured graph
            # (a slot's sequence is captured on its second call; which slot and whether the
            # one stream's or the copy streams' sequence runs a call is the device's timing:
            # with Q6SERVE_LAUNCH_SLOTS=3 the first GPU run's calls used both kinds)
            return bool(held.plans) and all(
                any(sq is not None and sq.graph for sq in (*p.rc._seqs, *p.rc._sseqs))
                for p in held.plans.values())

        # a repeat runs by its key's plan when the device is idle at its launch, else it goes
        # the usual way and a later call makes the plan again (how many do is timing, not a
        # contract: the first GPU run had 7 of 10): repeats until two ran by the plan, the
        # last call among them (so the plan held now has replayed), and its graph is captured
        for out in ("f32", "f16"):
            before = server.planned
            for i in range(24):
                j, last = i % 4, server.planned
                got = lane.matmul("w", xs[j], y_offset=1 << 20, precision="f16", out_dtype=out)
                same(np.array(got), wants[j].astype(np.float16) if out == "f16" else wants[j])
                del got
                if (i >= 5 and server.planned - before >= 2 and server.planned > last
                        and graphed()):
                    break
            assert server.planned - before >= 2, out
        made = [p.rc for p in held.plans.values()]
        assert len(made) == 2 and all(isinstance(rc, RegionCall) and rc.live() for rc in made)
        assert graphed()
        planned = server.planned
        x1 = [x[:1].copy() for x in xs[:3]]
        want1 = [c.matmul_full("w", x, precision="f16").y for x in x1]
        for i in range(16):
            got = lane.matmul("w", x1[i % 3], x_offset=2 << 20, y_offset=3 << 20,
                              precision="f16")
            same(np.array(got), want1[i % 3])
            del got
            if i >= 7 and server.planned - planned >= 3:
                break
        assert server.planned - planned >= 3  # (the first ones queued, then by the plan)
        c.register_shm("other", 4096).close()  # an unpin: every region call stale
        assert not any(rc.live() for rc in made)
        for i in range(3):
            got = lane.matmul("w", xs[i], y_offset=1 << 20, precision="f16")
            same(np.array(got), wants[i])
            del got
        _nothing_left(w, backend, [lane], regions)
    finally:
        w.stop()


def _eight_callers(backend: Any, rng: np.random.Generator, seed: int,
                   ) -> tuple[Any, list[Client], list[np.ndarray], list[np.ndarray], list[Any]]:
    """A --frontends 2 worker on ``backend`` with a weight, and 8 clients each with its 64-row
    f16 x, the bytes path's y for it and a 4 MiB region: (worker, clients, xs, ys, regions)."""
    from tests.dataplane.test_frontends import Running

    cfg = WorkerConfig(host="127.0.0.1", port=0, vram_budget=Budget(nbytes=2 << 30),
                       grace_period_s=2.0, allow_shm=True, frontends=2,
                       frontend_shm_bytes=8 << 20)
    w = Running(cfg, backend)
    try:
        c0 = w.client()
        c0.upload("w", random_q6k(ROWS, K, seed), ROWS, K)
        clients = [w.client() for _ in range(8)]
        xs = [rng.standard_normal((64, K)).astype(np.float16) for _ in clients]
        wants = [c0.matmul_full("w", x, precision="f16").y for x in xs]
        regions = [c.register_shm(f"r{seed}_{i}", 4 << 20) for i, c in enumerate(clients)]
    except BaseException:
        w.stop()
        raise
    return w, clients, xs, wants, regions


def test_full_region_calls_through_frontends_pipelined_and_planned(
        backend: Any, rng: np.random.Generator) -> None:
    """T3's shape through front ends (8 callers of 64-row calls, x and y in each caller's
    page-locked region, gRPC requests naming them): the device process launches them at its
    loop trips' ends through ``Engine.launch_now`` (``FrontendsWorker._sys_call``), repeats by
    their region's plan (the backend's ``RegionCall``); every y equals the bytes path's for
    the x written into the region before the call; nothing is left held, routed or pinned."""
    from concurrent.futures import ThreadPoolExecutor

    w, clients, xs, wants, regions = _eight_callers(backend, rng, 7)
    try:
        def caller(i: int) -> int:
            c, r = clients[i], regions[i]
            for j in range(30):
                k = (i + j % 2) % 8  # two x's in turn: a plan reads the region's x anew
                r.put(0, xs[k])
                y = c.matmul("w", r.ndarray(0, np.float16, xs[k].shape), precision="f16",
                             x_region=(r, 0), y_region=(r, 1 << 20))
                same(np.array(y), wants[k])
            return 30

        with ThreadPoolExecutor(8) as pool:
            assert sum(pool.map(caller, range(8))) == 240
        assert w.worker.pipelined[0] > 0 and w.worker.sys_planned > 0, (
            w.worker.pipelined, w.worker.sys_planned)
        _nothing_left(w, backend, [], regions)
    finally:
        w.stop()


def test_small_region_calls_merged_through_frontends(
        backend: Any, rng: np.random.Generator) -> None:
    """T2's shape over system regions (8 callers of 1-3 row calls through front ends, x and
    y in each caller's page-locked region): the device process merges a trip's calls, each
    y written into its caller's region from the batch's y (``_region_answer``), equal to the
    bytes path's y for that x up to the kernel's rounding at another N; a call left alone is
    routed; nothing is left held, routed or pinned."""
    from concurrent.futures import ThreadPoolExecutor

    w, clients, _, _, regions = _eight_callers(backend, rng, 9)
    try:
        xs = [rng.standard_normal((1 + i % 3, K)).astype(np.float16) for i in range(8)]
        wants = [clients[0].matmul_full("w", x, precision="f16").y for x in xs]

        def caller(i: int) -> None:
            c, r = clients[i], regions[i]
            for j in range(40):
                r.put(0, xs[i])
                y = c.matmul("w", r.ndarray(0, np.float16, xs[i].shape), precision="f16",
                             x_region=(r, 0), y_region=(r, (1 << 20) + 65536 * (j % 2)))
                want = wants[i].astype(np.float32)
                np.testing.assert_allclose(np.array(y, np.float32), want, rtol=1e-2,
                                           atol=2e-2 * float(np.abs(want).max()))

        with ThreadPoolExecutor(8) as pool:
            for _ in range(5):  # (calls merge when they meet in a trip: a few rounds)
                list(pool.map(caller, range(8)))
                if w.worker.merged_direct:
                    break
        assert w.worker.merged_direct > 0, w.worker.merged
        _nothing_left(w, backend, [], regions)
    finally:
        w.stop()
