"""Several front-end processes per device (issue 15, item 2) on the NumPy backend: matmuls
through every front end, the error contract, regions, status/flags/health/metrics through
them, a front end killed mid-call, drain, and the `q6serve worker --frontends 2` command."""

from __future__ import annotations

import asyncio
import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from q6serve.client.client import Client, Q6ServeError
from q6serve.client.retry import RetryPolicy
from q6serve.service.config import Budget, WorkerConfig
from q6serve.service.frontends import FrontendsWorker
from tests.dataplane.tol import assert_ref, assert_topk
from tests.service.svc_util import InstrumentedBackend, make_backend, random_q6k, reference

ROWS, K = 96, 512


class Running:
    """A FrontendsWorker (the device process) on a private loop thread of this process."""

    def __init__(self, config: WorkerConfig, backend: Any = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.registry = CollectorRegistry()
        self.worker = FrontendsWorker(config, backend or make_backend(), self.registry)
        self.call(self.worker.start(), 120)
        self.target = self.worker.target
        self.clients: list[Client] = []

    def call(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def client(self, **kw: Any) -> Client:
        """A client on its own TCP connection (gRPC shares one between channels to the same
        target unless told not to), so SO_REUSEPORT may place it on any front end."""
        ch = grpc.insecure_channel(self.target, options=[("grpc.use_local_subchannel_pool", 1)])
        c = Client(self.target, channel=ch, **kw)
        self.clients.append(c)
        return c

    def stop(self, grace: float = 2.0) -> None:
        if self.loop.is_closed():
            return
        for c in self.clients:
            c.close()
        self.call(self.worker.stop(grace), 60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def start() -> Iterator[Callable[..., Running]]:
    started: list[Running] = []

    def go(backend: Any = None, **kw: Any) -> Running:
        cfg = WorkerConfig(**{"host": "127.0.0.1", "port": 0,
                              "vram_budget": Budget(nbytes=64 << 20), "grace_period_s": 2.0,
                              "allow_shm": True, "frontends": 2, "frontend_shm_bytes": 8 << 20,
                              "max_batch_delay_us": 0, **kw})
        r = Running(cfg, backend)
        started.append(r)
        return r

    yield go
    for r in started:
        r.stop()


def arenas(pids: Any) -> list[str]:
    """Front-end arenas of these pids still named in /dev/shm (they are unlinked at start)."""
    return [n for n in os.listdir("/dev/shm") if any(f"q6fe_{p}_" in n for p in pids)]


def test_every_frontend_serves_the_whole_contract(start: Callable[..., Running],
                                                  rng: np.random.Generator) -> None:
    w = start()
    blocks = random_q6k(ROWS, K, 11)
    first = w.client()
    first.upload("w", blocks, ROWS, K)
    x = rng.standard_normal((3, K)).astype(np.float16)
    want = reference(blocks, ROWS, K, x)
    for _ in range(40):  # connections land on front ends by the kernel's hash: try a few
        c = w.client()
        assert_ref(c.matmul("w", x), want)
        if all(w.worker.frontend_calls.get(i, 0) for i in range(2)):
            break
    calls = w.worker.frontend_calls
    assert calls[0] > 0 and calls[1] > 0, calls
    assert arenas(w.worker.frontend_pids.values()) == []
    for c in w.clients[-2:]:  # the last client, and one more on the other front end
        # the error contract, as with one process
        with pytest.raises(Q6ServeError) as e:
            c.matmul("nope", x)
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(Q6ServeError) as e:
            c.matmul("w", np.zeros((2, 256), np.float32))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "K=256" in e.value.message
        outs = {o.request_id: o for o in c.matmul_stream([("a", "w", x), ("b", "nope", x)])}
        assert_ref(outs["a"].y, want)
        assert outs["b"].code == grpc.StatusCode.NOT_FOUND  # type: ignore[union-attr]
        # big activations travel in the message instead of a slot (8 MiB arena, 4 MiB slots)
        big = rng.standard_normal((256, K)).astype(np.float32)
        y = c.matmul_full("w", big).y
        assert_ref(y, reference(blocks, ROWS, K, big))
        # regions live in the device process: registered through one front end, used (or
        # refused) through any
        assert [wt.name for wt in c.list()] == ["w"] and c.get("w").rows == ROWS
        assert c.status().serving and c.health()
        assert c.flags()["Q6SERVE_DYNAMIC_BATCHING"] is True
    with first.register_shm("r", 1 << 16) as region:
        for c in w.clients:
            assert_ref(c.matmul("w", x, x_region=region, y_region=(region, 8192)), want)
        assert [r.name for r in w.clients[-1].list_regions()] == ["r"]
    # one /metrics: the front ends' request metrics reach the device process's registry
    time.sleep(0.5)
    ok = w.registry.get_sample_value("q6serve_requests_total",
                                     {"service": "q6serve.v1.Q6Serve", "method": "Matmul",
                                      "code": "OK"})
    assert ok is not None and ok >= len(w.clients), ok


def _killed_mid_call(w: Running, calls: list[Callable[[], Any]]) -> list[str]:
    """``calls`` started on threads, front end 0 SIGKILLed while they run on the device: their
    outcomes ("OK" or the status' name), once a replacement front end serves."""
    victim = w.worker.frontend_pids[0]
    with ThreadPoolExecutor(len(calls)) as pool:
        futs = [pool.submit(fn) for fn in calls]
        time.sleep(0.15)  # the calls are on the device now
        os.kill(victim, signal.SIGKILL)
        outcomes = []
        for f in futs:
            try:
                f.result(30)
                outcomes.append("OK")
            except Q6ServeError as e:
                outcomes.append(e.code.name)
    deadline = time.monotonic() + 60
    while w.worker.frontend_pids[0] == victim or 0 not in w.worker.frontend_calls:
        assert time.monotonic() < deadline, "no replacement front end"
        time.sleep(0.1)
    return outcomes


def test_frontend_killed_mid_call(start: Callable[..., Running],
                                  rng: np.random.Generator) -> None:
    """SIGKILL a front end while calls run through it: those calls fail UNAVAILABLE, the
    device process keeps serving through the other one, and a replacement starts."""
    w = start(backend=InstrumentedBackend(matmul_delay=0.3))
    clients = [w.client(retry=RetryPolicy(attempts=1)) for _ in range(8)]
    blocks = random_q6k(ROWS, K, 3)
    clients[0].upload("w", blocks, ROWS, K)
    x = rng.standard_normal((1, K)).astype(np.float32)
    for c in clients:
        c.matmul("w", x)  # every client connected (to some front end)
    victim = w.worker.frontend_pids[0]
    outcomes = _killed_mid_call(w, [functools.partial(c.matmul, "w", x) for c in clients])
    assert set(outcomes) <= {"OK", "UNAVAILABLE"}, outcomes
    fresh = w.client()
    assert_ref(fresh.matmul("w", x), reference(blocks, ROWS, K, x))
    assert fresh.status().serving
    assert w.call(_in_flight(w)) == 0  # nothing of the dead front end's left queued
    assert arenas([victim, *w.worker.frontend_pids.values()]) == []


async def _in_flight(w: Running) -> int:
    return sum(v.in_flight for v in w.worker.engine.list())


def test_frontend_killed_mid_region_call_leaks_nothing(start: Callable[..., Running],
                                                       rng: np.random.Generator) -> None:
    """SIGKILL a front end while region calls (x and y in the callers' regions) run through it:
    those calls fail UNAVAILABLE or finish; once the device is done, the device process holds
    no region, no call and no arena of the dead front end (its arena closed when its last call
    ended), and the regions serve on through the other front end and the replacement."""
    w = start(backend=InstrumentedBackend(matmul_delay=0.3))
    clients = [w.client(retry=RetryPolicy(attempts=1)) for _ in range(6)]
    blocks = random_q6k(ROWS, K, 3)
    clients[0].upload("w", blocks, ROWS, K)
    x = rng.standard_normal((1, K)).astype(np.float32)
    regions = [c.register_shm(f"r{i}", 1 << 16) for i, c in enumerate(clients)]
    for c, r in zip(clients, regions, strict=True):
        c.matmul("w", x, x_region=r, y_region=(r, 8192))  # each connected to a front end
    dead = w.worker._fronts[0]
    outcomes = _killed_mid_call(w, [functools.partial(c.matmul, "w", x, x_region=r,
                                                      y_region=(r, 8192))
                                    for c, r in zip(clients, regions, strict=True)])
    assert set(outcomes) <= {"OK", "UNAVAILABLE"}, outcomes

    async def left() -> tuple[Any, ...]:
        table = w.worker.regions
        return (sum(r.users for r in table._regions.values()), w.worker._pending,
                dead.alive, dead.pending, dead.arena.base is None)

    deadline = time.monotonic() + 10
    while w.call(left()) != (0, 0, False, 0, True):
        assert time.monotonic() < deadline, w.call(left())
        time.sleep(0.05)
    assert w.call(_in_flight(w)) == 0
    for c, r in zip(clients, regions, strict=True):  # every region serves on
        assert_ref(c.matmul("w", x, x_region=r, y_region=(r, 8192)),
                   reference(blocks, ROWS, K, x))
        r.close()


def test_drain_finishes_in_flight_calls(start: Callable[..., Running],
                                        rng: np.random.Generator) -> None:
    w = start(backend=InstrumentedBackend(matmul_delay=0.4))
    c = w.client()
    c.upload("w", random_q6k(ROWS, K, 5), ROWS, K)
    x = rng.standard_normal((1, K)).astype(np.float32)
    c.matmul("w", x)
    procs = list(w.worker._procs.values())
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(c.matmul, "w", x)
        while not w.call(_in_flight(w)):  # on the device now (bounded by the call's timeout)
            assert not slow.done()
            time.sleep(0.01)
        stopping = threading.Thread(target=lambda: w.call(w.worker.stop(2.0)))
        stopping.start()
        assert slow.result(30).shape == (1, ROWS)  # the in-flight call finished
        stopping.join(60)
    assert all(p.poll() is not None for p in procs)  # every front end exited
    assert w.worker.engine.status().vram.weights == 0


def test_worker_command_with_frontends(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "q6serve.client.cli", "worker", "--port", "0", "--backend",
         "numpy", "--vram-budget", "64MiB", "--frontends", "2", "--frontend-shm-bytes",
         "4194304", "--grace-period", "2"], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        m = re.search(r"listening on (\S+:\d+)$", first.strip())
        assert m, first
        with Client(m.group(1)) as c:
            c.upload("w", random_q6k(ROWS, K, 1), ROWS, K)
            assert c.matmul("w", np.ones((1, K), np.float32)).shape == (1, ROWS)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_multi_weight_and_topk_through_frontends(start: Callable[..., Running],
                                                 rng: np.random.Generator) -> None:
    """Everything a one-process worker serves, N front ends serve: multi-weight requests (y of
    every weight in the request's slot, or in the message when they do not fit), the top-k
    epilogue, both in unary and stream calls, with the same error contract."""
    w = start(frontend_shm_bytes=4 << 20)  # two 2 MiB slots per front end
    c = w.client()
    shapes = {"q": (96, 11), "k": (64, 12), "big": (2048, 13)}
    blocks = {}
    for name, (rows, seed) in shapes.items():
        blocks[name] = random_q6k(rows, K, seed)
        c.upload(name, blocks[name], rows, K)
    c.upload("other_k", random_q6k(32, 256, 14), 32, 256)
    x = rng.standard_normal((3, K)).astype(np.float32)
    want = {n: reference(b, shapes[n][0], K, x) for n, b in blocks.items()}
    for cl in (c, w.client()):
        ys = cl.matmul_multi(["q", "k"], x)
        for y, n in zip(ys, ("q", "k"), strict=True):
            assert_ref(y, want[n])
        # 256 x 2048 f32 of "big" (2 MiB) does not fit the slot after q's y: it travels inline
        xl = rng.standard_normal((256, K)).astype(np.float32)
        ys = cl.matmul_multi(["q", "big"], xl)
        assert_ref(ys[1], reference(blocks["big"], 2048, K, xl), atol=1e-3)
        assert_ref(ys[0], reference(blocks["q"], 96, K, xl), atol=1e-3)
        assert_topk(cl.matmul_topk("big", x, 5), want["big"], 5)
        outs = {o.request_id: o for o in cl.matmul_stream(
            [("m", ["q", "k"], x), ("t", "q", x), ("bad", ["q", "other_k"], x)])}
        assert [o.weight for o in outs["m"].outputs] == ["q", "k"]  # type: ignore[union-attr]
        assert_ref(outs["m"].outputs[1].y, want["k"])  # type: ignore[union-attr]
        assert outs["t"].y.shape == (3, 96)  # type: ignore[union-attr]
        bad = outs["bad"]
        assert isinstance(bad, Q6ServeError) and bad.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "other_k" in bad.message and "K=256" in bad.message
        # the same refusals as one process: unknown weight named, k beyond the rows
        with pytest.raises(Q6ServeError) as e:
            cl.matmul_multi(["q", "nope"], x)
        assert e.value.code == grpc.StatusCode.NOT_FOUND and "weights[1] 'nope'" in \
            e.value.message
        with pytest.raises(Q6ServeError) as e:
            cl.matmul_topk("k", x, 65)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "64 rows" in e.value.message
    assert w.call(_in_flight(w)) == 0


def test_admission_holds_for_the_whole_worker(start: Callable[..., Running],
                                              rng: np.random.Generator) -> None:
    """--max-inflight-rpcs bounds the worker, not each front end: with 2 front ends and a
    limit of 3, twelve callers on their own connections never have more than 3 matmuls in
    the device process at once (before the split each front end admitted 3)."""
    from q6serve.service.frontends_front import frontend_limits

    cfg = WorkerConfig(frontends=3, max_inflight_rpcs=10, max_stream_bytes_total=1000,
                       max_streams=20)
    limits = [frontend_limits(cfg, i) for i in range(3)]
    assert [sum(col) for col in zip(*limits, strict=True)] == [10, 1000, 20]
    w = start(backend=InstrumentedBackend(matmul_delay=0.05), max_inflight_rpcs=3,
              max_inflight_rpcs_per_connection=3)
    w.client().upload("w", random_q6k(ROWS, K, 2), ROWS, K)
    x = rng.standard_normal((1, K)).astype(np.float32)
    clients: list[Client] = []
    while len(clients) < 12 or not all(w.worker.frontend_calls.get(i, 0) for i in range(2)):
        assert len(clients) < 60, "every connection landed on one front end"
        clients.append(w.client())
        clients[-1].matmul("w", x)  # connected, to the front end the kernel chose
    w.worker.pending_peak = 0
    with ThreadPoolExecutor(len(clients)) as pool:
        outs = list(pool.map(lambda c: [c.matmul("w", x) for _ in range(4)], clients))
    assert len(outs) == len(clients)
    assert 1 <= w.worker.pending_peak <= 3, w.worker.pending_peak


class _Writer:
    """What _Link writes to, captured (a transport stand-in)."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def write(self, b: bytes) -> None:
        self.data += b

    def is_closing(self) -> bool:
        return False

    def messages(self) -> list[tuple[Any, ...]]:
        import struct

        from q6serve.service.frontends_ipc import _decode

        out, at = [], 0
        while at < len(self.data):
            (n,) = struct.unpack_from("<Q", self.data, at)
            out.append(_decode(bytes(self.data[at + 8 : at + 8 + n])))
            at += 8 + n
        self.data.clear()
        return out


def _proxy(slots: int) -> tuple[Any, _Writer, Any, Any]:
    """A front end's EngineProxy over a link whose writes are captured (call in a loop)."""
    from q6serve.service.frontends_arena import Arena
    from q6serve.service.frontends_proxy import EngineProxy, _Link

    arena = Arena.create(slots, 1 << 16)
    arena.unlink()
    w = _Writer()
    link = _Link(arena)
    link.connection_made(w)  # type: ignore[arg-type]
    return arena, w, link, EngineProxy(link)


def test_front_end_stacks_small_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """EngineProxy: calls of one loop iteration for the same weight, dtypes and K go to the
    device process as one stacked request; each caller gets its own rows of y and its sink
    runs in the trip that reads the answer (a small y is copied out and its slot is free at
    once; a big one is viewed in the slot, which is free again once the views are gone); a
    caller that gave up is skipped; an error reaches every caller of the stack; other calls
    are sent on their own."""
    import gc

    from q6serve.kernels.api import Precision
    from q6serve.kernels.errors import InvalidArgument, NotFound
    from q6serve.service import frontends_proxy
    from q6serve.service.engine_types import MatmulCall

    async def main() -> None:
        arena, w, link, proxy = _proxy(4)
        xs = [np.full((n, K), i + 1, np.float32) for i, n in enumerate((1, 2, 1))]
        for copy_max in (1 << 16, 0):  # y copied out of the slot, then y viewed in it
            monkeypatch.setattr(frontends_proxy, "COPY_Y_BYTES", copy_max)
            told: list[asyncio.Future[Any]] = []
            futs = [proxy.start_matmul(MatmulCall("w", x), told.append) for x in xs]
            odd = proxy.start_matmul(MatmulCall("w", np.ones((1, K), np.float16)))  # dtype
            gone = proxy.start_matmul(MatmulCall("w", xs[0]), told.append)
            gone.cancel()
            solo = proxy.start_matmul(MatmulCall("w", np.ones((1, K), np.float32),
                                                 Precision.EXACT))
            for _ in range(3):  # the group's flush, then the writer's
                await asyncio.sleep(0)
            msgs = w.messages()
            assert [m[0] for m in msgs] == ["mm", "mm", "mm"]
            stacked = next(m for m in msgs if m[8] == ("f32", (4, K)))
            rid, slot = stacked[1], stacked[9]
            x = arena.array(slot, np.dtype("<f4"), (4, K), writable=False)
            np.testing.assert_array_equal(x[:, 0], [1, 2, 2, 3])  # the three callers' rows
            del x
            y = arena.array(slot, np.dtype("<f4"), (4, 8), writable=True)
            y[...] = np.arange(32).reshape(4, 8)
            del y
            fields = ("k", "soa", "exact", 0.0, 1e-5, 4, 1, 2e-5, None)
            link._answer(("mmok", rid, fields, [(0, "f32", (4, 8))]))
            assert told == futs  # each sink once, in order, in this trip; not the cancelled
            assert link.rows == {"w": 8}  # noted for the stream's back-pressure estimate
            ys = [f.result().y for f in futs]
            assert [y.shape for y in ys] == [(1, 8), (2, 8), (1, 8)]
            np.testing.assert_array_equal(ys[1], np.arange(8, 24).reshape(2, 8))
            assert futs[0].result().precision is Precision.EXACT
            if copy_max:
                assert slot in link.free_slots  # copied out: free at once
            else:
                assert slot not in link.free_slots  # still viewed by the callers' ys
            del ys, futs, told
            await asyncio.sleep(0)
            gc.collect()
            assert slot in link.free_slots
            for f in (odd, solo):
                assert not f.done()
                f.cancel()
        # an error reaches every caller of a stack
        a, b = (proxy.start_matmul(MatmulCall("nope", xs[0])) for _ in range(2))
        for _ in range(3):
            await asyncio.sleep(0)
        (m,) = w.messages()
        link._answer(("err", m[1], NotFound("no weight named 'nope'")))
        assert isinstance(a.exception(), NotFound) and isinstance(b.exception(), NotFound)
        # INVALID_ARGUMENT may be one caller's input: the stack is sent again one by one
        a, b = (proxy.start_matmul(MatmulCall("w", xs[0])) for _ in range(2))
        for _ in range(3):
            await asyncio.sleep(0)
        (m,) = w.messages()
        link._answer(("err", m[1], InvalidArgument("values the kernel cannot take")))
        for _ in range(2):
            await asyncio.sleep(0)
        again = w.messages()
        shapes = [m[8][1] if isinstance(m[8], tuple) else m[8].shape for m in again]
        assert shapes == [(1, K)] * 2 and not a.done()  # (x in a slot, or in the message)
        for m in again:
            link._answer(("err", m[1], InvalidArgument("yours")))
        assert isinstance(a.exception(), InvalidArgument)
        arena.close()

    asyncio.run(main())


def test_front_end_holds_calls_behind_stacks_in_flight() -> None:
    """EngineProxy: with ``stacks_in_flight`` stacks of a key on the device, later calls of
    that key wait and go out as ONE stack when the first is answered; other keys are not
    held; when the device process goes away the waiting calls fail UNAVAILABLE."""
    from q6serve.kernels.errors import InvalidArgument, Unavailable
    from q6serve.service.engine_types import MatmulCall
    from q6serve.service.frontends_proxy import stacks_in_flight

    assert stacks_in_flight({}) == 2 and stacks_in_flight({"Q6SERVE_FRONTEND_STACKS": "3"}) == 3
    assert stacks_in_flight({"Q6SERVE_FRONTEND_STACKS": "0"}) > 1 << 20  # no limit
    with pytest.raises(InvalidArgument, match="Q6SERVE_FRONTEND_STACKS='two'"):
        stacks_in_flight({"Q6SERVE_FRONTEND_STACKS": "two"})

    async def main() -> None:
        arena, w, link, proxy = _proxy(8)
        assert proxy.stacks_in_flight == 2

        async def call(x: np.ndarray) -> tuple[asyncio.Future[Any], list[tuple[Any, ...]]]:
            fut = proxy.start_matmul(MatmulCall("w", x))
            for _ in range(2):  # the proxy's flush, then the writer's
                await asyncio.sleep(0)
            return fut, w.messages()

        one = np.ones((1, K), np.float32)
        a, sent_a = await call(one)
        b, sent_b = await call(one * 2)
        assert len(sent_a) == len(sent_b) == 1  # two stacks on the device
        c, sent_c = await call(one * 3)
        d, sent_d = await call(one * 4)
        assert sent_c == sent_d == []  # held
        other, sent_o = await call(np.ones((1, K), np.float16))
        assert len(sent_o) == 1  # another key is not held
        fields = ("k", "soa", "exact", 0.0, 1e-5, 1, 1, 2e-5, None)
        link._answer(("mmok", sent_a[0][1], fields, [(0, "f32", (1, 8))]))
        assert a.result().y.shape == (1, 8)
        for _ in range(2):
            await asyncio.sleep(0)
        (stacked,) = w.messages()  # the held calls, as one stack
        assert stacked[8] == ("f32", (2, K))
        x = arena.array(stacked[9], np.dtype("<f4"), (2, K), writable=False)
        np.testing.assert_array_equal(x[:, 0], [3, 4])
        del x
        e, sent_e = await call(one * 5)
        assert sent_e == []  # b and the new stack are on the device
        link.connection_lost(None)
        for _ in range(2):
            await asyncio.sleep(0)
        for f in (b, c, d, e, other):
            assert isinstance(f.exception(), Unavailable), f
        assert w.messages() == []
        arena.close()

    asyncio.run(main())


def test_front_end_sinks_run_in_the_answering_trip() -> None:
    """EngineProxy: a call's sink runs once, in the trip that reads its answer (as the
    Engine's: no done callback a trip later), for a plain call, a multi-weight call whose
    rows are noted per weight, a refusal and the device process going away; a sink that
    raises is logged and the link stays up for the other callers; y read from the slot is the
    device's; a cancelled caller's sink is not called."""
    from q6serve.kernels.errors import NotFound, Unavailable
    from q6serve.service.engine_types import MatmulCall
    from q6serve.service.frontends_ipc import FRAME, _encode

    async def main() -> None:
        arena, w, link, proxy = _proxy(4)
        told: list[tuple[str, asyncio.Future[Any]]] = []

        def sink(name: str) -> Callable[[asyncio.Future[Any]], None]:
            return lambda f: told.append((name, f))

        def boom(f: asyncio.Future[Any]) -> None:
            raise RuntimeError("a servicer's sink failed")

        big = np.ones((40, K), np.float32)  # not stacked: one request of its own
        plain = proxy.start_matmul(MatmulCall("w", big), sink("plain"))
        multi = proxy.start_matmul(MatmulCall("", big[:1], weights=("a", "b")), sink("multi"))
        bad = proxy.start_matmul(MatmulCall("w", big[:1] * 2), boom)  # stacked alone
        gone = proxy.start_matmul(MatmulCall("w", big), sink("gone"))
        gone.cancel()
        for _ in range(2):
            await asyncio.sleep(0)
        sent = {m[1]: m for m in w.messages()}
        assert len(sent) == 4 and not told
        p_rid, m_rid, g_rid, b_rid = sorted(sent)  # the stack went at the trip's end
        assert sent[m_rid][3] == ("a", "b") and sent[b_rid][8] == ("f32", (1, K))
        fields = ("k", "soa", "exact", 0.0, 1e-5, 40, 1, 2e-5, None)
        slot = sent[p_rid][9]
        arena.array(slot, np.dtype("<f4"), (40, 8), writable=True)[...] = 7
        link._answer(("mmok", p_rid, fields, [(0, "f32", (40, 8))]))
        assert told == [("plain", plain)]
        np.testing.assert_array_equal(plain.result().y, np.full((40, 8), 7, np.float32))
        ya, yb = np.zeros((1, 3), np.float32), np.ones((1, 5), np.float32)  # not in a slot
        link._answer(("mmok", m_rid, [("a", fields), ("b", fields)], [ya, yb]))
        assert told[-1] == ("multi", multi) and [r.y.shape for _, r in multi.result()] == [
            (1, 3), (1, 5)]
        assert link.rows == {"w": 8, "a": 3, "b": 5}
        refusal = _encode(("err", b_rid, NotFound("no weight named 'w'")))
        link.data_received(FRAME.pack(len(refusal)) + refusal)  # its sink raises
        assert isinstance(bad.exception(), NotFound) and not w.closed
        link._answer(("mmok", g_rid, fields, [(0, "f32", (40, 8))]))  # nobody waits
        assert len(told) == 2
        # the device process goes away: the waiting call and the held stack's fail, told
        held = [proxy.start_matmul(MatmulCall("w", big[:1]), sink(f"held{i}"))
                for i in range(3)]
        for _ in range(2):
            await asyncio.sleep(0)
        assert len(w.messages()) == 1 and len(link.free_slots) == 3  # y copied: slots free
        link.connection_lost(None)
        assert [n for n, _ in told[2:]] == ["held0", "held1", "held2"]
        assert all(isinstance(f.exception(), Unavailable) for f in held)
        arena.close()

    asyncio.run(main())


def test_concurrent_callers_get_their_own_rows(start: Callable[..., Running],
                                               rng: np.random.Generator) -> None:
    """Many callers at once through the front ends (their calls stacked as it happens):
    every caller gets the result of its own x."""
    callers_get_their_own_rows(start(backend=InstrumentedBackend(matmul_delay=0.01)), 12, 6,
                               rng)


def callers_get_their_own_rows(w: Running, callers: int, calls: int,
                               rng: np.random.Generator) -> None:
    """``callers`` clients at once, each on its own connection, ``calls`` each of 1-3 rows of
    its own x on a fresh weight "w": each result is its own x's."""
    blocks = random_q6k(ROWS, K, 9)
    w.client().upload("w", blocks, ROWS, K)
    clients = [w.client() for _ in range(callers)]
    xs = [rng.standard_normal((1 + i % 3, K)).astype(np.float32) for i in range(callers)]
    want = [reference(blocks, ROWS, K, x) for x in xs]

    def run(i: int) -> None:
        for _ in range(calls):
            assert_ref(clients[i].matmul("w", xs[i]), want[i])

    with ThreadPoolExecutor(callers) as pool:
        list(pool.map(run, range(callers)))


def test_region_calls_through_frontends(start: Callable[..., Running],
                                        rng: np.random.Generator) -> None:
    """x and y both in regions take the front ends' "rm" message (the device process checks,
    holds and answers from the engine's sink): results equal the bytes path on every front
    end, unary and stream; bad regions get the one-process statuses; nothing stays held."""
    from multiprocessing import shared_memory

    from q6serve.client.shm import ShmRegion
    from tests.dataplane.test_regions import matmul_raw

    w = start()
    first = w.client()
    blocks = random_q6k(ROWS, K, 13)
    first.upload("w", blocks, ROWS, K)
    x = rng.standard_normal((3, K)).astype(np.float32)
    want = reference(blocks, ROWS, K, x)
    C = grpc.StatusCode

    def code(fn: Callable[..., Any], *a: Any, **kw: Any) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(Q6ServeError) as e:
            fn(*a, **kw)
        return e.value.code, e.value.message

    with first.register_shm("r", 1 << 16) as region:
        for _ in range(40):  # clients on both front ends (the kernel's hash places them)
            c = w.client()
            assert_ref(c.matmul("w", x, x_region=region, y_region=(region, 8192)), want)
            if len(w.clients) > 3 and all(w.worker.frontend_calls.get(i, 0)
                                          for i in range(2)):
                break
        assert all(w.worker.frontend_calls.get(i, 0) for i in range(2))
        for c in w.clients[-2:]:
            outs = {o.request_id: o for o in c.matmul_stream(
                [("bad", "w", x, region, (region, 65536 - 100)),
                 ("ok", "w", x, region, (region, 16384)),
                 ("nope", "nope", x, region, (region, 16384))])}
            assert_ref(outs["ok"].y, want)
            assert outs["bad"].code == C.INVALID_ARGUMENT  # type: ignore[union-attr]
            assert outs["nope"].code == C.NOT_FOUND  # type: ignore[union-attr]
            # the one-process statuses (tests/dataplane/test_regions.py)
            got = code(c.matmul, "w", x, x_region=region, y_region=(region, 65500))
            assert got[0] == C.INVALID_ARGUMENT and "overruns region 'r'" in got[1], got
            got = matmul_raw(c, x, ("r", 65000), y_ref=("r", 0))
            assert got[0] == C.INVALID_ARGUMENT and "overruns" in got[1], got
            assert matmul_raw(c, x, ("r", 2), y_ref=("r", 8192))[0] == C.INVALID_ARGUMENT
            with ShmRegion.create("ghost", 8192) as ghost:
                assert code(c.matmul, "w", x, x_region=ghost,
                            y_region=(region, 0))[0] == C.NOT_FOUND
            wrong = rng.standard_normal((2, 256)).astype(np.float32)
            assert code(c.matmul, "w", wrong, x_region=region,
                        y_region=(region, 8192))[0] == C.INVALID_ARGUMENT
    # unlinked under the worker
    shm = shared_memory.SharedMemory(create=True, size=1 << 16)
    gone = ShmRegion("gone", shm, owned=True)
    first.register_region(gone)
    first.matmul("w", x, x_region=gone, y_region=(gone, 8192))
    shm.unlink()
    gone.owned = False
    got = code(first.matmul, "w", x, x_region=gone, y_region=(gone, 8192))
    assert got[0] == C.FAILED_PRECONDITION and "unlinked" in got[1], got
    first.unregister_region("gone")
    shm.close()

    async def held() -> tuple[int, int, int]:
        table = w.worker.regions
        assert table is not None
        return len(table), table.mapped_bytes, w.worker._pending

    assert w.call(held()) == (0, 0, 0)


def test_another_callers_region_through_frontends(start: Callable[..., Running]) -> None:
    """A region belongs to the caller that registered it on every front end: another token's
    matmul naming it (x or y) or unregistering it is PERMISSION_DENIED, and it does not list
    it (tests/dataplane/test_regions.py's one-process case, through the front ends)."""
    from tests.dataplane.test_regions import ADMIN, TOKEN

    w = start(token=TOKEN, admin_token=ADMIN)
    user, admin = w.client(token=TOKEN), w.client(token=ADMIN)
    x = np.ones((1, K), np.float32)
    admin.upload("w", random_q6k(ROWS, K, 3), ROWS, K)

    def denied(fn: Callable[..., Any], *a: Any, **kw: Any) -> None:
        with pytest.raises(Q6ServeError) as e:
            fn(*a, **kw)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED, e.value
        assert "another caller" in e.value.message

    with user.register_shm("mine", 8192) as region:
        for other in (admin, w.client(token=ADMIN)):  # (two connections: any front end)
            assert other.list_regions() == []
            denied(other.matmul, "w", x, x_region=region)
            denied(other.matmul, "w", x, x_region=region, y_region=(region, 4096))
            denied(other.unregister_region, "mine")
        user.matmul("w", x, x_region=region, y_region=(region, 4096))
        assert [r.name for r in user.list_regions()] == ["mine"]


@pytest.mark.parametrize("raw", ["soon", "-5", "inf", "nan"])
def test_a_bad_frontend_busy_poll_value_is_refused_by_name(raw: str) -> None:
    from q6serve.kernels.errors import InvalidArgument
    from q6serve.service.frontends_front import FRONTEND_BUSY_POLL_ENV, frontend_busy_poll_us

    with pytest.raises(InvalidArgument, match=f"{FRONTEND_BUSY_POLL_ENV}={raw!r}"):
        frontend_busy_poll_us({FRONTEND_BUSY_POLL_ENV: raw})


def test_frontend_busy_poll_is_off_unless_asked() -> None:
    """Off by default, whatever the worker's own busy polling (Q6SERVE_BUSY_POLL_US)."""
    from q6serve.service.frontends_front import FRONTEND_BUSY_POLL_ENV, frontend_busy_poll_us

    assert frontend_busy_poll_us({}) == 0
    assert frontend_busy_poll_us({"Q6SERVE_BUSY_POLL_US": "1000"}) == 0
    assert frontend_busy_poll_us({FRONTEND_BUSY_POLL_ENV: " 250 "}) == 250


def test_busy_polling_front_ends_serve(start: Callable[..., Running],
                                       monkeypatch: pytest.MonkeyPatch,
                                       rng: np.random.Generator) -> None:
    """With Q6SERVE_FRONTEND_BUSY_POLL_US the front ends spin before they sleep (a front end
    whose loop wakes for its 200 ms metrics flush then spins the whole interval: CPU time
    while idle shows it; off, it sleeps) and every call is answered as without; a bad value
    fails the worker's start, not its front ends one by one."""
    from q6serve.service.frontends_front import FRONTEND_BUSY_POLL_ENV

    def cpu(pids: list[int]) -> float:
        return sum(sum(int(v) for v in open(f"/proc/{p}/stat").read().rsplit(")", 1)[1]
                       .split()[11:13]) for p in pids) / os.sysconf("SC_CLK_TCK")

    blocks = random_q6k(ROWS, K, 5)
    idle = {}
    for spin in ("0", "1000000"):  # 1 s: longer than any of the loop's timeouts
        monkeypatch.setenv(FRONTEND_BUSY_POLL_ENV, spin)
        w = start()
        w.client().upload("w", blocks, ROWS, K)
        for i, c in enumerate([w.client() for _ in range(4)]):
            x = rng.standard_normal((1 + i, K)).astype(np.float32)
            assert_ref(c.matmul("w", x), reference(blocks, ROWS, K, x))
        pids = list(w.worker.frontend_pids.values())
        c0, t0 = cpu(pids), time.perf_counter()
        time.sleep(0.6)
        idle[spin] = (cpu(pids) - c0) / (time.perf_counter() - t0)
        w.stop()
    assert idle["0"] < 0.2 < 0.4 < idle["1000000"], idle
    monkeypatch.setenv(FRONTEND_BUSY_POLL_ENV, "fast")
    with pytest.raises(Exception, match=FRONTEND_BUSY_POLL_ENV):
        start()


def test_round_robin_deals_connections_to_the_front_ends_in_turn(
        start: Callable[..., Running], monkeypatch: pytest.MonkeyPatch) -> None:
    """Q6SERVE_FRONTEND_ROUND_ROBIN=1 (service/reuseport.py): the k-th new connection goes to
    front end k mod N (an eBPF program on the listeners' SO_REUSEPORT group), so 16
    connections over 4 front ends are 4 each, where the kernel's hash spreads them unevenly;
    calls are served as ever. Skipped where the kernel refuses the program (no privilege)."""
    import socket

    from q6serve.service import reuseport

    if (probe := reuseport.make(1)) is None:
        pytest.skip("this kernel or these privileges refuse an SK_REUSEPORT eBPF program")
    probe.close()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    try:
        import frontend_cpu
    finally:
        sys.path.pop(0)
    monkeypatch.setenv("Q6SERVE_FRONTEND_ROUND_ROBIN", "1")
    w = start(frontends=4)
    port = int(w.target.rsplit(":", 1)[1])
    pids = list(w.worker.frontend_pids.values())
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]
    try:
        for _ in range(100):  # (each front end's gRPC accepts them from its own loop)
            got = frontend_cpu.front_sockets(port, pids)
            if sum(len(v) for v in got.values()) == 16:
                break
            time.sleep(0.05)
        assert sorted(len(v) for v in got.values()) == [4, 4, 4, 4], got
        assert w.worker._steering is not None and w.worker._steering.count() == 16
    finally:
        for c in conns:
            c.close()
    c = w.client()
    blocks = random_q6k(ROWS, K, 5)
    c.upload("w", blocks, ROWS, K)
    x = np.random.default_rng(5).standard_normal((2, K)).astype(np.float32)
    assert_ref(c.matmul("w", x, precision="exact"), reference(blocks, ROWS, K, x))
