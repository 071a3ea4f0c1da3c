"""The direct path (issue 14): a request that would run at once as a lone inline job runs in
the stream reader's own trip (``Engine.run_now`` / ``Batcher.run_now``), with the same
outcome, errors and metrics as through the queue, and only then."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from typing import Any

import grpc
import numpy as np
import pytest
from svc_util import (
    InstrumentedBackend,
    RunningWorker,
    assert_close,
    matmul_stream,
    random_q6k,
    reference,
    wait_until,
)

from q6serve.client.core import Q6ServeError
from q6serve.kernels.api import KernelTiming, Layout, MatmulResult, Precision
from q6serve.kernels.errors import FailedPrecondition, InvalidArgument
from q6serve.service import batcher
from q6serve.service.batcher import Batcher, BatchKey, BatchSettings, BatchStats, Group
from q6serve.service.device_thread import Device
from q6serve.v1 import q6serve_pb2 as pb

KEY = BatchKey("f32", Precision.EXACT, "f32")
ROWS, K = 16, 256  # a kernel far shorter than DEFER_KERNEL_S on NumPy


async def _quiet() -> None:
    """Let every callback scheduled so far run (the loop's ready queue empties)."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_run_now_only_when_the_job_would_run_inline_at_once_and_alone() -> None:
    async def main() -> None:
        threads: list[str] = []
        stats: list[BatchStats] = []
        release = threading.Event()
        release.set()
        fail: list[BaseException] = []

        def run(x: np.ndarray, key: BatchKey) -> MatmulResult:
            threads.append(threading.current_thread().name)
            release.wait(10)
            if fail:
                raise fail[0]
            return MatmulResult(x * 2, "t", Layout.SOA, Precision.EXACT,
                                KernelTiming(host_seconds=1e-6))

        dev = Device("t", inline_s=10.0)
        b = Batcher("w", dev, run, BatchSettings(), lambda: True, stats.append)
        await _quiet()
        assert not b.can_run_now(1, KEY)  # no like job measured yet (a kernel may compile)
        await b.enqueue(np.ones((1, 4), np.float32), KEY, None)  # on the device thread
        await _quiet()
        assert b.can_run_now(1, KEY)
        assert not b.can_run_now(2, KEY)  # another size bucket: not measured
        other = asyncio.ensure_future(asyncio.sleep(0))  # a task to run in this trip: it may
        assert not b.can_run_now(1, KEY)  # queue a request that would join the batch
        assert b.can_run_now(1, KEY, own=other)  # unless it is the caller's own
        await other
        asyncio.get_running_loop().call_soon(lambda: None)  # a plain callback queues nothing
        assert b.can_run_now(1, KEY)
        await _quiet()
        got = b.run_now(np.full((1, 4), 3.0, np.float32), KEY)
        assert got.y[0, 0] == 6.0 and got.batch_rows == 1 and got.batch_requests == 1
        assert threads[-1] == threading.current_thread().name
        assert dev.direct_jobs == 1 and dev.inflight == 0 and b.in_flight == 0
        await _quiet()
        assert len(stats) == 2 and stats[-1].rows == 1  # batch metrics, after the reply
        # the device busy (a job on its thread): queue instead
        release.clear()
        blocker = dev.submit(release.wait, 10)
        assert not b.can_run_now(1, KEY)
        release.set()
        await blocker
        await _quiet()
        # something of this weight queued: queue behind it
        b._queue.append(object())  # type: ignore[arg-type]
        assert not b.can_run_now(1, KEY)
        b._queue.clear()
        # a refusal raises to the caller and leaves nothing behind
        await _quiet()
        fail.append(InvalidArgument("refused"))
        with pytest.raises(InvalidArgument, match="refused"):
            b.run_now(np.ones((1, 4), np.float32), KEY)
        assert dev.inflight == 0 and b.in_flight == 0 and b._unfinished == 0
        await b.close()
        dev.close()

    asyncio.run(main())


def _request(x: np.ndarray, rid: str, weight: str = "w") -> pb.MatmulRequest:
    req = pb.MatmulRequest(weight=weight, request_id=rid)
    req.x.dtype = pb.DTYPE_F32
    req.x.shape.extend(x.shape)
    req.x.data = x.astype("<f4").tobytes()
    return req


def test_stream_round_trips_take_the_direct_path_with_the_same_replies(
        worker: RunningWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    """One caller, one request at a time: after the first (its cost unknown: the queue and
    the device thread) requests run directly; replies, errors and metrics are as ever."""
    # NumPy's kernel here may take longer than DEFER_KERNEL_S (a job never run directly)
    monkeypatch.setattr(batcher, "DEFER_KERNEL_S", 1.0)
    blocks = random_q6k(ROWS, K, 3)
    worker.client().upload("w", blocks, ROWS, K)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((1, K)).astype(np.float32) for _ in range(20)]
    bad_k = _request(np.ones((1, K // 2), np.float32), "bad-k")
    unknown = _request(xs[0], "nope", weight="nope")
    with matmul_stream(worker.target) as (ask, _):
        outs = []
        for req in [_request(x, str(j)) for j, x in enumerate(xs)] + [bad_k, unknown]:
            outs.append(ask(req))
    for i, x in enumerate(xs):
        r = outs[i]
        assert r.request_id == str(i) and r.WhichOneof("outcome") == "result"
        y = np.frombuffer(r.result.y.data, "<f4").reshape(1, ROWS)
        assert_close(y, reference(blocks, ROWS, K, x))
        assert r.result.timing.batch_rows == 1
    assert outs[-2].error.code == 3 and "K=128" in outs[-2].error.message  # INVALID_ARGUMENT
    assert outs[-1].error.code == 5 and "no weight named 'nope'" in outs[-1].error.message
    eng = worker.engine
    assert worker.run(lambda: eng.device.direct_jobs) >= 1
    assert worker.run(lambda: eng.device.inflight) == 0
    reg = worker.worker.registry

    def sample(name: str, **labels: str) -> float:
        return reg.get_sample_value(name, labels) or 0.0

    assert sample("q6serve_requests_total", service="q6serve.v1.Q6Serve",
                  method="MatmulStream/request", code="OK") == 20
    assert sample("q6serve_requests_total", service="q6serve.v1.Q6Serve",
                  method="MatmulStream/request", code="INVALID_ARGUMENT") == 1
    assert sample("q6serve_batch_rows_count") == 20
    assert sample("q6serve_queue_delay_seconds_count") == 20


def test_unary_calls_take_the_direct_path_with_the_same_replies(
        worker: RunningWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batcher, "DEFER_KERNEL_S", 1.0)  # (see above)
    blocks = random_q6k(ROWS, K, 4)
    c = worker.client()
    c.upload("w", blocks, ROWS, K)
    rng = np.random.default_rng(2)
    for _ in range(10):
        x = rng.standard_normal((1, K)).astype(np.float32)
        assert_close(c.matmul("w", x), reference(blocks, ROWS, K, x))
    with pytest.raises(Q6ServeError, match="K=128") as refused:
        c.matmul("w", np.ones((1, K // 2), np.float32))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert worker.run(lambda: worker.engine.device.direct_jobs) >= 1
    reg = worker.worker.registry
    assert reg.get_sample_value("q6serve_batch_rows_count") == 10


class _Refusing(InstrumentedBackend):
    """Refuses the launches of the weight with ``rows`` rows while ``refuse`` is set."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows, self.refuse = rows, False

    def matmul(self, w: Any, x: np.ndarray, **kw: Any) -> Any:
        if self.refuse and w.rows == self.rows:
            raise FailedPrecondition("refused by the test")
        return super().matmul(w, x, **kw)


def _multi(x: np.ndarray, rid: str, weights: tuple[str, ...]) -> pb.MatmulRequest:
    req = _request(x, rid)
    req.ClearField("weight")
    req.weights.extend(weights)
    return req


def test_multi_weight_calls_take_the_direct_path_with_the_same_replies(
        start_worker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every part of a multi-weight request runs directly when each would (after the first
    request, which measures the parts' costs through the queue): the same replies, errors
    (named after their weight, refusals before any part runs) and metrics as queued. (Part
    by part: one backend call per request is test_multi_launch.py's.)"""
    monkeypatch.setenv("Q6SERVE_MULTI_LAUNCH", "0")
    monkeypatch.setattr(batcher, "DEFER_KERNEL_S", 1.0)  # (see above)
    backend = _Refusing(rows=8)
    # any measured cost inlines (a part's first job on a loaded machine may take > 3 ms)
    worker = start_worker(backend=backend, inline_device_us=10_000_000)
    shapes = {"q": (ROWS, 5), "k": (8, 6), "v": (24, 7), "other_k": (8, 8)}
    blocks = {n: random_q6k(r, K if n != "other_k" else 2 * K, s)
              for n, (r, s) in shapes.items()}
    c = worker.client()
    for n, (r, _) in shapes.items():
        c.upload(n, blocks[n], r, K if n != "other_k" else 2 * K)
    eng = worker.engine
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((2, K)).astype(np.float32) for _ in range(8)]
    qkv = ("q", "k", "v")
    with matmul_stream(worker.target) as (ask, stub):
        first = ask(_multi(xs[0], "0", qkv))  # the queue (costs unknown), one device job
        direct0 = worker.run(lambda: eng.device.direct_jobs)
        outs = [first] + [ask(_multi(x, str(j + 1), qkv)) for j, x in enumerate(xs[1:])]
        direct = worker.run(lambda: eng.device.direct_jobs) - direct0
        # all parts of a request directly or none; most requests (another task woken in the
        # reader's trip, e.g. the metrics poll, sends one through the queue)
        assert direct % 3 == 0 and direct >= 3 * (len(xs) - 3), direct
        # each part alone short enough to inline, not all three together (3 x 0.4): the
        # request is queued, as its group's one device job would run on the device thread
        def slow_parts() -> None:
            for n in qkv:
                b = eng.registry.get(n).batcher
                b._job_s = dict.fromkeys(b._job_s, 0.4 * eng.device.inline_s)

        worker.run(slow_parts)
        direct0 = worker.run(lambda: eng.device.direct_jobs)
        assert ask(_multi(xs[1], "slow", ("q",))).WhichOneof("outcome") == "result"
        assert worker.run(lambda: eng.device.direct_jobs) == direct0 + 1  # one part: direct
        worker.run(slow_parts)
        assert ask(_multi(xs[1], "slow", qkv)).WhichOneof("outcome") == "result"
        assert worker.run(lambda: eng.device.direct_jobs) == direct0 + 1  # all three: queued
        launches = len(backend.launches)
        bad_k = ask(_multi(xs[0], "bad-k", ("q", "other_k")))
        unknown = ask(_multi(xs[0], "unknown", ("q", "nope")))
        assert len(backend.launches) == launches  # refused before any part ran
        backend.refuse = True
        failed = ask(_multi(xs[0], "failed", qkv))
        backend.refuse = False
        again = ask(_multi(xs[1], "again", qkv))
        unary = stub.Matmul(_multi(xs[2], "unary", qkv), timeout=30)
    for j, (x, r) in enumerate(zip(xs, outs, strict=True)):
        assert r.request_id == str(j) and r.WhichOneof("outcome") == "result"
        assert [o.weight for o in r.result.outputs] == list(qkv)
        for o in r.result.outputs:
            rows = shapes[o.weight][0]
            y = np.frombuffer(o.y.data, "<f4").reshape(2, rows)
            assert_close(y, reference(blocks[o.weight], rows, K, x))
            if j:
                assert o.timing.queue_seconds == 0.0 and o.timing.batch_requests == 1
    assert bad_k.error.code == 3 and bad_k.error.message.startswith("weights[1] 'other_k': ")
    assert unknown.error.code == 5 and unknown.error.message.startswith("weights[1] 'nope': ")
    assert failed.error.code == 9  # FAILED_PRECONDITION, from the part that failed
    assert failed.error.message == "weights[1] 'k': refused by the test"
    assert [o.weight for o in again.result.outputs] == list(qkv)
    assert_close(np.frombuffer(again.result.outputs[2].y.data, "<f4").reshape(2, 24),
                 reference(blocks["v"], 24, K, xs[1]))
    assert_close(np.frombuffer(unary.outputs[0].y.data, "<f4").reshape(2, ROWS),
                 reference(blocks["q"], ROWS, K, xs[2]))
    assert worker.run(lambda: eng.device.inflight) == 0
    reg = worker.worker.registry
    assert reg.get_sample_value("q6serve_requests_total", {
        "service": "q6serve.v1.Q6Serve", "method": "MatmulStream/request", "code": "OK"}) == 11
    # every part's batch of the 12 answered requests, and q's of the failed one (k's failed)
    wait_until(lambda: reg.get_sample_value("q6serve_batch_rows_count") == 3 * 11 + 1 + 1,
               what="every part's batch observed")


def test_a_group_lets_go_of_its_parts_without_the_cyclic_gc() -> None:
    """A multi-weight call's parts and their group referred to each other: what the parts
    held (x, each reply's y) waited for the cyclic GC (the 7B replay at S=64 kept 30-50
    replies' y that way). Once every part has left its queue the group lets go."""
    async def main() -> None:
        made: list[weakref.ref[np.ndarray]] = []

        def run(x: np.ndarray, key: BatchKey) -> MatmulResult:
            y = x * 2
            made.append(weakref.ref(y))
            return MatmulResult(y, "t", Layout.SOA, Precision.EXACT,
                                KernelTiming(host_seconds=1e-6))

        dev = Device("t")
        bs = [Batcher(n, dev, run, BatchSettings(), lambda: True, lambda s: None)
              for n in "ab"]
        g = Group()
        futs = [b.enqueue(np.ones((1, 4), np.float32), KEY, None, group=g) for b in bs]
        g.launch()
        got = await asyncio.gather(*futs)
        assert [r.y[0, 0] for r in got] == [2.0, 2.0] and len(made) == 2
        del got, futs, g
        for _ in range(500):  # (the device thread lets go of its job's outcome after the
            if all(r() is None for r in made):  # hand-back: it may run later than the loop)
                break
            await asyncio.sleep(0.01)
        assert all(r() is None for r in made), "the parts' y are alive"
        for b in bs:
            await b.close()
        dev.close()

    gc.disable()
    try:
        asyncio.run(main())
    finally:
        gc.enable()


def test_a_direct_call_still_checks_each_request_after_a_like_one_passed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``Engine.run_now`` keeps what ``_admit`` passed for a weight, key and N (the batcher's
    ``DirectCall``): the checks of the request itself still refuse it (K, deadline, drain),
    with the weight let go, and a new flag state plans the call again."""
    from svc_util import numpy_engine

    from q6serve.kernels.errors import FormatError, Unavailable
    from q6serve.service.engine_types import MatmulCall

    monkeypatch.setattr(batcher, "DEFER_KERNEL_S", 1.0)  # (see above)

    async def main() -> None:
        eng = await numpy_engine("w", 8, 256)
        x = np.ones((1, 256), np.float32)

        def call(x: np.ndarray = x, timeout: float | None = None) -> MatmulCall:
            return MatmulCall("w", x, Precision.EXACT, timeout=timeout)  # (EXACT: no plan
            #                                                   per launch, only _admit's)

        await eng.matmul(call())  # its cost measured on the device thread
        await _quiet()
        assert eng.run_now(call()) is not None  # checked in full, kept
        admits: list[MatmulCall] = []
        admit = eng._admit
        monkeypatch.setattr(eng, "_admit", lambda c, k=None: admits.append(c) or admit(c, k))
        await _quiet()
        first = eng.run_now(call())
        assert first is not None and first.batch_rows == 1 and admits == []
        with pytest.raises(FormatError, match="K=128"):
            eng.run_now(call(np.ones((1, 128), np.float32)))
        with pytest.raises(batcher.DeadlineExceeded):
            eng.run_now(call(timeout=0.0))
        assert len(admits) == 2
        eng.set_flags({"Q6SERVE_DYNAMIC_BATCHING": False})  # a new state (costs kept)
        await _quiet()
        again = eng.run_now(call())
        assert again is not None and len(admits) == 3  # checked in full again
        assert eng.run_now(call()) is not None and len(admits) == 3
        assert eng.device.direct_jobs == 4
        eng.begin_drain()
        with pytest.raises(Unavailable, match="draining"):
            eng.run_now(call())
        assert eng.registry.get("w").refs == 0 and eng.device.inflight == 0
        await eng.close()

    asyncio.run(main())


class _Deferring(InstrumentedBackend):
    """Its launches compute at ``wait()`` (as a GPU's end), logging (what, weight rows) in
    order; launches of the weight with ``refuse_rows`` rows are refused while set. Three
    launch slots, as the CUDA backend's."""

    launch_slots = 3

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int]] = []
        self.refuse_rows = 0

    def launch(self, w: Any, x: np.ndarray, **kw: Any) -> Any:
        from q6serve.kernels.api import Launched

        if w.rows == self.refuse_rows:
            raise FailedPrecondition("refused at launch by the test")
        self.events.append(("launch", w.rows))

        def wait() -> Any:
            self.events.append(("wait", w.rows))
            return self.matmul(w, x, **kw)

        return Launched(wait)


@pytest.mark.parametrize("pipeline", ["0", "1"])
def test_multi_weight_direct_parts_launched_behind_each_other(
        start_worker: Any, monkeypatch: pytest.MonkeyPatch, pipeline: str) -> None:
    """Q6SERVE_MULTI_PIPELINE=1: a multi-weight call on the direct path launches its parts
    behind each other, then waits for them in order (without it: each part's launch and wait
    in turn); the same replies; a part refused at launch fails the call naming its weight,
    after the parts launched before it are waited for (nothing left in flight)."""
    monkeypatch.setenv("Q6SERVE_MULTI_PIPELINE", pipeline)
    monkeypatch.setenv("Q6SERVE_MULTI_LAUNCH", "0")  # (the parts' own launches)
    monkeypatch.setattr(batcher, "DEFER_KERNEL_S", 1.0)
    backend = _Deferring()
    worker = start_worker(backend=backend, inline_device_us=10_000_000)
    rows = {"q": 16, "k": 8, "v": 24}
    blocks = {n: random_q6k(r, K, s) for s, (n, r) in enumerate(rows.items())}
    c = worker.client()
    for n, r in rows.items():
        c.upload(n, blocks[n], r, K)
    eng = worker.engine
    xs = [np.random.default_rng(j).standard_normal((2, K)).astype(np.float32) for j in range(8)]
    with matmul_stream(worker.target) as (ask, _):
        outs = [ask(_multi(x, str(j), ("q", "k", "v"))) for j, x in enumerate(xs)]
        backend.refuse_rows = rows["k"]
        n0 = len(backend.events)
        failed = ask(_multi(xs[0], "failed", ("q", "k", "v")))
    for x, r in zip(xs, outs, strict=True):
        for o in r.result.outputs:
            y = np.frombuffer(o.y.data, "<f4").reshape(2, rows[o.weight])
            assert_close(y, reference(blocks[o.weight], rows[o.weight], K, x))
    # each request's six events: the first (the costs unknown) and any another task's wake
    # sent through the queue run each part in turn; the direct ones launch all, then wait
    serial = [("launch", 16), ("wait", 16), ("launch", 8), ("wait", 8), ("launch", 24),
              ("wait", 24)]
    behind = [("launch", 16), ("launch", 8), ("launch", 24), ("wait", 16), ("wait", 8),
              ("wait", 24)]
    per = [backend.events[i:i + 6] for i in range(0, n0, 6)]
    assert len(per) == len(xs) and per[0] == serial, backend.events
    assert all(e in (serial, behind) for e in per), backend.events
    assert (behind in per) == (pipeline == "1"), backend.events
    assert failed.error.code == 9
    assert failed.error.message == "weights[1] 'k': refused at launch by the test"
    assert backend.events[n0:] == [("launch", 16), ("wait", 16)]  # q waited for; v not run
    assert worker.run(lambda: eng.device.inflight) == 0
    assert worker.run(lambda: eng.device._now) == 0
    for n in rows:  # nothing holds a weight: each unloads
        c.unload(n)
