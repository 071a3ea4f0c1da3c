"""One backend call per multi-weight call (``Q6SERVE_MULTI_LAUNCH=1``, issue 14): a call's parts
that run together (the direct path; a group job whose batches hold the same requests) are one
``launch_many`` with the same replies, per-part kernel timings, metrics and errors as part by
part, and each weight still batches with other callers' requests."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import grpc
import numpy as np
import pytest
from svc_util import (
    InstrumentedBackend,
    assert_close,
    matmul_stream,
    random_q6k,
    reference,
    wait_until,
)

from q6serve.kernels.api import Launched, LaunchedMany, flags_of
from q6serve.kernels.errors import FailedPrecondition, Q6Error
from q6serve.service import batcher
from q6serve.v1 import q6serve_pb2 as pb
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc

K = 256
ROWS = {"q": 16, "k": 8, "v": 24}
QKV = ("q", "k", "v")


class _Many(InstrumentedBackend):
    """A backend with ``launch_many``: each call logged as (weights' rows, N); the parts run
    at ``wait()`` (as a GPU's end). A call of the weight with ``refuse_rows`` rows is refused
    at launch while set, single launches too. Single launches are logged in ``launches``
    (InstrumentedBackend)."""

    launch_slots = 3

    def __init__(self) -> None:
        super().__init__()
        self.many: list[tuple[tuple[int, ...], int]] = []
        self.refuse_rows = 0

    def matmul(self, w: Any, x: np.ndarray, **kw: Any) -> Any:
        if w.rows == self.refuse_rows:
            raise FailedPrecondition("refused by the test")
        return super().matmul(w, x, **kw)

    def launch_many(self, ws: Any, x: np.ndarray, *, flags: Any, **kw: Any) -> LaunchedMany:
        fl = flags_of(flags, len(ws))
        if any(w.rows == self.refuse_rows for w in ws):
            raise FailedPrecondition("refused by the test")
        self.many.append((tuple(w.rows for w in ws), int(x.shape[0])))
        x = x.copy()  # (x may be the staging buffer: a real backend uploads it here)
        return LaunchedMany(lambda: [self.inner.matmul(w, x, flags=f, **kw)
                                     for w, f in zip(ws, fl, strict=True)])


def _multi(x: np.ndarray, rid: str, weights: tuple[str, ...]) -> pb.MatmulRequest:
    req = pb.MatmulRequest(request_id=rid)
    req.weights.extend(weights)
    req.x.dtype = pb.DTYPE_F32
    req.x.shape.extend(x.shape)
    req.x.data = x.astype("<f4").tobytes()
    return req


def _setup(start_worker: Any, monkeypatch: pytest.MonkeyPatch, launch: str,
           **config: Any) -> tuple[Any, _Many, dict[str, np.ndarray]]:
    monkeypatch.setenv("Q6SERVE_MULTI_LAUNCH", launch)
    monkeypatch.setattr(batcher, "DEFER_KERNEL_S", 1.0)  # NumPy's kernels may take long
    backend = _Many()
    # any measured cost inlines (a part's first job on a loaded machine may take > 3 ms)
    worker = start_worker(backend=backend, inline_device_us=10_000_000, **config)
    blocks = {n: random_q6k(r, K, s) for s, (n, r) in enumerate(ROWS.items())}
    c = worker.client()
    for n, r in ROWS.items():
        c.upload(n, blocks[n], r, K)
    return worker, backend, blocks


def _check(reply: Any, x: np.ndarray, blocks: dict[str, np.ndarray]) -> None:
    assert [o.weight for o in reply.outputs] == list(QKV)
    for o in reply.outputs:
        y = np.frombuffer(o.y.data, "<f4").reshape(x.shape[0], ROWS[o.weight])
        assert_close(y, reference(blocks[o.weight], ROWS[o.weight], K, x))
        assert o.kernel.startswith("numpy.") and o.timing.kernel_seconds > 0


@pytest.mark.parametrize("launch", ["0", "1"])
def test_each_multi_weight_call_is_one_backend_call(
        start_worker: Any, monkeypatch: pytest.MonkeyPatch, launch: str) -> None:
    """A caller's q/k/v requests, one at a time on a stream: the first through the queue (one
    group job), the rest on the direct path; with the switch each is one ``launch_many`` of
    the three weights and no single launch, without it three single launches. The same
    replies and per-part metrics either way; a single-weight request is a single launch; a
    call refused at launch runs part by part, so the refusal names its weight, as before;
    nothing is left in flight."""
    worker, backend, blocks = _setup(start_worker, monkeypatch, launch)
    eng = worker.engine
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((2, K)).astype(np.float32) for _ in range(6)]
    with matmul_stream(worker.target) as (ask, stub):
        direct0 = worker.run(lambda: eng.device.direct_jobs)
        outs = [ask(_multi(x, str(j), QKV)) for j, x in enumerate(xs)]
        direct = worker.run(lambda: eng.device.direct_jobs) - direct0
        singles = len(backend.launches)
        one = ask(_multi(xs[0], "one", ("k",)))
        backend.refuse_rows = ROWS["k"]
        failed = ask(_multi(xs[1], "failed", QKV))
        backend.refuse_rows = 0
        again = ask(_multi(xs[2], "again", QKV))
        unary = stub.Matmul(_multi(xs[3], "unary", QKV), timeout=30)
    for x, r in zip(xs, outs, strict=True):
        _check(r.result, x, blocks)
    _check(again.result, xs[2], blocks)
    _check(unary, xs[3], blocks)
    assert one.result.outputs[0].weight == "k"
    assert failed.error.code == 9
    assert failed.error.message == "weights[1] 'k': refused by the test"
    rows = (ROWS["q"], ROWS["k"], ROWS["v"])
    if launch == "1":
        # every call of q/k/v one launch_many (the first and any sent through the queue by
        # another task woken in the reader's trip: their group job; the rest directly)
        assert backend.many == [(rows, 2)] * (len(xs) + 2), (backend.many, backend.launches)
        # "one" a single launch; the refused call part by part (q ran, k was refused)
        assert singles == 0 and backend.launches == [2, 2]
        # the direct path's one device job per call (not one per part)
        assert direct <= len(xs) - 1 and direct >= len(xs) - 3, direct
    else:
        assert backend.many == []
        assert singles == 3 * len(xs)
        assert direct % 3 == 0 and direct >= 3 * (len(xs) - 3), direct
    assert worker.run(lambda: eng.device.inflight) == 0
    reg = worker.worker.registry
    # every part's batch of the answered requests observed (6 + again + unary: 3 each, and
    # the single-weight one's), and q's of the failed call (part by part, k's failed)
    batches = 3 * 8 + 1 + 1
    wait_until(lambda: reg.get_sample_value("q6serve_batch_rows_count") == batches,
               what="every part's batch observed")
    assert reg.get_sample_value("q6serve_batch_rows_sum") == 2 * batches
    # the one call's y (N x 48 rows) exceeds the workspace of the largest weight (24 rows):
    # the reservation grew to it; unloading every weight gives it all back
    want = eng._workspace(sum(ROWS.values()) if launch == "1" else max(ROWS.values()), K)
    assert worker.run(lambda: eng.vram.used("scratch")) == want
    c = worker.client()
    for n in ROWS:  # nothing holds a weight: each unloads
        c.unload(n)
    assert worker.run(lambda: (eng.vram.used("scratch"), eng.vram.used("weights"))) == (0, 0)


def test_parts_still_batch_with_other_callers_requests(
        start_worker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two callers' q/k/v requests queued while the device is busy: each weight's batch holds
    both callers' rows, and the three batches (the same requests, in the same order) are one
    ``launch_many`` of N = 4; each caller gets its own rows."""
    worker, backend, blocks = _setup(start_worker, monkeypatch, "1",
                                     max_batch_delay_us=5_000_000)
    eng = worker.engine
    hold = threading.Event()
    worker.run(lambda: eng.device.submit(hold.wait, 30))  # the device busy until set
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal((2, K)).astype(np.float32) for _ in range(2)]
    with grpc.insecure_channel(worker.target) as ch, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        stub = pb_grpc.Q6ServeStub(ch)
        futs = [pool.submit(stub.Matmul, _multi(x, str(j), QKV), timeout=30)
                for j, x in enumerate(xs)]
        wait_until(lambda: worker.run(
            lambda: sum(eng.registry.get(n).batcher.queued_rows for n in QKV)) == 12,
            what="both calls' parts queued")
        hold.set()
        outs = [f.result() for f in futs]
    for x, r in zip(xs, outs, strict=True):
        _check(r, x, blocks)
        assert all(o.timing.batch_requests == 2 and o.timing.batch_rows == 4
                   for o in r.outputs)
    assert backend.many == [((ROWS["q"], ROWS["k"], ROWS["v"]), 4)], backend.many
    assert backend.launches == []
    assert worker.run(lambda: eng.device.inflight) == 0


def test_a_refused_group_job_runs_part_by_part() -> None:
    """The group job's one call refused (a caller's input): the batches run each as usual, so
    the refusal reaches that part's requests with its own message (the engine names the
    weight); a device error would reach every part."""
    import asyncio

    from q6serve.kernels.api import KernelTiming, Layout, MatmulResult, Precision
    from q6serve.service.batcher import Batcher, BatchKey, BatchSettings, Group
    from q6serve.service.device_thread import Device

    key = BatchKey("f32", Precision.EXACT, "f32")

    async def main() -> None:
        calls: list[str] = []

        def run_for(name: str) -> Any:
            def run(x: np.ndarray, k: BatchKey) -> MatmulResult:
                calls.append(name)
                if name == "b":
                    raise FailedPrecondition("b refused")
                return MatmulResult(x * 2, name, Layout.SOA, Precision.EXACT,
                                    KernelTiming(host_seconds=1e-6))
            return run

        def many(bs: Any, k: BatchKey) -> Any:
            def go(x: np.ndarray) -> Launched:
                calls.append("many")
                raise FailedPrecondition("refused as one")
            return go

        dev = Device("t")
        bs = [Batcher(n, dev, run_for(n), BatchSettings(), lambda: True, lambda s: None,
                      many=many) for n in "ab"]
        g = Group()
        x = np.ones((1, 4), np.float32)  # (a multi-weight call's parts share their x)
        futs = [b.enqueue(x, key, None, group=g) for b in bs]
        g.launch()
        got = await asyncio.gather(*futs, return_exceptions=True)
        assert calls == ["many", "a", "b"]
        assert isinstance(got[0], batcher.MatmulReply) and got[0].kernel == "a"
        assert isinstance(got[1], Q6Error) and str(got[1]) == "b refused"
        for b in bs:
            await b.close()
        dev.close()

    asyncio.run(main())


def test_kept_many_function_rechecks_the_workspace(
        start_worker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The function a multi-weight call's one backend call runs through is kept per kind
    (Engine._launch_many), but the workspace it needs is checked on every call: after the
    largest weight is unloaded (the reservation shrinks to the largest left), the next q/k/v
    call grows it again to its y (N x 48 rows), as the first did."""
    worker, backend, blocks = _setup(start_worker, monkeypatch, "1")
    eng = worker.engine
    c = worker.client()
    c.upload("big", random_q6k(200, K, 9), 200, K)
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((2, K)).astype(np.float32) for _ in range(4)]
    with matmul_stream(worker.target) as (ask, _):
        for j, x in enumerate(xs[:2]):
            _check(ask(_multi(x, str(j), QKV)).result, x, blocks)
        assert worker.run(lambda: eng.vram.used("scratch")) == eng._workspace(200, K)
        c.unload("big")
        wait_until(lambda: worker.run(lambda: eng.vram.used("scratch"))
                   == eng._workspace(max(ROWS.values()), K), what="scratch shrunk")
        for j, x in enumerate(xs[2:]):
            _check(ask(_multi(x, f"after{j}", QKV)).result, x, blocks)
    assert len(backend.many) == len(xs)
    assert worker.run(lambda: eng.vram.used("scratch")) == eng._workspace(sum(ROWS.values()), K)
