"""The device socket's messages (service/frontends.py): the hot path's fixed layouts decode to
the same tuples as the pickled form, and frames are reassembled however the bytes arrive."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from q6serve.service import frontends_ipc as ipc

MESSAGES: list[tuple[Any, ...]] = [
    # fixed layouts: a plain matmul with x in a slot, and its one-part reply in the slot
    ("mm", 7, "blk.0.ffn_down", (), 0, "auto", "f32", None, ("f16", (3, 256)), 2),
    ("mm", 2**40, "wé", (), 0, "q8_1", "bf16", 0.25, ("bf16", (64, 18944)), 0),
    ("mmok", 9, ("q6k_ks_f16", "soa", "f16", 1.5e-4, None, 32, 5, 2.5e-4, None),
     [(64, "f16", (3, 3584))]),
    ("mmok", 10, ("numpy", "aos", "exact", 0.0, 1e-5, 1, 1, None, None), [(0, "f32", (1, 16))]),
    # x and y in regions (T3), and its answer
    ("rm", 11, "tok-é", ("r0", 0, "f16", (64, 18944)), ("r0", 1 << 20), "ffn_down", "f16",
     "f32", None),
    ("rm", 2**50, "", ("x", 2**40, "bf16", (1, 256)), ("ÿ", 8), "w", "q8_1", "bf16", 0.5),
    ("rmok", 12, ("cuda.q6k_ks_f16.soa", "soa", "f16", 1.5e-5, 4.7e-5, 64, 1, 4.1e-5, None),
     ("f32", (64, 3584))),
    ("rmok", 13, ("numpy", "aos", "exact", 0.0, None, 3, 2, None, None), ("f16", (3, 16))),
    # pickled: what the fixed layouts do not cover
    ("rm", 14, "o", ("x", 0, "f32", (2, 3, 256)), ("y", 0), "w", "auto", "f32", None),  # 3-D
    ("rmok", 15, ("k", "soa", "f16", 0.0, None, 1, 1, None, 8), ("f32", (1, 8))),  # top-k
    ("mm", 3, "", ("a", "b"), 0, "auto", "f32", None, ("f32", (1, 256)), 1),  # multi-weight
    ("mm", 4, "w", (), 8, "auto", "f32", 1.0, ("f32", (1, 256)), 1),  # top-k
    ("mm", 5, "w", (), 0, "auto", "f32", None, np.ones((2, 256), np.float16), -1),  # x inline
    ("mmok", 6, [("a", ("k", "soa", "f16", 0.0, None, 1, 1, None, None))], [(0, "f32", (1, 8))]),
    ("mmok", 8, ("k", "soa", "f16", 0.0, None, 1, 1, None, None), [np.zeros((1, 8))]),
    ("err", 1, ValueError("x")), ("metrics", [("s", "m", "OK", [0.1, 0.2])]), ("ready",),
]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, BaseException):
        return type(a) is type(b) and a.args == b.args
    if isinstance(a, tuple | list):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b, strict=True)))
    return bool(a == b)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: str(m[0]))
def test_messages_round_trip(msg: tuple[Any, ...]) -> None:
    data = ipc._encode(msg)
    assert _same(ipc._decode(data), msg)
    assert _same(ipc._decode(memoryview(data)), msg)


def test_hot_messages_use_the_fixed_layouts() -> None:
    assert ipc._encode(MESSAGES[0])[:1] == b"M" and ipc._encode(MESSAGES[2])[:1] == b"R"
    assert len(ipc._encode(MESSAGES[0])) == ipc._MM.size + len("blk.0.ffn_down")
    assert ipc._encode(MESSAGES[4])[:1] == b"G" and ipc._encode(MESSAGES[6])[:1] == b"K"
    assert ipc._encode(MESSAGES[8])[:1] == b"\x80" and ipc._encode(MESSAGES[9])[:1] == b"\x80"
    assert ipc._encode(MESSAGES[10])[:1] == b"\x80"  # pickle


def test_shared_heads_build_the_fixed_layouts_bytes() -> None:
    """A merged batch's answers are packed from one head made for the batch (``_mmok_head``,
    ``_rmok_head``): the same bytes as ``_encode`` of each answer; a top-k reply has none."""
    for msg in (MESSAGES[2], MESSAGES[3]):
        _, rid, f, outs = msg
        head = ipc._mmok_head(f)
        assert head is not None
        off, dt, (r, c) = outs[0]
        assert (ipc._MMOK.pack(b"R", rid, *head[0], off, ipc._DTYPE_CODE[dt], r, c) + head[1]
                == ipc._encode(msg))
    for msg in (MESSAGES[6], MESSAGES[7]):
        _, rid, f, (dt, (r, c)) = msg
        y = np.zeros((r, c), ipc._LE[dt])
        head = ipc._rmok_head(f, y)
        assert head is not None
        assert ipc._RMOK.pack(b"K", rid, *head[0], r, c) + head[1] == ipc._encode(msg)
    y = np.zeros((1, 8), np.float32)
    assert ipc._rmok_head(MESSAGES[9][2], y) is None and ipc._mmok_head(MESSAGES[9][2]) is None
    assert ipc._rmok_head(MESSAGES[6][2], np.zeros((1, 2, 8), np.float32)) is None  # 3-D


class _Capture(ipc._Peer):
    def __init__(self) -> None:
        super().__init__()
        self.got: list[tuple[Any, ...]] = []

    def message(self, msg: tuple[Any, ...]) -> None:
        self.got.append(msg)


class _Transport:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def _frames(msgs: list[tuple[Any, ...]]) -> bytes:
    return b"".join(ipc.FRAME.pack(len(d)) + d for d in map(ipc._encode, msgs))


@pytest.mark.parametrize("cut", [1, 3, 8, 9, 100, 65536, 10**9])
def test_frames_reassembled_however_the_bytes_arrive(cut: int) -> None:
    """Every message once, in order, whether the bytes come one at a time, split inside a
    header or a payload, several frames per read, or all at once (a 1 MB array in between)."""
    big = ("mm", 11, "w", (), 0, "auto", "f32", None, np.arange(2**18, dtype=np.float32), -1)
    msgs = [*MESSAGES, big, *MESSAGES]
    data = _frames(msgs)
    peer = _Capture()

    async def main() -> None:
        peer.connection_made(_Transport())  # type: ignore[arg-type]
        step = cut if cut < len(data) else len(data)
        for at in range(0, len(data), step):
            peer.data_received(data[at : at + step])

    asyncio.run(main())
    assert len(peer.got) == len(msgs)
    assert all(_same(a, b) for a, b in zip(peer.got, msgs, strict=True))
    assert not peer._buf


def test_a_failing_message_closes_the_connection() -> None:
    """A message its handler cannot take is logged and ends the connection: nothing after it
    is handled (the peer then sees the connection lost, as if the process had gone)."""

    class Failing(_Capture):
        def message(self, msg: tuple[Any, ...]) -> None:
            if msg[0] == "err":
                raise RuntimeError("cannot take this")
            super().message(msg)

    peer = Failing()
    transport = _Transport()

    async def main() -> None:
        peer.connection_made(transport)  # type: ignore[arg-type]
        peer.data_received(_frames(MESSAGES))

    asyncio.run(main())
    assert transport.closed
    first_err = next(i for i, m in enumerate(MESSAGES) if m[0] == "err")
    assert [m[0] for m in peer.got] == [m[0] for m in MESSAGES[:first_err]]


def test_flush_now_writes_pending_messages_once_in_order() -> None:
    """_Out: small messages wait for the flush scheduled at the end of the loop iteration;
    ``flush_now`` writes them at once, in order, in one write, and calls that flush off (no
    second, empty write); a big message writes what is pending first."""

    class Writes(_Transport):
        def __init__(self) -> None:
            super().__init__()
            self.writes: list[bytes] = []

        def write(self, b: bytes) -> None:
            self.writes.append(bytes(b))

    async def main() -> None:
        t = Writes()
        out = ipc._Out(t)  # type: ignore[arg-type]
        out.send(MESSAGES[0])
        out.send(MESSAGES[2])
        assert t.writes == []  # waiting for the end of this iteration
        scheduled = out._flush_at
        out.flush_now()
        assert scheduled is not None and scheduled.cancelled()
        assert t.writes == [_frames([MESSAGES[0], MESSAGES[2]])]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(t.writes) == 1  # the scheduled flush was called off
        out.send(MESSAGES[3])
        await asyncio.sleep(0)
        assert t.writes[1:] == [_frames([MESSAGES[3]])]  # the scheduled flush, once
        big = ("ok", 1, b"x" * 70000)
        out.send(MESSAGES[1])
        out.send(big)  # pending first, then the big one (its length, then its payload)
        assert b"".join(t.writes[2:]) == _frames([MESSAGES[1], big])

    asyncio.run(main())
