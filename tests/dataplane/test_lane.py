"""The fast lane (issue 15 item 3) on the NumPy backend: results equal the gRPC path, errors
come back on the lane with their status (and the lane stays usable), bad tickets and
malformed records close the lane without harming the worker, other callers' regions are
refused, lanes work through --frontends (served by the device process) and end at drain.
These are the socket lane's tests (the ring's fallback: Q6SERVE_LANE_RING=0 here, on both sides)
but for the two marked ``ring`` that also run over the ring (the default on both sides);
test_lane_ring.py has the ring's own."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from q6serve.client import core
from q6serve.client.client import Client, Q6ServeError
from q6serve.client.lane import REPLY, REQUEST, Lane
from q6serve.service.config import Budget, WorkerConfig
from tests.dataplane.tol import assert_ref
from tests.service.svc_util import RunningWorker, random_q6k, reference

ROWS, K = 96, 512
C = grpc.StatusCode
BASE = WorkerConfig(host="127.0.0.1", port=0, vram_budget=Budget(nbytes=64 << 20),
                    grace_period_s=1.0, allow_shm=True, frontend_shm_bytes=4 << 20)


def code_of(fn: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(Q6ServeError) as e:
        fn()
    return e.value.code, e.value.message


@pytest.fixture(autouse=True)
def socket_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Socket lanes on both sides (each lane server reads it when it starts, at the worker's
    first OpenLane); a test taking ``ring`` sets it again before its first lane."""
    monkeypatch.setenv("Q6SERVE_LANE_RING", "0")


@pytest.fixture(params=[False, True], ids=["socket", "ring"])
def ring(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """The lane over the socket, or over the ring (both sides' default: the env unset)."""
    if request.param:
        monkeypatch.delenv("Q6SERVE_LANE_RING")
    return bool(request.param)


@pytest.fixture
def worker() -> Iterator[tuple[RunningWorker, Client, np.ndarray]]:
    w = RunningWorker(dataclasses.replace(BASE, token="u-secret", admin_token="a-secret"))
    c = w.client(token="a-secret")
    blocks = random_q6k(ROWS, K, 3)
    c.upload("w", blocks, ROWS, K)
    try:
        yield w, c, blocks
    finally:
        w.stop()


def test_lane_matmuls_equal_the_rpc_path(worker: Any, rng: np.random.Generator,
                                         ring: bool) -> None:
    _w, c, blocks = worker
    with c.register_shm("io", 1 << 16) as region, c.open_lane(region) as lane:
        assert lane.ring == ring
        for dtype, out in ((np.float16, "f32"), (np.float32, "f16"), (np.float32, "bf16")):
            x = rng.standard_normal((3, K)).astype(dtype)
            y = lane.matmul("w", x, out_dtype=out)
            np.testing.assert_array_equal(y, c.matmul("w", x, out_dtype=out))
            assert y.shape == (3, ROWS) and lane.last is not None
            assert lane.last.batch_rows >= 3 and lane.last.queue_seconds >= 0
        np.testing.assert_allclose(y.astype(np.float32), reference(blocks, ROWS, K, x),
                                   rtol=1e-2, atol=1e-1)
        # x already in the region (written by the caller), y at a chosen offset
        xv = region.ndarray(8192, np.float32, (2, K))
        xv[...] = rng.standard_normal((2, K))
        y = lane.matmul("w", shape=(2, K), dtype=np.float32, x_offset=8192, y_offset=32768)
        assert y.ctypes.data == region.ndarray(32768, np.float32, (2, ROWS)).ctypes.data
        np.testing.assert_array_equal(y, c.matmul("w", np.array(xv)))
        # errors come back on the lane with the RPC's status; the lane goes on
        assert code_of(lambda: lane.matmul("nope", x))[0] == C.NOT_FOUND
        code, msg = code_of(lambda: lane.matmul("w", x, y_offset=(1 << 16) - 64))
        assert code == C.INVALID_ARGUMENT and "overruns region 'io'" in msg, msg
        code, msg = code_of(lambda: lane.matmul("w", np.ones((2, 256), np.float32)))
        assert code == C.INVALID_ARGUMENT and "K=256" in msg
        assert lane.matmul("w", x).shape == (3, ROWS)


def test_lane_copies_x_unless_it_is_the_regions_x(worker: Any,
                                                 rng: np.random.Generator) -> None:
    """x is copied into the region unless it is the region's own x at x_offset (the caller
    wrote it there): a plain array, and a view of the same region at another place (it shares
    the region's memory, not x's address), are copied; the region's x is used as it is."""
    _w, c, _blocks = worker
    with c.register_shm("io", 1 << 16) as region, c.open_lane(region) as lane:
        x = rng.standard_normal((2, K)).astype(np.float32)
        want = c.matmul("w", x)
        np.testing.assert_array_equal(lane.matmul("w", x), want)  # a plain array: copied
        np.testing.assert_array_equal(region.ndarray(0, np.float32, (2, K)), x)
        other = region.ndarray(1024, np.float32, (2, K))  # the region: overlaps x, elsewhere
        other[...] = rng.standard_normal((2, K))
        was = np.array(other)  # (the copy into x's place overwrites part of it)
        got = lane.matmul("w", other, x_offset=0, y_offset=16384)
        np.testing.assert_array_equal(got, c.matmul("w", was))
        np.testing.assert_array_equal(region.ndarray(0, np.float32, (2, K)), was)
        own = region.ndarray(0, np.float32, (2, K))  # the region's x: used in place
        own[...] = x
        np.testing.assert_array_equal(lane.matmul("w", own, y_offset=16384), want)
        # the same bytes again, x changed in between (the kept place is not a stale copy)
        x2 = rng.standard_normal((2, K)).astype(np.float32)
        np.testing.assert_array_equal(lane.matmul("w", x2), c.matmul("w", x2))
        assert lane.last is not None and lane.last.batch_rows >= 2


def test_lane_refusals(worker: Any, rng: np.random.Generator) -> None:
    w, admin, _ = worker
    user = w.client(token="u-secret")
    x = rng.standard_normal((1, K)).astype(np.float32)
    with admin.register_shm("mine", 1 << 14) as region:
        # another identity's region, an unknown one
        code, msg = code_of(lambda: user.open_lane(region))
        assert code == C.PERMISSION_DENIED and "another caller" in msg
        ghost = dataclasses.make_dataclass("Ghost", ["name"])("ghost")
        assert code_of(lambda: admin.open_lane(ghost))[0] == C.NOT_FOUND  # type: ignore[arg-type]
        # a ticket works once
        path, ticket = admin._run(core.open_lane_call("mine"), 10)
        Lane(region, path, ticket).close()
        code, msg = code_of(lambda: Lane(region, path, ticket))
        assert code == C.PERMISSION_DENIED and "refused the lane" in msg
        code, _ = code_of(lambda: Lane(region, path, b"\0" * 32))
        assert code == C.PERMISSION_DENIED
        # a malformed record (a name longer than allowed) closes that lane only
        lane = admin.open_lane(region)
        lane.sock.sendall(REQUEST.pack(1, 1, K, 0, 4096, 2, 1, 0, 0, 60000, 0))
        assert lane.sock.recv(1) == b""
        lane.close()
        with admin.open_lane(region) as again:
            assert again.matmul("w", x).shape == (1, ROWS)
            # the region unregistered under the lane: NOT_FOUND on the lane
            admin.unregister_region("mine")
            assert code_of(lambda: again.matmul("w", x))[0] == C.NOT_FOUND
    few = RunningWorker(dataclasses.replace(BASE, max_regions=2))
    try:
        c = few.client()
        with c.register_shm("r", 8192) as r, c.open_lane(r), c.open_lane(r):
            code, msg = code_of(lambda: c.open_lane(r))
            assert code == C.RESOURCE_EXHAUSTED and "--max-regions" in msg
    finally:
        few.stop()
    off = RunningWorker(dataclasses.replace(BASE, allow_shm=False))
    try:
        c = off.client()
        code, msg = code_of(lambda: c.open_lane(region))
        assert code == C.FAILED_PRECONDITION and "--allow-shm" in msg
    finally:
        off.stop()


def test_lane_pipelined_beyond_its_room(rng: np.random.Generator) -> None:
    """150 records sent at once on one lane (more than the 64 a lane may have in the worker):
    reading pauses and resumes, every request is answered once, y is right."""
    from q6serve.service.lane import MAX_PIPELINED
    from tests.dataplane.test_frontends import Running
    from tests.service.svc_util import InstrumentedBackend

    w = Running(dataclasses.replace(BASE, frontends=2), InstrumentedBackend(matmul_delay=0.002))
    try:
        c = w.client()
        blocks = random_q6k(ROWS, K, 5)
        c.upload("w", blocks, ROWS, K)
        x = rng.standard_normal((2, K)).astype(np.float32)
        with c.register_shm("p", 1 << 16) as region, c.open_lane(region) as lane:
            region.ndarray(0, np.float32, x.shape)[...] = x
            count = 150
            assert count > 2 * MAX_PIPELINED
            f32 = core._DTYPE_TO_PB["f32"]
            lane.sock.sendall(b"".join(
                REQUEST.pack(seq, 2, K, 0, 8192, f32, f32, 0, 0, 1, 0) + b"w"
                for seq in range(1, count + 1)))
            seqs = []
            for _ in range(count):
                head = bytearray(REPLY.size)
                lane._read_into(head)
                seq, code, msg_len, cols, *_ = REPLY.unpack(head)
                assert (code, msg_len, cols) == (0, 0, ROWS)
                seqs.append(seq)
            assert sorted(seqs) == list(range(1, count + 1))
            assert_ref(region.ndarray(8192, np.float32, (2, ROWS)), reference(blocks, ROWS, K, x))
            # the lane goes on as usual
            assert_ref(lane.matmul("w", x), reference(blocks, ROWS, K, x))
            lanes = w.worker.plane.lanes
            assert lanes is not None and lanes.pauses >= 1 and lanes.direct >= count
    finally:
        w.stop()


@pytest.mark.parametrize("pipe", ["0", "1", None])
def test_full_batches_read_together_are_pipelined(rng: np.random.Generator,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  pipe: str | None) -> None:
    """Full-batch requests (N = --max-batch-rows: none could join another) read in one trip
    run as one pipeline (``LaneServer._flush``, ``Engine.launch_now``: the next launched
    before the last is answered, at most the device's launch slots in flight): each y right
    and in its place, a refusal among them answered with its status, every region let go.
    The first of its kind (no cost known) is queued as before. Q6SERVE_DP_LANE_PIPE=1: the
    same through the device process's pipeline (answered a loop trip later); unset: the
    pipeline (the default since session 24)."""
    from q6serve.service import batcher
    from tests.dataplane.test_frontends import Running

    if pipe is None:
        monkeypatch.delenv("Q6SERVE_DP_LANE_PIPE", raising=False)
    else:
        monkeypatch.setenv("Q6SERVE_DP_LANE_PIPE", pipe)

    # NumPy's "kernel" is the whole job: not one to defer; every job counts as short (the
    # loaded CI VM), as in test_lane_spin's direct-path test
    monkeypatch.setattr(batcher, "DEFER_KERNEL_S", 1.0)
    n, count = 4, 8
    w = Running(dataclasses.replace(BASE, frontends=2, max_batch_rows=n,
                                    inline_device_us=10_000_000))
    try:
        c = w.client()
        blocks = random_q6k(ROWS, K, 9)
        c.upload("w", blocks, ROWS, K)
        x = rng.standard_normal((count, n, K)).astype(np.float32)
        xb, yb = n * K * 4, n * ROWS * 4
        y0 = count * xb
        with c.register_shm("io", y0 + count * yb) as region, c.open_lane(region) as lane:
            # queued: its cost now known
            assert_ref(lane.matmul("w", x[0]), reference(blocks, ROWS, K, x[0]))
            lanes = w.worker.plane.lanes
            assert lanes is not None
            assert (lanes.pipe == w.worker._pipe) == (pipe != "0")
            piped, out = lanes.piped, w.worker.pipelined[0]
            # NumPy computes at launch, so two in flight are safe: the pipeline then answers
            # the oldest before it launches a third
            w.worker.engine.device.now_slots = 2
            f32 = core._DTYPE_TO_PB["f32"]
            recs = []
            for i in range(count):
                region.ndarray(i * xb, np.float32, (n, K))[...] = x[i]
                recs.append(REQUEST.pack(i + 1, n, K, i * xb, y0 + i * yb, f32, f32, 0, 0, 1, 0)
                            + b"w")
            # K=256 against the weight's 512: refused by the engine's checks in the pipeline
            recs.insert(3, REQUEST.pack(99, n, 256, 0, y0, f32, f32, 0, 0, 1, 0) + b"w")
            lane.sock.sendall(b"".join(recs))
            got = {}
            for _ in range(count + 1):
                head = bytearray(REPLY.size)
                lane._read_into(head)
                seq, code, msg_len, *_ = REPLY.unpack(head)
                got[seq] = (code, lane._read(msg_len).decode())
            code, msg = got.pop(99)
            assert code == C.INVALID_ARGUMENT.value[0] and "K=256" in msg, msg
            assert sorted(got) == list(range(1, count + 1))
            for i in range(count):
                assert got[i + 1] == (0, "")
                assert_ref(region.ndarray(y0 + i * yb, np.float32, (n, ROWS)),
                           reference(blocks, ROWS, K, x[i]))
            assert lanes.piped - piped == count
            assert w.worker.pipelined[0] - out == (count if pipe != "0" else 0)
            assert not w.worker._out
            assert w.call(_held(w)) == [0]  # every answered call let its region go
    finally:
        w.stop()


def test_lane_through_frontends_and_drain(rng: np.random.Generator, ring: bool) -> None:
    from tests.dataplane.test_frontends import Running

    w = Running(dataclasses.replace(BASE, frontends=2))
    try:
        c = w.client()
        blocks = random_q6k(ROWS, K, 4)
        c.upload("w", blocks, ROWS, K)
        x = rng.standard_normal((4, K)).astype(np.float32)
        region = c.register_shm("io", 1 << 16)
        lane = c.open_lane(region)
        assert lane.ring == ring
        np.testing.assert_array_equal(lane.matmul("w", x), c.matmul("w", x))
        # a system region's lane calls run as the front ends' "rm" calls do: no task each
        assert w.worker.plane.lanes is not None and w.worker.plane.lanes.direct >= 1
        assert code_of(lambda: lane.matmul("nope", x))[0] == C.NOT_FOUND
        np.testing.assert_array_equal(lane.matmul("w", x), c.matmul("w", x))
        assert w.call(_held(w)) == [0]  # every answered call let its region go
        w.stop()
        # drained: the lane is closed and its socket gone
        assert code_of(lambda: lane.matmul("w", x))[0] == C.UNAVAILABLE
        assert not os.path.exists(lane.path)
        lane.close()
        region.on_close = None  # the worker is gone: nothing to unregister
        region.close()
    finally:
        w.stop()


def test_lane_requests_in_the_device_stats(rng: np.random.Generator, tmp_path: Any,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Q6SERVE_DP_STATS of a --frontends worker counts its lanes' requests as calls
    (``lane_requests``) and times their stages (a record handled, a trip's pipeline, a
    reply), from the first lane's opening on: bench/device_stats_table.py's per-call figures
    of a lane load (bundle A's lane row read 16 "calls" a second without them)."""
    from tests.dataplane.test_frontends import Running

    monkeypatch.setenv("Q6SERVE_DP_STATS", str(tmp_path / "dpstats.jsonl"))
    w = Running(dataclasses.replace(BASE, frontends=2))
    try:
        c = w.client()
        blocks = random_q6k(ROWS, K, 4)
        c.upload("w", blocks, ROWS, K)
        x = rng.standard_normal((4, K)).astype(np.float32)
        stats = w.worker.stats
        assert stats is not None

        async def snapshot() -> dict[str, Any]:
            return stats.snapshot()

        assert w.call(snapshot())["lane_requests"] == 0  # (no lane yet)
        with c.register_shm("io", 1 << 16) as region, c.open_lane(region) as lane:
            for _ in range(3):
                np.testing.assert_array_equal(lane.matmul("w", x), c.matmul("w", x))
            got = w.call(snapshot())
        assert got["lane_requests"] == 3, got
        assert got["st_lane_request_n"] == 3 and got["st_lane_request_s"] > 0, got
    finally:
        w.stop()


async def _held(w: Any) -> list[int]:
    return [r.users for r in w.worker.regions._regions.values()]


def test_device_launch_now_keeps_its_launches_within_the_slots() -> None:
    """``Device.launch_now`` (the lane's pipeline): at most ``now_slots`` launches in flight,
    none beside a job on the device thread or an inline job's pending outcome counted against
    it; a launch that raises gives its place back; idle waiters hear of the last finish."""
    import threading

    from q6serve.kernels.api import Launched
    from q6serve.service.device_thread import Device

    def launch(v: str) -> Launched:
        if v == "bad":
            raise ValueError(v)
        return Launched(lambda: v)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        dev = Device("t", inline_s=1.0, launch_slots=2)
        try:
            assert dev.may_launch_now()
            first = dev.launch_now(launch, "a")
            assert not dev.idle and dev.may_launch_now()
            second = dev.launch_now(launch, "b")
            assert not dev.may_launch_now()  # both slots taken
            assert first() == "a" and dev.may_launch_now()
            with pytest.raises(ValueError):
                dev.launch_now(launch, "bad")
            woken: list[bool] = []
            dev.notify_when_idle(lambda: woken.append(True))
            assert second() == "b" and dev.idle and woken == [True]
            # the backend's launch_now slots beyond its batcher pipelines' (CUDA: 3 and 2)
            deep = Device("t", inline_s=1.0, launch_slots=2, now_slots=3)
            try:
                assert deep.launch_slots == 2 and deep.now_slots == 3
                finishes = [deep.launch_now(launch, v) for v in "xyz"]
                assert not deep.may_launch_now()  # all three taken
                assert [f() for f in finishes] == ["x", "y", "z"] and deep.may_launch_now()
            finally:
                deep.close()
            # a job on the device thread: nothing launched beside it until it is over
            go = threading.Event()
            fut = dev.submit(go.wait, 10)
            assert not dev.may_launch_now()
            go.set()
            await fut
            assert dev.may_launch_now()
            # an inline job that is over, its outcome handed on in the next trip: no bar
            told = loop.create_future()
            dev.call(loop, lambda: "c", (), told, expect_s=0.0)
            assert not dev.idle and dev.may_launch_now()
            assert await told == "c" and dev.idle
        finally:
            dev.close()

    asyncio.run(run())


class _CpuRegionCall:
    """The CUDA backend's ``RegionCall`` on the NumPy backend: the call repeated with x read
    from and y written into the region places it was made for; live while no page-locked
    range was unpinned since."""

    def __init__(self, backend: _PlanBackend, w: Any, x: np.ndarray, y: np.ndarray,
                 kw: dict[str, Any]) -> None:
        self.backend, self.w, self.x, self.y, self.kw = backend, w, x, y, kw
        self.epoch = backend.hostio.epoch

    def live(self) -> bool:
        return self.backend.hostio.epoch == self.epoch

    def launch(self) -> Any:
        from q6serve.kernels.api import Launched

        self.backend.region_launches += 1
        r = self.backend.inner.matmul(self.w, self.x, **self.kw)
        self.y[...] = r.y
        return Launched.ready(dataclasses.replace(r, y=self.y))


class _PlanBackend:
    """The NumPy backend with the CUDA backend's contract for page-locked memory and plans:
    a routed y written into its region, and for a route that asks for it (``Route.want``) a
    region call left in ``Route.call``."""

    def __init__(self) -> None:
        from q6serve.kernels.backends import make_backend
        from q6serve.kernels.hostio import HostIO

        self.inner = make_backend()
        self.name = self.inner.name
        self.hostio = HostIO()
        self.region_launches = 0
        self.wanted = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def matmul(self, w: Any, x: np.ndarray, **kw: Any) -> Any:
        r = self.inner.matmul(w, x, **kw)
        route = self.hostio.take(x, w.rows, kw.get("out_dtype"))
        if route is None:
            return r
        route.y[...] = r.y
        if route.want:
            self.wanted += 1
            route.call = _CpuRegionCall(self, w, x, route.y, kw)
        return dataclasses.replace(r, y=route.y)

    def launch(self, w: Any, x: np.ndarray, **kw: Any) -> Any:
        from q6serve.kernels.api import Launched

        return Launched.ready(self.matmul(w, x, **kw))


@pytest.mark.parametrize("pipe", ["0", "1"])
def test_full_batches_repeated_take_their_region_plan(rng: np.random.Generator,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     pipe: str) -> None:
    """A full batch repeated at the same region places (weight, shapes, dtypes, precision)
    runs by its region's plan once the backend left a region call for it (``Route.want``,
    ``Route.call``): launched through ``Engine.launch_now`` with that call (no route, no
    region views), x read anew each time and y right in place; a flag flip or an unpin makes
    the plan stale (that call runs as any other, a new plan follows); another place, no
    plan; a lone smaller request by its plan on the direct path; unregistering the region
    drops its plans."""
    from q6serve.service import batcher
    from tests.dataplane.test_frontends import Running

    monkeypatch.setattr(batcher, "DEFER_KERNEL_S", 1.0)  # (as the pipeline test above)
    monkeypatch.setenv("Q6SERVE_DP_LANE_PIPE", pipe)  # (the device process's pipeline)
    n = 4
    backend = _PlanBackend()
    w = Running(dataclasses.replace(BASE, frontends=2, max_batch_rows=n,
                                    inline_device_us=10_000_000), backend)
    try:
        c = w.client()
        blocks = random_q6k(ROWS, K, 11)
        c.upload("w", blocks, ROWS, K)
        xb = n * K * 4
        with c.register_shm("io", 4 * xb + 4 * n * ROWS * 4) as region, \
                c.open_lane(region) as lane:
            lanes = w.worker.plane.lanes

            def call(x: np.ndarray, x_off: int = 0) -> np.ndarray:
                region.ndarray(x_off, np.float32, (n, K))[...] = x
                return lane.matmul("w", x_offset=x_off, y_offset=4 * xb, shape=(n, K),
                                   dtype=np.float32)

            planned = []
            for _ in range(5):
                x = rng.standard_normal((n, K)).astype(np.float32)
                assert_ref(call(x), reference(blocks, ROWS, K, x))
                planned.append(lanes.planned)
            # the 1st (queued: no cost known) leaves the plan, the rest run by it
            assert planned == [0, 1, 2, 3, 4] and backend.wanted == 1
            assert backend.region_launches == 4

            def flip() -> None:
                w.worker.engine.set_flags({"Q6SERVE_DYNAMIC_BATCHING": False})

            w.loop.call_soon_threadsafe(flip)
            for expect in (4, 5, 6):  # stale: as any other (leaving a new plan), then by it
                x = rng.standard_normal((n, K)).astype(np.float32)
                assert_ref(call(x), reference(blocks, ROWS, K, x))
                assert lanes.planned == expect
            assert backend.wanted == 2
            c.register_shm("other", 4096).close()  # an unpin: every region call stale
            for expect in (6, 7):
                x = rng.standard_normal((n, K)).astype(np.float32)
                assert_ref(call(x), reference(blocks, ROWS, K, x))
                assert lanes.planned == expect
            assert backend.wanted == 3
            x = rng.standard_normal((n, K)).astype(np.float32)  # another place: no plan yet
            assert_ref(call(x, xb), reference(blocks, ROWS, K, x))
            assert lanes.planned == 7 and backend.wanted == 4
            assert backend.region_launches == 7
            # a lone request below a full batch: on the direct path (Engine.run_now) by its
            # plan once one is made (the first is queued: no cost known yet)
            for _ in range(4):
                x = rng.standard_normal((1, K)).astype(np.float32)
                region.ndarray(2 * xb, np.float32, (1, K))[...] = x
                y = lane.matmul("w", x_offset=2 * xb, y_offset=4 * xb, shape=(1, K),
                                dtype=np.float32)
                assert_ref(y, reference(blocks, ROWS, K, x))
            assert lanes.planned >= 8 and backend.region_launches == lanes.planned
            held = w.worker.regions._regions["io"]
            assert len(held.plans) == 3
            assert w.call(_held(w)) == [0]
        assert held.plans == {} and backend.hostio.routes == 0
    finally:
        w.stop()
