"""Shared-memory regions (issue 15, item 1) on an in-process worker: results equal the bytes
path, every bad region gets a clear status, and nothing leaks (fds, mappings, counts)."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from q6serve.client.client import Client, Q6ServeError
from q6serve.client.shm import ShmRegion
from q6serve.service.config import Budget, WorkerConfig
from tests.dataplane.tol import assert_ref
from tests.service.svc_util import RunningWorker, random_q6k, reference

ROWS, K = 96, 512
TOKEN, ADMIN = "user-secret", "admin-secret"


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def mapped(key: str) -> int:
    """Mappings of /dev/shm/<key> in this process (worker and client share it here)."""
    return sum(key in line for line in Path("/proc/self/maps").read_text().splitlines())


@pytest.fixture
def start(model_dir: Path) -> Iterator[Callable[..., RunningWorker]]:
    started: list[RunningWorker] = []

    def go(backend: Any = None, **overrides: Any) -> RunningWorker:
        cfg = WorkerConfig(host="127.0.0.1", port=0, model_dir=model_dir,
                           vram_budget=Budget(nbytes=64 << 20), grace_period_s=1.0,
                           allow_shm=True)
        w = RunningWorker(dataclasses.replace(cfg, **overrides), backend)
        started.append(w)
        return w

    yield go
    for w in started:
        w.stop()


@pytest.fixture
def weight(start: Callable[..., RunningWorker]) -> tuple[RunningWorker, Client, np.ndarray]:
    w = start()
    c = w.client()
    blocks = random_q6k(ROWS, K, 7)
    c.upload("w", blocks, ROWS, K)
    c.register_shm("warm", 4096).close()  # starts Python's shm resource tracker (its fds)
    return w, c, blocks


def matmul_holding_region(c: Client, x: np.ndarray, region: ShmRegion,
                          ) -> tuple[threading.Thread, list[Any]]:
    """``c.matmul`` of weight "w" with x at the start of ``region`` and y at offset 8192, in a
    thread; returns once the worker holds the region (bounded: ~5 s). The thread's result is
    appended to the returned list."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(
        c.matmul("w", x, x_region=region, y_region=(region, 8192))))
    t.start()
    for _ in range(1000):
        if c.list_regions()[0].in_use:
            break
        time.sleep(0.005)
    return t, out


def code_of(fn: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(Q6ServeError) as e:
        fn()
    return e.value.code, e.value.message


def test_matmul_through_regions_equals_bytes(weight: Any, rng: np.random.Generator) -> None:
    _w, c, blocks = weight
    x = rng.standard_normal((5, K)).astype(np.float16)
    want = c.matmul("w", x)
    assert_ref(want, reference(blocks, ROWS, K, x))
    with c.register_shm("io", 1 << 16) as region:
        xv = region.ndarray(128, np.float16, x.shape)
        xv[...] = x
        both = c.matmul_full("w", xv, x_region=(region, 128), y_region=(region, 8192))
        np.testing.assert_array_equal(both.y, want)
        assert both.y.ctypes.data == region.ndarray(8192, np.float32, want.shape).ctypes.data
        assert both.kernel and both.batch_rows >= 5
        # x only (the client copies x in), y only, and f16 output
        np.testing.assert_array_equal(c.matmul("w", x, x_region=region), want)
        y16 = c.matmul("w", x, out_dtype="f16", y_region=(region, 4096))
        np.testing.assert_array_equal(y16, want.astype(np.float16))
        infos = c.list_regions()
        assert [(r.name, r.kind, r.key, r.byte_size, r.in_use) for r in infos] == [
            ("io", "system", region.key, 1 << 16, 0)]
        # the stream: regions per request, mixed with bytes
        outs = {o.request_id: o for o in c.matmul_stream(
            [("a", "w", x, region, (region, 16384)), ("b", "w", x)])}
        np.testing.assert_array_equal(outs["a"].y, want)
        np.testing.assert_array_equal(outs["b"].y, want)
    assert c.list_regions() == []


def test_reply_carries_no_bytes_with_y_region(weight: Any, rng: np.random.Generator) -> None:
    from q6serve.client.client import matmul_request
    from q6serve.v1 import q6serve_pb2_grpc as pb_grpc

    _w, c, _ = weight
    x = rng.standard_normal((3, K)).astype(np.float32)
    with c.register_shm("r", 1 << 16) as region:
        req = matmul_request("w", x, x_region=region, y_region=(region, 8192))
        assert req.x.data == b"" and list(req.x.shape) == [3, K]
        r = pb_grpc.Q6ServeStub(c._channel).Matmul(req, timeout=10)
        assert r.y.data == b"" and list(r.y.shape) == [3, ROWS]
        assert r.timing.batch_rows >= 3


def test_bad_regions_clear_status_and_no_leak(weight: Any, rng: np.random.Generator) -> None:
    w, c, _ = weight
    x = rng.standard_normal((4, K)).astype(np.float32)  # 8192 bytes
    before = fds()
    region = c.register_shm("r", 16384)
    held = fds()
    assert held == before + 4  # client and worker: a descriptor and mmap's own dup each
    C = grpc.StatusCode

    def bad(**kw: Any) -> tuple[grpc.StatusCode, str]:
        return code_of(lambda: c.matmul("w", x, **kw))

    # unknown name (a region object this worker never saw)
    with ShmRegion.create("ghost", 8192) as ghost:
        assert bad(x_region=ghost)[0] == C.NOT_FOUND
    # out of bounds: x overruns; y overruns (checked before any device work); misaligned
    code, msg = bad(x_region=(region, 0), y_region=(region, 16384 - 100))
    assert code == C.INVALID_ARGUMENT and "overruns region 'r'" in msg, msg
    raw = matmul_raw(c, x, x_ref=("r", 12288))
    assert raw[0] == C.INVALID_ARGUMENT and "overruns" in raw[1], raw
    assert matmul_raw(c, x, x_ref=("r", 2))[0] == C.INVALID_ARGUMENT  # misaligned
    # size mismatch: x bytes and a region both, or a shape whose bytes do not fit
    assert matmul_raw(c, x, x_ref=("r", 0), keep_bytes=True)[0] == C.INVALID_ARGUMENT
    assert matmul_raw(c, np.zeros((9, K), np.float32), x_ref=("r", 0))[0] == \
        C.INVALID_ARGUMENT
    # registering: taken name, missing object, object too small, bad keys
    assert code_of(lambda: c.register_region(region))[0] == C.ALREADY_EXISTS
    assert register_raw(c, "n1", "q6r_missing", 0, 10)[0] == C.NOT_FOUND
    assert register_raw(c, "n2", region.key, 8192, 16384)[0] == C.INVALID_ARGUMENT
    for key in ("../etc/passwd", "a/b", "", ".."):
        assert register_raw(c, "n3", key, 0, 10)[0] == C.INVALID_ARGUMENT, key
    assert register_raw(c, "bad name!", region.key, 0, 10)[0] == C.INVALID_ARGUMENT
    assert register_raw(c, "n4", region.key, 0, 0)[0] == C.INVALID_ARGUMENT
    # the worker still serves, with the region
    np.testing.assert_allclose(c.matmul("w", x, x_region=region), c.matmul("w", x),
                               rtol=0, atol=0)
    assert fds() == held
    region.close()  # unregisters, unmaps, unlinks
    assert fds() == before and mapped(region.key) == 0
    assert w.run(lambda: w.worker.regions.mapped_bytes) == 0


def test_region_unlinked_under_the_worker(weight: Any, rng: np.random.Generator) -> None:
    _w, c, _ = weight
    x = rng.standard_normal((2, K)).astype(np.float32)
    before = fds()
    shm = shared_memory.SharedMemory(create=True, size=8192)
    region = ShmRegion("gone", shm, owned=True)
    c.register_region(region)
    c.matmul("w", x, x_region=region)
    shm.unlink()
    region.owned = False
    code, msg = code_of(lambda: c.matmul("w", x, x_region=region))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "unlinked" in msg, msg
    assert "x region 'gone'" in msg, msg  # (what and which region: Mapping.check_alive)
    # shrunk under the worker: caught before any read (no SIGBUS)
    shm2 = shared_memory.SharedMemory(create=True, size=8192)
    r2 = ShmRegion("shrunk", shm2, owned=True)
    c.register_region(r2)
    os.truncate(f"/dev/shm/{shm2.name}", 4096)
    code, msg = code_of(lambda: c.matmul("w", x, y_region=r2))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "shrank" in msg, msg
    assert "y region 'shrunk'" in msg, msg
    c.unregister_region("gone")
    c.unregister_region("shrunk")
    shm.close()
    r2.close()
    assert fds() == before and mapped(shm.name) == 0 and mapped(shm2.name) == 0


def test_another_callers_region(start: Callable[..., RunningWorker],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    w = start(token=TOKEN, admin_token=ADMIN)
    user, admin = w.client(token=TOKEN), w.client(token=ADMIN)
    x = np.ones((1, K), np.float32)
    admin.upload("w", random_q6k(ROWS, K, 3), ROWS, K)
    with user.register_shm("mine", 8192) as region:
        assert admin.list_regions() == []
        for fn in (lambda: admin.matmul("w", x, x_region=region),
                   lambda: admin.matmul("w", x, y_region=region),
                   lambda: admin.unregister_region("mine")):
            code, msg = code_of(fn)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "another caller" in msg
        user.matmul("w", x, x_region=region, y_region=region)  # in place: x read first
        assert [r.name for r in user.list_regions()] == ["mine"]


def test_refused_without_allow_shm_and_limits(start: Callable[..., RunningWorker]) -> None:
    off = start(allow_shm=False).client()
    code, msg = code_of(lambda: off.register_shm("r", 4096))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "--allow-shm" in msg
    assert code_of(off.list_regions)[0] == grpc.StatusCode.FAILED_PRECONDITION
    on = start(max_regions=2, max_region_bytes=10000)
    c = on.client()
    with c.register_shm("a", 4096), c.register_shm("b", 4096):
        code, msg = code_of(lambda: c.register_shm("c", 4096))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-regions" in msg
    with c.register_shm("a", 8192):
        code, msg = code_of(lambda: c.register_shm("b", 4096))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-region-bytes" in msg
    assert on.run(lambda: on.worker.regions.mapped_bytes) == 0


def test_drain_releases_regions(start: Callable[..., RunningWorker]) -> None:
    ShmRegion.create("warm", 4096).close()  # starts Python's shm resource tracker (its fds)
    before = fds()
    w = start()
    c = w.client()
    region = c.register_shm("r", 8192)
    key = region.key
    w.stop()
    assert mapped(key) == 1  # the client's own mapping only
    region.close()  # the worker is gone: unregistering is skipped quietly
    assert mapped(key) == 0
    assert fds() <= before  # every descriptor of the worker and the region closed


# -- raw requests the client helpers refuse to build ------------------------------------------
def matmul_raw(c: Client, x: np.ndarray, x_ref: tuple[str, int], keep_bytes: bool = False,
               y_ref: tuple[str, int] | None = None) -> tuple[grpc.StatusCode, str]:
    """A Matmul past the client's own checks (it refuses bad region references itself)."""
    from q6serve.client.client import matmul_request
    from q6serve.v1 import q6serve_pb2_grpc as pb_grpc

    req = matmul_request("w", x)
    if not keep_bytes:
        req.x.data = b""
    req.x_region.region, req.x_region.offset = x_ref
    if y_ref is not None:
        req.y_region.region, req.y_region.offset = y_ref
    try:
        pb_grpc.Q6ServeStub(c._channel).Matmul(req, timeout=10)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    raise AssertionError("the worker accepted a bad request")


def register_raw(c: Client, name: str, key: str, offset: int,
                 size: int) -> tuple[grpc.StatusCode, str]:
    from q6serve.v1 import q6serve_pb2 as pb
    from q6serve.v1 import q6serve_pb2_grpc as pb_grpc

    req = pb.RegisterRegionRequest(name=name, system=pb.SystemShm(key=key, offset=offset,
                                                                  byte_size=size))
    try:
        pb_grpc.Q6ServeStub(c._channel).RegisterRegion(req, timeout=10)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    raise AssertionError("the worker accepted a bad region")


def test_unregister_while_in_use(start: Callable[..., RunningWorker],
                                 rng: np.random.Generator) -> None:
    """The name goes at once; the running request still reads x and writes y; the mapping
    closes when it finishes."""
    from tests.service.svc_util import InstrumentedBackend

    w = start(backend=InstrumentedBackend(matmul_delay=0.5))
    c = w.client()
    blocks = random_q6k(ROWS, K, 5)
    c.upload("w", blocks, ROWS, K)
    x = rng.standard_normal((2, K)).astype(np.float32)
    region = c.register_shm("r", 1 << 16)
    t, out = matmul_holding_region(c, x, region)
    info = c.unregister_region("r")
    assert info.in_use >= 1
    code, _ = code_of(lambda: c.matmul("w", x, x_region=region))
    assert code == grpc.StatusCode.NOT_FOUND
    t.join(10)
    # out held y: a view of the client's mapping
    assert_ref(out.pop(), reference(blocks, ROWS, K, x))
    assert w.run(lambda: w.worker.regions.mapped_bytes) == 0
    region.on_close = None
    key = region.key
    region.close()
    assert mapped(key) == 0


def test_stream_region_errors_do_not_end_the_stream(weight: Any,
                                                    rng: np.random.Generator) -> None:
    _w, c, _ = weight
    x = rng.standard_normal((2, K)).astype(np.float32)
    with c.register_shm("r", 8192) as region:
        outs = {o.request_id: o for o in c.matmul_stream(
            [("bad", "w", x, None, (region, 8000)), ("ok", "w", x, region, (region, 4096))])}
        assert isinstance(outs["bad"], Q6ServeError)
        assert outs["bad"].code == grpc.StatusCode.INVALID_ARGUMENT
        np.testing.assert_array_equal(outs["ok"].y, c.matmul("w", x))


def test_async_client_regions(weight: Any, rng: np.random.Generator) -> None:
    import asyncio

    from q6serve.client import AsyncClient

    w, c, _ = weight
    x = rng.standard_normal((2, K)).astype(np.float32)
    want = c.matmul("w", x)

    async def go(region: ShmRegion) -> list[Any]:
        async with AsyncClient(w.target) as ac:
            one = await ac.matmul("w", x, x_region=region, y_region=(region, 4096))
            one = one.copy()  # the next call writes the same bytes
            outs = [o async for o in ac.matmul_stream([("s", "w", x, region, (region, 8192))])]
            return [one, outs[0].y]

    with c.register_shm("r", 1 << 14) as region:
        for y in asyncio.run(go(region)):
            np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("mode", ["unary", "stream"])
def test_cli_bench_through_regions(weight: Any, mode: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from q6serve.client import cli

    w, c, _ = weight
    rc = cli.main(["bench", "--target", w.target, "--duration", "0.3", "--warmup", "0.1",
                   "--concurrency", "1", "3", "--n", "2", "--mode", mode, "--shm", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["shm"] is True
    for cell in doc["cells"]:
        assert cell["calls"] > 0 and not cell["errors"], cell
    assert c.list_regions() == []  # every caller's region unregistered


def test_x_region_with_a_large_y_in_the_reply(weight: Any, rng: np.random.Generator) -> None:
    """x from a region, y (>= 64 KiB) back in the reply: the spliced encoder of the bytes
    path (wire_replies.matmul_reply / stream_reply) serves region replies too."""
    _w, c, _ = weight
    x = rng.standard_normal((200, K)).astype(np.float16)  # y: 200 x 96 f32 = 76,800 bytes
    want = c.matmul("w", x)
    with c.register_shm("big", 1 << 18) as region:
        np.testing.assert_array_equal(c.matmul("w", x, x_region=region), want)
        out = list(c.matmul_stream([("a", "w", x, region, None)]))
        np.testing.assert_array_equal(out[0].y, want)  # type: ignore[union-attr]


def test_region_views_cached_yet_checked_every_call() -> None:
    """A system region hands out the same view again for the same place (Region.array's
    cache), still checks the object per call (shrunk: refused, not read), bounds-checks a
    new place, holds at most VIEW_CACHE views and drops them before it unmaps."""
    from q6serve.kernels.errors import FailedPrecondition, InvalidArgument
    from q6serve.service.regions import VIEW_CACHE, RegionRef, RegionTable, ShmSource

    table = RegionTable(True, 4, 1 << 30)
    shm = ShmRegion.create(f"views{os.getpid()}", 8192)
    try:
        table.register("", shm.name, ShmSource(shm.key, 0, 8192))
        r = table.hold("", RegionRef(shm.name, 0))
        assert r is not None
        f4 = np.dtype("<f4")
        x = r.array(0, f4, (2, 4), "x")
        assert r.array(0, f4, [2, 4], "x") is x  # (a list shape: the same place)
        y = r.array(64, f4, (2, 4), "y", writable=True)
        assert y is not x and r.array(64, f4, (2, 4), "y", writable=True) is y
        assert r.array(64, f4, (2, 4), "y") is not y and not x.flags.writeable
        y[...] = 3.0
        np.testing.assert_array_equal(r.array(64, f4, (2, 4), "y"), 3.0)
        with pytest.raises(InvalidArgument, match="overruns"):
            r.array(8192 - 16, f4, (2, 4), "x")
        for off in range(0, 4 * VIEW_CACHE + 4, 4):  # more places than the cache holds
            r.array(off, f4, (1,), "x")
        assert len(r._views or {}) <= VIEW_CACHE
        os.truncate(f"/dev/shm/{shm.key.lstrip('/')}", 4096)
        with pytest.raises(FailedPrecondition, match="shrank"):
            r.array(0, f4, (2, 4), "x")  # cached, refused all the same
        os.truncate(f"/dev/shm/{shm.key.lstrip('/')}", 8192)
        del x, y
        table.let_go(r)
        table.unregister("", shm.name)
        assert r._views == {} and r.mapping._mm.closed  # no view kept it mapped
    finally:
        shm.close()


@pytest.mark.skipif(os.getuid() != 0, reason="making another user's object takes root")
def test_another_users_object_is_no_region(weight: Any) -> None:
    """A shared-memory object of another user (here: made by root, handed to uid 65534) is
    refused at registration: its owner could shrink it under a call, and the worker's next
    access to the lost pages would be a SIGBUS (session 30); the worker's own user's object
    registers."""
    _w, c, _ = weight
    shm = shared_memory.SharedMemory(create=True, size=8192)
    try:
        os.fchown(shm._fd, 65534, 65534)  # type: ignore[attr-defined]
        region = ShmRegion("theirs", shm, owned=False)
        code, msg = code_of(lambda: c.register_region(region))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "uid 65534" in msg, msg
        os.fchown(shm._fd, 0, 0)  # type: ignore[attr-defined]
        c.register_region(region)
        c.unregister_region("theirs")
    finally:
        shm.close()
        shm.unlink()
