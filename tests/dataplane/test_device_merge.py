"""The device process of a --frontends worker merges the plain calls it reads in one loop trip
(same weight, dtypes and K, from any front end) into one engine request, and hands each call
its own rows of y; a merged request refused as INVALID_ARGUMENT (maybe one caller's input) runs
its calls one by one, so only the bad one fails (FrontendsWorker._queue_call). Run in-process:
the device side of a front end's connection fed ready-made frames, as bench/device_ipc.py."""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

import numpy as np
import pytest

from q6serve.kernels.errors import InvalidArgument
from q6serve.kernels.numpy_backend import NumpyBackend
from q6serve.service import frontends as fe
from q6serve.service import frontends_ipc as ipc
from q6serve.service.config import WorkerConfig
from q6serve.service.engine_types import UploadSpec
from tests.dataplane.tol import assert_ref
from tests.service.svc_util import random_q6k, reference

ROWS, K, BAD = 48, 256, 777.0


class Picky(NumpyBackend):
    """Refuses a launch whose activations hold BAD (a stand-in for one caller's input that a
    kernel cannot take); counts launches."""

    launches = 0

    def launch(self, w: Any, x: np.ndarray, **kw: Any) -> Any:
        Picky.launches += 1
        if (x == BAD).any():
            raise InvalidArgument("activations hold the refused value")
        return super().launch(w, x, **kw)


class Transport:
    def __init__(self) -> None:
        self.answers: dict[int, tuple[Any, ...]] = {}

    def write(self, data: bytes) -> None:
        pos = 0
        while pos < len(data):
            (n,) = ipc.FRAME.unpack_from(data, pos)
            msg = ipc._decode(data[pos + ipc.FRAME.size : pos + ipc.FRAME.size + n])
            pos += ipc.FRAME.size + n
            if msg[0] != "ack":
                self.answers[msg[1]] = msg

    def is_closing(self) -> bool:
        return False


async def _device(merge: bool, xs: list[np.ndarray],
                  ) -> tuple[Any, dict[int, tuple[Any, ...]], fe.Arena, Any]:
    os.environ[fe.MERGE_ENV] = "1" if merge else "0"
    try:
        worker = fe.FrontendsWorker(WorkerConfig(frontends=2), Picky())
    finally:
        del os.environ[fe.MERGE_ENV]
    worker._init_metrics()
    worker.engine = engine = worker.make_engine()
    blocks = random_q6k(ROWS, K, 3)
    data = blocks.tobytes()

    async def once() -> Any:
        yield data

    await engine.upload(UploadSpec("w", ROWS, K, "q6_k", len(data),
                                   hashlib.sha256(data).hexdigest()), once())
    arena = fe.Arena.create(len(xs), 1 << 16)
    out = Transport()
    conn = fe._FrontConnection(worker)
    ipc._Peer.connection_made(conn, out)  # type: ignore[arg-type]  # (no peer pid)
    conn.fe = worker._hello(conn, ("hello", 0, os.getpid(), arena.name, len(xs), 1 << 16))
    arena.unlink()
    frames = b""
    for slot, x in enumerate(xs):  # one message per call, all read in one trip
        arena.array(slot, np.dtype("<f4"), x.shape, writable=True)[...] = x
        payload = ipc._encode(("mm", slot + 1, "w", (), 0, "exact", "f32", None,
                              ("f32", x.shape), slot))
        frames += ipc.FRAME.pack(len(payload)) + payload
    Picky.launches = 0
    conn.data_received(frames)
    for _ in range(200):
        if len(out.answers) == len(xs):
            break
        await asyncio.sleep(0.005)
    await engine.close()
    return worker, out.answers, arena, blocks


def _check_y(arena: fe.Arena, slot: int, msg: tuple[Any, ...], want: np.ndarray) -> None:
    """An answer with y in its slot, equal to ``want``."""
    assert msg[0] == "mmok", msg
    off, _, shape = msg[3][0]
    y = arena.array(slot, np.dtype("<f4"), shape, writable=False, offset=off)
    assert_ref(y, want)


@pytest.mark.parametrize("merge", [True, False])
def test_calls_of_one_trip_merge_and_get_their_rows(merge: bool,
                                                     rng: np.random.Generator) -> None:
    xs = [rng.standard_normal((n, K)).astype(np.float32) for n in (1, 3, 2)]

    async def main() -> None:
        worker, answers, arena, blocks = await _device(merge, xs)
        assert worker.merged == ([1, 3] if merge else [0, 0])
        if merge:  # one request, one launch (without: the batcher's first launch takes the
            assert Picky.launches == 1  # first call alone, on an idle device)
        for slot, x in enumerate(xs):
            msg = answers[slot + 1]
            _check_y(arena, slot, msg, reference(blocks, ROWS, K, x))
            if merge:
                assert msg[2][5] == 6 and msg[2][6] == 1  # batch rows, requests
        assert worker._pending == 0
        arena.close()

    asyncio.run(main())


def test_a_refused_merge_runs_its_calls_alone(rng: np.random.Generator) -> None:
    xs = [rng.standard_normal((n, K)).astype(np.float32) for n in (2, 1, 2)]
    xs[1][0, 5] = BAD

    async def main() -> None:
        worker, answers, arena, blocks = await _device(True, xs)
        assert worker.merged == [1, 3]
        assert answers[2][0] == "err" and isinstance(answers[2][2], InvalidArgument)
        for slot in (0, 2):
            _check_y(arena, slot, answers[slot + 1], reference(blocks, ROWS, K, xs[slot]))
        assert worker._pending == 0
        arena.close()

    asyncio.run(main())


def test_a_full_call_goes_to_the_engine_alone(rng: np.random.Generator) -> None:
    """A call of max_batch_rows merges with nothing: it is queued when read (not at the end of
    the trip), and the small calls around it still merge."""
    xs = [rng.standard_normal((n, K)).astype(np.float32) for n in (1, 64, 2)]

    async def main() -> None:
        worker, answers, arena, blocks = await _device(True, xs)
        assert worker._merge_rows == 64
        assert worker.merged == [1, 2]
        for slot, x in enumerate(xs):
            _check_y(arena, slot, answers[slot + 1], reference(blocks, ROWS, K, x))
        assert answers[2][2][5] == 64  # a batch of its own
        assert worker._pending == 0
        arena.close()

    asyncio.run(main())
