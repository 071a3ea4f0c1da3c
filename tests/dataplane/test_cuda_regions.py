"""CUDA IPC regions (issue 15, item 1) in CI, without a GPU: the NumPy backend refuses them
clearly (one process and --frontends), and the whole message path -- client helper, proto,
wire, servicer, region table (limits, ownership, bounds), the routing of a request with a
CUDA region to the device-side matmul, y written into the region, unregister and drain
closing the handle -- runs against a stand-in that maps "device memory" in host memory.
The real thing (CuPy, cudaIpcOpenMemHandle, the CUDA backend) is test_cuda_ipc_gpu.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from q6serve.client.client import Client, Q6ServeError
from q6serve.service import batcher, cuda_regions
from q6serve.service.config import Budget, WorkerConfig
from q6serve.service.regions import CudaIpcSource, Mapping
from q6serve.v1 import q6serve_pb2 as pb
from tests.dataplane.tol import assert_ref
from tests.service.svc_util import RunningWorker, random_q6k, reference

ROWS, K = 96, 512
C = grpc.StatusCode


def code_of(fn: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(Q6ServeError) as e:
        fn()
    return e.value.code, e.value.message


class Raw:
    """A RegisterRegion request as the client's register_region takes a region."""

    def __init__(self, req: pb.RegisterRegionRequest) -> None:
        self.req, self.name = req, req.name

    def register_request(self) -> pb.RegisterRegionRequest:
        return self.req


def register_raw(c: Client, req: pb.RegisterRegionRequest) -> Any:
    return c.register_region(Raw(req))  # type: ignore[arg-type]


def cuda_request(name: str, handle: bytes = b"h" * 64, device: int = 0, size: int = 4096,
                 offset: int = 0) -> pb.RegisterRegionRequest:
    return pb.RegisterRegionRequest(name=name, cuda=pb.CudaIpcBuffer(
        handle=handle, device=device, byte_size=size, offset=offset))


def test_numpy_backend_refuses_cuda_regions(tmp_path: Any) -> None:
    from tests.dataplane.test_frontends import Running

    base = WorkerConfig(host="127.0.0.1", port=0, vram_budget=Budget(nbytes=64 << 20),
                        grace_period_s=1.0, allow_shm=True, frontend_shm_bytes=4 << 20)
    one = RunningWorker(base)
    many = Running(dataclasses.replace(base, frontends=2))
    try:
        for c in (one.client(), many.client()):
            code, msg = code_of(lambda c=c: register_raw(c, cuda_request("g")))
            assert code == C.INVALID_ARGUMENT and "CUDA IPC regions need the CUDA backend" in \
                msg, msg
            assert c.list_regions() == []
    finally:
        one.stop()
        many.stop()


class HostPlane:
    """Stands in for cuda_regions.CudaSupport: "allocations" are host arrays by handle; the
    "device-side" matmul runs the engine's host path, then writes y into the region view."""

    def __init__(self) -> None:
        self.allocations: dict[bytes, np.ndarray] = {}
        self.open_count = 0
        self.calls = 0
        self.started = 0  # calls through start (no task)
        self.launched = 0  # calls through launch_now (the device process's pipeline)

    def open(self, src: CudaIpcSource) -> Mapping:
        alloc = self.allocations.get(src.handle)
        if alloc is None:
            raise cuda_regions.InvalidArgument("cannot open the CUDA IPC handle")
        if src.offset + src.byte_size > alloc.size:
            raise cuda_regions.InvalidArgument("region does not fit the CUDA allocation")
        self.open_count += 1
        return HostMapping(self, alloc[src.offset : src.offset + src.byte_size])

    async def matmul(self, engine: Any, call: Any, yd: Any) -> Any:
        self.calls += 1
        reply = await engine.matmul(dataclasses.replace(call, x=np.array(call.x)))
        if yd is None:
            return reply
        yd[...] = reply.y
        return dataclasses.replace(reply, y=None)

    def start(self, engine: Any, call: Any, yd: Any, done: Callable[..., None]) -> None:
        """matmul without a task (the device process's "rm" path): refusals raise here."""
        self.calls += 1
        self.started += 1

        def sink(fut: Any) -> None:
            if fut.cancelled() or fut.exception() is not None:
                done(None, fut.exception() if not fut.cancelled() else RuntimeError("cancel"))
                return
            reply = fut.result()
            if yd is not None:
                yd[...] = reply.y
                reply = dataclasses.replace(reply, y=None)
            done(reply, None)

        engine.start_matmul(dataclasses.replace(call, x=np.array(call.x)), sink)

    def launch_now(self, engine: Any, call: Any, yd: Any) -> Callable[[], Any] | None:
        """start in two halves (the device process's pipeline): launched now where the engine
        may launch it (its direct path's launch of a batch no other joins: the test's worker
        takes batches of the calls' rows; y into the region at the wait), else None."""
        if yd is None:
            return None
        wait = engine.launch_now(dataclasses.replace(call, x=np.array(call.x)))
        if wait is None:
            return None
        self.calls += 1
        self.launched += 1

        def done() -> Any:
            reply = wait()
            yd[...] = reply.y
            return dataclasses.replace(reply, y=None)

        return done


class HostMapping(Mapping):
    def __init__(self, plane: HostPlane, buf: np.ndarray) -> None:
        self.plane, self.buf = plane, buf

    def view(self, offset: int, nbytes: int, dtype: np.dtype, shape: tuple[int, ...],
             writable: bool) -> Any:
        return self.buf[offset : offset + nbytes].view(dtype).reshape(shape)

    def close(self) -> None:
        self.plane.open_count -= 1


class FakeCudaRegion:
    """The client side of HostPlane: what CudaRegion offers the client helpers."""

    def __init__(self, plane: HostPlane, name: str, size: int, offset: int = 0) -> None:
        self.name, self.size, self.offset = name, size, offset
        self.handle = bytes([len(plane.allocations)]) * 64
        self.mem = np.zeros(offset + size, np.uint8)
        plane.allocations[self.handle] = self.mem

    def register_request(self) -> pb.RegisterRegionRequest:
        return cuda_request(self.name, self.handle, 0, self.size, self.offset)

    def ndarray(self, offset: int, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        at = self.offset + offset
        return self.mem[at : at + n].view(dtype).reshape(shape)

    def put(self, offset: int, x: np.ndarray) -> None:
        self.ndarray(offset, x.dtype, x.shape)[...] = x


@pytest.fixture
def plane(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[HostPlane, RunningWorker, Client]]:
    p = HostPlane()
    monkeypatch.setattr(cuda_regions, "support", lambda backend, engine: p)
    w = RunningWorker(WorkerConfig(host="127.0.0.1", port=0, vram_budget=Budget(nbytes=64 << 20),
                                   grace_period_s=1.0, allow_shm=True, max_regions=3,
                                   max_region_bytes=1 << 20))
    c = w.client()
    c.upload("w", random_q6k(ROWS, K, 5), ROWS, K)
    try:
        yield p, w, c
    finally:
        w.stop()


def test_cuda_region_message_path(plane: Any, rng: np.random.Generator) -> None:
    p, w, c = plane
    blocks = random_q6k(ROWS, K, 5)
    x = rng.standard_normal((3, K)).astype(np.float16)
    want = reference(blocks, ROWS, K, x)
    dev = FakeCudaRegion(p, "dev", 65536, offset=256)  # the region starts 256 B into its block
    info = c.register_region(dev)  # type: ignore[arg-type]
    assert (info.name, info.kind, info.offset, info.byte_size) == ("dev", "cuda", 256, 65536)
    out = c.matmul_full("w", x, x_region=(dev, 128), y_region=(dev, 8192))  # type: ignore[arg-type]
    assert_ref(out.y, want)
    # y was written at the region's offset in the allocation (256 + 8192), x read at 256 + 128
    np.testing.assert_array_equal(dev.mem[256 + 8192 :][: out.y.nbytes].view(np.float32),
                                  out.y.reshape(-1))
    assert p.calls == 1
    # x from the CUDA region, y back in the reply's bytes; x inline, y into the CUDA region;
    # x in a system region, y in the CUDA region
    assert_ref(c.matmul("w", x, x_region=(dev, 128)), want)
    assert_ref(c.matmul("w", x, y_region=(dev, 0)), want)
    with c.register_shm("sys", 8192) as sysr:
        assert_ref(c.matmul("w", x, x_region=sysr, y_region=(dev, 0)), want)
        assert_ref(c.matmul("w", x, x_region=(dev, 128), y_region=sysr), want)
    assert p.calls == 5
    # bounds and ownership as for system regions, checked before any device work
    code, msg = code_of(lambda: c.matmul("w", x, y_region=(dev, 65536 - 100)))  # type: ignore[arg-type]
    assert code == C.INVALID_ARGUMENT and "overruns region 'dev'" in msg, msg
    assert p.calls == 5
    # registering: handle not openable, range past the allocation, short handle, limits
    assert code_of(lambda: register_raw(c, cuda_request("x", b"z" * 64)))[0] == \
        C.INVALID_ARGUMENT
    assert code_of(lambda: register_raw(c, cuda_request(
        "x", dev.handle, size=65536, offset=512)))[0] == C.INVALID_ARGUMENT
    assert code_of(lambda: register_raw(c, cuda_request("x", b"h" * 10)))[0] == \
        C.INVALID_ARGUMENT
    big = FakeCudaRegion(p, "big", 1 << 20)
    code, msg = code_of(lambda: c.register_region(big))  # type: ignore[arg-type]
    assert code == C.RESOURCE_EXHAUSTED and "--max-region-bytes" in msg
    assert w.run(lambda: w.worker.regions.mapped_bytes) == 65536
    # unregister closes the handle; drain closes the rest
    c.unregister_region("dev")
    assert p.open_count == 0 and c.list_regions() == []
    assert w.run(lambda: w.worker.regions.mapped_bytes) == 0
    c.register_region(FakeCudaRegion(p, "left", 4096))  # type: ignore[arg-type]
    assert p.open_count == 1
    w.stop()
    assert p.open_count == 0


def test_cuda_regions_through_frontends(monkeypatch: pytest.MonkeyPatch,
                                        rng: np.random.Generator) -> None:
    """With --frontends, a request naming CUDA regions for x and y reaches the device-side
    matmul through the device process's "rm" message (FrontendsWorker._cuda_region_matmul:
    CudaSupport.start, no task; once a like job was measured, CudaSupport.launch_now at the
    trip's end, waited for a trip later); mixed with a system region either way; a bad y
    offset or weight is refused before any device work; nothing stays held."""
    from tests.dataplane.test_frontends import Running

    p = HostPlane()
    monkeypatch.setattr(cuda_regions, "support", lambda backend, engine: p)
    # (NumPy's "kernel" may take longer than a batch defers or inlines: no launch here then,
    # as with a long CUDA kernel; the pipeline's launches below need a short one)
    monkeypatch.setattr(batcher, "DEFER_KERNEL_S", 1e9)
    w = Running(WorkerConfig(host="127.0.0.1", port=0, vram_budget=Budget(nbytes=64 << 20),
                             grace_period_s=1.0, allow_shm=True, frontends=2,
                             frontend_shm_bytes=4 << 20, max_batch_rows=3,
                             inline_device_us=10**6))
    try:
        c = w.client()
        blocks = random_q6k(ROWS, K, 5)
        c.upload("w", blocks, ROWS, K)
        x = rng.standard_normal((3, K)).astype(np.float16)
        want = reference(blocks, ROWS, K, x)
        dev = FakeCudaRegion(p, "dev", 65536, offset=256)
        c.register_region(dev)  # type: ignore[arg-type]
        out = c.matmul_full("w", x, x_region=(dev, 128), y_region=(dev, 8192))  # type: ignore[arg-type]
        assert_ref(out.y, want)
        with c.register_shm("sys", 16384) as sysr:
            assert_ref(c.matmul("w", x, x_region=(dev, 128), y_region=sysr), want)
            sysr.put(8192, x)
            c.matmul("w", sysr.ndarray(8192, np.float16, x.shape), x_region=(sysr, 8192),
                     y_region=(dev, 16384))
            assert_ref(dev.ndarray(16384, np.float32, want.shape), want)
            assert code_of(lambda: c.matmul("nope", x, x_region=(dev, 128),  # type: ignore[arg-type]
                                            y_region=sysr))[0] == C.NOT_FOUND
        assert p.calls == p.started + p.launched == 3
        code, msg = code_of(lambda: c.matmul("w", x, x_region=(dev, 128),  # type: ignore[arg-type]
                                             y_region=(dev, 65536 - 100)))
        assert code == C.INVALID_ARGUMENT and "overruns region 'dev'" in msg, msg
        assert p.calls == 3
        assert c.list_regions()[0].in_use == 0 and w.worker._pending == 0
        # once a like job was measured: launched at the trip's end (CudaSupport.launch_now),
        # y in the region by the answer
        for i in range(4):
            xi = x * (i + 2)
            out = c.matmul_full("w", xi, x_region=(dev, 128), y_region=(dev, 8192))  # type: ignore[arg-type]
            assert_ref(out.y, reference(blocks, ROWS, K, xi))
        assert p.launched >= 3 and p.calls == 7 and w.worker.pipelined[0] == p.launched
        assert c.list_regions()[0].in_use == 0 and w.worker._pending == 0
        c.unregister_region("dev")
        assert p.open_count == 0
    finally:
        w.stop()


def test_matmul_awaits_the_outcome_that_start_reports() -> None:
    """CudaSupport.matmul is start + a future: the reply start's job reports is returned, its
    error raised, and an outcome after the waiter went is dropped (no CUDA needed: start is
    replaced by one that reports from a later loop trip)."""
    import asyncio

    class Started(cuda_regions.CudaSupport):
        def __init__(self, outcome: tuple[Any, BaseException | None]) -> None:
            self.outcome = outcome

        def start(self, engine: Any, call: Any, yd: Any, done: Any) -> None:
            asyncio.get_running_loop().call_soon(done, *self.outcome)

    async def main() -> None:
        assert await Started(("reply", None)).matmul(None, None, None) == "reply"
        with pytest.raises(ValueError, match="bad"):
            await Started((None, ValueError("bad"))).matmul(None, None, None)
        waiter = asyncio.ensure_future(Started(("late", None)).matmul(None, None, None))
        await asyncio.sleep(0)
        waiter.cancel()  # the outcome arrives after: settled into a done future, ignored
        await asyncio.sleep(0.01)
        assert waiter.cancelled()

    asyncio.run(main())


def test_lane_on_a_cuda_region(plane: Any, rng: np.random.Generator) -> None:
    """A lane over a CUDA IPC region: each request through CudaPlane.start (LaneServer._cuda:
    no task per request), y written into the region, equal to the RPC path; a refusal is
    answered on the lane before any device work and the lane goes on; nothing stays held."""
    from q6serve.service.lane import LaneServer

    p, w, c = plane
    x = rng.standard_normal((3, K)).astype(np.float16)
    want = c.matmul("w", x)
    dev = FakeCudaRegion(p, "dev", 65536, offset=256)
    c.register_region(dev)  # type: ignore[arg-type]
    with c.open_lane(dev) as lane:  # type: ignore[arg-type]
        for y_off in (8192, 16384, 8192):
            y = lane.matmul("w", x, x_offset=128, y_offset=y_off)
            np.testing.assert_array_equal(y, want)
            np.testing.assert_array_equal(dev.mem[256 + y_off :][: want.nbytes]
                                          .view(np.float32).reshape(want.shape), want)
        assert lane.last is not None and lane.last.batch_rows >= 3
        code, msg = code_of(lambda: lane.matmul("w", x, y_offset=65536 - 100))
        assert code == C.INVALID_ARGUMENT and "overruns region 'dev'" in msg, msg
        assert code_of(lambda: lane.matmul("nope", x))[0] == C.NOT_FOUND
        assert p.started == 3  # the refusals reached no device work
        np.testing.assert_array_equal(lane.matmul("w", x, x_offset=4096), want)
        lanes = [f.__self__ for f in w.worker.regions.on_close
                 if isinstance(getattr(f, "__self__", None), LaneServer)]
        # every request through start (the task path would take HostPlane.matmul)
        assert lanes[0].cuda == p.started == p.calls == 4
    assert c.list_regions()[0].in_use == 0
    c.unregister_region("dev")
    assert p.open_count == 0
