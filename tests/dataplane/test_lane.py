"""The fast lane (issue 15 item 3) on the NumPy backend: results equal the gRPC path, errors
come back on the lane with their status (and the lane stays usable), bad tickets and
malformed records close the lane without harming the worker, other callers' regions are
refused, lanes work through --frontends (served by the device process) and end at drain."""

from __future__ import annotations

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
from tests.service.svc_util import RunningWorker, random_q6k, reference

ROWS, K = 96, 512
C = grpc.StatusCode
BASE = WorkerConfig(host="127.0.0.1", port=0, vram_budget=Budget(nbytes=64 << 20),
                    grace_period_s=1.0, allow_shm=True, frontend_shm_bytes=4 << 20)


def code_of(fn: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(Q6ServeError) as e:
        fn()
    return e.value.code, e.value.message


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


def test_lane_matmuls_equal_the_rpc_path(worker: Any, rng: np.random.Generator) -> None:
    _w, c, blocks = worker
    with c.register_shm("io", 1 << 16) as region, c.open_lane(region) as lane:
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
            np.testing.assert_allclose(region.ndarray(8192, np.float32, (2, ROWS)),
                                       reference(blocks, ROWS, K, x), rtol=1e-5, atol=1e-4)
            # the lane goes on as usual
            np.testing.assert_allclose(lane.matmul("w", x), reference(blocks, ROWS, K, x),
                                       rtol=1e-5, atol=1e-4)
            lanes = w.worker.plane.lanes
            assert lanes is not None and lanes.pauses >= 1 and lanes.direct >= count
    finally:
        w.stop()


def test_lane_through_frontends_and_drain(rng: np.random.Generator) -> None:
    from tests.dataplane.test_frontends import Running

    w = Running(dataclasses.replace(BASE, frontends=2))
    try:
        c = w.client()
        blocks = random_q6k(ROWS, K, 4)
        c.upload("w", blocks, ROWS, K)
        x = rng.standard_normal((4, K)).astype(np.float32)
        region = c.register_shm("io", 1 << 16)
        lane = c.open_lane(region)
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


async def _held(w: Any) -> list[int]:
    return [r.users for r in w.worker.regions._regions.values()]
