"""The device socket of a ``--frontends N`` worker (service/frontends.py): what a front-end
process and the device process say to each other, and how.

A frame is its payload's length and the payload; the hot path's messages have fixed struct
layouts (``_MM``, ``_MMOK``, ``_RM``, ``_RMOK``), everything else is a pickled tuple of plain
values (``_encode``/``_decode``). ``_Peer`` parses frames as they arrive (no reader task) and
``_Out`` writes a loop iteration's small messages to a peer together. Also here: the dtype,
precision and layout codes, a reply's plain fields (``_fields``, ``_strip``, ``_dress``), what
an error becomes on the other side (``_portable_error``), one connected front end as the
device process sees it (``_Front``) and a front end's start-up arguments (``child_args``).

Used by both ends: service/frontends.py and its frontends_calls/_regions/_stats (the device
process), service/frontends_front.py (a front end). The one module of the worker that
unpickles: both ends are the worker's own processes, over a socket in a 0700 directory whose
peers the device process checks (SO_PEERCRED); nothing a client sends is unpickled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pickle
import struct
from typing import Any

import numpy as np

from q6serve.kernels.api import DTYPES, Layout, Precision, dtype_name
from q6serve.kernels.errors import Q6Error, Unavailable

from .engine import MatmulReply
from .frontends_arena import Arena

log = logging.getLogger("q6serve.frontends")
FRAME = struct.Struct("<Q")


# -- framing ------------------------------------------------------------------------------------
# A frame: payload length (FRAME), payload. The hot path's two messages have fixed layouts
# (_MM, _MMOK: a few struct fields, no pickling); everything else is one pickled tuple. Both
# decode to the same tuples, so only _encode/_decode know which travelled how.
_DTYPE_NAMES = tuple(DTYPES)  # dtype codes of the fixed layouts
_DTYPE_CODE = {name: i for i, name in enumerate(_DTYPE_NAMES)}
_PRECISIONS = tuple(p.value for p in Precision)
_PRECISION_CODE = {v: i for i, v in enumerate(_PRECISIONS)}
_LAYOUTS = tuple(v.value for v in Layout)
_LAYOUT_CODE = {v: i for i, v in enumerate(_LAYOUTS)}
# "mm" of one weight, no top-k, x [rows, k] in slot: b"M", request id, slot, rows, k, x dtype,
# out dtype, precision, timeout s (NaN: none); then the weight's name (UTF-8) to the end
_MM = struct.Struct("<cQiIIBBBd")
# "mmok" of one part with y in the slot: b"R", request id, layout, precision, queue s, kernel s,
# batch rows, batch requests, device s (NaN: None), y offset, y dtype, y rows, y columns; then
# the kernel's name (UTF-8) to the end
_MMOK = struct.Struct("<cQBBddIIdIBII")
# "rm" (x and y in regions, x [rows, k]): b"G", request id, x offset, rows, k, y offset, x dtype,
# out dtype, precision, timeout s (NaN: none), the UTF-8 lengths of the owner, x's region and y's
# region; then those three and the weight's name to the end
_RM = struct.Struct("<cQQIIQBBBdHHH")
# "rmok" of a 2-D y (no top-k): b"K", request id, layout, precision, queue s, kernel s, batch
# rows, batch requests, device s (NaN: None), y dtype, y rows, y columns; then the kernel's name
_RMOK = struct.Struct("<cQBBddIIdBII")
# the frames the device process's connections parse themselves (_Peer.plain: plain_mm,
# region_mm), undecoded: b"M" and b"G"
_UNDECODED = frozenset((0x4D, 0x47))
_NAN = float("nan")


def _opt(v: float | None) -> float:
    return _NAN if v is None else v


def _unopt(v: float) -> float | None:
    return None if v != v else v  # NaN: None


def _encode(msg: tuple[Any, ...]) -> bytes:
    """A message's payload (see _MM, _MMOK; pickled when it has another shape)."""
    kind = msg[0]
    if kind == "mm":
        _, rid, weight, weights, topk, precision, out, timeout, x, slot = msg
        if not weights and not topk and isinstance(x, tuple) and len(x[1]) == 2:
            return _MM.pack(b"M", rid, slot, x[1][0], x[1][1], _DTYPE_CODE[x[0]],
                            _DTYPE_CODE[out], _PRECISION_CODE[precision],
                            _opt(timeout)) + weight.encode()
    elif kind == "mmok":
        _, rid, f, outs = msg
        if (isinstance(f, tuple) and f[8] is None and len(outs) == 1
                and isinstance(outs[0], tuple) and len(outs[0][2]) == 2):
            off, dt, (rows, cols) = outs[0]
            return _MMOK.pack(b"R", rid, _LAYOUT_CODE[f[1]], _PRECISION_CODE[f[2]], f[3],
                              _opt(f[4]), f[5], f[6], _opt(f[7]), off, _DTYPE_CODE[dt], rows,
                              cols) + f[0].encode()
    elif kind == "rm":
        _, rid, owner, (xn, xo, xdt, xsh), (yn, yo), weight, prec, out, timeout = msg
        if (len(xsh) == 2 and xdt in _DTYPE_CODE and out in _DTYPE_CODE
                and prec in _PRECISION_CODE):
            names = (owner.encode(), xn.encode(), yn.encode())
            if all(len(b) < 65536 for b in names):
                return b"".join((_RM.pack(b"G", rid, xo, xsh[0], xsh[1], yo, _DTYPE_CODE[xdt],
                                          _DTYPE_CODE[out], _PRECISION_CODE[prec],
                                          _opt(timeout), *map(len, names)),
                                 *names, weight.encode()))
    elif kind == "rmok":
        _, rid, f, (dt, shape) = msg
        if f[8] is None and len(shape) == 2 and dt in _DTYPE_CODE:
            return _RMOK.pack(b"K", rid, _LAYOUT_CODE[f[1]], _PRECISION_CODE[f[2]], _opt(f[3]),
                              _opt(f[4]), f[5], f[6], _opt(f[7]), _DTYPE_CODE[dt], shape[0],
                              shape[1]) + f[0].encode()
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def _decode(b: memoryview | bytes) -> tuple[Any, ...]:
    """``_encode``'s inverse."""
    tag = b[0]
    if tag == 0x4D:  # b"M"
        _, rid, slot, rows, k, xdt, out, prec, timeout = _MM.unpack_from(b)
        return ("mm", rid, bytes(b[_MM.size:]).decode(), (), 0, _PRECISIONS[prec],
                _DTYPE_NAMES[out], _unopt(timeout), (_DTYPE_NAMES[xdt], (rows, k)), slot)
    if tag == 0x52:  # b"R"
        (_, rid, layout, prec, queue, kernel_s, rows, reqs, device_s, off, dt, yrows,
         ycols) = _MMOK.unpack_from(b)
        return ("mmok", rid, (bytes(b[_MMOK.size:]).decode(), _LAYOUTS[layout],
                              _PRECISIONS[prec], queue, _unopt(kernel_s), rows, reqs,
                              _unopt(device_s), None), [(off, _DTYPE_NAMES[dt], (yrows, ycols))])
    if tag == 0x47:  # b"G"
        (_, rid, xo, rows, k, yo, xdt, out, prec, timeout, lo, lx,
         ly) = _RM.unpack_from(b)
        p = _RM.size
        owner = bytes(b[p : p + lo]).decode()
        xn = bytes(b[p + lo : p + lo + lx]).decode()
        yn = bytes(b[p + lo + lx : p + lo + lx + ly]).decode()
        return ("rm", rid, owner, (xn, xo, _DTYPE_NAMES[xdt], (rows, k)), (yn, yo),
                bytes(b[p + lo + lx + ly :]).decode(), _PRECISIONS[prec], _DTYPE_NAMES[out],
                _unopt(timeout))
    if tag == 0x4B:  # b"K"
        (_, rid, layout, prec, queue, kernel_s, rows, reqs, device_s, dt, yrows,
         ycols) = _RMOK.unpack_from(b)
        return ("rmok", rid, (bytes(b[_RMOK.size:]).decode(), _LAYOUTS[layout],
                              _PRECISIONS[prec], _unopt(queue), _unopt(kernel_s), rows, reqs,
                              _unopt(device_s), None), (_DTYPE_NAMES[dt], (yrows, ycols)))
    # pickle: both ends are this worker's own processes, over a socket in a 0700 directory
    return pickle.loads(b)  # type: ignore[no-any-return]


class _Out:
    """The messages to one peer, small ones written together once per loop iteration: a
    batch's replies (or a burst of requests) cost one send() and one wake-up of the peer
    instead of one each. A big message first writes what is pending (order is kept). Every
    message to the peer goes through here."""

    def __init__(self, transport: asyncio.WriteTransport) -> None:
        self.transport = transport
        self._buf: list[bytes] = []
        self._loop = asyncio.get_running_loop()
        self._flush_at: asyncio.Handle | None = None  # the flush scheduled by send

    def send(self, msg: tuple[Any, ...]) -> None:
        self.send_bytes(_encode(msg))

    def send_bytes(self, data: bytes) -> None:
        """A message already encoded (``_encode``'s payload)."""
        if len(data) >= 65536:
            self.flush_now()
            if not self.transport.is_closing():
                self.transport.write(FRAME.pack(len(data)))  # no copy of a big payload
                self.transport.write(data)
            return
        if not self._buf:
            self._flush_at = self._loop.call_soon(self.flush)
        self._buf.append(FRAME.pack(len(data)) + data)

    def flush(self) -> None:
        self._flush_at = None
        if self._buf:
            data = b"".join(self._buf)
            self._buf.clear()
            if not self.transport.is_closing():
                self.transport.write(data)

    def flush_now(self) -> None:
        """Write what is pending now, not at the scheduled flush (which is called off): the
        sender knows nothing more goes to the peer in this trip (EngineProxy._flush)."""
        if self._flush_at is not None:
            self._flush_at.cancel()
        self.flush()


class _Peer(asyncio.Protocol):
    """One end of a device-socket connection. Each complete frame that arrives is decoded and
    handed to :meth:`message` in the loop trip that read it: no reader task, no coroutine
    or future per message. :meth:`drain` waits while the socket's write buffer is full."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.out: _Out | None = None
        self._buf = bytearray()  # the start of a frame not yet complete
        self._need = FRAME.size  # bytes _buf must hold before a frame can complete
        self._paused: asyncio.Future[None] | None = None
        # a plain matmul's frame (b"M", ``_MM``) goes to plain_mm undecoded (the device end)
        self.plain = False

    def message(self, msg: tuple[Any, ...]) -> None:
        raise NotImplementedError

    def plain_mm(self, payload: memoryview) -> None:
        raise NotImplementedError

    def region_mm(self, payload: memoryview) -> None:
        raise NotImplementedError

    def lost(self) -> None:
        """The connection is gone (called once)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.out = _Out(self.transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        if not buf:
            used = self._frames(data)
            if used < len(data):
                buf += memoryview(data)[used:]
            return
        buf += data
        if len(buf) >= self._need:
            used = self._frames(buf)
            del buf[:used]

    def _frames(self, data: bytes | bytearray) -> int:
        """Hand on every complete frame at the start of ``data``; returns the bytes used."""
        pos, end = 0, len(data)
        with memoryview(data) as mv:
            while end - pos >= FRAME.size:
                (n,) = FRAME.unpack_from(mv, pos)
                if end - pos - FRAME.size < n:
                    self._need = FRAME.size + n
                    return pos
                start, pos = pos + FRAME.size, pos + FRAME.size + n
                if self.plain and data[start] in _UNDECODED:  # b"M", b"G"
                    try:
                        with mv[start:pos] as payload:
                            if data[start] == 0x4D:
                                self.plain_mm(payload)
                            else:
                                self.region_mm(payload)
                    except Exception:
                        log.exception("device-socket plain matmul failed; closing the "
                                      "connection")
                        assert self.transport is not None
                        self.transport.close()
                        return end
                    continue
                with mv[start:pos] as payload:
                    msg = _decode(payload)
                try:
                    self.message(msg)
                except Exception:
                    log.exception("device-socket message %r failed; closing the connection",
                                  msg[0])
                    assert self.transport is not None
                    self.transport.close()
                    return end
        self._need = FRAME.size
        return pos

    def pause_writing(self) -> None:
        self._paused = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)
        self._paused = None

    async def drain(self) -> None:
        if self._paused is not None:
            await asyncio.shield(self._paused)

    def connection_lost(self, exc: Exception | None) -> None:
        self.resume_writing()
        self.lost()


def _portable_error(e: BaseException) -> Q6Error:
    """What the front end re-raises: our errors as they are, anything else INTERNAL (logged
    here, in the device process, with its traceback)."""
    if isinstance(e, Q6Error):
        return e
    if isinstance(e, asyncio.CancelledError):
        return Unavailable("the request was cancelled in the device process")
    log.error("front-end request failed in the device process", exc_info=e)
    return Q6Error("internal error (logged by the worker)")


# per dtype name: the little-endian dtype the arena holds; per dtype: its name (dict lookups
# on the hot path instead of dtype_name's scan and newbyteorder per call)
_LE = {name: d.newbyteorder("<") for name, d in DTYPES.items()}
_NAME = {d: name for name, d in DTYPES.items()}
_PRECISION_OF = {p.value: p for p in Precision}
_LAYOUT_OF = {v.value: v for v in Layout}
# by the codes of a plain matmul's frame (``_MM``): x's little-endian dtype, y's dtype, precision
_LE_BY_CODE = tuple(_LE[name] for name in _DTYPE_NAMES)
_DTYPE_BY_CODE = tuple(DTYPES[name] for name in _DTYPE_NAMES)
_PRECISION_BY_CODE = tuple(_PRECISION_OF[v] for v in _PRECISIONS)


def _desc(a: np.ndarray) -> tuple[str, tuple[int, ...]]:
    return _NAME.get(a.dtype) or dtype_name(a.dtype), a.shape


SLOT_ALIGN = 64  # several outputs in one slot (a multi-weight reply) start at multiples of this

# A matmul's outputs as the device process sends them: per reply part (one, or one per weight
# of a multi-weight request) None (top-k: no y), (offset, dtype, shape) of y in the request's
# slot, or y itself (did not fit the slot)
Outs = list[tuple[int, str, tuple[int, ...]] | np.ndarray | None]


def _parts(reply: Any) -> list[MatmulReply]:
    """A reply's parts: the MatmulReply, or one per weight of a multi-weight reply."""
    return [reply] if isinstance(reply, MatmulReply) else [r for _, r in reply]


def _fields(r: MatmulReply) -> tuple[Any, ...]:
    # plain values: pickling the dataclass (and its enums) cost ~40 us a reply
    return (r.kernel, r.layout.value, r.precision.value, r.queue_seconds, r.kernel_seconds,
            r.batch_rows, r.batch_requests, r.device_seconds, r.topk)


def _mmok_head(f: tuple[Any, ...]) -> tuple[tuple[Any, ...], bytes] | None:
    """What the "R" frames (``_MMOK``) of replies with fields ``f`` share: the values between
    the request id and y's place, and the kernel's name; None: not that layout (top-k)."""
    if f[8] is not None:
        return None
    return ((_LAYOUT_CODE[f[1]], _PRECISION_CODE[f[2]], f[3], _opt(f[4]), f[5], f[6],
             _opt(f[7])), f[0].encode())


def _rmok_head(f: tuple[Any, ...], y: Any) -> tuple[tuple[Any, ...], bytes] | None:
    """``_mmok_head`` for the "K" frames (``_RMOK``) of region calls' replies with fields
    ``f`` and rows of ``y``: the values between the request id and y's rows, with y's dtype
    code last; None: not that layout (top-k, a y of another rank or dtype)."""
    dt = _DTYPE_CODE.get(_NAME.get(y.dtype)) if isinstance(y, np.ndarray) else None
    if f[8] is not None or dt is None or y.ndim != 2:  # type: ignore[union-attr]
        return None
    return ((_LAYOUT_CODE[f[1]], _PRECISION_CODE[f[2]], _opt(f[3]), _opt(f[4]), f[5], f[6],
             _opt(f[7]), dt), f[0].encode())


def _strip(reply: Any) -> Any:
    """The reply without its y arrays (they travel as ``Outs``), as plain values."""
    if isinstance(reply, MatmulReply):
        return _fields(reply)
    return [(name, _fields(r)) for name, r in reply]


def _reply(f: tuple[Any, ...], y: np.ndarray | None) -> MatmulReply:
    kernel, layout, precision, queue, kernel_s, rows, reqs, device_s, topk = f
    return MatmulReply(y, kernel, _LAYOUT_OF[layout], _PRECISION_OF[precision], queue,
                       kernel_s, rows, reqs, device_s, topk)


def _dress(reply: Any, ys: list[np.ndarray | None]) -> Any:
    """``_strip``'s inverse: the replies with their y arrays, in order."""
    if isinstance(reply, tuple):
        return _reply(reply, ys[0])
    return [(name, _reply(f, y)) for (name, f), y in zip(reply, ys, strict=True)]


@dataclasses.dataclass(eq=False)
class _Front:
    """One connected front end, as the device process sees it."""

    index: int
    pid: int
    transport: asyncio.Transport
    arena: Arena
    out: _Out
    alive: bool = True
    pending: int = 0  # matmuls on the device whose result goes to this front end
    calls: int = 0  # matmuls it sent (tests check that every front end serves)
    uploads: dict[int, asyncio.Queue[Any]] = dataclasses.field(default_factory=dict)

    def send(self, msg: tuple[Any, ...]) -> None:
        if self.alive:
            self.out.send(msg)

    def done_one(self) -> None:
        self.pending -= 1
        if not self.alive and self.pending == 0:
            self.arena.close()


def child_args(args: tuple[Any, ...]) -> bytes:
    """A front end's start-up arguments, as the device process writes them to its stdin
    (``FrontendsWorker._spawn``)."""
    return pickle.dumps(args)


def read_child_args(f: Any) -> tuple[Any, ...]:
    """``child_args``'s inverse (``frontend_main`` reads its stdin)."""
    return pickle.load(f)  # type: ignore[no-any-return]
