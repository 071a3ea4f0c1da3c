"""Several front-end processes per device: ``q6serve worker --frontends N`` (issue 15 item 2).

One Python gRPC process moves ~5-6k requests/s whatever its handlers do, so the gRPC edge runs
in N processes that listen on one port (SO_REUSEPORT: the kernel spreads connections over
them, as in grpc's multiprocessing example) and feed ONE device process, which alone owns the
backend, the weights, the VRAM accountant, the batchers, the regions and /metrics::

    clients ──TCP──▶ front end 0..N-1 (grpc.aio: interceptor, auth, wire decode, servicer,
                     health, reflection)
                          │ Unix socket per front end: small messages + wake-up
                          │ shared-memory arena per front end: x and y of matmuls
                          ▼
                     device process (this module's FrontendsWorker, the `q6serve worker`
                     process): Engine, RegionTable, Metrics (/metrics), drain

A matmul's activations go into a slot of the front end's arena (one copy, which the bytes
path makes anyway); the device process views them there, runs the batcher, writes y into the
same slot and answers with a ~100-byte message; the front end copies a small y (<= 64 KiB) out
of the slot and frees it at once, or encodes a bigger one from the slot and frees the slot when
the reply's y is gone; the caller's sink (the servicer's reply) runs in the loop trip that
reads the answer. A plain matmul and its reply travel in fixed
struct layouts (``_MM``, ``_MMOK``), everything else as pickled tuples of plain values; the
frames are parsed as they arrive (``_Peer``: no reader task or coroutine per message). Calls
whose x or y do not fit a slot (or when every slot is busy) carry the array in the message
instead. The socket is the wake-up; the small messages to a peer within one loop iteration
(e.g. a batch's replies) go out in one write (``_Out``).

Contract kept from the one-process worker: the same servicer, interceptor (error codes,
auth), health and reflection run in every front end; every request kind (multi-weight, top-k,
regions, streams) is served (small calls stacked per front end: ``EngineProxy``);
admission limits are split over the front ends
(``frontend_limits``), so they hold for the worker as a whole; request metrics are forwarded to the
device process every 200 ms, so one /metrics shows the whole worker; status and flags are the
device process's. SIGTERM to the `q6serve worker` process drains: every front end turns
health NOT_SERVING and stops its server with the grace period, the engine refuses new work,
and when the front ends have exited the regions and weights are freed. A front end that dies
(even mid-call) is logged and replaced; its unfinished calls complete on the device and their
results are dropped; the device process keeps serving the others.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import gc
import json
import logging
import math
import mmap
import os
import pickle
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from q6serve.kernels.api import DTYPES, Backend, Layout, Precision, dtype_name
from q6serve.kernels.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Q6Error,
    Unavailable,
)
from q6serve.kernels.hostio import HostIO, Route

from . import envvars, reuseport, wire
from . import lane as lane_mod
from . import regions as regions_mod
from .admission import Admission, StreamBudget, StreamSlots
from .affinity import cores_of, pin_process
from .auth import TokenAuth
from .config import WorkerConfig
from .engine import Engine, MatmulCall, MatmulReply
from .interceptor import ErrorInterceptor
from .multi import start_matmul_weights
from .regions import CUDA, SHM_DIR, Region, RegionIO, RegionRef, YSpec, table_for
from .servicer import Q6ServeServicer, RegionPlane
from .threads import busy_poll, outcome
from .worker import Worker, build_server, stop_server

log = logging.getLogger("q6serve.frontends")
SLOT_BYTES = 4 << 20  # one matmul's x, then its y; bigger ones travel in the message
GROUP_MAX_ROWS = 64  # a front end stacks small calls up to this many rows (EngineProxy)
# a front end's stacked requests per (weight, dtypes, K) on the device at once; later calls
# wait for one of them to be answered and go stacked (EngineProxy: fewer, larger messages).
# Env Q6SERVE_FRONTEND_STACKS (read when a front end starts; 0: no limit). Two: one measured
# better only with round-robin connections, and T2 under the default connection hash fell with
# it in session 13's closing check (bench/RESULTS.md, issue 15 session 13).
STACKS_IN_FLIGHT = int(envvars.FRONTEND_STACKS.default)
STACKS_ENV = envvars.FRONTEND_STACKS.name


def stacks_in_flight(env: Mapping[str, str] | None = None) -> int:
    """STACKS_IN_FLIGHT, or the env's count (0: unlimited)."""
    return int(envvars.FRONTEND_STACKS.read(env)) or 1 << 30


# a front end's loop may busy-poll (service/threads.py's busy_poll: select without blocking
# for up to this many us after its last event before it sleeps) so that a device answer or a
# gRPC event finds it running instead of woken from epoll. Env Q6SERVE_FRONTEND_BUSY_POLL_US
# (read when a front end starts). Off by default: on the H200 (16 cores) T2 through 8 front
# ends was not faster with 1000 us in an alternated A/B (13.1k/13.3k off, 14.5k/13.4k on; p99
# 8.2 -> 8.8/10.6 ms): the wait for the device's answer got shorter (server other 2.9 -> 2.3 ms)
# and gRPC's own transport longer (1.3 -> 1.6-1.9 ms; the spinning loop holds the GIL that
# gRPC's threads need). bench/RESULTS.md, issue 15 session 9.
FRONTEND_BUSY_POLL_ENV = envvars.FRONTEND_BUSY_POLL_US.name


def frontend_busy_poll_us(env: Mapping[str, str] | None = None) -> float:
    """A front end's spin before it sleeps, in us (0: off, the default)."""
    return float(envvars.FRONTEND_BUSY_POLL_US.read(env))  # type: ignore[arg-type]


# plain calls read in one loop trip for the same weight, dtypes and K go to the engine as one
# request (FrontendsWorker._queue_call). Env Q6SERVE_DEVICE_MERGE=0 turns it off (experiments).
MERGE_ENV = envvars.DEVICE_MERGE.name
FRAME = struct.Struct("<Q")
METRICS_FLUSH_S = 0.2
START_TIMEOUT_S = 120.0


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


# -- the arena: per front end, fixed slots of shared memory -------------------------------------
class Arena:
    """``slots`` x ``slot_bytes`` of POSIX shared memory. The front end creates it (and
    commits its pages: a full /dev/shm fails here, not as a SIGBUS later), the device process
    maps it, then the name is unlinked: nothing is left in /dev/shm even after a kill -9."""

    def __init__(self, name: str, mm: mmap.mmap, slots: int, slot_bytes: int) -> None:
        self.name, self._mm, self.slots, self.slot_bytes = name, mm, slots, slot_bytes
        # the whole arena as bytes, writable and read-only: a view of a slot is then one
        # ndarray(...) call (~0.2 us; np.frombuffer on the mmap costs ~1 us)
        self._rw: np.ndarray | None = np.frombuffer(mm, np.uint8)
        self._ro: np.ndarray | None = self._rw.view()
        self._ro.flags.writeable = False
        self.addr = int(self._rw.ctypes.data)  # slot s starts at addr + s * slot_bytes
        self._hostio: HostIO | None = None  # page-locked with it (pin), until close

    @classmethod
    def create(cls, slots: int, slot_bytes: int) -> Arena:
        name = f"q6fe_{os.getpid()}_{secrets.token_hex(4)}"
        size = slots * slot_bytes
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                os.unlink(SHM_DIR / name)
                raise Unavailable(f"cannot commit a {size}-byte front-end arena in {SHM_DIR}: "
                                  f"{e.strerror} (lower --frontend-shm-bytes or grow "
                                  f"{SHM_DIR})") from None
            return cls(name, mmap.mmap(fd, size), slots, slot_bytes)
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, name: str, slots: int, slot_bytes: int) -> Arena:
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size < slots * slot_bytes:
                raise InvalidArgument(f"front-end arena {name} is smaller than announced")
            return cls(name, mmap.mmap(fd, slots * slot_bytes), slots, slot_bytes)
        finally:
            os.close(fd)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_DIR / self.name)

    def pin(self, hostio: HostIO) -> bool:
        """Page-lock the whole arena for the device's copies (the device process, on a backend
        that DMAs host memory: ``HostIO.pin``): an x viewing a slot is then DMA'd from there
        (no copy into the staging buffer) and a routed y DMA'd into its slot. False where the
        backend refuses (correct, only slower). Undone by :meth:`close`."""
        if self._hostio is None and hostio.pin(self.addr, self.slots * self.slot_bytes):
            self._hostio = hostio
        return self._hostio is not None

    @property
    def pinned(self) -> bool:
        return self._hostio is not None

    @property
    def base(self) -> np.ndarray | None:
        """The array every view of a slot has as its base (NumPy's base of a view of the
        read-only view is this one): ``x.base is arena.base`` says x views this arena."""
        return self._rw

    def array(self, slot: int, dtype: np.dtype, shape: tuple[int, ...],
              writable: bool, offset: int = 0) -> np.ndarray:
        """``shape`` of ``dtype`` at byte ``offset`` of slot ``slot``."""
        n = math.prod(shape) * dtype.itemsize  # (np.prod costs ~10 us a call)
        if not 0 <= slot < self.slots or offset < 0 or offset + n > self.slot_bytes:
            raise InvalidArgument(f"arena slot {slot} cannot hold {n} bytes at {offset}")
        base = self._rw if writable else self._ro
        if base is None:
            raise Unavailable(f"front-end arena {self.name} is closed")
        return np.ndarray(shape, dtype, base, slot * self.slot_bytes + offset)

    def put(self, slot: int, y: np.ndarray) -> None:
        """``y`` at the start of slot ``slot``, little-endian (a C-contiguous native y on a
        little-endian host: one copy into the mapping, no view made)."""
        n = y.nbytes
        if not 0 <= slot < self.slots or n > self.slot_bytes:
            raise InvalidArgument(f"arena slot {slot} cannot hold {n} bytes at 0")
        if self._rw is None:
            raise Unavailable(f"front-end arena {self.name} is closed")
        if _LITTLE and y.flags.c_contiguous and y.dtype.isnative:
            start = slot * self.slot_bytes
            self._mm[start : start + n] = y  # type: ignore[index]
        else:
            self.array(slot, y.dtype.newbyteorder("<"), y.shape, writable=True)[...] = y

    def unpin(self) -> None:
        """Undo :meth:`pin` (waits for the device's copies first: call before the unmap)."""
        if self._hostio is not None:
            self._hostio, hostio = None, self._hostio
            hostio.unpin(self.addr)

    def close(self) -> None:
        self.unpin()
        self._rw = self._ro = None
        with contextlib.suppress(BufferError):  # still viewed: unmapped when that array goes
            self._mm.close()


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
_LITTLE = sys.byteorder == "little"
# a merged batch's x is gathered from its calls' slots only at these precisions: the others
# may resolve to Q8_1, whose launch reads x on the host first (kernels/api.py launch_ieee)
_GATHER_PRECISIONS = frozenset((Precision.EXACT, Precision.F16))


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


# -- counters of the device process, for profiling (env Q6SERVE_DP_STATS=FILE) ----------------
STATS_ENV = "Q6SERVE_DP_STATS"


class _DeviceStats:
    """What the device process does per call, counted from outside the hot path: with
    ``Q6SERVE_DP_STATS=FILE`` the device process wraps its selector, its connections, its
    dispatch, its inline device jobs and its batch metrics with counters, and appends one JSON
    line of cumulative figures to FILE every second (deltas of two lines = a window): loop
    iterations and time blocked in epoll, socket reads and writes, messages and calls received
    (and each front end's rows, by pid),
    batches and their rows, inline jobs' wall and CPU, per-thread CPU and context switches.
    Off (no wrapper at all) unless the env names a file."""

    def __init__(self, worker: FrontendsWorker, path: str) -> None:
        import threading

        self.w, self.path, self._threading = worker, path, threading
        self._lanes: lane_mod.LaneServer | None = None  # the fast lanes', once one opened
        self.c: dict[str, float] = collections.defaultdict(float)
        loop = asyncio.get_running_loop()
        sel = loop._selector  # type: ignore[attr-defined]
        select, c = sel.select, self.c
        pc = time.perf_counter

        def counted_select(timeout: float | None = None) -> Any:
            t = pc()
            ev = select(timeout)
            c["select_s"] += pc() - t
            c["loop_iterations"] += 1
            c["select_events"] += len(ev)
            if ev:
                c["wakeups"] += 1
            return ev

        sel.select = counted_select
        dev = worker.engine.device  # type: ignore[union-attr]

        def timed(run: Callable[..., Any]) -> Callable[..., Any]:
            def timed_run(*a: Any) -> Any:
                t, tc = pc(), time.thread_time()
                try:
                    return run(*a)
                finally:
                    c["inline_jobs_wall_s"] += pc() - t
                    c["inline_jobs_cpu_s"] += time.thread_time() - tc

            return timed_run

        dev._run_here = timed(dev._run_here)  # type: ignore[method-assign]
        # the direct path's jobs (their answers are not in their time)
        dev.run_now = timed(dev.run_now)  # type: ignore[method-assign]
        if worker.metrics is not None:
            observe = worker.metrics.observe_batch

            def counted_batch(stats: Any) -> None:
                c["batches"] += 1
                c["batch_rows"] += stats.rows
                c["batch_requests"] += stats.requests
                observe(stats)

            worker.metrics.observe_batch = counted_batch  # type: ignore[method-assign]
        dispatch = worker._dispatch

        def counted_dispatch(fe: _Front, msg: tuple[Any, ...]) -> None:
            c["msg_" + msg[0]] += 1
            if msg[0] == "call":  # which device call (a region's: which operation)
                c[f"call_{msg[2]}" + (f"_{msg[3][0]}" if msg[2] == "region" else "")] += 1
                if msg[2] == "region" and msg[3][0] == "matmul":  # a call of x's rows
                    shape = msg[3][2].x_shape
                    c["region_rows"] += shape[0] if shape else 1
            elif msg[0] == "rm":  # x and y in regions
                c["region_rows"] += msg[3][3][0]
            elif msg[0] == "mm":
                x = msg[8]
                n = x[1][0] if isinstance(x, tuple) else len(x)
                c["mm_rows"] += n
                c[f"front_rows_{fe.pid}"] += n
            dispatch(fe, msg)

        worker._dispatch = counted_dispatch  # type: ignore[method-assign]
        plain = worker._plain_mm

        def counted_plain(fe: _Front, b: memoryview) -> None:
            c["msg_mm"] += 1
            n = _MM.unpack_from(b)[3]
            c["mm_rows"] += n
            c[f"front_rows_{fe.pid}"] += n  # each front end's rows (calls of one row)
            plain(fe, b)

        worker._plain_mm = counted_plain  # type: ignore[method-assign]
        region_frame = worker._region_frame

        def counted_region(fe: _Front, b: memoryview) -> None:
            c["msg_rm"] += 1
            c["region_rows"] += _RM.unpack_from(b)[3]
            region_frame(fe, b)

        worker._region_frame = counted_region  # type: ignore[method-assign]
        self._stages(worker)
        for fe in worker._fronts.values():  # connected while the worker started
            self.connection(fe.transport.get_protocol())  # type: ignore[arg-type]
        self.t0 = pc()
        loop.call_later(1.0, self._tick)

    def _timed(self, obj: Any, attr: str, key: str) -> None:
        """``obj.attr`` (a bound method or a module function) wrapped to add its wall time
        and calls to ``st_KEY_s`` / ``st_KEY_n`` (inclusive of what it calls: a stage's
        nested stages are inside its time). Two perf_counter reads a call (~0.1 us)."""
        fn, c, pc = getattr(obj, attr, None), self.c, time.perf_counter
        if fn is None:
            return
        s_key, n_key = f"st_{key}_s", f"st_{key}_n"

        def timed_stage(*a: Any, **kw: Any) -> Any:
            t = pc()
            try:
                return fn(*a, **kw)
            finally:
                c[s_key] += pc() - t
                c[n_key] += 1

        setattr(obj, attr, timed_stage)

    def _stages(self, worker: FrontendsWorker) -> None:
        """Where the loop's busy time goes per call (issue 15, session 20: 100-160 us of
        loop a region call with nothing dominant in py-spy's few samples): wall time of the
        device process's stages, each a method of the worker, its region table, its CUDA
        region support or its engine, or this module's message codec. The top-level ones
        (what a loop trip runs: ``read``, ``flush_calls``, ``tick``, ``out_flush``) sum to
        the loop's busy time less asyncio's own share; bench/device_stats_table.py
        --stages prints them a call."""
        t = self._timed
        t(worker, "_dispatch", "dispatch")  # (inside read: a decoded message)
        t(worker, "_plain_mm", "plain_mm")
        t(worker, "_region_matmul", "region_mm")  # the checks, x/y views, queued for the trip
        t(worker, "_flush_calls", "flush_calls")  # the trip's end: launches, waits, answers
        t(worker, "_launch_cuda_due", "launch_cuda")
        t(worker, "_launch_sys_due", "launch_sys")
        t(worker, "_settle", "settle")  # waits (pipelined_wait_s) and the answers
        t(worker, "_cuda_region_done", "cuda_done")
        t(worker, "_sys_done", "sys_done")
        t(worker, "_tick", "tick")
        t(worker, "_start_merged", "start_merged")
        # (inside start_merged: T2's merged batch, x's rows staged, the job, the answers)
        t(worker, "_stage_x", "stage_x")
        t(worker, "_answer_merged", "answer_merged")
        t(worker, "_region_answer", "region_answer")  # (inside answer_merged: a region call)
        t(worker, "_start_alone", "start_alone")  # (a trip's lone call: its job, its answer)
        if worker.regions is not None:
            t(worker.regions, "hold", "hold")
            t(worker.regions, "let_go", "let_go")
            if (cuda := worker.regions.cuda) is not None:
                t(cuda, "launch_now", "cuda_launch_now")
                t(cuda, "_admit", "cuda_admit")
                t(cuda, "_launch", "cuda_launch")  # the slot, the bound sequence, the event
                t(cuda, "_launch_known", "cuda_launch_known")
                t(cuda, "_launch_place", "cuda_launch_place")  # (a place graph's launch)
        if worker.engine is not None:
            t(worker.engine, "launch_now", "engine_launch_now")
            t(worker.engine, "run_direct", "run_direct")  # (the merged batch's inline job)
            t(worker.engine, "run_now", "run_now")  # (a lone call's inline job)

    def lanes(self, server: lane_mod.LaneServer) -> None:
        """Time the fast lanes' stages (once, when the first lane opens): a request record
        handled (``lane_request``: the checks, then launched or queued), the trip's full
        batches pipelined (``lane_flush``) and a reply (``lane_answer``); their requests
        are the snapshot's ``lane_requests`` (bench/device_stats_table.py counts them as
        calls: a lane's request is one, as a front end's message is)."""
        if self._lanes is None:
            self._lanes = server
            self._timed(server, "_request", "lane_request")
            self._timed(server, "_flush", "lane_flush")
            self._timed(server, "_answer", "lane_answer")

    def connection(self, conn: _FrontConnection) -> None:
        """Count one front end's socket reads and writes (and their time: ``read`` is a
        socket read's frames parsed and handed on, ``write`` the transport's send)."""
        c, received = self.c, conn.data_received
        transport = conn.transport
        assert transport is not None
        write = transport.write

        def counted_received(data: bytes) -> None:
            c["socket_reads"] += 1
            c["socket_read_bytes"] += len(data)
            received(data)

        def counted_write(data: Any) -> None:
            c["socket_writes"] += 1
            write(data)

        conn.data_received = counted_received  # type: ignore[method-assign]
        transport.write = counted_write  # type: ignore[method-assign]
        self._timed(conn, "data_received", "read")
        self._timed(transport, "write", "write")
        if conn.out is not None:  # its answers' writes, scheduled or at a trip's end
            self._timed(conn.out, "flush", "out_flush")

    def snapshot(self) -> dict[str, Any]:
        names = {t.native_id: t.name for t in self._threading.enumerate()}
        tick = os.sysconf("SC_CLK_TCK")
        threads = {}
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                with open(f"/proc/self/task/{task}/stat") as f:
                    comm, rest = f.read().rsplit(")", 1)
                fields = rest.split()
                key = f"{task}:{names.get(int(task), comm.split('(', 1)[1])}"
                threads[key] = (int(fields[11]) + int(fields[12])) / tick
        with open("/proc/self/status") as f:
            status = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
        dev = self.w.engine.device  # type: ignore[union-attr]
        return {"t": time.perf_counter() - self.t0, "wall": time.time(),
                "cpu_s": time.process_time(),
                **self.c, "jobs": dev.jobs, "inline_jobs": dev.inline_jobs,
                "deferred_jobs": dev.deferred_jobs, "behind_jobs": dev.behind_jobs,
                "direct_jobs": dev.direct_jobs, "merged_requests": self.w.merged[0],
                "merged_calls": self.w.merged[1], "gathered_batches": self.w.gathered,
                "pipelined_batches": self.w.pipelined[0],
                "pipelined_wait_s": self.w.pipelined[1], "threads_cpu_s": threads,
                # the full system-region calls: launched, by their plan, queued
                "sys_launched": self.w.sys_launched, "sys_planned": self.w.sys_planned,
                "sys_queued": self.w.sys_queued,
                # the fast lanes' requests (each a call; none before a lane opened)
                "lane_requests": 0 if self._lanes is None else self._lanes.direct,
                # (not ``regions and ...``: a RegionTable with no region left is falsy)
                "place_launches": getattr(None if self.w.regions is None
                                          else self.w.regions.cuda, "place_launches", 0),
                **{k.strip(): int(v) for k, v in status.items()}}

    def _tick(self) -> None:
        with contextlib.suppress(OSError), open(self.path, "a") as f:
            f.write(json.dumps(self.snapshot()) + "\n")
        if not self.w._draining:
            asyncio.get_running_loop().call_later(1.0, self._tick)


def _settled(outcome: Any) -> asyncio.Future[Any]:
    """A future already holding ``outcome`` (an exception: failed), for a sink."""
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    if isinstance(outcome, BaseException):
        fut.set_exception(outcome)
    else:
        fut.set_result(outcome)
    return fut


def _told_failure(fe: _Front, rid: int, fut: asyncio.Future[Any]) -> bool:
    """A sink's first step: a failed (or cancelled) request's error goes to its front end."""
    if not fut.cancelled() and fut.exception() is None:
        return False
    exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
    fe.send(("err", rid, _portable_error(exc)))  # type: ignore[arg-type]
    return True


def _longest(parts: list[tuple[MatmulCall, Any]]) -> float | None:
    """The deadline of merged calls' one request: the longest (each caller's own deadline
    ends its RPC); None if any has none."""
    timeout = 0.0
    for c, _ in parts:
        if c.timeout is None:
            return None
        timeout = max(timeout, c.timeout)
    return timeout


def _probe(parts: list[tuple[MatmulCall, Any]], rows: int, timeout: float | None) -> MatmulCall:
    """Merged calls' request as the engine's checks read it (rows and dtypes; x one row,
    repeated: nothing copied), before x is built (``_staged``)."""
    first = parts[0][0]
    x0 = first.x
    return MatmulCall(first.weight, np.ndarray((rows, x0.shape[1]), x0.dtype, x0, 0,
                                               (0, x0.strides[1])),
                      first.precision, first.out_dtype, timeout)


def _staged(engine: Engine, parts: list[tuple[MatmulCall, Any]], rows: int) -> np.ndarray:
    """Merged calls' x concatenated straight into the backend's upload buffer
    (``Backend.staging``: valid until the next launch, which must be this one's)."""
    x0 = parts[0][0].x
    return np.concatenate([c.x for c, _ in parts],
                          out=engine.backend.staging(rows, x0.shape[1], x0.dtype))


# ============================================================================================
# The device process
# ============================================================================================
@dataclasses.dataclass(slots=True)
class _SysCall:
    """A full system-region call on its way through the device process's pipeline
    (``FrontendsWorker._sys_call``): who gets the answer, its region (x and y, held), y's
    place, the call, y's view, the route key (unrouted once), its plan (launched by it), the
    plan's key in ``region.plans`` and the flag state a plan from it would be valid for."""

    fe: _Front
    rid: int
    region: Region
    y_off: int
    call: MatmulCall
    dest: np.ndarray
    key: Any
    plan: Any
    pkey: tuple[Any, ...]
    state: Any

    def drop_plan(self) -> None:
        """Forget the region's plan for this call's place (stale, refused, or the call queued:
        a later repeat plans again)."""
        if self.region.plans is not None:
            self.region.plans.pop(self.pkey, None)


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


class FrontendsWorker(Worker):
    """The device process of a ``--frontends N`` worker (N >= 1 front-end processes)."""

    def __init__(self, config: WorkerConfig, backend: Backend,
                 registry: CollectorRegistry | None = None) -> None:
        super().__init__(config, backend, registry)
        self.n = config.frontends
        self.slot_bytes = min(SLOT_BYTES, config.frontend_shm_bytes)
        self.slots = max(1, config.frontend_shm_bytes // self.slot_bytes)
        self._dir = Path(tempfile.mkdtemp(prefix="q6serve-fe-"))  # 0700: ours only
        self._sock_path = str(self._dir / "device.sock")
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._fronts: dict[int, _Front] = {}
        self._ready: dict[int, asyncio.Future[None]] = {}
        self._reserved: socket.socket | None = None
        self._unix: asyncio.base_events.Server | None = None
        self._draining = False
        self._supervisor: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pending = 0  # matmuls in this process now
        self.pending_peak = 0  # most matmuls in this process at once (admission tests)
        self.stats: _DeviceStats | None = None  # Q6SERVE_DP_STATS
        # calls to merge at the end of this loop trip, by (weight, x dtype, K, precision, out)
        self._merging: dict[tuple[Any, ...], list[tuple[MatmulCall, Any]]] = {}
        self.merge = bool(envvars.DEVICE_MERGE.read())
        # CUDA-region calls (y in a CUDA region) are launched at the trip's end behind the
        # launches still out, and waited for a loop trip later (_tick), or, once the device
        # may launch no more, before the next launch: the loop reads and launches the next
        # calls while the GPU runs the previous ones. T3 through front ends over CUDA IPC
        # regions, H200, alternated: 414-462k rows/s against 264-329k waiting inline (session
        # 17, 3 pairs of 3; 6 of 7 pairs since session 16). Bytes and system-region calls wait
        # inline: the same pipeline lost T3 through system regions (162-186k against
        # 163-238k) and left T2 even (docs/SCALEOUT.md, session 17). Out: (wait,
        # done(reply, exception), launch number, its slot's completion event or None).
        self._out: collections.deque[tuple[Callable[[], Any],
                                           Callable[[Any, BaseException | None], None], int,
                                           Any]] = collections.deque()
        # Q6SERVE_DP_READY_POLL: the launches out are answered at a loop trip once their launch
        # slot's completion event says they are done (a query, no sync), in order; one not
        # done yet is looked at again a trip later, the loop reading messages meanwhile
        # (bundle A: the loop blocked in those syncs 15 us a CUDA-region call, 43 a system-
        # region one). Where a slot is needed the oldest is still waited for.
        self.ready_poll = bool(envvars.DP_READY_POLL.read())
        self._ws: Any = None  # the CUDA launcher's workspace (its slots), set at start
        self._ws_slots = 0  # its launch slots (kernels/cuda/launch.py SLOTS)
        self._launches = 0  # launches so far (each out entry's number)
        self._tick_due = False
        # CUDA-region calls read in this trip, launched at its end: (call, y's CUDA view or
        # None, done)
        self._cuda_due: list[tuple[MatmulCall, Any, Callable[[Any, BaseException | None],
                                                             None]]] = []
        # full system-region calls read in this trip (x and y page-locked in one region),
        # launched at its end through the same pipeline (``_launch_sys_due``)
        self._sys_due: list[_SysCall] = []
        self.sys_pipe = bool(envvars.DP_SYS_PIPE.read())  # (0: queued to the batcher)
        # of the full system-region calls: launched (by their plan or routed), by their
        # region's plan, and queued to the batcher (the engine would not launch them now);
        # in Q6SERVE_DP_STATS' lines (bench/device_stats_table.py's "sys" cell)
        self.sys_launched = 0
        self.sys_planned = 0
        self.sys_queued = 0
        self.pipelined = [0, 0.0]  # calls launched so, and the loop's seconds in their waits
        self._merge_rows = min(config.max_batch_rows, config.max_request_rows)
        self.merged = [0, 0]  # engine requests that merged several calls, and those calls
        self.merged_direct = 0  # of those requests, run on the direct path (tests)
        # Q6SERVE_DP_LANE_PIPE: the fast lanes' full batches through the same pipeline
        # (LaneServer.pipe), not waited for inline in the lane's flush
        self.lane_pipe = bool(envvars.DP_LANE_PIPE.read())
        # Q6SERVE_FRONTEND_ROUND_ROBIN: the eBPF program and maps that deal new connections to
        # the front ends in turn (service/reuseport.py), passed down to each front end
        self._steering: reuseport.Steering | None = None
        # Q6SERVE_DP_PIN_ARENA: the backend's page-locked ranges (kernels/hostio.py) that each
        # front end's arena joins when it connects (None: arenas stay pageable), and the
        # arenas pinned so far (unpinned when one closes, or at stop before the backend goes)
        self._arena_io: HostIO | None = None
        self._pinned_arenas: set[Arena] = set()
        # Q6SERVE_DP_ARENA_GATHER (with pinned arenas): the backend's ``gathered`` (a merged
        # batch's x DMA'd from its calls' slots), or None: x's rows concatenated (``_staged``)
        self._gather: Callable[..., np.ndarray | None] | None = None
        self.gathered = 0  # merged batches launched so (tests)

    # -- start ------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        frontend_busy_poll_us()  # a bad value fails the start here, not in every front end
        self._init_metrics()
        self.engine = self.make_engine()
        if self.ready_poll:
            self._ws = getattr(getattr(self.backend, "launcher", None), "ws", None)
            if self._ws is not None:
                from ..kernels.cuda.launch import SLOTS

                self._ws_slots = SLOTS
        self.regions = table_for(cfg.allow_shm, cfg.max_regions, cfg.max_region_bytes,
                                 self.backend, self.engine)
        if envvars.DP_PIN_ARENA.read():
            self._arena_io = getattr(self.backend, "hostio", None)
            if self._arena_io is not None and envvars.DP_ARENA_GATHER.read():
                self._gather = getattr(self.backend, "gathered", None)
        self.plane = RegionPlane(self.regions, self.engine)
        self.port = self._reserve_port()
        if envvars.FRONTEND_ROUND_ROBIN.read():
            self._steering = reuseport.make(self.n)
        self._unix = await asyncio.get_running_loop().create_unix_server(
            lambda: _FrontConnection(self), path=self._sock_path)
        for i in range(self.n):
            self._spawn(i)
        try:
            await asyncio.wait_for(self._started(), START_TIMEOUT_S)
        except BaseException:
            await self._teardown()
            raise
        log.info("listening on %s:%d", cfg.host, self.port)  # must stay the first line
        log.info("%s", cfg.describe())
        log.info("%s; %d front-end processes (pids %s), %d arena slots of %d bytes each",
                 self.engine.describe(), self.n,
                 ",".join(str(p.pid) for p in self._procs.values()), self.slots,
                 self.slot_bytes)
        if self._steering is not None:
            log.info("new connections are dealt to the front ends in turn "
                     "(Q6SERVE_FRONTEND_ROUND_ROBIN: an eBPF program on the port's listeners)")
        self._start_metrics_http()
        self.engine.on_health(self._broadcast_health)
        if path := os.environ.get(STATS_ENV):
            self.stats = _DeviceStats(self, path)
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

    async def _started(self) -> None:
        """Every front end reported ready; one that exits first fails the start at once."""
        while not all(f.done() for f in self._ready.values()):
            for i, p in self._procs.items():
                if p.poll() is not None:
                    raise Unavailable(f"front end {i} exited with {p.returncode} while "
                                      "starting (its error is in the log above)")
            await asyncio.sleep(0.05)

    def _reserve_port(self) -> int:
        """Hold the port with a bound, non-listening SO_REUSEPORT socket: the front ends bind it
        too, the kernel spreads connections over the listening ones (``--port 0``: a free
        port, the same for every front end)."""
        host = self.config.host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind((host, self.config.port))
        except OSError as e:
            s.close()
            raise Unavailable(f"cannot bind {self.config.host}:{self.config.port}: "
                              f"{e.strerror}") from None
        self._reserved = s
        return int(s.getsockname()[1])

    def _spawn(self, index: int) -> None:
        """Start front end ``index``: a fresh interpreter (never a fork of a process holding a
        device context), its arguments pickled on stdin."""
        self._ready[index] = asyncio.get_running_loop().create_future()
        steer = self._steering.fds if self._steering is not None else None
        p = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                             pass_fds=steer or ())
        assert p.stdin is not None
        p.stdin.write(pickle.dumps((index, self.config, self.port, self._sock_path, self.slots,
                                    self.slot_bytes, logging.getLogger().getEffectiveLevel(),
                                    steer)))
        p.stdin.close()
        self._procs[index] = p

    @property
    def frontend_pids(self) -> dict[int, int]:
        return {i: p.pid for i, p in self._procs.items()}

    @property
    def frontend_calls(self) -> dict[int, int]:
        return {i: f.calls for i, f in self._fronts.items()}

    async def _supervise(self) -> None:
        """Replace a front end that exits while the worker serves (crash, OOM kill)."""
        while not self._draining:
            await asyncio.sleep(0.2)
            for i, p in list(self._procs.items()):
                if p.poll() is None or self._draining:
                    continue
                log.error("front end %d (pid %s) exited with %s; starting a new one", i,
                          p.pid, p.returncode)
                self._spawn(i)

    # -- one front end's connection (_FrontConnection) ---------------------------------------
    def _hello(self, conn: _FrontConnection, msg: tuple[Any, ...]) -> _Front:
        _, index, pid, arena_name, slots, slot_bytes = msg
        assert conn.transport is not None and conn.out is not None
        fe = _Front(index, pid, conn.transport, Arena.attach(arena_name, slots, slot_bytes),
                    conn.out)
        if self._arena_io is not None and fe.arena.pin(self._arena_io):
            self._pinned_arenas.add(fe.arena)
        self._fronts[index] = fe
        if self.stats is not None:
            self.stats.connection(conn)
        fe.send(("ack",))
        return fe

    def _gone(self, fe: _Front) -> None:
        fe.alive = False
        for q in fe.uploads.values():
            q.put_nowait(Unavailable("the front end went away mid-upload"))
        if fe.pending == 0:
            fe.arena.close()
        if self._fronts.get(fe.index) is fe:
            del self._fronts[fe.index]
        if not self._draining:
            log.warning("front end %d (pid %d) disconnected with %d calls in flight",
                        fe.index, fe.pid, fe.pending)

    def _dispatch(self, fe: _Front, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "mm":
            self._matmul(fe, *msg[1:])
        elif kind == "rm":
            self._region_matmul(fe, *msg[1:])
        elif kind == "call":
            self._task(self._call(fe, *msg[1:]))
        elif kind == "metrics":
            if self.metrics is not None:
                for args in msg[1]:
                    self.metrics.observe_requests(*args)
        elif kind == "up":
            q: asyncio.Queue[Any] = asyncio.Queue()
            fe.uploads[msg[1]] = q
            self._task(self._upload(fe, msg[1], msg[2], q))
        elif kind == "upc":
            if (q2 := fe.uploads.get(msg[1])) is not None:
                q2.put_nowait(msg[2])
        elif kind == "ready":
            fut = self._ready.get(fe.index)
            if fut is not None and not fut.done():
                fut.set_result(None)
        else:
            log.error("front end %d sent an unknown message %r", fe.index, kind)

    def _task(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _matmul(self, fe: _Front, rid: int, weight: str, weights: tuple[str, ...], topk: int,
                precision: Any, out_dtype: str, timeout: float | None, x: Any,
                slot: int) -> None:
        fe.calls += 1
        try:
            if isinstance(x, tuple):  # (dtype, shape) in the slot
                x = fe.arena.array(slot, _LE[x[0]], x[1], writable=False)
            call = MatmulCall(weight, x, _PRECISION_OF[precision], DTYPES[out_dtype], timeout,
                              topk, weights)
            # the answer goes out from the sink, in the loop trip that resolves the future (a
            # done callback would cost one more trip and handle per request)
            sink = functools.partial(self._matmul_done, fe, rid, slot)
            # what the one-process servicer does (Q6ServeServicer._start): a multi-weight
            # request fans out here, to every weight's batcher
            if weights:
                start_matmul_weights(self.engine, call, sink)  # type: ignore[arg-type]
            else:
                self._queue_call(call, sink)
        except BaseException as e:
            fe.send(("err", rid, _portable_error(e)))
            return
        del x, call  # the queued request holds x; once it ran, nothing here does
        self._count_pending(fe)

    def _plain_mm(self, fe: _Front, b: memoryview) -> None:
        """A plain matmul's frame (``_MM``: one weight, no top-k, x in its slot), parsed here:
        ``_matmul``'s work for that one case, without the decoded message tuple."""
        _, rid, slot, rows, k, xdt, out, prec, timeout = _MM.unpack_from(b)
        weight = bytes(b[_MM.size :]).decode()
        x_dtype, out_dtype, precision = _LE_BY_CODE[xdt], _DTYPE_BY_CODE[out], \
            _PRECISION_BY_CODE[prec]
        fe.calls += 1
        key: Route | None = None
        try:
            x = fe.arena.array(slot, x_dtype, (rows, k), writable=False)
            if rows >= self._merge_rows and fe.arena.pinned:  # a full call, alone: y routed
                key = self._route_arena(fe, slot, x, weight, out_dtype)
            sink = (functools.partial(self._matmul_done, fe, rid, slot) if key is None else
                    functools.partial(self._routed_done, fe, rid, slot, key))
            self._queue_call(MatmulCall(weight, x, precision, out_dtype, _unopt(timeout)), sink)
        except BaseException as e:
            if key is not None:
                self._arena_io.unroute(key)  # type: ignore[union-attr]
            fe.send(("err", rid, _portable_error(e)))
            return
        del x  # the queued request holds x; once it ran, nothing here does
        self._count_pending(fe)

    def _route_arena(self, fe: _Front, slot: int, x: np.ndarray, weight: str,
                     out_dtype: np.dtype) -> Route | None:
        """A full call's y routed to the start of its slot in the page-locked arena (where
        the front end reads it; kernels/hostio.py): the backend DMAs y there (x's upload from
        the same bytes comes first on its stream). None where y does not fit the slot."""
        io = self._arena_io
        assert io is not None and self.engine is not None
        shape = (x.shape[0], self.engine.rows_of(weight))
        if shape[0] * shape[1] * out_dtype.itemsize > fe.arena.slot_bytes:
            return None
        at = fe.arena.addr + slot * fe.arena.slot_bytes
        return io.route(x, fe.arena.array(slot, out_dtype.newbyteorder("<"), shape,
                                          writable=True), at, at)

    def _routed_done(self, fe: _Front, rid: int, slot: int, key: Route,
                     fut: asyncio.Future[Any]) -> None:
        """``_matmul_done`` for a call whose y was routed into its slot (``_route_arena``):
        where the backend took the route, y is in the slot already (no copy)."""
        taken = self._arena_io.unroute(key)  # type: ignore[union-attr]
        if not taken or _told_failure(fe, rid, fut):
            if taken:
                self._one_done(fe)
            else:
                self._matmul_done(fe, rid, slot, fut)
            return
        reply = fut.result()
        self._answer_mm(fe, rid, slot, _fields(reply), reply.y, placed=True)

    # -- the calls of one loop trip as one engine request ------------------------------------
    def _queue_call(self, call: MatmulCall, sink: Callable[[Any], None],
                    merges: bool | None = None) -> None:
        """Queue a single-weight call whose answer goes to ``sink(fut)``. A plain one (no
        top-k, fewer than ``_merge_rows`` rows) waits for the end of this loop trip and goes to
        the engine together with the others of its weight, dtypes and K read in the same trip
        (from every front end): one request, one MatmulReply for all of them, each sink then
        gets its rows (``_answer_merged``). The engine's per-request work was a third of the
        device process's loop under T2 (bench/RESULTS.md, issue 15 session 5). On an idle
        device, once a like job is measured, that request takes the engine's direct path at
        the end of the trip (``_run_merged_now``: no queue, future or timer; -27% of the
        device process's CPU per call under T2, session 9). Not with dynamic batching off
        (Q6SERVE_DYNAMIC_BATCHING) or Q6SERVE_DEVICE_MERGE=0. ``merges``: ``_merges(x)``,
        where the caller knows it already."""
        x, engine = call.x, self.engine
        assert engine is not None
        if call.topk or not (self._merges(x) if merges is None else merges):
            engine.start_matmul(call, sink)
            return
        self._flush_due()
        key = (call.weight, x.dtype, x.shape[1], call.precision, call.out_dtype)
        if (got := self._merging.get(key)) is None:
            self._merging[key] = [(call, sink)]
        else:
            got.append((call, sink))

    def _merges(self, x: np.ndarray) -> bool:
        """Would a single-weight call of ``x`` (no top-k) wait for the trip's end to merge
        (``_queue_call``)? Not with merging or dynamic batching off (one by one), not a full
        one (it merges with nothing)."""
        return (self.merge and x.ndim == 2 and 0 < x.shape[0] < self._merge_rows
                and self.engine.flags.state.dynamic_batching)  # type: ignore[union-attr]

    def _flush_due(self) -> None:
        """A call for the trip's end (``_flush_calls``, scheduled once a trip)."""
        if not self._merging and not self._cuda_due and not self._sys_due:
            asyncio.get_running_loop().call_soon(self._flush_calls)

    def _flush_calls(self) -> None:
        """The calls merged in this trip to the engine (``_start_merged``). What ran here on
        the direct path is answered here: those answers go out now (``_Out.flush_now``),
        not a loop iteration later, after the messages read meanwhile were parsed and
        merged. The trip's CUDA-region calls are launched next, then the launches of earlier
        trips are waited for and answered (the GPU has this trip's to run meanwhile)."""
        merging, self._merging = self._merging, {}
        earlier = self._launches
        for parts in merging.values():
            chunk: list[tuple[MatmulCall, Any]] = []
            rows = 0
            for part in parts:
                n = part[0].x.shape[0]
                if chunk and rows + n > self._merge_rows:
                    self._start_merged(chunk, rows)
                    chunk, rows = [], 0
                chunk.append(part)
                rows += n
            self._start_merged(chunk, rows)
        if self._cuda_due:
            self._launch_cuda_due()
        if self._sys_due:
            self._launch_sys_due()
        self._settle_done(earlier)
        for fe in self._fronts.values():
            fe.out.flush_now()

    def _start_merged(self, parts: list[tuple[MatmulCall, Any]], rows: int) -> None:
        if len(parts) == 1:
            call, sink = parts[0]
            if getattr(sink, "func", None) == self._region_done:  # alone after all: routed
                sink = self._region_routed(call, sink)
            self._start_alone(call, sink)
            return
        timeout = _longest(parts)
        try:
            if self._run_merged_now(parts, rows, timeout):
                return
        except Exception:  # (a refusal may be one caller's: each gets its own answer)
            for part in parts:
                self._start_alone(*part)
            return
        self._start_queued(parts, timeout)

    def _start_queued(self, parts: list[tuple[MatmulCall, Any]],
                      timeout: float | None) -> None:
        """Merged calls as one queued engine request (x concatenated), each answered from
        its reply (``_merged_done``)."""
        calls = [c for c, _ in parts]
        first = calls[0]
        try:
            x = np.concatenate([c.x for c in calls])
            self.engine.start_matmul(  # type: ignore[union-attr]
                MatmulCall(first.weight, x, first.precision, first.out_dtype, timeout),
                functools.partial(self._merged_done, parts))
        except Exception:  # (a refusal may be one caller's: each gets its own answer)
            for part in parts:
                self._start_alone(*part)
            return
        self.merged[0] += 1
        self.merged[1] += len(parts)

    def _run_merged_now(self, parts: list[tuple[MatmulCall, Any]], rows: int,
                        timeout: float | None) -> bool:
        """The engine's direct path for merged calls (``Engine.direct_batchers`` and
        ``run_direct``): when their request would run at once as an inline job anyway (the
        device idle, nothing of the weight queued, a like job measured and short), x is
        concatenated straight into the backend's upload buffer (``Backend.staging``: the CUDA
        backend then skips its own copy of x) and the job runs here, now, its reply split
        among the calls in this trip: no queue entry, future, deadline timer or loop trip per
        merged request (the one-process servicer's direct path, for the device process).
        False: nothing was done (queue it). A refusal is handled as ``_merged_done`` does."""
        engine = self.engine
        assert engine is not None
        probe = _probe(parts, rows, timeout)
        key = engine.batch_key(probe)
        got = engine.direct_batchers((probe,), key)
        if got is None:
            return False
        x = self._stage_x(engine, parts, rows)
        if len(parts) > 1:
            self.merged[0] += 1
            self.merged[1] += len(parts)
            self.merged_direct += 1
        call = MatmulCall(probe.weight, x, probe.precision, probe.out_dtype, timeout)
        try:
            reply = engine.run_direct(got[0], call, key)
        except Exception as e:
            self._merged_failed(parts, e)
            return True
        self._answer_merged(parts, reply)
        return True

    def _stage_x(self, engine: Engine, parts: list[tuple[MatmulCall, Any]],
                 rows: int) -> np.ndarray:
        """``_staged``, as a method: a stage of its own for the stage timers (T2's merged
        batch: x's rows copied into the upload buffer, ``_DeviceStats._stages``); with the
        arenas pinned, ``_gathered`` first."""
        if self._gather is not None and (x := self._gathered(parts, rows)) is not None:
            return x
        return _staged(engine, parts, rows)

    def _gathered(self, parts: list[tuple[MatmulCall, Any]], rows: int) -> np.ndarray | None:
        """The merged calls' x as the backend's placeholder for their slots' bytes
        (``CudaBackend.gathered``: each call's rows DMA'd from its slot in its pinned arena
        into the device's x at the launch, instead of ~36 us of concatenation a batch on the
        H200 under T2: session 21, bundle B), or None (a call whose x is not at the start of
        its slot, e.g. sent in its message; a Q8_1-capable precision, whose launch reads x on
        the host; an arena not pinned)."""
        first = parts[0][0]
        if first.precision not in _GATHER_PRECISIONS:
            return None
        pieces = []
        done = self._matmul_done
        for call, sink in parts:
            if getattr(sink, "func", None) != done:
                return None
            fe, _, slot = sink.args
            a = fe.arena
            if call.x.base is not a.base or not a.pinned:  # (x in its slot, at offset 0)
                return None
            pieces.append((a.addr + slot * a.slot_bytes, call.x.nbytes))
        x0 = first.x
        x = self._gather(pieces, rows, x0.shape[1], x0.dtype)  # type: ignore[misc]
        if x is not None:
            self.gathered += 1
        return x

    # -- CUDA-region calls: launched at a trip's end, waited for a trip later ---------------
    def _launch_cuda_due(self) -> None:
        """The trip's CUDA-region calls (y in a CUDA region: ``CudaSupport.launch_now``;
        else, or where none may launch, ``CudaSupport.start``), behind the launches out."""
        due, self._cuda_due = self._cuda_due, []
        cuda, engine = self.regions.cuda, self.engine  # type: ignore[union-attr]
        assert cuda is not None
        for call, yd, done in due:
            try:
                self._pipe(lambda c=call, y=yd: cuda.launch_now(engine, c, y), done,
                           lambda c=call, y=yd, d=done: cuda.start(engine, c, y, d))
            except Exception as e:
                done(None, e)

    def _pipe(self, launch: Callable[[], Callable[[], Any] | None],
              done: Callable[[Any, BaseException | None], None],
              otherwise: Callable[[], None]) -> None:
        """``launch()`` (the wait of a launch, or None: the device may not launch it now) now,
        behind the launches out; while it may not, the oldest out is waited for and
        answered, then it is tried again; with none out, ``otherwise()``. Launched, its
        wait and ``done(reply, exception)`` are out until ``_settle``: a loop trip later, or
        before a later launch that needs its slot. Refusals raise from ``launch``."""
        dev = self.engine.device  # type: ignore[union-attr]
        while True:
            if self._out and not dev.may_launch_now():  # (its slots taken: no launch() try)
                self._settle(self._out[0][2] + 1)
                continue
            held = self._held_slots()
            wait = launch()
            if wait is not None:
                self._out.append((wait, done, self._launches, self._taken_event(held)))
                self._launches += 1
                self.pipelined[0] += 1
                if not self._tick_due:
                    self._tick_due = True
                    asyncio.get_running_loop().call_soon(self._tick, True)
                return
            if not self._out:
                otherwise()
                return
            self._settle(self._out[0][2] + 1)

    def _held_slots(self) -> int:
        """The workspace's launch slots held now (bit s: slot s), before a launch, for
        :meth:`_taken_event` (0: no ready polling)."""
        ws = self._ws
        if ws is None:
            return 0
        return sum(1 << s for s in range(self._ws_slots) if ws.held(s))

    def _taken_event(self, before: int) -> Any:
        """The completion event of the slot a launch just took: the one held now that was
        not before it (``held``: :meth:`_held_slots` then), as the launch itself marked it
        (``Workspace.take``), whichever slot its launcher chose; None (no ready polling, or
        a launch that took no slot of this workspace): its wait is called a trip later."""
        ws = self._ws
        if ws is None:
            return None
        for s in range(self._ws_slots):
            if not before >> s & 1 and ws.held(s):
                return ws.done_event(s)
        return None

    def _settle_done(self, before: int) -> None:
        """:meth:`_settle`, with ready polling only those done by now (their slot's event; no
        event: waited for), in order up to the first that is not; a tick looks at the rest a
        loop trip later."""
        if self._ws is None:
            self._settle(before)
            return
        out = self._out
        while out and out[0][2] < before:
            ev = out[0][3]
            if ev is not None and not ev.done:
                if not self._tick_due:
                    self._tick_due = True
                    asyncio.get_running_loop().call_soon(self._tick, True)
                return
            self._settle(out[0][2] + 1)

    def _settle(self, before: int) -> None:
        """Wait for the launches out numbered below ``before``, in order, each answered."""
        out = self._out
        while out and out[0][2] < before:
            wait, done, _, _ = out.popleft()
            t = time.perf_counter()
            try:
                reply, exc = wait(), None
            except Exception as e:
                reply, exc = None, e
            finally:
                self.pipelined[1] += time.perf_counter() - t
            done(reply, exc)

    def _tick(self, first: bool) -> None:
        """A loop trip after a launch: the launches out are waited for and answered. In two
        steps: the first, at the start of the next trip, only schedules the second, so the
        messages that trip reads are parsed first; the second runs before that trip's end
        (``_flush_calls``), which, where the trip read calls, launches them before it waits
        for the earlier ones: the second then leaves the waits to it."""
        if first:
            asyncio.get_running_loop().call_soon(self._tick, False)
            return
        self._tick_due = False
        if self._merging or self._cuda_due or self._sys_due:
            return  # (_flush_calls comes: it settles them, after its own launches)
        self._settle_done(self._launches)
        for fe in self._fronts.values():
            fe.out.flush_now()

    def _start_alone(self, call: MatmulCall, sink: Callable[[Any], None]) -> None:
        """One call to the engine: run here and now on its direct path when it would run at
        once as an inline job anyway (``Engine.run_now``), else queued."""
        engine = self.engine
        assert engine is not None
        try:
            reply = engine.run_now(call)
            if reply is None:
                engine.start_matmul(call, sink)
                return
        except Exception as e:
            sink(_settled(e))
            return
        if getattr(sink, "func", None) == self._matmul_done and reply.y is not None:
            self._answer_mm(*sink.args, _fields(reply), reply.y)  # (no future for it)
        else:
            sink(_settled(reply))

    def _merged_done(self, parts: list[tuple[MatmulCall, Any]],
                     fut: asyncio.Future[Any]) -> None:
        """Each merged call's sink with its rows of y, or the failure."""
        if fut.cancelled() or fut.exception() is not None:
            self._merged_failed(parts, fut.exception() if not fut.cancelled()  # type: ignore[arg-type]
                                else asyncio.CancelledError())
            return
        self._answer_merged(parts, fut.result())

    def _merged_failed(self, parts: list[tuple[MatmulCall, Any]], e: BaseException) -> None:
        """A merged request failed: a refusal that may be one caller's input
        (INVALID_ARGUMENT, FAILED_PRECONDITION) runs each call alone, as the batcher isolates a
        bad request; any other failure goes to every call."""
        exc = _portable_error(e)
        if isinstance(exc, InvalidArgument | FailedPrecondition):
            for part in parts:
                self._start_alone(*part)
            return
        for _, sink in parts:
            sink(_settled(exc))

    def _answer_merged(self, parts: list[tuple[MatmulCall, Any]], r: MatmulReply) -> None:
        """Each merged call's sink with its rows of ``r.y``."""
        fields = head = rhead = None  # the merged reply's fields: the same for every part
        row = 0
        done, region_done = self._matmul_done, self._region_done
        for call, sink in parts:
            n = call.x.shape[0]
            y = r.y[row : row + n]
            row += n
            func = getattr(sink, "func", None)
            if func == done:  # a plain call: answered here
                if head is None:
                    fields = fields or _fields(r)
                    head = _mmok_head(fields)
                self._answer_mm(*sink.args, fields, y, head)  # (no reply object or future)
                continue
            if func == region_done:  # a system-region call: y into its region, "rmok"
                if rhead is None:
                    fields = fields or _fields(r)
                    rhead = _rmok_head(fields, r.y)
                self._region_answer(*sink.args, fields, y, rhead)  # (no reply or future)
                continue
            sink(_settled(MatmulReply(y, r.kernel, r.layout, r.precision, r.queue_seconds,
                                      r.kernel_seconds, r.batch_rows, r.batch_requests,
                                      r.device_seconds)))

    def _count_pending(self, fe: _Front) -> None:
        """A matmul of ``fe`` was queued (its sink counts it done)."""
        fe.pending += 1
        self._pending += 1
        self.pending_peak = max(self.pending_peak, self._pending)

    def _matmul_done(self, fe: _Front, rid: int, slot: int, fut: asyncio.Future[Any]) -> None:
        if _told_failure(fe, rid, fut):
            self._one_done(fe)
            return
        reply = fut.result()
        if isinstance(reply, MatmulReply) and reply.y is not None:
            self._answer_mm(fe, rid, slot, _fields(reply), reply.y)
            return
        try:
            if not fe.alive:
                return  # its front end died: the result has nobody to go to
            outs: Outs = []
            used = 0  # bytes of the slot taken by earlier parts
            for part in _parts(reply):
                y = part.y
                if y is None:  # the top-k epilogue: its small arrays travel in the reply
                    outs.append(None)
                elif slot >= 0 and used + y.nbytes <= fe.arena.slot_bytes:
                    fe.arena.array(slot, y.dtype.newbyteorder("<"), y.shape, writable=True,
                                   offset=used)[...] = y
                    outs.append((used, *_desc(y)))
                    used += -(-y.nbytes // SLOT_ALIGN) * SLOT_ALIGN
                else:
                    outs.append(np.ascontiguousarray(y))
            fe.send(("mmok", rid, _strip(reply), outs))
        except Exception as e:
            fe.send(("err", rid, _portable_error(e)))
        finally:
            self._one_done(fe)

    def _answer_mm(self, fe: _Front, rid: int, slot: int, fields: tuple[Any, ...],
                   y: np.ndarray, head: tuple[tuple[Any, ...], bytes] | None = None,
                   placed: bool = False) -> None:
        """A plain call's answer: y into its slot (or in the message), "mmok" with the
        reply's ``fields``; ``head``: ``_mmok_head(fields)``, made once for a merged batch's
        calls (None: made here); ``placed``: y is in its slot already (the device wrote it
        there: ``_routed_done``)."""
        try:
            if not fe.alive:
                return  # its front end died: the result has nobody to go to
            if slot >= 0 and y.nbytes <= fe.arena.slot_bytes:
                if not placed:
                    fe.arena.put(slot, y)
                if head is None:
                    head = _mmok_head(fields)
                dt = _DTYPE_CODE.get(_NAME.get(y.dtype))  # type: ignore[arg-type]
                if head is not None and dt is not None and y.ndim == 2:  # _encode's "R" frame
                    fe.out.send_bytes(_MMOK.pack(b"R", rid, *head[0], 0, dt, *y.shape)
                                      + head[1])
                    return
                out: Any = (0, *_desc(y))
            else:
                out = np.ascontiguousarray(y)
            fe.send(("mmok", rid, fields, [out]))
        except Exception as e:
            fe.send(("err", rid, _portable_error(e)))
        finally:
            self._one_done(fe)

    def _one_done(self, fe: _Front) -> None:
        fe.done_one()
        self._pending -= 1

    def _region_frame(self, fe: _Front, b: memoryview) -> None:
        """A region call's frame (``_RM``: x and y in system or CUDA regions, x 2-D), parsed
        here: ``_decode`` and ``_dispatch``'s work for that one case, without the decoded
        message tuple, then ``_region_matmul``."""
        (_, rid, xo, rows, k, yo, xdt, out, prec, timeout, lo, lx,
         ly) = _RM.unpack_from(b)
        raw = bytes(b[_RM.size :])
        xe, ye = lo + lx, lo + lx + ly
        self._region_matmul(fe, rid, raw[:lo].decode(),
                            (raw[lo:xe].decode(), xo, _DTYPE_NAMES[xdt], (rows, k)),
                            (raw[xe:ye].decode(), yo), raw[ye:].decode(), _PRECISIONS[prec],
                            _DTYPE_NAMES[out], _unopt(timeout))

    def _region_matmul(self, fe: _Front, rid: int, owner: str, xs: tuple[Any, ...],
                       ys: tuple[str, int], weight: str, precision: str, out_dtype: str,
                       timeout: float | None) -> None:
        """A matmul whose x and y both live in the caller's system shared-memory regions
        (the front end's ``_PlaneProxy.matmul``): the checks of ``regions.matmul`` (owner,
        bounds, alignment, the backing object still there, y's span) run here, in this loop
        trip; the request goes to the engine with a sink, which writes y into its region,
        lets the regions go and answers ("rmok": the reply's fields, no bytes). No task, no
        protobuf. A CUDA IPC region on either side: ``_cuda_region_matmul`` (no task either)."""
        fe.calls += 1
        table = self.regions
        assert table is not None
        x_name, x_off, x_dtype, x_shape = xs
        xr = yr = None
        try:
            # (one at a time: x's hold is let go below if y's is refused)
            xr = table.hold_name(owner, x_name)
            yr = table.hold_name(owner, ys[0])
            if CUDA in (xr.kind, yr.kind):  # on the device end to end (cuda_regions.py)
                io = RegionIO(RegionRef(x_name, x_off), _LE[x_dtype], x_shape, RegionRef(*ys))
                self._cuda_region_matmul(fe, rid, xr, yr, io, weight, precision, out_dtype,
                                         timeout)
                self._count_pending(fe)
                return
            if (self.sys_pipe and xr is yr and len(x_shape) == 2
                    and x_shape[0] >= self.config.max_batch_rows):
                self._sys_call(fe, rid, xr, xs, ys[1], weight, precision, out_dtype, timeout)
                self._count_pending(fe)
                return
            call = MatmulCall(weight, xr.array(x_off, _LE[x_dtype], x_shape, "x"),
                              _PRECISION_OF[precision], DTYPES[out_dtype], timeout)
            shape = (x_shape[0], self.engine.rows_of(weight))  # type: ignore[union-attr]
            # y's place, for the backend to write straight into (kernels/hostio.py); one
            # region for x and y (the usual case): its backing object was checked just now
            dest = yr.array(ys[1], call.out_dtype, shape, "y", writable=True, alive=yr is xr)
            # a call that merges with the trip's others (``_queue_call``) is not routed: the
            # batch's x is not its x, so the backend would never take the route (one left
            # alone at the trip's end is routed then, ``_region_routed``)
            merges = self._merges(call.x)
            key = None if merges else table.route(call.x, dest)
            try:
                self._queue_call(call, functools.partial(self._region_done, fe, rid, xr, yr,
                                                         ys[1], dest, key), merges)
            except BaseException:
                table.unroute(key)
                raise
        except BaseException as e:
            call = dest = None  # type: ignore[assignment]  # (views of the regions: drop first)
            table.let_go(xr)
            table.let_go(yr)
            fe.send(("err", rid, _portable_error(e)))
            if not isinstance(e, Exception):
                raise
            return
        del call, dest
        self._count_pending(fe)

    def _sys_call(self, fe: _Front, rid: int, r: Region, xs: tuple[Any, ...], y_off: int,
                  weight: str, precision: str, out_dtype: str, timeout: float | None) -> None:
        """A full batch (N >= --max-batch-rows) with x and y in one system
        region, both held: the fast lane's route for full batches (service/lane.py
        ``_direct``/``_flush``) in this process's pipeline. A repeat of a call planned before
        (same weight, shapes, dtypes, precision and places) takes its plan (``lane._Plan``:
        the backend's region call, one graph launch, the copies on copy streams beside
        another launch); else x and y are viewed, y routed (the backend DMAs it into the
        region, and is asked for a region call to plan with). Launched at the trip's end
        (``_launch_sys_due``) behind the launches out, waited for a trip later; a call the
        engine will not launch now is queued as any other. Raises what refuses the call."""
        engine, table = self.engine, self.regions
        assert engine is not None and table is not None
        x_off, x_dtype, x_shape = xs[1], _LE[xs[2]], tuple(xs[3])
        out, prec = DTYPES[out_dtype], _PRECISION_OF[precision]
        pkey = (weight, x_shape, x_off, y_off, x_dtype, out, prec)
        plans = r.plans
        # (a plan's call has its first call's deadline, which only had to be ahead: a call
        # whose deadline passed is checked, and refused, by a call of its own)
        plan = plans.get(pkey) if plans and (timeout is None or timeout > 0) else None
        flags = engine.flags
        if plan is not None:
            r.mapping.check_alive("x", r.name)  # (checked when it was made)
            if plan.live(flags):
                if not engine.serving:
                    raise Unavailable("the worker is draining and takes no new requests")
                self._flush_due()
                self._sys_due.append(_SysCall(fe, rid, r, y_off, plan.call, plan.dest, None,
                                              plan, pkey, None))
                return
            plans.pop(pkey, None)  # stale (weight, flags, page-locked ranges)
        call = MatmulCall(weight, r.array(x_off, x_dtype, x_shape, "x", alive=plan is not None),
                          prec, out, timeout)
        if not engine.serving:
            raise Unavailable("the worker is draining and takes no new requests")
        dest = r.array(y_off, out, (x_shape[0], engine.rows_of(weight)), "y", writable=True,
                       alive=True)
        self._flush_due()
        self._sys_due.append(self._sys_routed(_SysCall(fe, rid, r, y_off, call, dest, None,
                                                       None, pkey, None)))

    def _sys_routed(self, p: _SysCall) -> _SysCall:
        """``p`` with y routed into its region (the backend DMAs it there) and, where its
        region has room for another plan, a region call asked for (``Route.want``)."""
        table = self.regions
        assert table is not None and self.engine is not None
        r, base = p.region, p.region.mapping.addr
        x_off = p.pkey[2]
        p.plan = None
        p.key = table.route(p.call.x, p.dest, None if base is None else base + x_off,
                            None if base is None else base + p.y_off)
        if (p.key is not None and r.plans is not None
                and len(r.plans) < regions_mod.VIEW_CACHE):
            p.key.want, p.state = True, self.engine.flags.state
        return p

    def _launch_sys_due(self) -> None:
        """The trip's full system-region calls (``_sys_call``) through ``Engine.launch_now``
        (a plan's call by its region call), behind the launches out; one the engine will not
        launch now (a like job not measured yet, or the device busy otherwise) is queued."""
        due, self._sys_due = self._sys_due, []
        engine = self.engine
        assert engine is not None
        for p in due:
            try:
                self._pipe(functools.partial(self._sys_launch, p),
                           functools.partial(self._sys_done, p),
                           functools.partial(self._sys_queue, p))
            except Exception as e:
                self._sys_done(p, None, e)

    def _sys_launch(self, p: _SysCall) -> Callable[[], Any] | None:
        engine = self.engine
        assert engine is not None
        plan = p.plan
        if plan is not None and not plan.live(engine.flags):
            p.drop_plan()
            self._sys_routed(p)
            plan = None
        try:
            wait = engine.launch_now(p.call, None if plan is None else plan.launch)
        except Exception:
            if plan is not None:
                p.drop_plan()  # (not again)
            raise
        if wait is not None:
            self.sys_launched += 1
            self.sys_planned += plan is not None
        return wait

    def _sys_queue(self, p: _SysCall) -> None:
        """``p`` queued as any full call (the engine would not launch it now)."""
        self.sys_queued += 1
        if p.plan is not None:
            p.drop_plan()
            self._sys_routed(p)  # (queued: routed as any other)

        def answered(fut: asyncio.Future[Any]) -> None:
            self._sys_done(p, *outcome(fut))

        self.engine.start_matmul(p.call, answered)  # type: ignore[union-attr]

    def _sys_done(self, p: _SysCall, reply: Any, exc: BaseException | None) -> None:
        """``p``'s answer: y into place unless the backend wrote it there (its route, or its
        plan's region call), a plan made from a routed call's region call, "rmok"; then its
        region let go."""
        table, fe = self.regions, p.fe
        assert table is not None
        try:
            taken = table.unroute(p.key) or p.plan is not None
            if exc is not None:
                fe.send(("err", p.rid, _portable_error(exc)))
                return
            key, plans = p.key, p.region.plans
            if (key is not None and key.call is not None and plans is not None
                    and self.engine.flags.state is p.state):  # type: ignore[union-attr]
                plans[p.pkey] = lane_mod._Plan(p.call, p.dest, key.call, p.state)
            y = reply.y
            regions_mod.place_y(p.region, p.y_off, y, p.dest, taken)
            fe.send(("rmok", p.rid, _fields(reply), (_NAME.get(y.dtype) or dtype_name(y.dtype),
                                                      y.shape)))
        except Exception as e:
            fe.send(("err", p.rid, _portable_error(e)))
        finally:
            self._region_call_ended(fe, p.region, p.region)

    def _region_done(self, fe: _Front, rid: int, xr: Region, yr: Region, y_off: int,
                     dest: np.ndarray, key: Any, fut: asyncio.Future[Any]) -> None:
        table = self.regions
        assert table is not None
        try:
            taken = table.unroute(key)  # the device wrote y into its region
            if _told_failure(fe, rid, fut):
                return
            reply = fut.result()
            y = reply.y
            regions_mod.place_y(yr, y_off, y, dest, taken)
            fe.send(("rmok", rid, _fields(reply), (_NAME.get(y.dtype) or dtype_name(y.dtype),
                                                   y.shape)))
        except Exception as e:
            fe.send(("err", rid, _portable_error(e)))
        finally:
            self._region_call_ended(fe, xr, yr)

    def _region_routed(self, call: MatmulCall, sink: Any) -> Any:
        """A system-region call's sink (``_region_done``) with its y routed into its region
        (the backend DMAs it there), for a call that did not merge (``_region_matmul``
        routes only the calls that will not)."""
        fe, rid, xr, yr, y_off, dest, key = sink.args
        if key is not None:
            return sink
        key = self.regions.route(call.x, dest)  # type: ignore[union-attr]
        return functools.partial(self._region_done, fe, rid, xr, yr, y_off, dest, key)

    def _region_answer(self, fe: _Front, rid: int, xr: Region, yr: Region, y_off: int,
                       dest: np.ndarray, key: Any, fields: tuple[Any, ...],
                       y: np.ndarray, head: tuple[tuple[Any, ...], bytes] | None) -> None:
        """``_region_done`` for a merged batch's system-region call (``_answer_merged``): its
        rows ``y`` of the batch's y and the batch's reply ``fields``, no reply object or
        future. A merged call's y is never the backend's to route (the batch's x is not
        this call's), so it is copied into place: into ``dest`` (its view, made when the
        call came) once the backing object is checked again (a shrunk one is refused, not
        written: SIGBUS), else as ``place_y`` does. ``head``: ``_rmok_head(fields, y of the
        batch)``, made once for the batch (None: the message is encoded as usual)."""
        try:
            if key is not None:  # (None: never routed)
                self.regions.unroute(key)  # type: ignore[union-attr]
            if y.shape == dest.shape and y.dtype == dest.dtype:
                yr.mapping.check_alive("y", yr.name)
                dest[...] = y
            else:
                regions_mod.place_y(yr, y_off, y, dest, False)
            if head is not None:  # _encode's "K" frame
                if fe.alive:
                    fe.out.send_bytes(_RMOK.pack(b"K", rid, *head[0], *y.shape) + head[1])
                return
            fe.send(("rmok", rid, fields, (_NAME.get(y.dtype) or dtype_name(y.dtype),
                                           y.shape)))
        except Exception as e:
            fe.send(("err", rid, _portable_error(e)))
        finally:
            self._region_call_ended(fe, xr, yr)

    def _cuda_region_matmul(self, fe: _Front, rid: int, xr: Region, yr: Region, io: RegionIO,
                            weight: str, precision: str, out_dtype: str,
                            timeout: float | None) -> None:
        """``_region_matmul`` with a CUDA IPC region on either side (x and y held): the
        checks of ``regions.matmul`` here, the job through ``CudaSupport.start`` (no task, no
        future), answered as "rmok" from its end (``_region_done``; a y in a CUDA region is
        written by the job, a y for a system region comes back on the host). Raises what
        refuses the call (the caller lets the regions go)."""
        table = self.regions
        assert table is not None and table.cuda is not None  # (a CUDA region exists)
        assert io.x is not None and io.y is not None and io.x_shape is not None
        call = MatmulCall(weight, xr.array(io.x.offset, io.x_dtype, io.x_shape, "x"),
                          _PRECISION_OF[precision], DTYPES[out_dtype], timeout)
        # (rows_of: the rows without building a WeightView, ~7 us on the VM a call)
        shape = (io.x_shape[0], self.engine.rows_of(weight))  # type: ignore[union-attr]
        dest = yr.array(io.y.offset, call.out_dtype, shape, "y", writable=True)
        yd = dest if yr.kind == CUDA else None
        done = functools.partial(self._cuda_region_done, fe, rid, xr, yr, io.y.offset, dest,
                                 np.dtype(call.out_dtype), shape)
        self._flush_due()  # launched at the trip's end (_launch_cuda_due)
        self._cuda_due.append((call, yd, done))

    def _cuda_region_done(self, fe: _Front, rid: int, xr: Region, yr: Region, y_off: int,
                          dest: Any, out: np.dtype, shape: tuple[int, int], reply: Any,
                          exc: BaseException | None) -> None:
        try:
            if exc is not None:
                fe.send(("err", rid, _portable_error(exc)))
                return
            if yr.kind != CUDA:  # y came back on the host: into the system region
                yr.array(y_off, reply.y.dtype, reply.y.shape, "y", writable=True)[...] = reply.y
            fe.send(("rmok", rid, _fields(reply), (_NAME.get(out) or dtype_name(out), shape)))
        except Exception as e:
            fe.send(("err", rid, _portable_error(e)))
        finally:
            self._region_call_ended(fe, xr, yr)

    def _region_call_ended(self, fe: _Front, xr: Region, yr: Region) -> None:
        """A region call answered: its regions let go, its front end's call done."""
        assert self.regions is not None
        self.regions.let_go(xr)
        self.regions.let_go(yr)
        self._one_done(fe)

    async def _call(self, fe: _Front, rid: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            if method not in _DEVICE_CALLS:
                raise InvalidArgument(f"unknown device call {method!r}")
            result = await _DEVICE_CALLS[method](self, *args)
            fe.send(("ok", rid, result))
        except BaseException as e:
            fe.send(("err", rid, _portable_error(e)))
            if not isinstance(e, Exception):
                raise

    async def _upload(self, fe: _Front, rid: int, spec: Any, q: asyncio.Queue[Any]) -> None:
        async def chunks() -> AsyncIterator[bytes]:
            while (c := await q.get()) is not None:
                if isinstance(c, BaseException):
                    raise c
                yield c

        try:
            view = await self.engine.upload(spec, chunks())  # type: ignore[union-attr]
            fe.send(("ok", rid, view))
        except BaseException as e:
            fe.send(("err", rid, _portable_error(e)))
            if not isinstance(e, Exception):
                raise
        finally:
            fe.uploads.pop(rid, None)

    def _broadcast_health(self, ok: bool) -> None:
        for fe in self._fronts.values():
            fe.send(("health", ok))

    # -- stop -------------------------------------------------------------------------------
    async def stop(self, grace: float | None = None) -> bool:
        """Drain: front ends turn NOT_SERVING and stop their servers with the grace period
        (their in-flight calls finish on the device), then regions and weights are freed."""
        if self._stopped.is_set() or self.engine is None:
            return self._clean
        grace = self.config.grace_period_s if grace is None else grace
        log.info("draining %d front ends: health NOT_SERVING, grace %.1f s", self.n, grace)
        self._draining = True
        for fe in list(self._fronts.values()):
            fe.send(("drain", grace))
        self.engine.begin_drain()
        deadline = time.monotonic() + grace + 10.0
        while (any(p.poll() is None for p in self._procs.values())
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        # a front end that had to be killed may have left calls unanswered
        self._clean = not any(p.poll() is None for p in self._procs.values())
        await self._teardown()
        if self.regions is not None:
            self.regions.close()
        for arena in self._pinned_arenas:  # (before the backend goes; its copies waited for)
            arena.unpin()
        self._pinned_arenas.clear()
        await self.engine.close()
        self._stop_metrics_http()
        self._stopped.set()
        log.info("stopped")
        return self._clean

    async def _teardown(self) -> None:
        self._draining = True
        if self._supervisor is not None:
            self._supervisor.cancel()
        for p in self._procs.values():
            if p.poll() is None:
                p.kill()
            await asyncio.to_thread(p.wait, 10)
        if self._unix is not None:
            self._unix.close()
        for fe in list(self._fronts.values()):
            fe.transport.close()
        if self._reserved is not None:
            self._reserved.close()
        if self._steering is not None:
            self._steering.close()
            self._steering = None
        shutil.rmtree(self._dir, ignore_errors=True)


class _FrontConnection(_Peer):
    """The device process's end of one front end's socket: its first message is the hello
    (arena name); every later one goes to FrontendsWorker._dispatch."""

    def __init__(self, worker: FrontendsWorker) -> None:
        super().__init__()
        self.worker = worker
        self.fe: _Front | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # unpickle only what our own front-end processes send (peer pid from the kernel)
        sock = transport.get_extra_info("socket")
        pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  12))[0]
        if pid not in {p.pid for p in self.worker._procs.values()}:
            log.error("refused a device-socket connection from pid %d", pid)
            transport.close()

    def message(self, msg: tuple[Any, ...]) -> None:
        if self.fe is None:
            self.fe = self.worker._hello(self, msg)
            self.plain = True  # from now on plain matmuls go to plain_mm
        else:
            self.worker._dispatch(self.fe, msg)

    def plain_mm(self, payload: memoryview) -> None:
        assert self.fe is not None
        self.worker._plain_mm(self.fe, payload)

    def region_mm(self, payload: memoryview) -> None:
        assert self.fe is not None
        self.worker._region_frame(self.fe, payload)

    def lost(self) -> None:
        if self.fe is not None:
            self.worker._gone(self.fe)


async def _dev_load(w: FrontendsWorker, *a: Any) -> Any:
    return await w.engine.load_gguf(*a)  # type: ignore[union-attr]


async def _dev_unload(w: FrontendsWorker, name: str) -> Any:
    return await w.engine.unload(name)  # type: ignore[union-attr]


async def _dev_list(w: FrontendsWorker) -> Any:
    return w.engine.list()  # type: ignore[union-attr]


async def _dev_get(w: FrontendsWorker, name: str) -> Any:
    return w.engine.get(name)  # type: ignore[union-attr]


async def _dev_status(w: FrontendsWorker) -> Any:
    return w.engine.status()  # type: ignore[union-attr]


async def _dev_set_flags(w: FrontendsWorker, changes: dict[str, bool]) -> Any:
    return w.engine.set_flags(changes)  # type: ignore[union-attr]


async def _dev_region(w: FrontendsWorker, op: str, *a: Any) -> Any:
    if op == "matmul":
        owner, io, req_bytes, timeout, t0 = a
        reply, took = await w.plane.matmul(owner, io, wire.parse_matmul_request(req_bytes),
                                           timeout, t0)
        return reply, took
    if op not in ("register", "unregister", "list", "open_lane"):
        raise InvalidArgument(f"unknown region call {op!r}")
    got = await getattr(w.plane, op)(*a)
    if op == "open_lane" and (lanes := w.plane.lanes) is not None:
        if w.lane_pipe:
            lanes.pipe = w._pipe  # (the lanes' full batches through this process's pipeline)
        if w.stats is not None:
            w.stats.lanes(lanes)
    return got


_DEVICE_CALLS: dict[str, Callable[..., Any]] = {
    "load_gguf": _dev_load, "unload": _dev_unload, "list": _dev_list, "get": _dev_get,
    "status": _dev_status, "set_flags": _dev_set_flags, "region": _dev_region}


# ============================================================================================
# A front-end process
# ============================================================================================
# a reply's y in a slot at most this big is copied out at once, so the slot is free at once
# and the callers share the copy; a bigger one is viewed in place and its slot freed when the
# last view goes (a weakref.finalize per view, ~3 us: more than copying a small y)
COPY_Y_BYTES = 64 << 10

# (call, its future, its sink): a matmul of a front end not answered yet
_Pending = tuple[MatmulCall, "asyncio.Future[Any]", "Callable[[Any], None] | None"]


def _resolve(fut: asyncio.Future[Any], sink: Callable[[Any], None] | None,
             outcome: Any) -> None:
    """Settle ``fut`` with ``outcome`` (an exception: failed) and tell its sink in this trip,
    as the Engine does (``Batcher._resolve``); a caller that gave up is skipped. A failing
    sink is logged: it must not take the device socket down with it."""
    if fut.done():
        return
    if isinstance(outcome, BaseException):
        fut.set_exception(outcome)
    else:
        fut.set_result(outcome)
    if sink is not None:
        try:
            sink(fut)
        except Exception:
            log.exception("a matmul's sink failed")


class _Link(_Peer):
    """The front end's connection to the device process: request ids -> futures. Its first
    message from the device process is the ack of the hello (``acked``)."""

    out: _Out

    def __init__(self, arena: Arena) -> None:
        super().__init__()
        self.arena = arena
        self._ids = 0
        # rid -> (future, slot, stack, sink, weight names): see request
        self._waiting: dict[int, tuple[Any, ...]] = {}
        self.free_slots = list(range(arena.slots))
        self.serving = True
        self.loop = loop = asyncio.get_running_loop()
        self.acked: asyncio.Future[tuple[Any, ...]] = loop.create_future()
        # the device process's drain order: the grace period (0.0: the device process is gone)
        self.stop_order: asyncio.Future[float] = loop.create_future()
        self.on_health: Callable[[bool], None] = lambda ok: None
        self.rows: dict[str, int] = {}  # weight -> rows, seen in replies (stream back-pressure)

    def request(self, msg: tuple[Any, ...], slot: int = -1,
                fut: asyncio.Future[Any] | None = None, group: _Stack | None = None,
                sink: Callable[[Any], None] | None = None, names: tuple[str, ...] = (),
                ) -> tuple[int, asyncio.Future[Any]]:
        """Send ``msg``; ``fut`` (made here unless given) gets the answer, then ``sink(fut)``
        runs; ``names``: the weights of a matmul (their rows are noted from the reply).
        ``group``: the request is several callers' matmuls stacked (EngineProxy._send_group):
        each of their futures gets its rows of y, ``fut`` is not used."""
        self._ids = rid = self._ids + 1
        if fut is None:
            fut = self.loop.create_future()
        self._waiting[rid] = (fut, slot, group, sink, names)
        self.out.send((msg[0], rid, *msg[1:]))
        return rid, fut

    async def call(self, method: str, *args: Any) -> Any:
        _, fut = self.request(("call", method, args))
        return await fut

    def free(self, slot: int) -> None:
        self.free_slots.append(slot)

    def _y(self, slot: int, out: tuple[int, str, tuple[int, ...]],
           in_slot: list[int]) -> np.ndarray:
        """y at ``out`` (offset, dtype, shape) of ``slot``: a copy when small (COPY_Y_BYTES),
        else a view that holds the slot (``in_slot`` counts them, see _free_part). A view's
        slices do not hold it (their base is the arena): each holder needs its own view."""
        off, dt, shape = out
        y = self.arena.array(slot, _LE[dt], shape, writable=False, offset=off)
        if y.nbytes <= COPY_Y_BYTES:
            return y.copy()
        in_slot[0] += 1
        weakref.finalize(y, self._free_part, slot, in_slot)
        return y

    def _answer_group(self, group: _Stack, slot: int, fields: tuple[Any, ...],
                      out: Any) -> None:
        """A stacked request's reply: each caller its rows of y (slices of one copy of a
        small y; views of the slot for a big one, see _y)."""
        in_slot = [1]  # one for this loop: the slot is not freed while callers are served
        y: Any = out
        if isinstance(out, tuple):
            off, dt, shape = out
            if shape[0] * shape[1] * _LE[dt].itemsize <= COPY_Y_BYTES:
                y = self._y(slot, out, in_slot)
        kernel, layout, precision, queue, kernel_s, rows, reqs, device_s, topk = fields
        layout, precision = _LAYOUT_OF[layout], _PRECISION_OF[precision]
        row = 0
        for c, f, sink in group.members:
            n = c.x.shape[0]
            if f.done():  # the caller gave up
                row += n
                continue
            if isinstance(y, tuple):
                part = self._y(slot, (off + row * shape[1] * _LE[dt].itemsize, dt,
                                      (n, shape[1])), in_slot)
            else:
                part = y[row : row + n]
            row += n
            _resolve(f, sink, MatmulReply(part, kernel, layout, precision, queue, kernel_s,
                                          rows, reqs, device_s, topk))
        self.rows[group.key[0]] = int(out[2][1] if isinstance(out, tuple) else out.shape[1])
        if slot >= 0:
            self._free_part(slot, in_slot)

    def _free_part(self, slot: int, in_slot: list[int]) -> None:
        in_slot[0] -= 1
        if not in_slot[0]:
            self.free(slot)

    def message(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind in ("ok", "err", "mmok", "rmok"):
            self._answer(msg)
        elif kind == "health":
            self.on_health(msg[1])
        elif kind == "drain":
            self.serving = False
            if not self.stop_order.done():
                self.stop_order.set_result(float(msg[1]))
        elif not self.acked.done():
            self.acked.set_result(msg)

    def lost(self) -> None:
        """The device process went away: every waiting call fails, the front end stops."""
        self.serving = False
        waiting, self._waiting = self._waiting, {}
        gone = Unavailable("the worker's device process went away")
        for fut, _, group, sink, _ in waiting.values():
            if group is None:
                _resolve(fut, sink, gone)
                continue
            group.answered()  # the calls waiting behind it then fail, not sent
            for _, f, s in group.members:
                _resolve(f, s, gone)
        if not self.acked.done():
            self.acked.set_exception(Unavailable("the device process closed the connection"))
        if not self.stop_order.done():
            self.stop_order.set_result(0.0)

    def _answer(self, msg: tuple[Any, ...]) -> None:
        kind, rid = msg[0], msg[1]
        got = self._waiting.pop(rid, None)
        if got is None:
            return
        fut, slot, group, sink, names = got
        if group is not None:
            group.answered()
        if kind == "err":
            if slot >= 0:
                self.free(slot)
            if group is None:
                _resolve(fut, sink, msg[2])
            elif len(group.members) > 1 and isinstance(msg[2],
                                                       InvalidArgument | FailedPrecondition):
                group.one_by_one()  # maybe one caller's input: each gets its own answer
            else:
                for _, f, s in group.members:
                    _resolve(f, s, msg[2])
            return
        if kind == "ok":
            _resolve(fut, sink, msg[2])
            return
        if kind == "rmok":  # y is in the caller's region (_PlaneProxy.matmul)
            dt, shape = msg[3]
            _resolve(fut, sink, _reply(msg[2], YSpec(_LE[dt], tuple(shape))))
            return
        reply, outs = msg[2], msg[3]
        if group is not None:
            self._answer_group(group, slot, reply, outs[0])
            return
        ys: list[np.ndarray | None] = []
        in_slot = [1]  # ys viewing the slot (+ this loop): it is free once all are gone
        for out in outs:
            ys.append(self._y(slot, out, in_slot) if isinstance(out, tuple) else out)
        for name, y in zip(names if isinstance(reply, tuple) else [n for n, _ in reply], ys,
                           strict=True):
            if y is not None:
                self.rows[name] = int(y.shape[1])
        if slot >= 0:
            self._free_part(slot, in_slot)
        _resolve(fut, sink, _dress(reply, ys))
        # a caller that gave up: y (and with it the slot, if viewed) goes with this frame


class _Stack:
    """Several callers' calls sent as one request (EngineProxy._send_group), in order. When
    the stack was refused as INVALID_ARGUMENT or FAILED_PRECONDITION, which may be one
    caller's input, they are sent again one by one (as the batcher isolates such a request,
    each caller then gets its own answer)."""

    __slots__ = ("key", "members", "proxy")

    def __init__(self, proxy: EngineProxy, key: tuple[Any, ...],
                 members: list[_Pending]) -> None:
        self.proxy, self.key, self.members = proxy, key, members

    def one_by_one(self) -> None:
        for c, f, sink in self.members:
            if not f.done():
                self.proxy._send(c, f, sink)

    def answered(self) -> None:
        """The device process answered the stack (or went away)."""
        self.proxy._answered(self.key)


class EngineProxy:
    """What the servicer needs of an Engine, answered by the device process."""

    # a multi-weight call goes to the device process whole, which fans it out to the
    # weights' batchers (the servicer leaves the fan-out to this engine)
    takes_multi_weight = True

    def __init__(self, link: _Link) -> None:
        self.link = link
        # groupable calls not sent yet by (weight, x dtype, K, precision, out dtype)
        self._groups: dict[tuple[Any, ...], list[_Pending]] = {}
        self._stacks: dict[tuple[Any, ...], int] = {}  # stacked requests in flight, by key
        self.stacks_in_flight = stacks_in_flight()
        self._flushing = False
        self._rows: dict[str, _Rows] = {}  # what get answers, by weight

    @property
    def serving(self) -> bool:
        return self.link.serving

    def start_matmul(self, call: MatmulCall, sink: Callable[[Any], None] | None = None,
                     ) -> asyncio.Future[MatmulReply]:
        """As Engine.start_matmul; ``sink(fut)`` runs in the loop trip that resolves the
        future (the one that reads the device process's answer; not when the future is
        cancelled from outside).

        Plain single-weight calls of a few rows wait for the end of this loop iteration and
        go to the device process stacked with the others for the same weight, dtypes and K
        (up to GROUP_MAX_ROWS rows: one IPC message and one engine request for all of them;
        the device process's per-request work was T2's ceiling, bench/RESULTS.md). While
        ``stacks_in_flight`` stacks of that key are on the device (one running, one queued in
        its batcher), they wait for the first answer instead: the device could not run them
        sooner, and they go as one larger stack."""
        link = self.link
        if not link.serving:
            raise Unavailable("the worker is draining and takes no new requests")
        fut: asyncio.Future[Any] = link.loop.create_future()
        x = call.x
        if (call.weights or call.topk or x.ndim != 2
                or not 1 <= x.shape[0] <= GROUP_MAX_ROWS // 2):
            self._send(call, fut, sink)
            return fut
        key = (call.weight, x.dtype, x.shape[1], call.precision, call.out_dtype)
        if (waiting := self._groups.get(key)) is None:
            self._groups[key] = [(call, fut, sink)]
        else:
            waiting.append((call, fut, sink))
        if not self._flushing and self._stacks.get(key, 0) < self.stacks_in_flight:
            self._flushing = True
            link.loop.call_soon(self._flush)
        return fut

    def _send(self, call: MatmulCall, fut: asyncio.Future[Any],
              sink: Callable[[Any], None] | None) -> None:
        """One call as one request; its x in a free slot when it fits."""
        x, link = call.x, self.link
        slot = link.free_slots.pop() if link.free_slots else -1
        if slot >= 0 and x.nbytes <= link.arena.slot_bytes:
            link.arena.array(slot, x.dtype.newbyteorder("<"), x.shape, writable=True)[...] = x
            xs: Any = _desc(x)
        else:
            xs = np.ascontiguousarray(x)
        link.request(("mm", call.weight, call.weights, call.topk, call.precision.value,
                      dtype_name(call.out_dtype), call.timeout, xs, slot), slot, fut,
                     sink=sink, names=call.weights or (call.weight,))

    def _flush(self) -> None:
        """The waiting calls out, one request per key split at GROUP_MAX_ROWS rows, except
        for keys with ``stacks_in_flight`` stacks on the device (their first answer flushes)."""
        self._flushing = False
        for key in [k for k in self._groups
                    if self._stacks.get(k, 0) < self.stacks_in_flight or not self.link.serving]:
            live = [p for p in self._groups.pop(key) if not p[1].done()]  # not cancelled
            chunk: list[_Pending] = []
            rows = 0
            for p in live:
                n = p[0].x.shape[0]
                if chunk and rows + n > GROUP_MAX_ROWS:
                    self._send_group(key, chunk, rows)
                    chunk, rows = [], 0
                chunk.append(p)
                rows += n
            if chunk:
                self._send_group(key, chunk, rows)
        self.link.out.flush_now()  # the stacks go now, not a loop iteration later

    def _answered(self, key: tuple[Any, ...]) -> None:
        """A stack of ``key`` was answered: calls waiting for it go out (end of this trip:
        with the other answers read with this one, one stack)."""
        if (n := self._stacks[key] - 1) > 0:
            self._stacks[key] = n
        else:
            del self._stacks[key]
        if key in self._groups and not self._flushing:
            self._flushing = True
            self.link.loop.call_soon(self._flush)

    def _send_group(self, key: tuple[Any, ...], members: list[_Pending], rows: int) -> None:
        if not self.link.serving:
            for _, f, sink in members:
                _resolve(f, sink, Unavailable("the worker is draining and takes no new "
                                              "requests"))
            return
        weight, dtype, k, precision, out_dtype = key
        link = self.link
        dtype = dtype.newbyteorder("<")
        shape = (rows, k)
        slot = link.free_slots.pop() if link.free_slots else -1
        if slot >= 0 and rows * k * dtype.itemsize <= link.arena.slot_bytes:
            # straight into the slot: no concatenated copy
            np.concatenate([c.x for c, _, _ in members],
                           out=link.arena.array(slot, dtype, shape, writable=True))
            xs: Any = (_NAME.get(dtype) or dtype_name(dtype), shape)
        else:
            xs = np.concatenate([c.x for c, _, _ in members])
        # the longest deadline: a caller's own deadline still ends its RPC (gRPC enforces it)
        timeout: float | None = 0.0
        for c, _, _ in members:
            if c.timeout is None:
                timeout = None
                break
            timeout = max(timeout, c.timeout)
        self._stacks[key] = self._stacks.get(key, 0) + 1
        link.request(("mm", weight, (), 0, precision.value,
                      _NAME.get(out_dtype) or dtype_name(out_dtype), timeout, xs, slot), slot,
                     group=_Stack(self, key, members))

    async def matmul(self, call: MatmulCall) -> MatmulReply:
        # shielded: a cancelled caller must not cancel the future the reply resolves (its
        # slot is freed only when the device process has answered)
        return await asyncio.shield(self.start_matmul(call))

    def get(self, name: str) -> Any:
        """Sync, for the stream's back-pressure estimate only: rows seen in replies."""
        rows = self.link.rows.get(name)
        if rows is None:
            raise NotFound(f"rows of {name!r} not seen yet")
        if (got := self._rows.get(name)) is None or got.rows != rows:
            got = self._rows[name] = _Rows(rows)  # (one per call was ~1 us of the stream's)
        return got

    async def load_gguf(self, *a: Any) -> Any:
        return await self.link.call("load_gguf", *a)

    async def upload(self, spec: Any, chunks: AsyncIterator[bytes]) -> Any:
        rid, fut = self.link.request(("up", spec))
        try:
            async for c in chunks:
                if fut.done():
                    break  # refused already (header, budget): stop reading the client
                self.link.out.send(("upc", rid, bytes(c)))
                await self.link.drain()
            else:
                self.link.out.send(("upc", rid, None))
        except BaseException as e:
            self.link.out.send(("upc", rid, _portable_error(e)
                                     if isinstance(e, Exception) else
                                     Unavailable("the upload was cancelled")))
            raise
        return await fut

    async def unload(self, name: str) -> Any:
        return await self.link.call("unload", name)


@dataclasses.dataclass(frozen=True)
class _Rows:
    rows: int


_NO_X = np.empty((0, 0), np.float32)  # wire.matmul_call's x for a request whose x is in a region


class _PlaneProxy:
    """The device process's RegionPlane, seen from a front end."""

    def __init__(self, link: _Link) -> None:
        self.link = link

    async def register(self, owner: str, name: str, src: Any) -> Any:
        return await self.link.call("region", "register", owner, name, src)

    async def unregister(self, owner: str, name: str) -> Any:
        return await self.link.call("region", "unregister", owner, name)

    async def list(self, owner: str) -> Any:
        return await self.link.call("region", "list", owner)

    async def open_lane(self, owner: str, region: str) -> Any:
        return await self.link.call("region", "open_lane", owner, region)  # lanes: device side

    async def matmul(self, owner: str, io: RegionIO, req: Any, timeout: float | None,
                     t0: float) -> Any:
        """x and y both in regions: one "rm" message of plain values (the device process
        answers from the engine's sink, FrontendsWorker._region_matmul); otherwise (x or y
        inline) the request itself goes as a device call."""
        if io.x is None or io.y is None:
            return await self.link.call("region", "matmul", owner, io,
                                        req.SerializeToString(), timeout, t0)
        call = wire.matmul_call(req, timeout, _NO_X)  # the request's checks, x aside
        assert io.x_dtype is not None and io.x_shape is not None
        decoded = time.perf_counter()
        _, fut = self.link.request((
            "rm", owner, (io.x.region, io.x.offset, _NAME.get(io.x_dtype) or
                          dtype_name(io.x_dtype), tuple(io.x_shape)),
            (io.y.region, io.y.offset), call.weight, call.precision.value,
            _NAME.get(call.out_dtype) or dtype_name(call.out_dtype), timeout))
        return await fut, wire.Took(t0, decoded)


class _MetricsForwarder:
    """The interceptor's request metrics, batched to the device process's one registry
    (grouped by labels: the device process looks each label set up once per batch)."""

    def __init__(self, link: _Link) -> None:
        self.link = link
        self.buf: dict[tuple[str, str, str], list[float]] = {}

    def observe_request(self, service: str, method: str, code: str, seconds: float) -> None:
        if (got := self.buf.get((service, method, code))) is None:
            self.buf[(service, method, code)] = [seconds]
        else:
            got.append(seconds)

    def flush(self) -> None:
        if self.buf and not self.link.out.transport.is_closing():
            buf, self.buf = self.buf, {}
            self.link.out.send(("metrics", [(*k, v) for k, v in buf.items()]))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(METRICS_FLUSH_S)
            self.flush()


class FrontendServicer(Q6ServeServicer):
    """The servicer over an EngineProxy: the engine's synchronous queries become device
    calls (awaited here); everything else is Q6ServeServicer's."""

    async def ListWeights(self, request: Any, context: Any) -> Any:
        return wire.list_response(await self.engine.link.call("list"))  # type: ignore[attr-defined]

    async def GetWeight(self, request: Any, context: Any) -> Any:
        return wire.get_response(
            await self.engine.link.call("get", request.name))  # type: ignore[attr-defined]

    async def GetStatus(self, request: Any, context: Any) -> Any:
        return wire.status_response(
            await self.engine.link.call("status"))  # type: ignore[attr-defined]

    async def SetFlags(self, request: Any, context: Any) -> Any:
        return wire.set_flags_response(await self.engine.link.call(  # type: ignore[attr-defined]
            "set_flags", wire.flag_changes(request)))


def share(total: int, n: int, index: int) -> int:
    """Front end ``index``'s part of a worker-wide limit ``total``: the parts of the N front
    ends add up to ``total`` (at least 1 each, so a limit below N admits N)."""
    return max(1, total // n + (index < total % n))


def frontend_limits(cfg: WorkerConfig, index: int) -> tuple[int, int, int]:
    """(unary RPCs in flight, bytes of all MatmulStream windows, streaming calls open) of
    front end ``index``: the worker's --max-inflight-rpcs, --max-stream-bytes-total and
    --max-streams split over the front ends, so
    the worker as a whole holds what one process would. The split is static, with no
    traffic between front ends on the hot path; a connection lives on one front end, so the
    per-connection limits apply unchanged (each capped by its front end's part)."""
    n = cfg.frontends
    return (share(cfg.max_inflight_rpcs, n, index), share(cfg.max_stream_bytes_total, n, index),
            share(cfg.max_streams, n, index))


_CHILD = "from q6serve.service.frontends import frontend_main; frontend_main()"


def freeze_startup(env: Mapping[str, str] | None = None) -> bool:
    """With ``Q6SERVE_FRONTEND_GC_FREEZE=1`` (off by default: not measured on the H200), what
    a front end's start-up made (modules, gRPC's server, the servicer: ~47k objects the GC
    tracks) leaves the cyclic GC's generations (``gc.freeze``), so that a full collection
    walks only what came since. On the VM under T2-shaped load a front end ran a full
    collection every ~10k calls, 34-41 ms of CPU (64-94 ms of wall time) each, a stall of every
    call in flight on it; with the switch none came in 13k calls a front end
    (bench/t2_timeline.py, bench/RESULTS.md, session 11). True if it froze."""
    if not envvars.FRONTEND_GC_FREEZE.read(env):
        return False
    gc.freeze()
    return True


def frontend_main() -> None:
    """Entry point of a front-end process (FrontendsWorker._spawn): arguments on stdin."""
    (index, config, port, sock_path, slots, slot_bytes, log_level,
     steer) = pickle.load(sys.stdin.buffer)
    if config.cpus:  # its own core of --cpus where there are enough (service/affinity.py)
        pin_process(cores_of(config.cpus, index + 1, config.frontends))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the device drains
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s frontend{index}: %(name)s: "
                               "%(message)s")
    asyncio.run(_frontend(index, config, port, sock_path, slots, slot_bytes, steer))


async def _frontend(index: int, cfg: WorkerConfig, port: int, sock_path: str, slots: int,
                    slot_bytes: int, steer: tuple[int, int, int] | None = None) -> None:
    busy_poll(asyncio.get_running_loop(), lambda: True, frontend_busy_poll_us())
    arena = Arena.create(slots, slot_bytes)
    link = _Link(arena)
    try:
        await asyncio.get_running_loop().create_unix_connection(lambda: link, sock_path)
        link.out.send(("hello", index, os.getpid(), arena.name, slots, slot_bytes))
        ack = await link.acked
    finally:
        arena.unlink()  # mapped on both sides (or failed): the name is not needed any more
    if ack[0] != "ack":
        raise FailedPrecondition(f"the device process refused front end {index}: {ack!r}")
    metrics = _MetricsForwarder(link)
    flushing = asyncio.get_running_loop().create_task(metrics.run())
    auth = TokenAuth(cfg.token, cfg.admin_token)
    proxy = EngineProxy(link)
    inflight, stream_bytes, streams = frontend_limits(cfg, index)
    servicer = FrontendServicer(proxy, max_stream_bytes=cfg.max_stream_bytes,  # type: ignore[arg-type]
                                auth=auth, plane=_PlaneProxy(link),
                                stream_budget=StreamBudget(stream_bytes,
                                                           cfg.max_stream_bytes_per_connection))
    interceptor = ErrorInterceptor(metrics, auth,  # type: ignore[arg-type]
                                   Admission(inflight, cfg.max_inflight_rpcs_per_connection,
                                             cfg.min_inflight_rpcs_per_connection,
                                             cfg.reply_timeout_s), cfg.receive_limit,
                                   streams=StreamSlots(streams, cfg.max_streams_per_connection))
    server, health, _ = build_server(dataclasses.replace(cfg, port=port), servicer,
                                     interceptor, reuseport=True)
    await server.start()
    if steer is not None:  # (Q6SERVE_FRONTEND_ROUND_ROBIN) before "ready": before any caller
        reuseport.join(steer, index, port)
        for fd in steer:  # the group holds the program, the program its maps
            os.close(fd)

    async def set_health(ok: bool) -> None:
        for service in ("", wire.SERVICE_NAME):
            await health.set(service, wire.health_status(ok))

    await set_health(True)
    health_tasks: set[asyncio.Task[None]] = set()

    def on_health(ok: bool) -> None:
        t = asyncio.get_running_loop().create_task(set_health(ok))
        health_tasks.add(t)
        t.add_done_callback(health_tasks.discard)

    link.on_health = on_health
    freeze_startup()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM,
                            lambda: link.stop_order.done() or link.stop_order.set_result(
                                cfg.grace_period_s))
    link.out.send(("ready",))
    grace = await link.stop_order
    await health.enter_graceful_shutdown()
    link.serving = False
    await stop_server(server, interceptor, grace)
    metrics.flush()
    link.out.flush()  # what is pending goes before the socket closes
    flushing.cancel()
    with contextlib.suppress(Exception):
        await link.drain()
    link.out.transport.close()  # writes what is buffered first
    arena.close()
