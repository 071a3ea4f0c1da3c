"""Full system-region calls through a ``--frontends`` worker's device process pipeline (issue 15,
T3 over system regions): a call of N >= --max-batch-rows rows with x and y in one shared-memory
region joins no batch, so the device process launches it at its loop trip's end through
``Engine.launch_now`` (the fast lane's route for full batches) behind the launches out, waited for
a trip later (``FrontendsWorker._sys_call``); the first of a kind, not yet measured, is queued.
Every y equals the reference, refusals are answered with their status, and nothing stays held.
On the NumPy backend (no page-locked regions: y is copied into the region by the answer); the
CUDA backend's region plans are test_pinned_gpu.py's."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest

from q6serve.client.client import Q6ServeError
from q6serve.service import batcher
from q6serve.service.config import Budget, WorkerConfig
from tests.dataplane.tol import assert_ref
from tests.service.svc_util import random_q6k, reference

ROWS, K, N = 96, 512, 3


@pytest.fixture
def running(monkeypatch: pytest.MonkeyPatch) -> Any:
    from tests.dataplane.test_frontends import Running

    # (NumPy's "kernel" may take longer than a batch defers; the launches below need a short one)
    monkeypatch.setattr(batcher, "DEFER_KERNEL_S", 1e9)
    w = Running(WorkerConfig(host="127.0.0.1", port=0, vram_budget=Budget(nbytes=64 << 20),
                             grace_period_s=1.0, allow_shm=True, frontends=2,
                             frontend_shm_bytes=4 << 20, max_batch_rows=N,
                             inline_device_us=10**6))
    try:
        yield w
    finally:
        w.stop()


def _six_region_calls(w: Any, seed: int, rng: np.random.Generator) -> None:
    """Upload a weight "w" and run six full system-region calls on it (x at offset 0, y at
    8192 of one region), each y checked against the reference, in the reply and in the
    region, which is idle (no call in use) when it is unregistered on the way out."""
    c = w.client()
    blocks = random_q6k(ROWS, K, seed)
    c.upload("w", blocks, ROWS, K)
    with c.register_shm("r", 65536) as r:
        for _ in range(6):
            x = rng.standard_normal((N, K)).astype(np.float16)
            r.put(0, x)
            y = c.matmul("w", r.ndarray(0, np.float16, x.shape), x_region=(r, 0),
                         y_region=(r, 8192))
            assert_ref(y, reference(blocks, ROWS, K, x))
            np.testing.assert_allclose(r.ndarray(8192, np.float32, (N, ROWS)), y)
        in_use = c.list_regions()[0].in_use
    assert in_use == 0


def test_full_system_region_calls_are_pipelined(running: Any,
                                                rng: np.random.Generator) -> None:
    w = running
    _six_region_calls(w, 3, rng)
    # the first was queued (no like job measured); the later ones launched at trip ends
    assert w.worker.pipelined[0] >= 4, w.worker.pipelined
    assert w.worker._pending == 0
    # Q6SERVE_DP_STATS' counts of them: each launched or queued, none by a plan (the NumPy
    # backend makes no region calls to plan with)
    counts = (w.worker.sys_launched, w.worker.sys_planned, w.worker.sys_queued)
    assert counts[0] == w.worker.pipelined[0] and counts[0] + counts[2] == 6, counts
    assert counts[1] == 0 and counts[2] >= 1, counts


def test_pipelined_calls_of_several_callers_each_get_their_y(running: Any,
                                                             rng: np.random.Generator) -> None:
    """Callers on both front ends, each with its own region, calls in flight together: each
    y is its own x's."""
    w = running
    blocks = random_q6k(ROWS, K, 4)
    w.client().upload("w", blocks, ROWS, K)
    xs = [rng.standard_normal((N, K)).astype(np.float16) for _ in range(4)]

    def caller(i: int) -> int:
        c = w.client()
        with c.register_shm(f"c{i}", 65536) as r:
            r.put(1024, xs[i])
            want = reference(blocks, ROWS, K, xs[i])
            for _ in range(8):
                y = c.matmul("w", r.ndarray(1024, np.float16, xs[i].shape),
                             x_region=(r, 1024), y_region=(r, 16384))
                assert_ref(y, want)
        return 8

    with ThreadPoolExecutor(4) as pool:
        assert sum(pool.map(caller, range(4))) == 32
    assert w.worker.pipelined[0] >= 16, w.worker.pipelined
    assert w.worker._pending == 0 and not w.worker._out


def test_refused_full_region_calls_hold_nothing(running: Any,
                                                rng: np.random.Generator) -> None:
    """An unknown weight, a K that is not the weight's, a y that overruns the region: each
    answered with its status (the first two by the engine's checks at the launch), the region
    not left held, and the next call still right."""
    w = running
    c = w.client()
    blocks = random_q6k(ROWS, K, 5)
    c.upload("w", blocks, ROWS, K)
    x = rng.standard_normal((N, K)).astype(np.float16)
    with c.register_shm("r", 65536) as r:
        r.put(0, x)
        ok = c.matmul("w", r.ndarray(0, np.float16, x.shape), x_region=(r, 0), y_region=(r, 8192))
        for weight, xv, y_off, code in (
                ("nope", r.ndarray(0, np.float16, x.shape), 8192, grpc.StatusCode.NOT_FOUND),
                ("w", r.ndarray(0, np.float16, (N, K // 2)), 8192,
                 grpc.StatusCode.INVALID_ARGUMENT),
                ("w", r.ndarray(0, np.float16, x.shape), 65536 - 64,
                 grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(Q6ServeError) as e:
                c.matmul(weight, xv, x_region=(r, 0), y_region=(r, y_off))
            assert e.value.code == code, (weight, e.value)
            assert c.list_regions()[0].in_use == 0
        y = c.matmul("w", r.ndarray(0, np.float16, x.shape), x_region=(r, 0), y_region=(r, 8192))
        np.testing.assert_array_equal(y, ok)
    assert w.worker._pending == 0


class _SlowEvents:
    """A stand-in for the CUDA launcher's workspace as the device process's ready polling
    sees it (``FrontendsWorker._ws``): one slot, taken by a launch (``take``, which the CUDA
    launcher calls as it launches: here the engine's ``launch_now``, wrapped by ``watch``)
    and let go by its wait, whose completion event reports "not done" to its first two
    queries after each launch."""

    def __init__(self) -> None:
        self.queries = self.not_done = self.launches = 0
        self._left = 0
        self._taken = False
        self.event = self

    def watch(self, engine: Any) -> None:
        launch_now = engine.launch_now

        def taking(*a: Any) -> Any:
            wait = launch_now(*a)
            if wait is None:
                return None
            assert not self._taken  # (one slot: the device process waits for it first)
            self._taken, self._left = True, 2  # its event "running" for two queries
            self.launches += 1

            def released() -> Any:
                self._taken = False
                return wait()

            return released

        engine.launch_now = taking

    def held(self, slot: int) -> bool:
        assert slot == 0
        return self._taken

    def done_event(self, slot: int) -> Any:
        return self

    @property
    def done(self) -> bool:
        self.queries += 1
        if self._left:
            self._left -= 1
            self.not_done += 1
            return False
        return True


def test_launches_answered_once_their_event_is_done(running: Any,
                                                    rng: np.random.Generator) -> None:
    """Ready polling (Q6SERVE_DP_READY_POLL): a launch whose slot's event is not done yet is
    not waited for at the next trip; a later trip answers it once the event says done.
    Every y right, every call answered, nothing left out."""
    w = running
    ws = _SlowEvents()
    w.worker._ws, w.worker._ws_slots = ws, 1
    ws.watch(w.worker.engine)  # (before any call: nothing runs on the loop yet)
    _six_region_calls(w, 6, rng)
    assert w.worker.pipelined[0] >= 4 and ws.not_done >= 8, (w.worker.pipelined, ws.not_done)
    assert ws.launches == w.worker.pipelined[0]  # each launch's own slot event polled
    assert w.worker._pending == 0 and not w.worker._out
