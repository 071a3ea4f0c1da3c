"""Page-locked front-end arenas (issue 15, session 22; ``Q6SERVE_DP_PIN_ARENA``): the device
process pins each front end's arena with the backend when it connects, so an x in its slot is
DMA'd from there and a full call's y is routed into its slot (the front end reads it there: no
copy in the device process); a dead front end's arena is unpinned (after the device's copies)
and its replacement's pinned; drain unpins every arena. CPU: test_pinned_regions' NumPy
backend whose HostIO records the pins and honours the routes as the CUDA backend does."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import grpc
import numpy as np
import pytest

from q6serve.client.client import Q6ServeError
from tests.dataplane.test_frontends import start  # noqa: F401  (fixture)
from tests.dataplane.test_pinned_regions import DmaBackend, Recorder
from tests.dataplane.tol import assert_ref
from tests.service.svc_util import random_q6k, reference

ROWS, K = 96, 512
FULL = 8  # --max-batch-rows of these workers: a call of 8 rows or more is full (alone)


def _run(w: Any, fn: Any) -> Any:
    async def on_loop() -> Any:
        return fn()
    return w.call(on_loop())


def _until(w: Any, fn: Any, want: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while (got := _run(w, fn)) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def test_arenas_pinned_full_calls_y_in_place(start: Any,  # noqa: F811
                                            monkeypatch: pytest.MonkeyPatch,
                                            rng: np.random.Generator) -> None:
    monkeypatch.setenv("Q6SERVE_DP_PIN_ARENA", "1")
    rec = Recorder()
    backend = DmaBackend(rec)
    w = start(backend=backend, max_batch_rows=FULL)
    io = backend.hostio
    assert _run(w, lambda: io.pinned) == 2  # both front ends' arenas, whole
    assert _run(w, lambda: io.pinned_bytes) == 2 * (8 << 20)
    c = w.client()
    blocks = random_q6k(ROWS, K, 11)
    c.upload("w", blocks, ROWS, K)
    for n in (FULL, 16):  # full calls: x read in its slot, y written into it by the backend
        x = rng.standard_normal((n, K)).astype(np.float32)
        assert_ref(c.matmul("w", x), reference(blocks, ROWS, K, x))
    assert backend.direct_x == 2 and backend.direct_y == 2
    x16 = rng.standard_normal((FULL, K)).astype(np.float16)
    got = c.matmul("w", x16, out_dtype="f16")  # f16 y routed too
    assert_ref(got.astype(np.float32), reference(blocks, ROWS, K, x16.astype(np.float32)),
               rtol=2e-3, atol=2e-3)
    assert backend.direct_y == 3
    got = c.matmul("w", rng.standard_normal((FULL, K)).astype(np.float32), out_dtype="bf16")
    assert backend.direct_y == 3  # bf16: no route the backend takes (copied as before)
    assert got.shape == (FULL, ROWS)
    x = rng.standard_normal((2, K)).astype(np.float32)  # small: x read in place, y not routed
    assert_ref(c.matmul("w", x), reference(blocks, ROWS, K, x))
    assert backend.direct_x == 5 and backend.direct_y == 3
    with pytest.raises(Q6ServeError) as e:  # refused (an unknown weight): no route left
        c.matmul("nope", rng.standard_normal((FULL, K)).astype(np.float32))
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert _run(w, lambda: io.routes) == 0  # every route let go, the refused one too
    # a front end killed: its arena unpinned once its calls are done (after a sync), the
    # supervisor's replacement pinned; the worker still serves
    fe = next(iter(w.worker.frontend_pids.values()))
    os.kill(fe, signal.SIGKILL)
    assert _until(w, lambda: rec.log.count(("sync", 0)), 1) == 1
    assert _until(w, lambda: io.pinned, 2) == 2
    assert [k for k, _ in rec.log].count("unregister") == 1
    assert [k for k, _ in rec.log].count("register") == 3
    x = rng.standard_normal((FULL, K)).astype(np.float32)
    assert_ref(w.client().matmul("w", x), reference(blocks, ROWS, K, x))
    w.stop()  # drain: every arena unpinned before the backend goes
    assert io.pinned == 0 and io.routes == 0
    assert [k for k, _ in rec.log].count("unregister") == 3
    assert all(rec.lock_held_at_unregister)


def test_arenas_pinned_by_default_and_not_when_switched_off(
        start: Any, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        rng: np.random.Generator) -> None:
    monkeypatch.delenv("Q6SERVE_DP_PIN_ARENA", raising=False)
    for env, pinned in (("", 2), ("0", 0)):
        monkeypatch.setenv("Q6SERVE_DP_PIN_ARENA", env)
        rec = Recorder()
        backend = DmaBackend(rec)
        w = start(backend=backend, max_batch_rows=FULL)
        c = w.client()
        blocks = random_q6k(ROWS, K, 12)
        c.upload("w", blocks, ROWS, K)
        x = rng.standard_normal((FULL, K)).astype(np.float32)
        assert_ref(c.matmul("w", x), reference(blocks, ROWS, K, x))
        assert _run(w, lambda: backend.hostio.pinned) == pinned  # noqa: B023
        assert backend.direct_y == (1 if pinned else 0)
        w.stop()
        assert backend.hostio.pinned == 0


@pytest.mark.gpu
def test_pinned_arenas_on_a_gpu(monkeypatch: pytest.MonkeyPatch,
                                rng: np.random.Generator) -> None:
    """The CUDA backend (``-m gpu``; skipped without CuPy and a GPU), two front ends whose
    arenas are page-locked: one caller's calls of 64, 8, 3 and 1 rows (each alone: x DMA'd
    from its slot by ``Launcher.launch_host``, a full call's y DMA'd into its slot) bit for bit
    the same as with pageable arenas; then 8 callers at once (merged batches gathered from
    their slots, ``Launcher.launch_pieces``), each y the one-caller y within the rounding of
    a batch of another N (another kernel shape); nothing left routed, drain unpins both."""
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    from q6serve.service.config import Budget, WorkerConfig
    from tests.dataplane.test_cuda_ipc_gpu import _gpus, same
    from tests.dataplane.test_frontends import Running
    from tests.dataplane.test_pinned_gpu import Counted

    if _gpus() == 0:
        pytest.skip("needs CuPy and a CUDA GPU")
    from q6serve.kernels.cuda_backend import CudaBackend

    backend = CudaBackend()
    rows, k = 2048, 3584
    blocks = random_q6k(rows, k, 21)
    xs = [rng.standard_normal((n, k)).astype(np.float16) for n in (64, 8, 3, 1) * 2]
    cfg = WorkerConfig(host="127.0.0.1", port=0, vram_budget=Budget(nbytes=2 << 30),
                       grace_period_s=2.0, frontends=2, frontend_shm_bytes=32 << 20)

    def run(pin: str, many: bool) -> list[list[np.ndarray]]:
        monkeypatch.setenv("Q6SERVE_DP_PIN_ARENA", pin)
        w = Running(dataclasses.replace(cfg), backend)
        try:
            assert backend.hostio.pinned == (2 if pin == "1" else 0)
            clients = [w.client() for _ in xs]
            clients[0].upload("w", blocks, rows, k)

            def caller(i: int) -> list[np.ndarray]:
                return [np.array(clients[i].matmul("w", xs[i], precision="f16"))
                        for _ in range(20 if many else 3)]

            if not many:
                return [caller(i) for i in range(len(xs))]
            with ThreadPoolExecutor(len(xs)) as pool:
                got = list(pool.map(caller, range(len(xs))))
            if pin == "1":
                assert w.worker.gathered > 0  # merged batches took their slots
            return got
        finally:
            w.stop()
            assert backend.hostio.pinned == 0 and backend.hostio.routes == 0

    want = run("0", False)
    counted = Counted(backend)
    try:
        alone = run("1", False)
    finally:
        del backend.launcher.launch_host
    assert counted.n > 0  # x DMA'd from the arena (not staged)
    for g, wnt in zip(alone, want, strict=True):
        for a in g:
            same(a, wnt[0])
    for g, wnt in zip(run("1", True), want, strict=True):
        scale = float(np.abs(wnt[0]).max())
        for a in g:  # (a wrong row, slot or stale y is off by about |y| itself)
            np.testing.assert_allclose(a, wnt[0], rtol=1e-3, atol=1e-3 * scale)
