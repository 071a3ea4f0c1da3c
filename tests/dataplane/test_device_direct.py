"""The device process's per-trip path for plain front-end calls (service/frontends.py): once a
like job has been measured, the calls merged in a loop trip (or a lone one) run on the engine's
direct path there and then (``FrontendsWorker._run_merged_now``, ``_start_alone``), x
concatenated straight into the backend's upload buffer (``Backend.staging``); a refusal still
reaches only the caller whose input caused it. Plain matmul frames are parsed without the
generic message tuple (``_Peer.plain_mm``), answers are written into the slot in one copy
(``Arena.put``) and framed with the fields shared by the batch (``_mmok_head``): the bytes are
``_encode``'s. Run in-process, as tests/dataplane/test_device_merge.py."""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

import numpy as np
import pytest

from q6serve.kernels.api import DTYPES, Launched
from q6serve.kernels.errors import InvalidArgument
from q6serve.service import batcher, device_thread
from q6serve.service import frontends as fe
from q6serve.service import frontends_ipc as ipc
from q6serve.service.config import WorkerConfig
from q6serve.service.engine_types import UploadSpec
from tests.dataplane.test_device_merge import BAD, ROWS, K, Picky, Transport
from tests.dataplane.tol import assert_ref
from tests.service.svc_util import random_q6k, reference


@pytest.fixture(autouse=True)
def _short_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """NumPy's "kernel" of these batches may take longer than the wait a batch defers
    (DEFER_KERNEL_S): no direct path then, as with a long CUDA kernel."""
    monkeypatch.setattr(batcher, "DEFER_KERNEL_S", 1e9)


class Staged(Picky):
    """Picky (refuses activations holding BAD), recording each launch's rows and whether its x
    is the array ``staging`` handed out last."""

    def __init__(self) -> None:
        super().__init__()
        self.staged: np.ndarray | None = None
        self.launched: list[tuple[int, bool]] = []

    def staging(self, n: int, k: int, dtype: np.dtype) -> np.ndarray:
        self.staged = super().staging(n, k, dtype)
        return self.staged

    def launch(self, w: Any, x: np.ndarray, **kw: Any) -> Any:
        self.launched.append((int(x.shape[0]), x is self.staged))
        self.staged = None
        return super().launch(w, x, **kw)


class Device:
    """A device process with one front end's connection, fed ready-made frames."""

    def __init__(self, slots: int, backend: Any = None, dtype: str = "f32",
                 precision: str = "exact", rows: int = ROWS, k: int = K) -> None:
        os.environ[fe.MERGE_ENV] = "1"
        try:  # (inline jobs whatever this machine's load: every measured job is "short")
            self.worker = fe.FrontendsWorker(
                WorkerConfig(frontends=2, inline_device_us=10**6),
                Staged() if backend is None else backend)
        finally:
            del os.environ[fe.MERGE_ENV]
        self.slots, self.dtype, self.precision = slots, dtype, precision
        self.rows, self.k = rows, k

    async def start(self) -> None:
        w = self.worker
        w._init_metrics()
        w.engine = engine = w.make_engine()
        self.blocks = random_q6k(self.rows, self.k, 3)
        data = self.blocks.tobytes()

        async def once() -> Any:
            yield data

        await engine.upload(UploadSpec("w", self.rows, self.k, "q6_k", len(data),
                                       hashlib.sha256(data).hexdigest()), once())
        self.arena = fe.Arena.create(self.slots, 1 << 18)
        self.out = Transport()
        self.conn = conn = fe._FrontConnection(w)
        ipc._Peer.connection_made(conn, self.out)  # type: ignore[arg-type]  # (no peer pid)
        conn.message(("hello", 0, os.getpid(), self.arena.name, self.slots, 1 << 18))
        self.arena.unlink()

    def frames(self, xs: list[np.ndarray], rid0: int, slot0: int = 0) -> bytes:
        """One message per call (request ids rid0.., x in slot slot0 + i)."""
        frames = b""
        for slot, x in enumerate(xs, slot0):
            self.arena.array(slot, x.dtype.newbyteorder("<"), x.shape, writable=True)[...] = x
            payload = ipc._encode(("mm", rid0 + slot - slot0, "w", (), 0, self.precision, "f32",
                                  None, (self.dtype, x.shape), slot))
            frames += ipc.FRAME.pack(len(payload)) + payload
        return frames

    async def trip(self, xs: list[np.ndarray], rid0: int,
                   slot0: int = 0) -> dict[int, tuple[Any, ...]]:
        """``frames`` all read in one loop trip; returns the answers once every call has
        one."""
        frames = self.frames(xs, rid0, slot0)
        self.out.answers.clear()
        self.conn.data_received(frames)
        for _ in range(400):
            if len(self.out.answers) == len(xs):
                break
            await asyncio.sleep(0.005)
        return dict(self.out.answers)

    async def measured(self, xs: list[np.ndarray]) -> None:
        """A trip of ``xs`` (the first job of its kind: queued and measured), then until the
        device counts it done (its answer may come first)."""
        await self.trip(xs, 1)
        dev = self.worker.engine.device  # type: ignore[union-attr]
        for _ in range(400):
            if not dev.inflight:
                break
            await asyncio.sleep(0.005)

    def count_writes(self) -> list[int]:
        """From now on, the byte count of each write to the front end (answers cleared)."""
        writes: list[int] = []
        write = self.out.write

        def counted(data: bytes) -> None:
            writes.append(len(data))
            write(data)

        self.out.write = counted  # type: ignore[method-assign]
        self.out.answers.clear()
        return writes

    def y(self, slot: int, msg: tuple[Any, ...]) -> np.ndarray:
        assert msg[0] == "mmok", msg
        off, _, shape = msg[3][0]
        return self.arena.array(slot, np.dtype("<f4"), shape, writable=False, offset=off)

    async def close(self) -> None:
        await self.worker.engine.close()  # type: ignore[union-attr]
        self.arena.close()


def test_merged_calls_run_on_the_direct_path_from_the_staging_buffer(
        rng: np.random.Generator) -> None:
    """The first trip's merged request is queued (no like job measured yet); the second's, of
    the same rows, runs on the direct path, x built in the backend's upload buffer, and each
    call gets its own rows and the batch's fields."""
    xs = [rng.standard_normal((n, K)).astype(np.float32) for n in (1, 3, 2)]

    async def main() -> None:
        d = Device(len(xs))
        await d.start()
        w, backend = d.worker, d.worker.backend
        dev = w.engine.device  # type: ignore[union-attr]
        await d.trip(xs, 1)
        assert dev.direct_jobs == 0 and backend.launched == [(6, False)]  # type: ignore[attr-defined]
        xs2 = [x[::-1] * 2 for x in xs]  # other values, the same rows
        answers = await d.trip(xs2, 10)
        assert dev.direct_jobs == 1
        assert backend.launched[1:] == [(6, True)]  # type: ignore[attr-defined]
        assert w.merged == [2, 6]
        for slot, x in enumerate(xs2):
            msg = answers[10 + slot]
            assert_ref(d.y(slot, msg), reference(d.blocks, ROWS, K, x))
            assert msg[2][5] == 6 and msg[2][6] == 1  # batch rows, requests
            assert msg[2][3] == 0.0  # not queued
        assert w._pending == 0
        await d.close()

    asyncio.run(main())


def test_a_refused_direct_merge_reaches_only_the_bad_caller(rng: np.random.Generator) -> None:
    xs = [rng.standard_normal((n, K)).astype(np.float32) for n in (2, 1, 2)]

    async def main() -> None:
        d = Device(len(xs))
        await d.start()
        dev = d.worker.engine.device  # type: ignore[union-attr]
        await d.trip(xs, 1)  # measured
        bad = [x.copy() for x in xs]
        bad[1][0, 5] = BAD
        answers = await d.trip(bad, 10)
        assert dev.direct_jobs >= 1
        assert answers[11][0] == "err" and isinstance(answers[11][2], InvalidArgument)
        for slot in (0, 2):
            assert_ref(d.y(slot, answers[10 + slot]), reference(d.blocks, ROWS, K, bad[slot]))
        assert d.worker._pending == 0
        await d.close()

    asyncio.run(main())


def test_a_lone_call_runs_on_the_direct_path(rng: np.random.Generator) -> None:
    x = rng.standard_normal((3, K)).astype(np.float32)

    async def main() -> None:
        d = Device(1)
        await d.start()
        dev = d.worker.engine.device  # type: ignore[union-attr]
        await d.trip([x], 1)
        assert dev.direct_jobs == 0
        answers = await d.trip([x * 3], 2)
        assert dev.direct_jobs == 1
        assert_ref(d.y(0, answers[2]), reference(d.blocks, ROWS, K, x * 3))
        assert answers[2][2][5] == 3 and d.worker._pending == 0
        await d.close()

    asyncio.run(main())


def test_an_answer_frame_is_encodes_frame() -> None:
    """The "R" frame ``_answer_mm`` packs from the batch's shared head is byte for byte
    what ``_encode`` makes of the same answer."""
    fields = ("q6k_ks_f16", "soa", "f16", 1.5e-4, None, 32, 1, 2.5e-4, None)
    head = ipc._mmok_head(fields)
    assert head is not None
    y = np.zeros((3, 3584), np.float32)
    fast = ipc._MMOK.pack(b"R", 9, *head[0], 0, ipc._DTYPE_CODE["f32"], *y.shape) + head[1]
    assert fast == ipc._encode(("mmok", 9, fields, [(0, "f32", (3, 3584))]))
    assert ipc._mmok_head(("k", "soa", "f16", 0.0, None, 1, 1, None, "top")) is None


def test_arena_put_writes_little_endian_and_checks_the_slot() -> None:
    arena = fe.Arena.create(2, 4096)
    try:
        y = np.arange(12, dtype=np.float32).reshape(3, 4)
        arena.put(1, y)
        np.testing.assert_array_equal(arena.array(1, np.dtype("<f4"), (3, 4), False), y)
        bf16 = DTYPES["bf16"]
        yb = np.arange(6, dtype=np.float32).astype(bf16).reshape(2, 3)
        arena.put(0, yb)  # (an ml_dtypes array through the buffer protocol)
        np.testing.assert_array_equal(arena.array(0, bf16.newbyteorder("<"), (2, 3), False), yb)
        odd = np.arange(24, dtype=">f2").reshape(4, 6)[:, ::2]  # strided, big-endian
        arena.put(0, odd)
        np.testing.assert_array_equal(arena.array(0, np.dtype("<f2"), (4, 3), False), odd)
        with pytest.raises(InvalidArgument):
            arena.put(2, y)
        with pytest.raises(InvalidArgument):
            arena.put(0, np.zeros(4097, np.uint8))
    finally:
        arena.unlink()
        arena.close()


class _Plain(ipc._Peer):
    """A peer taking plain matmul frames undecoded (as the device end does)."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.plain, self.fail = True, fail
        self.got: list[tuple[Any, ...]] = []

    def message(self, msg: tuple[Any, ...]) -> None:
        self.got.append(msg)

    def plain_mm(self, payload: memoryview) -> None:
        if self.fail:
            raise RuntimeError("cannot take this")
        self.got.append(("plain", ipc._decode(bytes(payload))))


class _Transport:
    closed = False

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


@pytest.mark.parametrize("cut", [1, 7, 10**9])
def test_plain_frames_reach_plain_mm_in_order(cut: int) -> None:
    mm = ("mm", 7, "blk.0.ffn_down", (), 0, "auto", "f32", None, ("f16", (3, 256)), 2)
    other = ("mm", 4, "w", (), 8, "auto", "f32", 1.0, ("f32", (1, 256)), 1)  # top-k: pickled
    msgs = [mm, other, mm, ("ready",)]
    data = b"".join(ipc.FRAME.pack(len(d)) + d for d in map(ipc._encode, msgs))
    peer = _Plain()

    async def main() -> None:
        peer.connection_made(_Transport())  # type: ignore[arg-type]
        for at in range(0, len(data), cut):
            peer.data_received(data[at : at + cut])

    asyncio.run(main())
    assert peer.got == [("plain", mm), other, ("plain", mm), ("ready",)]


def test_a_failing_plain_frame_closes_the_connection() -> None:
    mm = ("mm", 7, "w", (), 0, "auto", "f32", None, ("f16", (3, 256)), 2)
    data = b"".join(ipc.FRAME.pack(len(d)) + d for d in map(ipc._encode, [("ready",), mm,
                                                                         ("ready",)]))
    peer, transport = _Plain(fail=True), _Transport()

    async def main() -> None:
        peer.connection_made(transport)  # type: ignore[arg-type]
        peer.data_received(data)

    asyncio.run(main())
    assert transport.closed and peer.got == [("ready",)]


def test_the_device_counters_see_plain_frames_and_direct_jobs(
        rng: np.random.Generator, tmp_path: Any) -> None:
    """Q6SERVE_DP_STATS's counters (bench/frontend_cpu.py --profile): plain matmul frames
    counted as messages and rows, direct-path jobs as inline jobs with their time."""
    xs = [rng.standard_normal((n, K)).astype(np.float32) for n in (1, 3)]

    async def main() -> None:
        d = Device(len(xs))
        await d.start()
        d.out.get_protocol = lambda: d.conn  # type: ignore[attr-defined]
        stats = fe._DeviceStats(d.worker, str(tmp_path / "stats.jsonl"))
        await d.trip(xs, 1)
        await d.trip(xs, 10)
        snap = stats.snapshot()
        assert snap["msg_mm"] == 4 and snap["mm_rows"] == 8
        assert snap["direct_jobs"] == 1 and snap["inline_jobs_wall_s"] > 0
        assert snap["socket_reads"] == 2 and snap["batches"] == 2
        # the stages' wall time (bench/device_stats_table.py --stages): each socket read's
        # frames, each plain frame, each trip's end
        assert snap["st_read_n"] == 2 and snap["st_plain_mm_n"] == 4
        assert snap["st_flush_calls_n"] == 2 and 0 < snap["st_plain_mm_s"] < snap["st_read_s"]
        # the merged batch that ran on the direct path in its parts (T2's device cost): x
        # staged and the inline job once; answered twice (the first trip's batch was queued)
        assert snap["st_stage_x_n"] == snap["st_run_direct_n"] == 1
        assert snap["st_answer_merged_n"] == 2
        assert 0 < snap["st_stage_x_s"] + snap["st_run_direct_s"] < snap["st_start_merged_s"]
        await d.close()

    asyncio.run(main())


def test_direct_path_answers_leave_in_the_trip_that_ran_them(
        rng: np.random.Generator) -> None:
    """The answers of calls run on the direct path are written to their front end by the
    handle that ran them (``_flush_calls``: ``_Out.flush_now``), before any other handle of
    that loop iteration (the next messages read meanwhile) runs, and in one write."""
    xs = [rng.standard_normal((n, K)).astype(np.float32) for n in (1, 2, 1)]

    async def main() -> None:
        d = Device(len(xs))
        await d.start()
        dev = d.worker.engine.device  # type: ignore[union-attr]
        await d.measured(xs)
        writes = d.count_writes()
        d.conn.data_received(d.frames(xs, 20))  # (the merge runs at the end of this trip)
        seen: list[list[int]] = []  # the answers written when the merge's handle returned
        # (a plain callback, not this task: a task ready to run keeps the direct path off)
        asyncio.get_running_loop().call_soon(lambda: seen.append(sorted(d.out.answers)))
        await asyncio.sleep(0.05)
        assert dev.direct_jobs == 1 and seen == [[20, 21, 22]] and len(writes) == 1
        for slot, x in enumerate(xs):
            assert_ref(d.y(slot, d.out.answers[20 + slot]), reference(d.blocks, ROWS, K, x))
        await d.close()

    asyncio.run(main())


def test_a_job_that_comes_while_a_launch_is_out_is_held() -> None:
    """``Device.call`` holds jobs while a launch_now launch is out, across loop trips (no other
    launch may come between the pipeline's: service/lane.py); the wait of the last one runs
    them, in order."""

    async def main() -> None:
        dev = device_thread.Device("t", inline_s=1.0)
        loop = asyncio.get_running_loop()
        ran: list[str] = []
        finish = dev.launch_now(lambda: Launched(lambda: ran.append("wait") or "r"))
        got: list[Any] = []
        dev.call(loop, lambda: ran.append("job") or 7, (), lambda r, e: got.append(r),
                 expect_s=1e-6)
        await asyncio.sleep(0)  # a loop trip later: still held
        assert ran == [] and dev.inflight == 2
        assert finish() == "r"
        assert ran == ["wait", "job"]
        await asyncio.sleep(0)
        assert got == [7] and dev.inflight == 0
        dev.close()

    asyncio.run(main())
