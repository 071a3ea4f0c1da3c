"""Multi-weight requests and the top-k epilogue through the RPCs (raw stubs: the wire contract).

Every failure is checked for its status, that its message names the culprit, and that nothing
is left behind (no request in flight, no queued rows, VRAM figures back where they were).
"""

from __future__ import annotations

import threading
from typing import Any

import grpc
import numpy as np
import pytest
from svc_util import (
    InstrumentedBackend,
    RunningWorker,
    assert_close,
    matmul_request,
    random_q6k,
    reference,
    wait_until,
)

from q6serve.client.client import decode_tensor
from q6serve.kernels.epilogue import LSE_RTOL, topk_reference
from q6serve.v1 import q6serve_pb2 as pb
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc

K = 512
SHAPES = {"q": (48, K, 1), "k": (32, K, 2), "v": (16, K, 3), "other_k": (16, 256, 4)}
C = grpc.StatusCode


class GatedBackend(InstrumentedBackend):
    """Every launch is logged, then waits until the test opens ``gate``: the device stays busy
    exactly as long as the test needs (no guessed sleeps on a loaded machine)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def matmul(self, w: Any, x: np.ndarray, **kw: Any) -> Any:
        self.launches.append(int(x.shape[0]))
        assert self.gate.wait(30), "the test never opened the gate"
        return self.inner.matmul(w, x, **kw)


@pytest.fixture
def loaded(worker: RunningWorker) -> tuple[RunningWorker, dict[str, np.ndarray]]:
    c = worker.client()
    blocks = {}
    for name, (rows, k, seed) in SHAPES.items():
        blocks[name] = random_q6k(rows, k, seed)
        c.upload(name, blocks[name], rows, k)
    return worker, blocks


def _x(n: int, k: int = K, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)


_req = matmul_request


def _stub(worker: RunningWorker) -> Any:
    """A raw stub on a channel the worker fixture closes at teardown."""
    ch = grpc.insecure_channel(worker.target)
    worker.clients.append(ch)  # type: ignore[arg-type]
    return pb_grpc.Q6ServeStub(ch)


@pytest.fixture
def stub(loaded: tuple[RunningWorker, dict[str, np.ndarray]]) -> Any:
    return _stub(loaded[0])


def _topk(t: pb.TopKResult) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    v = np.frombuffer(t.values, "<f4").reshape(t.rows, t.k)
    i = np.frombuffer(t.indices, "<i4").reshape(t.rows, t.k)
    return v, i, np.frombuffer(t.lse, "<f4").reshape(t.rows)


def check_topk(t: pb.TopKResult, y: np.ndarray, k: int, rtol: float = 1e-5) -> None:
    """``t`` against the reference top-k of ``y`` (this x's y from another call, which may
    have run in a different batch: equal within ``rtol`` of the scale, not bit-equal)."""
    v, i, lse = _topk(t)
    assert (t.rows, t.k) == (y.shape[0], k)
    tol = rtol * max(1.0, float(np.abs(y).max()))
    assert np.all(v[:, 1:] <= v[:, :-1])  # descending
    assert np.all(np.abs(np.take_along_axis(y, i, axis=1) - v) <= tol)  # y's values there
    ref = topk_reference(y, k)
    assert np.all(np.abs(v - ref.values) <= tol)
    # indices equal wherever the reference value is not within 2 tol of a neighbour's
    gap = np.full(ref.values.shape, np.inf)
    d = np.abs(np.diff(ref.values.astype(np.float64), axis=1))
    gap[:, 1:] = d
    gap[:, :-1] = np.minimum(gap[:, :-1], d)
    clear = gap > 2 * tol
    np.testing.assert_array_equal(i[clear], ref.indices[clear])
    want = np.log(np.exp(y.astype(np.float64)).sum(axis=1))
    assert np.all(np.abs(lse - want) <= LSE_RTOL * np.maximum(1, np.abs(want)) + tol)


def assert_idle(worker: RunningWorker, vram_before: Any = None) -> None:
    """No request in flight or queued on any weight; VRAM accounting as before."""
    def busy() -> list[tuple[str, int, int]]:
        return worker.run(lambda: [(w.name, w.batcher.in_flight, w.batcher.queued_rows)
                                   for w in worker.engine.registry.entries()])

    wait_until(lambda: all(f == q == 0 for _, f, q in busy()), what="idle batchers")
    if vram_before is not None:
        assert _vram(worker) == vram_before


def _vram(worker: RunningWorker) -> tuple[int, ...]:
    """The accountant's own figures (not the device's free bytes, which other tests move)."""
    def read() -> tuple[int, ...]:
        v = worker.engine.vram.stats()
        return v.budget, v.weights, v.scratch, v.staging, v.reserved

    return worker.run(read)


# -- multi-weight ---------------------------------------------------------------------------
def test_multi_weight_unary(loaded, stub) -> None:  # type: ignore[no-untyped-def]
    worker, blocks = loaded
    x = _x(3)
    jobs = worker.run(lambda: worker.engine.device.jobs)
    r = stub.Matmul(_req(["v", "q", "k"], x, request_id="r1"))
    # the three parts ran back to back in one device job (service/batcher.py's Group)
    assert worker.run(lambda: worker.engine.device.jobs) == jobs + 1
    assert [o.weight for o in r.outputs] == ["v", "q", "k"]
    assert not r.HasField("y") and not r.HasField("topk") and r.kernel == ""
    assert r.timing.HasField("decode_seconds") and r.timing.HasField("handler_seconds")
    for o in r.outputs:
        rows = SHAPES[o.weight][0]
        y = decode_tensor(o.y)
        assert y.shape == (3, rows) and o.precision == pb.PRECISION_EXACT and o.kernel
        assert o.timing.batch_rows >= 3 and o.timing.HasField("kernel_seconds")
        assert_close(y, reference(blocks[o.weight], rows, K, x))
    # one name in `weights` is still a multi-weight reply; `weight` keeps the old reply
    one = stub.Matmul(_req(["k"], x))
    assert len(one.outputs) == 1 and not one.HasField("y")
    single = stub.Matmul(_req("k", x))
    assert not single.outputs
    np.testing.assert_array_equal(decode_tensor(single.y), decode_tensor(one.outputs[0].y))
    assert_idle(worker)


def test_multi_weight_stream_with_errors_in_between(loaded, stub) -> None:  # type: ignore[no-untyped-def]
    worker, blocks = loaded
    x = _x(2, seed=1)
    reqs = [_req(["q", "k"], x, request_id="a"), _req(["q", "nope"], x, request_id="b"),
            _req("v", x, request_id="c"), _req(["k", "v"], x, topk=4, request_id="d"),
            _req(["q", "other_k"], x, request_id="e")]
    got = {r.request_id: r for r in stub.MatmulStream(iter(reqs), timeout=30)}
    assert set(got) == {"a", "b", "c", "d", "e"}
    a = got["a"].result
    assert [o.weight for o in a.outputs] == ["q", "k"]
    for o in a.outputs:
        assert_close(decode_tensor(o.y), reference(blocks[o.weight], SHAPES[o.weight][0], K, x))
    b = got["b"]
    assert b.WhichOneof("outcome") == "error" and b.error.code == C.NOT_FOUND.value[0]
    assert b.error.message.startswith("weights[1] 'nope': ")
    assert got["c"].result.y.shape == [2, 16]
    d = got["d"].result
    assert [o.weight for o in d.outputs] == ["k", "v"]
    for o in d.outputs:
        assert not o.HasField("y")
        y = decode_tensor(stub.Matmul(_req(o.weight, x)).y)
        check_topk(o.topk, y, 4)
    e = got["e"]
    assert e.error.code == C.INVALID_ARGUMENT.value[0]
    assert "weights[1] 'other_k'" in e.error.message and "K=512" in e.error.message
    assert_idle(worker)


BAD_MULTI = [
    # (id, weights, x K, extra request fields, code, message fragment)
    ("none", [], K, {}, C.INVALID_ARGUMENT, "weight is empty"),
    ("empty-name", ["q", ""], K, {}, C.INVALID_ARGUMENT, "weights[1] is empty"),
    ("duplicate", ["q", "k", "q"], K, {}, C.INVALID_ARGUMENT, "lists 'q' twice"),
    ("too-many", [f"w{i}" for i in range(17)], K, {}, C.INVALID_ARGUMENT, "at most 16"),
    ("far-too-many", ["x" * 256] * 20000, K, {}, C.INVALID_ARGUMENT, "at most 16"),
    ("both", ["q"], K, {"weight": "k"}, C.INVALID_ARGUMENT, "both weight and weights"),
    ("unknown", ["q", "k", "missing"], K, {}, C.NOT_FOUND,
     "weights[2] 'missing': no weight named 'missing'"),
    ("garbage-name", ["q", "\x00\xff" * 200], K, {}, C.NOT_FOUND, "weights[1] '\\x00"),
    ("mixed-k", ["other_k", "q"], 256, {}, C.INVALID_ARGUMENT,
     "weights[1] 'q': activations have K=256, the weight has K=512"),
    ("k-mismatch-all", ["q", "k"], 1024, {}, C.INVALID_ARGUMENT, "weights[0] 'q'"),
]


@pytest.mark.parametrize("case", BAD_MULTI, ids=[c[0] for c in BAD_MULTI])
def test_multi_weight_bad_input(loaded, stub, case) -> None:  # type: ignore[no-untyped-def]
    worker, _ = loaded
    _, weights, k, extra, code, fragment = case
    before = _vram(worker)
    req = _req(weights, _x(1, k))
    for field, value in extra.items():
        setattr(req, field, value)
    with pytest.raises(grpc.RpcError) as e:
        stub.Matmul(req, timeout=30)
    assert e.value.code() == code and fragment in e.value.details(), e.value.details()
    # the same request inside a stream: that request's error, the stream goes on
    req.request_id = "bad"
    out = list(stub.MatmulStream(iter([req, _req("v", _x(1))]), timeout=30))
    assert {r.request_id for r in out} == {"bad", ""}
    bad = next(r for r in out if r.request_id == "bad")
    assert bad.error.code == code.value[0] and fragment in bad.error.message
    assert_idle(worker, before)


def test_multi_weight_parts_batch_with_other_callers(start_worker) -> None:  # type: ignore[no-untyped-def]
    backend = GatedBackend()  # the first call holds the device
    worker = start_worker(backend=backend, max_batch_delay_us=5_000_000)  # wait for idle
    blocks = {n: random_q6k(SHAPES[n][0], K, SHAPES[n][2]) for n in ("q", "k")}
    for n, b in blocks.items():
        worker.client().upload(n, b, SHAPES[n][0], K)
    stub = _stub(worker)
    xs = {name: _x(n, seed=i) for i, (name, n) in enumerate([("a", 1), ("b", 2), ("c", 3)])}
    out: dict[str, Any] = {}

    def call(name: str, req: pb.MatmulRequest) -> None:
        out[name] = stub.Matmul(req, timeout=30)

    first = threading.Thread(target=call, args=("a", _req("q", xs["a"])))
    first.start()
    wait_until(lambda: len(backend.launches) == 1, what="the device busy")
    threads = [threading.Thread(target=call, args=("b", _req("q", xs["b"]))),
               threading.Thread(target=call, args=("c", _req(["q", "k"], xs["c"])))]
    for t in threads:
        t.start()

    def queued() -> tuple[int, int]:
        return worker.run(lambda: tuple(worker.engine.registry.get(n).batcher.queued_rows
                                        for n in ("q", "k")))

    wait_until(lambda: queued() == (5, 3), what="both callers queued")
    jobs = worker.run(lambda: worker.engine.device.jobs)
    backend.gate.set()
    for t in (first, *threads):
        t.join(30)
    # q's batch (b with c's part) and k's (c's part) went to the device as one job
    assert worker.run(lambda: worker.engine.device.jobs) == jobs + 1
    q_of_c, k_of_c = out["c"].outputs
    assert (q_of_c.timing.batch_requests, q_of_c.timing.batch_rows) == (2, 5)  # with b
    assert (out["b"].timing.batch_requests, out["b"].timing.batch_rows) == (2, 5)
    assert (k_of_c.timing.batch_requests, k_of_c.timing.batch_rows) == (1, 3)
    assert sorted(backend.launches) == [1, 3, 5]
    assert_close(decode_tensor(out["b"].y), reference(blocks["q"], 48, K, xs["b"]))
    assert_close(decode_tensor(q_of_c.y), reference(blocks["q"], 48, K, xs["c"]))
    assert_close(decode_tensor(k_of_c.y), reference(blocks["k"], 32, K, xs["c"]))
    assert_idle(worker)


def test_multi_weight_part_failing_after_queueing_cancels_the_rest(start_worker) -> None:  # type: ignore[no-untyped-def]
    backend = GatedBackend()
    worker = start_worker(backend=backend, max_queue_rows=4, max_batch_delay_us=0)
    for n in ("q", "k"):
        worker.client().upload(n, random_q6k(SHAPES[n][0], K, SHAPES[n][2]), SHAPES[n][0], K)
    before = _vram(worker)
    stub = _stub(worker)
    threads = []

    def start(n: int) -> None:
        t = threading.Thread(target=lambda: stub.Matmul(_req("k", _x(n)), timeout=30))
        t.start()
        threads.append(t)

    start(1)  # runs (holds the device)
    wait_until(lambda: len(backend.launches) == 1, what="the device busy")
    start(1)  # staged behind it (two unfinished batches per weight)
    wait_until(lambda: worker.run(lambda: worker.engine.device.inflight) == 2, what="staged")
    start(4)  # queued: k's queue is now full (4 rows)
    wait_until(lambda: worker.run(
        lambda: worker.engine.registry.get("k").batcher.queued_rows) == 4, what="k full")
    with pytest.raises(grpc.RpcError) as e:
        stub.Matmul(_req(["q", "k"], _x(2)), timeout=30)
    assert e.value.code() == C.RESOURCE_EXHAUSTED
    assert e.value.details().startswith("weights[1] 'k': queue of weight 'k' is full")
    backend.gate.set()
    for t in threads:
        t.join(30)
    assert_idle(worker, before)
    assert sorted(backend.launches) == [1, 1, 4]  # q's part was dropped before its launch
    assert stub.Matmul(_req(["q", "k"], _x(1)), timeout=30).outputs[1].weight == "k"


# -- top-k epilogue -------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 5, 48])
def test_topk_matches_reference(loaded, stub, k: int) -> None:  # type: ignore[no-untyped-def]
    worker, _ = loaded
    x = _x(4, seed=k)
    y = decode_tensor(stub.Matmul(_req("q", x)).y)
    r = stub.Matmul(_req("q", x, topk=k))
    assert not r.HasField("y") and r.kernel and r.timing.batch_rows >= 4
    assert len(r.topk.values) == len(r.topk.indices) == 4 * 4 * k and len(r.topk.lse) == 16
    check_topk(r.topk, y, k)
    assert_idle(worker)


def test_topk_rows_batch_with_other_callers_and_split(start_worker) -> None:  # type: ignore[no-untyped-def]
    backend = GatedBackend()
    worker = start_worker(backend=backend, max_batch_delay_us=5_000_000)
    worker.client().upload("q", random_q6k(48, K, 1), 48, K)
    stub = _stub(worker)
    xs = [_x(n, seed=n) for n in (1, 2, 3)]
    out: dict[int, Any] = {}

    def call(i: int) -> None:
        out[i] = stub.Matmul(_req("q", xs[i], topk=8), timeout=30)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    threads[0].start()
    wait_until(lambda: len(backend.launches) == 1, what="the device busy")
    for t in threads[1:]:
        t.start()
    wait_until(lambda: worker.run(
        lambda: worker.engine.registry.get("q").batcher.queued_rows) == 5, what="queued")
    backend.gate.set()
    for t in threads:
        t.join(30)
    assert (out[1].timing.batch_requests, out[2].timing.batch_rows) == (2, 5)
    for i, x in enumerate(xs):
        check_topk(out[i].topk, decode_tensor(stub.Matmul(_req("q", x)).y), 8)


BAD_TOPK = [
    # (id, weight, k, out_dtype, code, fragment)
    ("k-0", "q", 0, 0, C.INVALID_ARGUMENT, "topk.k=0 is out of range: use 1..256"),
    ("k-257", "q", 257, 0, C.INVALID_ARGUMENT, "topk.k=257 is out of range"),
    ("k-huge", "q", (1 << 32) - 1, 0, C.INVALID_ARGUMENT, "topk.k=4294967295 is out of range"),
    ("k-over-rows", "v", 17, 0, C.INVALID_ARGUMENT, "topk k=17 exceeds the 16 rows of weight 'v'"),
    ("k-over-rows-multi", ["q", "v"], 20, 0, C.INVALID_ARGUMENT,
     "weights[1] 'v': topk k=20 exceeds the 16 rows of weight 'v'"),
    ("out-f16", "q", 4, pb.DTYPE_F16, C.INVALID_ARGUMENT, "top-k values are always f32"),
    ("unknown-weight", "nope", 4, 0, C.NOT_FOUND, "no weight named 'nope'"),
]


@pytest.mark.parametrize("case", BAD_TOPK, ids=[c[0] for c in BAD_TOPK])
def test_topk_bad_input(loaded, stub, case) -> None:  # type: ignore[no-untyped-def]
    worker, _ = loaded
    _, weight, k, out_dtype, code, fragment = case
    before = _vram(worker)
    with pytest.raises(grpc.RpcError) as e:
        stub.Matmul(_req(weight, _x(2), topk=k, out_dtype=out_dtype), timeout=30)
    assert e.value.code() == code and fragment in e.value.details(), e.value.details()
    assert_idle(worker, before)


def test_topk_garbage_bytes_are_invalid_argument(loaded) -> None:  # type: ignore[no-untyped-def]
    """A topk submessage that is not one (wrong wire type) is refused by protobuf parsing."""
    worker, _ = loaded
    ch = grpc.insecure_channel(worker.target)
    raw = _req("q", _x(1)).SerializeToString() + b"\x3a\x03\xff\xff\xff"  # field 7, junk
    call = ch.unary_unary("/q6serve.v1.Q6Serve/Matmul", request_serializer=None,
                          response_deserializer=None)
    with pytest.raises(grpc.RpcError) as e:
        call(raw, timeout=30)
    ch.close()
    assert e.value.code() in (C.INVALID_ARGUMENT, C.INTERNAL)
    assert_idle(worker)


# -- several devices (row-sharded and replicated weights) ----------------------------------------
@pytest.mark.parametrize("placement", ["shard", "replicate"])
def test_multi_device_topk_and_multi_weight(base_config, placement: str) -> None:  # type: ignore[no-untyped-def]
    """Sharded: each device's top-k of its rows, merged (global columns, combined lse)."""
    import asyncio
    import hashlib

    from prometheus_client import CollectorRegistry

    from q6serve.kernels.numpy_backend import NumpyBackend
    from q6serve.service.devices import MultiDeviceEngine
    from q6serve.service.engine_types import MatmulCall, UploadSpec
    from q6serve.service.metrics import Metrics
    from q6serve.service.multi import start_matmul_weights

    blocks = {"q": random_q6k(37, K, 1), "k": random_q6k(20, K, 2)}  # 19 + 18, 10 + 10 rows
    x = _x(3, seed=5)

    async def once(data: bytes) -> Any:
        yield data

    async def main() -> None:
        metrics = Metrics(CollectorRegistry(), version="t", backend="numpy", device="cpu")
        eng = MultiDeviceEngine([NumpyBackend(threads=1) for _ in range(2)], base_config,
                                metrics, placement)
        try:
            for n, b in blocks.items():
                raw = b.tobytes()
                await eng.upload(UploadSpec(n, b.shape[0] * 256 // K, K, "q6_k", len(raw),
                                            hashlib.sha256(raw).hexdigest()), once(raw))
            y = (await eng.matmul(MatmulCall("q", x))).y
            for k in (1, 18, 19, 37):  # k above one shard's rows: that shard gives all of it
                r = await eng.matmul(MatmulCall("q", x, topk=k))
                assert r.y is None and r.topk is not None
                t = pb.TopKResult(rows=3, k=k, values=r.topk.values.tobytes(),
                                  indices=r.topk.indices.tobytes(), lse=r.topk.lse.tobytes())
                check_topk(t, y, k)
            with pytest.raises(Exception, match="topk k=38 exceeds the 37 rows of weight 'q'"):
                await eng.matmul(MatmulCall("q", x, topk=38))
            jobs = [e.device.jobs for e in eng.engines]
            both = await start_matmul_weights(eng, MatmulCall("", x, topk=5, weights=("k", "q")))
            # each device ran the parts it got (its shard of both, or its replicas' picks) in
            # one job
            ran = [e.device.jobs - j for e, j in zip(eng.engines, jobs, strict=True)]
            assert ran == [1, 1] if placement == "shard" else sum(ran) in (1, 2) and max(ran) == 1
            for (name, r), want in zip(both, ("k", "q"), strict=True):
                assert name == want
                assert r.topk is not None and r.topk.values.shape == (3, 5)
                full = (await eng.matmul(MatmulCall(name, x))).y
                assert_close(full, reference(blocks[name], full.shape[1], K, x))
                np.testing.assert_array_equal(r.topk.indices, topk_reference(full, 5).indices)
        finally:
            await eng.close()

    asyncio.run(main())


def test_topk_with_non_finite_rows_at_q8_1(loaded, stub) -> None:  # type: ignore[no-untyped-def]
    """q8_1 runs rows holding NaN/Inf at exact (kernels.api.matmul_ieee): with topk the two
    parts' epilogue rows are put back in order; a NaN row ranks NaN first and its lse is NaN."""
    worker, _ = loaded
    x = _x(4, seed=9)
    x[1, 3] = np.nan
    req = _req("q", x, topk=5)
    req.precision = pb.PRECISION_Q8_1
    r = stub.Matmul(req)
    v, _, lse = _topk(r.topk)
    assert np.isnan(v[1]).all() and np.isnan(lse[1])
    finite = [0, 2, 3]
    plain = _req("q", x[finite])
    plain.precision = pb.PRECISION_Q8_1
    check_topk(_subset(r.topk, finite), decode_tensor(stub.Matmul(plain).y), 5)
    assert_idle(worker)


def _subset(t: pb.TopKResult, rows: list[int]) -> pb.TopKResult:
    v, i, lse = _topk(t)
    return pb.TopKResult(rows=len(rows), k=t.k, values=v[rows].tobytes(),
                         indices=i[rows].tobytes(), lse=lse[rows].tobytes())
