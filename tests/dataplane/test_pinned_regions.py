"""Page-locked system regions (issue 15): a region is pinned with the backend when it is
registered and unpinned (after the device's queued copies) when it is unregistered, when its
last request finishes after an unregister, and at drain; a y region takes y straight from the
backend when the call is routed to it (kernels/hostio.py). CPU: a NumPy backend whose HostIO
records the pins and honours the routes as the CUDA backend does (x read where it is, y
written into the routed region); tests/dataplane/test_pinned_gpu.py runs the real DMA."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any

import grpc
import numpy as np
import pytest

from q6serve.client.shm import ShmRegion
from q6serve.kernels.hostio import HostIO
from tests.dataplane.test_frontends import start  # noqa: F401  (fixture)
from tests.dataplane.test_regions import ROWS, K, code_of, mapped, matmul_holding_region
from tests.dataplane.test_regions import start as one_process  # noqa: F401  (fixture)
from tests.dataplane.tol import assert_ref
from tests.service.svc_util import InstrumentedBackend, random_q6k, reference

C = grpc.StatusCode


class Recorder:
    """register / unregister / sync calls in order."""

    def __init__(self, fail: bool = False) -> None:
        self.log: list[tuple[str, int]] = []
        self.fail = fail
        self.lock_held_at_unregister: list[bool] = []
        self.io: HostIO | None = None

    def register(self, p: int, n: int) -> None:
        if self.fail:
            raise RuntimeError("cudaErrorMemoryAllocation")
        self.log.append(("register", p))

    def unregister(self, p: int) -> None:
        assert self.io is not None
        self.lock_held_at_unregister.append(self.io.lock.locked())
        self.log.append(("unregister", p))

    def sync(self) -> None:
        self.log.append(("sync", 0))

    def hostio(self) -> HostIO:
        self.io = HostIO(self.register, self.unregister, self.sync)
        return self.io


class DmaBackend(InstrumentedBackend):
    """The NumPy backend with the CUDA backend's contract for page-locked memory: an x inside
    a pinned range is read where it is (counted), a routed y is written into its region and
    returned as the result's y."""

    def __init__(self, rec: Recorder, **kw: Any) -> None:
        super().__init__(**kw)
        self.hostio = rec.hostio()
        self.direct_x = 0
        self.direct_y = 0

    def matmul(self, w: Any, x: np.ndarray, **kw: Any) -> Any:
        if self.hostio.covers(x):
            self.direct_x += 1
        dest = self.hostio.output(x, w.rows, kw.get("out_dtype"))
        r = super().matmul(w, x, **kw)
        if dest is None:
            return r
        dest[...] = r.y
        self.direct_y += 1
        return dataclasses.replace(r, y=dest)


# -- HostIO alone ---------------------------------------------------------------------------
def test_hostio_pins_covers_and_unpins_after_a_sync_under_the_lock() -> None:
    rec = Recorder()
    io = rec.hostio()
    buf = np.zeros(4096, np.uint8)
    p = buf.ctypes.data
    assert io.pin(p, 4096) and not io.pin(p, 4096)  # once per range
    assert io.pinned == 1 and io.pinned_bytes == 4096
    assert io.covers(buf[16:4096]) and io.covers(buf.view(np.float32).reshape(16, 64))
    assert not io.covers(np.zeros(8, np.uint8))  # another buffer
    assert not io.covers(buf.reshape(64, 64)[:, :8])  # not contiguous
    io.unpin(p)
    io.unpin(p)  # twice: nothing more
    assert rec.log == [("register", p), ("sync", 0), ("unregister", p)]
    assert rec.lock_held_at_unregister == [True]
    assert io.pinned == 0 and not io.covers(buf)


def test_hostio_covers_among_many_ranges() -> None:
    """With many ranges pinned (T3's 32 lanes), an array is covered only inside one of them:
    not across two adjacent ones, not past a range's end, not in another buffer, not once
    unpinned."""
    io = HostIO()
    buf = np.zeros(64 * 4096, np.uint8)
    base = buf.ctypes.data
    for i in range(0, 64, 2):  # every other 4 KiB block pinned, then the two next to block 10
        assert io.pin(base + i * 4096, 4096)
    assert io.pin(base + 11 * 4096, 4096) and io.pinned == 33
    for i in range(0, 64, 2):
        assert io.covers(buf[i * 4096 : (i + 1) * 4096]), i
        assert not io.covers(buf[i * 4096 + 4000 : (i + 1) * 4096 + 8]), i  # runs past its end
    assert not io.covers(buf[4096:8192])  # a block not pinned
    assert not io.covers(buf[10 * 4096 : 12 * 4096])  # two adjacent ranges: neither holds it
    assert not io.covers(np.zeros(8, np.uint8))  # another buffer (before or after them all)
    io.unpin(base + 10 * 4096)
    assert not io.covers(buf[10 * 4096 : 10 * 4096 + 8]) and io.covers(buf[11 * 4096 :][:8])


def test_hostio_refused_pin_leaves_the_range_unpinned() -> None:
    rec = Recorder(fail=True)
    io = rec.hostio()
    buf = np.zeros(4096, np.uint8)
    assert not io.pin(buf.ctypes.data, 4096)
    assert io.pinned == 0 and not io.covers(buf)
    io.unpin(buf.ctypes.data)
    assert rec.log == []


def test_hostio_routes_exact_x_only_and_ambiguous_routes_nobody() -> None:
    io = HostIO()
    mem = np.zeros(1 << 16, np.uint8)
    io.pin(mem.ctypes.data, mem.nbytes)
    x = mem[:2048].view(np.float32).reshape(4, 128)
    y = mem[8192 : 8192 + 4 * 16 * 4].view(np.float32).reshape(4, 16)
    key = io.route(x, y)
    assert io.output(x, 16, None) is y and io.output(x, 16, np.dtype(np.float32)) is y
    assert io.output(x, 16, np.dtype(np.float16)) is None  # the call's dtype is not y's
    assert io.output(x, 17, None) is None  # nor its shape
    assert io.output(x[:2], 16, None) is None  # same address, other rows
    assert io.output(x.copy(), 16, None) is None  # other address
    key2 = io.route(x, y[:, :8])  # a second call on the same x bytes: nobody gets a route
    assert io.output(x, 16, None) is None and io.output(x, 8, None) is None
    io.unroute(key)
    assert io.output(x, 16, None) is None  # still ambiguous until both are answered
    assert not io.unroute(key2)  # (nobody took a y)
    assert io.routes == 0
    key = io.route(x, y)
    assert io.output(x, 16, None) is y
    assert io.unroute(key)  # the backend took this call's y
    assert io.routes == 0
    # the addresses given by a caller that knows them (a region's): the same routes
    key = io.route(x, y, mem.ctypes.data, mem.ctypes.data + 8192)
    assert io.output(x, 16, None) is y and io.covers(x)
    assert io.unroute(key) and io.routes == 0
    io.pin(mem.ctypes.data + mem.nbytes, 1)  # (another range: y's address decides, not y's)
    key = io.route(x, y, mem.ctypes.data, mem.ctypes.data + mem.nbytes)
    assert io.output(x, 16, None) is None  # "y" not inside one range: not taken
    io.unroute(key)
    key3 = io.route(x, None)  # a call on these x bytes whose y comes back in the reply
    key = io.route(x, y)
    assert io.output(x, 16, None) is None  # so nobody may take a route meanwhile
    io.unroute(key3)
    assert not io.unroute(key)
    assert io.routes == 0
    ro = y.view()
    ro.flags.writeable = False
    key = io.route(x, ro)
    assert io.output(x, 16, None) is None  # not writable
    io.unroute(key)
    key = io.route(x, y)
    assert io.covers(x) and io.output(x, 16, None) is y
    io.unpin(mem.ctypes.data)  # what the route knew of the pins is forgotten
    assert not io.covers(x)
    assert io.y_for(x) is y and io.output(x, 16, None) is None  # y no longer page-locked
    io.unroute(key)
    key = io.route(x, y)
    io.unroute(key)
    assert io.y_for(x) is None and io.output(x, 16, None) is None  # answered: no route


# -- through a worker -------------------------------------------------------------------------
def _one_process(start_fn: Callable[..., Any], rec: Recorder, **kw: Any) -> tuple[Any, Any]:
    backend = DmaBackend(rec, **kw)
    w = start_fn(backend=backend)
    return w, backend


def test_one_process_pins_writes_y_in_place_and_releases(one_process: Any,  # noqa: F811
                                                         rng: np.random.Generator) -> None:
    rec = Recorder()
    w, backend = _one_process(one_process, rec)
    c = w.client()
    blocks = random_q6k(ROWS, K, 3)
    c.upload("w", blocks, ROWS, K)
    x = rng.standard_normal((3, K)).astype(np.float32)
    want = reference(blocks, ROWS, K, x)
    region = c.register_shm("r", 1 << 16)
    assert backend.hostio.pinned == 1 and backend.hostio.pinned_bytes >= 1 << 16
    got = c.matmul("w", x, x_region=region, y_region=(region, 16384))
    assert_ref(got, want)
    assert backend.direct_x == 1 and backend.direct_y == 1
    # f16 out straight into the region; x as bytes with y in the region (routed too)
    got16 = c.matmul("w", x, x_region=region, y_region=(region, 32768), out_dtype="f16")
    assert_ref(got16.astype(np.float32), want, rtol=2e-3, atol=2e-3)
    got = c.matmul("w", x, y_region=(region, 40960))
    assert_ref(got, want)
    assert backend.direct_y == 3 and backend.direct_x == 2
    # bf16 out: no route the backend can take (staged y, copied into the region as before)
    got = c.matmul("w", x, x_region=region, y_region=(region, 49152), out_dtype="bf16")
    assert_ref(got.astype(np.float32), want, rtol=2e-2, atol=2e-2)
    assert backend.direct_y == 3
    assert w.run(lambda: backend.hostio.routes) == 0
    # bad regions keep their statuses and hold nothing
    got_code, msg = code_of(lambda: c.matmul("w", x, x_region=region,
                                             y_region=(region, 65500)))
    assert got_code == C.INVALID_ARGUMENT and "overruns" in msg
    assert w.run(lambda: backend.hostio.routes) == 0
    key = region.key
    del got, got16  # (views of the client's mapping)
    region.close()  # unregisters: unpinned after a sync, then unmapped
    assert backend.hostio.pinned == 0
    assert [k for k, _ in rec.log] == ["register", "sync", "unregister"]
    assert mapped(key) == 0


def test_drain_and_unlinked_regions_unpin(one_process: Any,  # noqa: F811
                                          rng: np.random.Generator) -> None:
    rec = Recorder()
    w, backend = _one_process(one_process, rec)
    c = w.client()
    c.upload("w", random_q6k(ROWS, K, 4), ROWS, K)
    x = rng.standard_normal((2, K)).astype(np.float32)
    shm = shared_memory.SharedMemory(create=True, size=1 << 16)
    gone = ShmRegion("gone", shm, owned=True)
    c.register_region(gone)
    c.matmul("w", x, x_region=gone, y_region=(gone, 8192))
    shm.unlink()  # under the worker: a clear status, the pin stays until unregistered
    gone.owned = False
    got_code, msg = code_of(lambda: c.matmul("w", x, x_region=gone, y_region=(gone, 8192)))
    assert got_code == C.FAILED_PRECONDITION and "unlinked" in msg
    assert backend.hostio.pinned == 1
    kept = c.register_shm("kept", 8192)
    assert backend.hostio.pinned == 2
    w.stop()  # drain: every region unpinned, then unmapped
    assert backend.hostio.pinned == 0
    assert [k for k, _ in rec.log].count("unregister") == 2
    gone.close()
    kept.close()


def test_pinning_off(one_process: Any, rng: np.random.Generator,  # noqa: F811
                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("Q6SERVE_PIN_REGIONS", "0")
    rec = Recorder()
    w, backend = _one_process(one_process, rec)
    c = w.client()
    blocks = random_q6k(ROWS, K, 5)
    c.upload("w", blocks, ROWS, K)
    x = rng.standard_normal((2, K)).astype(np.float32)
    with c.register_shm("r", 1 << 16) as region:
        got = c.matmul("w", x, x_region=region, y_region=(region, 8192))
        assert_ref(got, reference(blocks, ROWS, K, x))
    assert rec.log == [] and backend.direct_x == backend.direct_y == 0


def test_unregister_while_in_use_unpins_when_the_call_ends(one_process: Any,  # noqa: F811
                                                           rng: np.random.Generator) -> None:
    rec = Recorder()
    w, backend = _one_process(one_process, rec, matmul_delay=0.5)
    c = w.client()
    blocks = random_q6k(ROWS, K, 6)
    c.upload("w", blocks, ROWS, K)
    x = rng.standard_normal((2, K)).astype(np.float32)
    region = c.register_shm("r", 1 << 16)
    t, out = matmul_holding_region(c, x, region)
    c.unregister_region("r")
    assert backend.hostio.pinned == 1  # its call still reads x and writes y
    t.join(10)
    assert_ref(out.pop(), reference(blocks, ROWS, K, x))
    assert backend.direct_y == 1
    assert w.run(lambda: backend.hostio.pinned) == 0
    region.on_close = None
    region.close()


def test_front_ends_write_y_in_place_and_release(start: Any,  # noqa: F811
                                                 rng: np.random.Generator,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The device process of a --frontends worker ("rm" messages): pinned at register, y in
    place, routes gone after every answer (good or bad), unpinned at unregister and drain."""
    monkeypatch.setenv("Q6SERVE_DP_PIN_ARENA", "0")  # (the pins counted are the regions')
    rec = Recorder()
    backend = DmaBackend(rec)
    w = start(backend=backend)
    c = w.client()
    blocks = random_q6k(ROWS, K, 7)
    c.upload("w", blocks, ROWS, K)
    x = rng.standard_normal((4, K)).astype(np.float32)
    want = reference(blocks, ROWS, K, x)
    region = c.register_shm("r", 1 << 16)
    assert w.call(_pinned(backend)) == 1
    for off in (8192, 16384):
        assert_ref(c.matmul("w", x, x_region=region, y_region=(region, off)), want)
    assert backend.direct_x >= 2 and backend.direct_y >= 2
    got_code, _ = code_of(lambda: c.matmul("w", x, x_region=region, y_region=(region, 65500)))
    assert got_code == C.INVALID_ARGUMENT
    assert w.call(_routes(backend)) == 0
    region.close()
    assert w.call(_pinned(backend)) == 0
    c.register_shm("again", 8192)
    assert w.call(_pinned(backend)) == 1
    w.stop()
    assert backend.hostio.pinned == 0 and backend.hostio.routes == 0


async def _pinned(backend: DmaBackend) -> int:
    return backend.hostio.pinned


async def _routes(backend: DmaBackend) -> int:
    return backend.hostio.routes


def test_a_refused_y_region_lets_x_region_go(start: Any,  # noqa: F811
                                             rng: np.random.Generator) -> None:
    """Through front ends: a call whose x region is good and whose y region is refused (not
    registered) is answered NOT_FOUND, and x's region is let go (its hold was taken first: a
    hold of both in one expression left x's counted, so its unregister never closed it)."""
    backend = DmaBackend(Recorder())
    w = start(backend=backend)
    c = w.client()
    c.upload("w", random_q6k(ROWS, K, 8), ROWS, K)
    x = rng.standard_normal((1, K)).astype(np.float32)
    region = c.register_shm("good", 1 << 16)
    other = ShmRegion.create("nope", 1 << 16)  # (never registered)
    code, _ = code_of(lambda: c.matmul("w", x, x_region=region, y_region=(other, 0)))
    other.close()
    assert code == grpc.StatusCode.NOT_FOUND

    async def users() -> int:
        return w.worker.regions._regions["good"].users  # type: ignore[no-any-return]

    assert w.call(users()) == 0
    region.close()


def test_region_frames_parsed_undecoded_and_counted(start: Any,  # noqa: F811
                                                    rng: np.random.Generator, tmp_path: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The device process parses a region call's frame itself (b"G": ``_region_frame``, no
    decoded tuple or dispatch), and Q6SERVE_DP_STATS counts it as a message of its rows."""
    from q6serve.service import frontends_ipc

    monkeypatch.setenv("Q6SERVE_DP_STATS", str(tmp_path / "stats.jsonl"))
    decoded: list[int] = []  # the tags decoded anywhere in this process (front ends are not)
    decode = frontends_ipc._decode

    def counted(b: Any) -> tuple[Any, ...]:
        decoded.append(b[0])
        return decode(b)

    monkeypatch.setattr(frontends_ipc, "_decode", counted)
    w = start(backend=DmaBackend(Recorder()))
    c = w.client()
    blocks = random_q6k(ROWS, K, 9)
    c.upload("w", blocks, ROWS, K)
    region = c.register_shm("r", 1 << 16)
    for n in (1, 3, 2):
        x = rng.standard_normal((n, K)).astype(np.float32)
        assert_ref(c.matmul("w", x, x_region=region, y_region=(region, 16384)),
                   reference(blocks, ROWS, K, x))

    async def snap() -> dict[str, Any]:
        assert w.worker.stats is not None
        return w.worker.stats.snapshot()  # type: ignore[no-any-return]

    got = w.call(snap())
    assert got["msg_rm"] == 3 and got["region_rows"] == 6
    assert got["st_region_mm_n"] == 3 and not got.get("msg_mm")
    assert 0x47 not in decoded and decoded  # (the hello and the device calls are decoded)
    region.close()
