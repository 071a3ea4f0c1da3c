"""Faults: unload racing in-flight matmuls, callers cancelling mid-batch, deadlines expiring
in the queue, an allocation failure in the middle of a load, a device error.

Faults come from a wrapping backend (tests/reliability/faulty.py) handed to the worker, so the
service code under test runs unmodified.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from q6serve.client.client import Q6ServeError, matmul_request
from q6serve.kernels.errors import DeviceError, NotFound, ResourceExhausted
from q6serve.service.batcher import DeadlineExceeded
from q6serve.service.config import Budget, WorkerConfig
from q6serve.service.engine_types import MatmulCall, UploadSpec
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc
from tests.reliability.faulty import FaultyBackend
from tests.reliability.gguf_corpus import File, Tensor
from tests.reliability.harness import RunningWorker, health, random_q6k, reference, vram_figures
from tests.service.svc_util import assert_close, verified_callers

K = 256
RACE_ITERATIONS = 1000
C = grpc.StatusCode


def config(model_dir: Path | None = None, **kw: Any) -> WorkerConfig:
    return WorkerConfig(host="127.0.0.1", port=0, model_dir=model_dir,
                        vram_budget=Budget(nbytes=64 << 20), grace_period_s=2.0, **kw)


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., RunningWorker]]:
    started: list[RunningWorker] = []

    def go(backend: Any = None, **kw: Any) -> RunningWorker:
        w = RunningWorker(config(tmp_path, **kw), backend)
        started.append(w)
        return w

    yield go
    for w in started:
        w.stop()


def pool_used(w: RunningWorker) -> int:
    return int(w.engine.backend.memory().pool_used)


# -- unload racing in-flight matmuls --------------------------------------------------------------
def test_unload_races_in_flight_matmuls_1000_iterations(start: Callable[..., RunningWorker],
                                                        ) -> None:
    """On the worker's own loop: upload, launch matmuls, unload at a random point while they
    run, launch more after. Every matmul is either exact or NOT_FOUND; memory returns."""
    w = start()
    rows = 16
    blocks = random_q6k(rows, K, 11)
    raw = blocks.tobytes()
    spec = UploadSpec("race", rows, K, "q6_k", len(raw), hashlib.sha256(raw).hexdigest())
    rng = np.random.default_rng(12)
    xs = [rng.standard_normal((n, K)).astype(np.float32) for n in (1, 2, 3, 5)]
    wants = [reference(blocks, rows, K, x) for x in xs]
    c = w.client()
    base, base_pool = vram_figures(c), pool_used(w)

    async def chunks() -> AsyncIterator[bytes]:
        yield raw

    async def race() -> tuple[Counter[str], int]:
        eng = w.engine
        seen: Counter[str] = Counter()
        busy_unloads = 0
        for i in range(RACE_ITERATIONS):
            await eng.upload(spec, chunks())
            first = [asyncio.ensure_future(eng.matmul(MatmulCall("race", x))) for x in xs]
            for _ in range(i % 4):
                await asyncio.sleep(0)
            unload = asyncio.ensure_future(eng.unload("race"))
            await asyncio.sleep(0)
            late = [asyncio.ensure_future(eng.matmul(MatmulCall("race", x))) for x in xs[:2]]
            outs = await asyncio.gather(*first, *late, return_exceptions=True)
            view = await unload
            busy_unloads += view.in_flight > 0
            for out, want in zip(outs, wants + wants[:2], strict=True):
                if isinstance(out, NotFound):
                    seen["not_found"] += 1
                elif isinstance(out, BaseException):
                    raise out
                else:
                    assert_close(out.y, want, 1e-5)  # (of the scale: rows batch differently)
                    seen["ok"] += 1
        return seen, busy_unloads

    t0 = time.perf_counter()
    seen, busy = w.call(race(), timeout=240)
    elapsed = time.perf_counter() - t0
    print(f"unload race: {RACE_ITERATIONS} iterations in {elapsed:.1f} s, {dict(seen)}, "
          f"{busy} unloads with requests in flight")
    assert seen["ok"] >= RACE_ITERATIONS * 4  # every request issued before the unload ran
    assert seen["not_found"] > 0  # late requests lost the race, cleanly
    assert busy > RACE_ITERATIONS // 2  # the unloads really overlapped in-flight work
    assert c.list() == []
    assert vram_figures(c) == base and pool_used(w) == base_pool
    assert health(w.target) == "SERVING"


def test_unload_races_grpc_callers(start: Callable[..., RunningWorker]) -> None:
    """The same race end to end: 8 gRPC callers against 200 unload/upload cycles."""
    w = start()
    rows = 32
    blocks = random_q6k(rows, K, 13)
    c = w.client()
    c.upload("w", blocks, rows, K)
    base_pool = pool_used(w)
    callers = verified_callers(w.target, blocks, rows, K, {C.NOT_FOUND}, threads=8, max_n=4,
                               client_kw={"timeout": 30})
    try:
        for _ in range(200):
            c.unload("w")
            c.upload("w", blocks, rows, K)
    finally:
        callers.join()
    assert not callers.errors, callers.errors[:3]
    assert sum(callers.ok) > 100
    assert pool_used(w) == base_pool
    c.unload("w")
    assert vram_figures(c)["weights"] == 0 and pool_used(w) == 0


# -- cancellation and deadlines ------------------------------------------------------------------
def _stub(w: RunningWorker) -> tuple[grpc.Channel, Any]:
    ch = grpc.insecure_channel(w.target)
    return ch, pb_grpc.Q6ServeStub(ch)


def _wait(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.002)


def test_clients_cancelling_mid_batch(start: Callable[..., RunningWorker]) -> None:
    """Callers cancel while waiting (dropped before launch) and while their batch runs (the
    batch finishes; the others in it get their own correct rows)."""
    backend = FaultyBackend(matmul_delay_s=0.5)
    # A long batching delay: while the blocker runs, the 8 followers wait for the device to go
    # idle and then launch together, however slowly this (shared) machine submits them.
    w = start(backend, max_batch_delay_us=2_000_000)
    rows = 8
    blocks = random_q6k(rows, K, 21)
    c = w.client()
    c.upload("w", blocks, rows, K)
    base = vram_figures(c)
    rng = np.random.default_rng(22)
    xs = [rng.standard_normal((2, K)).astype(np.float32) for _ in range(9)]
    ch, stub = _stub(w)
    with ch:
        blocker = stub.Matmul.future(matmul_request("w", xs[0]), timeout=30)
        _wait(lambda: len(backend.launches) == 1)  # the blocker runs: the rest will queue
        futs = [stub.Matmul.future(matmul_request("w", x), timeout=30) for x in xs[1:]]
        # all 8 wait (queued, or staged behind the running blocker)
        _wait(lambda: w.run(lambda: w.engine.registry.get("w").batcher.in_flight) == 9)
        for f in futs[:3]:  # cancelled while waiting
            f.cancel()
        _wait(lambda: len(backend.launches) == 2)  # the second batch is running now
        for f in futs[3:5]:  # cancelled mid-batch
            f.cancel()
        blocker.result()
        for f, x in zip(futs[5:], xs[6:], strict=True):
            y = np.frombuffer(f.result().y.data, np.float32).reshape(2, rows)
            assert_close(y, reference(blocks, rows, K, x), 1e-5)
        for f in futs[:5]:
            assert f.cancelled()
    # The requests cancelled while waiting never ran: 2 launches, 2 + 5 * 2 rows.
    assert backend.launches == [2, 10], backend.launches
    _wait(lambda: w.run(lambda: w.engine.registry.get("w").batcher.in_flight) == 0)
    assert vram_figures(c) == base and health(w.target) == "SERVING"
    assert_close(c.matmul("w", xs[1]), reference(blocks, rows, K, xs[1]), 1e-5)


def test_deadlines_expire_in_the_queue(start: Callable[..., RunningWorker]) -> None:
    backend = FaultyBackend(matmul_delay_s=0.4)
    w = start(backend)
    rows = 8
    blocks = random_q6k(rows, K, 31)
    c = w.client()
    c.upload("w", blocks, rows, K)
    base = vram_figures(c)
    x = np.ones((1, K), np.float32)
    ch, stub = _stub(w)
    with ch:
        blocker = stub.Matmul.future(matmul_request("w", x), timeout=30)
        _wait(lambda: len(backend.launches) == 1)
        late = [stub.Matmul.future(matmul_request("w", x), timeout=0.1) for _ in range(6)]
        for f in late:
            with pytest.raises(grpc.RpcError) as info:
                f.result()
            assert info.value.code() == C.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
        blocker.result()
    # In-process, behind another running launch, the engine's message names the deadline.
    async def behind_a_blocker() -> None:
        running = asyncio.ensure_future(w.engine.matmul(MatmulCall("w", x)))
        while len(backend.launches) < 2:
            await asyncio.sleep(0.005)
        try:
            await w.engine.matmul(MatmulCall("w", x, timeout=0.05))
        finally:
            await running

    with pytest.raises(DeadlineExceeded, match=r"deadline of 0\.050000 s passed before weight "
                                               r"'w' answered"):
        w.call(behind_a_blocker())
    _wait(lambda: w.run(lambda: w.engine.registry.get("w").batcher.in_flight) == 0)
    # Only the two blockers ran: the 7 expired requests were dropped, never computed.
    assert backend.launches == [1, 1] and backend.rows_computed == 2
    backend.matmul_delay_s = 0.0
    assert_close(c.matmul("w", x), reference(blocks, rows, K, x), 1e-5)
    assert vram_figures(c) == base and health(w.target) == "SERVING"


# -- allocation failure in the middle of a load --------------------------------------------------
FAILURES: dict[str, tuple[Callable[[], Exception], grpc.StatusCode, str]] = {
    "oom": (lambda: ResourceExhausted("injected: device allocation of 2048 bytes failed"),
            C.RESOURCE_EXHAUSTED, r"injected: device allocation of 2048 bytes failed"),
    "device": (lambda: DeviceError("injected: cudaMalloc failed"), C.INTERNAL,
               r"injected: cudaMalloc failed"),
    "host-memory": (lambda: MemoryError(), C.INTERNAL, r"internal error \(logged"),
}


@pytest.mark.parametrize("kind", list(FAILURES))
def test_allocation_failure_mid_load_rolls_back(kind: str, start: Callable[..., RunningWorker],
                                                tmp_path: Path) -> None:
    make, code, match = FAILURES[kind]
    rows = 16
    parts = {n: random_q6k(rows, K, s) for n, s in (("a", 1), ("b", 2), ("c", 3))}
    (tmp_path / "m.gguf").write_bytes(File([Tensor(n, [K, rows], data=b.tobytes())
                                            for n, b in parts.items()]).build())
    backend = FaultyBackend()
    # 4-row chunks: tensor b (the 2nd load) fails after 2 of its 4 chunks went to the device.
    w = start(backend, load_chunk_bytes=4 * 210)
    c = w.client()
    c.upload("keep", random_q6k(4, K, 9), 4, K)  # a resident weight that must survive
    backend.fail_load = {backend.loads + 2: (2, make)}
    base, base_pool = vram_figures(c), pool_used(w)
    with pytest.raises(Q6ServeError) as info:
        c.load("m.gguf")
    assert info.value.code == code
    assert re.search(match, info.value.message), info.value.message
    assert [x.name for x in c.list()] == ["keep"]  # a loaded and rolled back, c never started
    assert vram_figures(c) == base and pool_used(w) == base_pool
    assert health(w.target) == "SERVING"
    loaded = {x.name for x in c.load("m.gguf")}  # the same load now succeeds
    assert loaded == {"a", "b", "c"}
    x = np.ones((1, K), np.float32)
    assert_close(c.matmul("b", x), reference(parts["b"], rows, K, x), 1e-5)


def test_allocation_failure_mid_upload_rolls_back(start: Callable[..., RunningWorker]) -> None:
    backend = FaultyBackend()
    w = start(backend, load_chunk_bytes=2 * 210)
    c = w.client()
    base, base_pool = vram_figures(c), pool_used(w)
    backend.fail_load = {1: (3, lambda: ResourceExhausted("injected: out of device memory"))}
    with pytest.raises(Q6ServeError) as info:
        c.upload("u", random_q6k(16, K, 5), 16, K)
    assert info.value.code == C.RESOURCE_EXHAUSTED and "injected" in info.value.message
    assert c.list() == [] and vram_figures(c) == base and pool_used(w) == base_pool
    c.upload("u", random_q6k(16, K, 5), 16, K)
    assert [x.name for x in c.list()] == ["u"]


# -- a device error marks the worker NOT_SERVING ------------------------------------------------
def test_device_error_marks_health_not_serving(start: Callable[..., RunningWorker]) -> None:
    backend = FaultyBackend()
    w = start(backend)
    c = w.client()
    c.upload("w", random_q6k(8, K, 41), 8, K)
    x = np.ones((1, K), np.float32)
    c.matmul("w", x)
    assert health(w.target) == "SERVING"
    backend.fail_matmul = lambda: DeviceError("injected: an illegal memory access was "
                                              "encountered")
    with pytest.raises(Q6ServeError) as info:
        c.matmul("w", x)
    assert info.value.code == C.INTERNAL and "illegal memory access" in info.value.message
    assert health(w.target) == "NOT_SERVING"
    assert health(w.target, "q6serve.v1.Q6Serve") == "NOT_SERVING"
    assert c.status().serving is False
    with pytest.raises(Q6ServeError) as info:  # no more work on a failed device
        c.matmul("w", x)
    assert info.value.code == C.UNAVAILABLE and "device failed" in info.value.message
    # Read-only RPCs still answer, so an operator can see what happened.
    assert [x.name for x in c.list()] == ["w"]
