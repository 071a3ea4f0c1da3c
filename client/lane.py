"""The fast lane's client side (issue 15 item 3): Matmuls without RPCs for a co-located
caller, over the worker's Unix socket, x and y in one of the caller's regions.

    with Client(target) as c, c.register_shm("io", 1 << 20) as region, \\
            c.open_lane(region) as lane:
        y = lane.matmul("blk.0.ffn_down.weight", x)   # a view of the region, as with y_region

The record layouts are in the .proto's "Fast lane" section (service/lane.py is the worker's
side). One call at a time per Lane (it is not thread-safe); open one lane per thread. By default
the records go through a 2 KiB shared-memory ring of the lane's own (service/lane.py, "The
ring"; the socket kept for setup and wake-ups), over the socket where the worker takes no ring
or with ``ring=False`` / ``Q6SERVE_LANE_RING=0``.

Waiting for a reply, the caller first polls the socket without blocking for up to ``spin_us``
(busy polling, as the worker's loop does before it sleeps: service/threads.py), then blocks in
``recv``: a reply that comes within the spin is read by a thread that is running instead of by
one woken from sleep. The spin takes a core of the caller while it lasts: by default
``LANE_SPIN_US`` where this process may run on ``SPIN_MIN_CPUS`` cores or more (the worker's
busy-polling rule), else none; ``Q6SERVE_LANE_SPIN_US`` (microseconds, 0: never) or
``spin_us=`` override. On the H200 host (16 cores) 1000 us took the reply's way down from
~12 to ~6 us and p50 - kernel down 7-27 us in 6 of 6 alternated pairs (bench/RESULTS.md,
"Fast lane latency, session 9").
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import select
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from . import core
from .shm import ALIGN, Region, ShmRegion
from .spin import caller_spin_us

REQUEST = struct.Struct("<QIIQQBBBBHH")
REPLY = struct.Struct("<QIIIIIIddd")
ACCEPTED = b"\x00"
FULL = b"\x02"  # the worker's answer to the ticket when --max-regions lanes are open
# the ring (service/lane.py's layout): a RING_BYTES memfd of the lane's own, sealed against
# shrinking, passed to the worker with a setup record named "fd" (SCM_RIGHTS on the lane's
# socket: no /proc, so a caller in another pid namespace sharing the socket gets one too; the
# worker maps it). A lane asks
# for one unless ring=False or Q6SERVE_LANE_RING=0 here; x86-64 workers take it unless started
# with Q6SERVE_LANE_RING=0 (a refusal: a socket lane then, unless ring=True asked for the ring)
R_SEQ, R_REQ, R_CSLEEP = 0, 8, 64
R_RSEQ, R_REP, R_WSLEEP = 128, 136, 192
R_NAME, R_MSG, RING_BYTES = 256, 1280, 2048
RING_NAME_MAX, RING_MSG_MAX = R_MSG - R_NAME, RING_BYTES - R_MSG
RING_ENV = "Q6SERVE_LANE_RING"
RING_SETUP = 2
RING_PASSED = b"fd"  # the setup record's name: the memfd comes with it (SCM_RIGHTS)
RING_RECHECK_S = 20e-6  # the ring re-checked after this side's sleep flag is set
RING_WAKE_MS = 5  # the longest block before the ring is looked at again
SEQ = struct.Struct("<Q")
FLAG = struct.Struct("<I")
SPIN_ENV = "Q6SERVE_LANE_SPIN_US"
LANE_SPIN_US = 1000.0  # default spin where the caller may run on SPIN_MIN_CPUS cores or more
MAX_KEPT = 64  # record codes and region views a lane keeps (cleared beyond)
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def ring_memfd() -> int:
    """A new ring block's descriptor (the caller closes it): a zeroed memfd of RING_BYTES,
    sealed against shrinking and growing, and against further seals (service/lane.py
    refuses a ring that could shrink under its mapping)."""
    fd = os.memfd_create("q6ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, RING_BYTES)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass(frozen=True)
class LaneTiming:
    """The worker's figures of the last lane call (MatmulTiming's)."""

    queue_seconds: float
    kernel_seconds: float | None
    device_seconds: float | None
    batch_rows: int
    batch_requests: int


def lane_spin_us(env: Mapping[str, str] | None = None) -> float:
    """The caller's spin before it blocks for a reply, in us: ``Q6SERVE_LANE_SPIN_US`` when
    set, else LANE_SPIN_US on a process allowed SPIN_MIN_CPUS cores or more, else 0
    (client/spin.py)."""
    return caller_spin_us(SPIN_ENV, LANE_SPIN_US, "the lane's caller", env)


class Lane:
    """An open lane on ``region``; ``matmul`` returns y as a view of the region.
    ``spin_us``: how long a call polls for its reply before it blocks (None: the default of
    :func:`lane_spin_us`); ``spun`` / ``slept`` count the replies read while spinning / after
    blocking. ``ring``: True asks for the ring (a refusal raises), False the socket, None
    (default) the ring unless ``Q6SERVE_LANE_RING`` is off here, the socket where refused."""

    def __init__(self, region: Region, path: str, ticket: bytes,
                 timeout: float | None = 60.0, spin_us: float | None = None,
                 ring: bool | None = None) -> None:
        self.region, self.path = region, path
        self.spin_us = lane_spin_us() if spin_us is None else float(spin_us)
        self.spun = self.slept = 0
        self._codes: dict[tuple[Any, ...], tuple[bytes, int, int, int, int]] = {}
        self._views: dict[tuple[Any, ...], Any] = {}  # the region's views by place
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self._seq = 0
        self._last: tuple[float, float, float, int, int] | None = None  # (``last``)
        self._xs: dict[tuple[Any, ...], tuple[np.ndarray, int]] = {}  # x's places (_x_place)
        self._head = bytearray(REPLY.size)
        self._ring: memoryview | None = None  # the ring block (ring lanes)
        self._ring_mm: mmap.mmap | None = None  # (its mapping)
        self._ring_name = b""
        self._timeout = timeout
        asked = ring
        if ring is None:
            ring = os.environ.get(RING_ENV, "").strip().lower() not in ("0", "off", "false",
                                                                         "no")
        try:
            self.sock.connect(path)
            self.sock.sendall(ticket)
            answer = self.sock.recv(1)
            if answer == FULL:
                raise core.Q6ServeError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        "the worker has --max-regions lanes open; close a "
                                        "lane first")
            if answer != ACCEPTED:
                raise core.Q6ServeError(grpc.StatusCode.PERMISSION_DENIED,
                                        "the worker refused the lane (ticket used, expired or "
                                        "from another user)")
            if ring:
                try:
                    self._ring_setup()
                except core.Q6ServeError:
                    if asked:  # (asked for: the refusal is the caller's to see)
                        raise
                    # (by default: a socket lane where the worker or this host takes no ring)
        except OSError as e:
            self.sock.close()
            raise core.Q6ServeError(grpc.StatusCode.UNAVAILABLE,
                                    f"cannot open the lane at {path}: {e}") from None
        except BaseException:
            self.sock.close()
            raise

    @property
    def ring(self) -> bool:
        """Whether requests and replies go through the ring (else the socket)."""
        return self._ring is not None

    def _ring_setup(self) -> None:
        """The ring: a zeroed RING_BYTES memfd of its own, sealed (``ring_memfd``: no one can
        shrink it under the worker's mapping), passed to the worker with a setup record named
        "fd" (SCM_RIGHTS) and closed here at once (in flight, the passed one holds the block);
        the worker's answer is read on the socket (a refusal raises). The two mappings are all
        there is of the block then."""
        try:
            fd = ring_memfd()
        except (OSError, AttributeError) as e:  # (no memfd on this host)
            raise core.Q6ServeError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"cannot create the lane's ring: {e}") from None
        try:
            mm = mmap.mmap(fd, RING_BYTES)
            try:
                rec = REQUEST.pack(0, 0, 0, 0, 0, 0, 0, 0, RING_SETUP, len(RING_PASSED), 0)
                sent = socket.send_fds(self.sock, [rec + RING_PASSED], [fd])
                os.close(fd)  # (the worker has its own now: in flight, the descriptor is held)
                fd = -1
                if sent < len(rec) + len(RING_PASSED):
                    self.sock.sendall((rec + RING_PASSED)[sent:])
                self._read_into(self._head)
                _, code, msg_len, *_ = REPLY.unpack(self._head)
                msg = self._read(msg_len).decode("utf-8", "replace") if msg_len else ""
                if code:
                    raise core.Q6ServeError(_CODES.get(code, grpc.StatusCode.UNKNOWN), msg)
            except BaseException:
                mm.close()
                raise
        finally:
            if fd >= 0:
                os.close(fd)
        self._ring_mm, self._ring = mm, memoryview(mm)
        self._poll = select.poll()
        self._poll.register(self.sock.fileno(), select.POLLIN)

    def _ring_call(self, rec: bytes, wname: bytes) -> tuple[Any, ...]:
        """One request through the ring: the record (the name only when it changed), its
        seq last, the doorbell if the worker's flag says it sleeps; the reply waited for
        (:meth:`_ring_wait`) and returned unpacked, with its message."""
        mv = self._ring
        assert mv is not None
        if wname != self._ring_name:
            if len(wname) > RING_NAME_MAX:
                raise ValueError(f"a weight name of {len(wname)} bytes: a ring takes at most "
                                 f"{RING_NAME_MAX}")
            mv[R_NAME : R_NAME + len(wname)] = wname
            self._ring_name = wname
        mv[R_REQ : R_REQ + REQUEST.size] = rec
        SEQ.pack_into(mv, R_SEQ, self._seq)
        if FLAG.unpack_from(mv, R_WSLEEP)[0]:
            os.write(self.sock.fileno(), b"\x01")  # the doorbell
        self._ring_wait()
        seq, code, msg_len, cols, rows, reqs, _, queue, kernel, device = REPLY.unpack_from(
            mv, R_REP)
        n = min(msg_len, RING_MSG_MAX)
        msg = bytes(mv[R_MSG : R_MSG + n]).decode("utf-8", "replace") if n else ""
        return seq, code, cols, rows, reqs, queue, kernel, device, msg

    def _ring_wait(self) -> None:
        """The reply seq spun on for up to ``spin_us``; then this side's flag set (the worker
        rings the doorbell), the ring re-checked for RING_RECHECK_S, and the socket waited on
        RING_WAKE_MS at a time (the ring looked at after each) until the lane's timeout."""
        mv, seq, unpack, now = self._ring, self._seq, SEQ.unpack_from, time.perf_counter
        assert mv is not None
        if unpack(mv, R_RSEQ)[0] == seq:
            self.spun += 1
            return
        t0 = now()
        if self.spin_us > 0:
            end = t0 + self.spin_us * 1e-6
            while now() < end:
                if unpack(mv, R_RSEQ)[0] == seq:
                    self.spun += 1
                    return
        self.slept += 1
        FLAG.pack_into(mv, R_CSLEEP, 1)
        try:
            end = now() + RING_RECHECK_S
            while now() < end:
                if unpack(mv, R_RSEQ)[0] == seq:
                    return
            fd = self.sock.fileno()
            limit = None if self._timeout is None else t0 + self._timeout
            while unpack(mv, R_RSEQ)[0] != seq:
                wait = RING_WAKE_MS
                if limit is not None:
                    left = limit - now()
                    if left <= 0:
                        raise TimeoutError("no reply on the lane's ring in time")
                    wait = min(wait, math.ceil(left * 1000))
                if self._poll.poll(wait):
                    try:
                        if not os.read(fd, 64):  # doorbells (stale ones too): drained
                            raise ConnectionError("the worker closed the lane")
                    except BlockingIOError:
                        pass
        finally:
            FLAG.pack_into(mv, R_CSLEEP, 0)

    def matmul(self, weight: str, x: Any = None, *, x_offset: int = 0,
               y_offset: int | None = None, shape: tuple[int, int] | None = None,
               dtype: Any = None, precision: str = "auto", out_dtype: str = "f32") -> Any:
        """y = x · Wᵀ through the lane. ``x``: copied into the region at ``x_offset`` unless
        it already is the region's view there; or None with ``shape`` and ``dtype`` of the x
        already in the region. y goes to ``y_offset`` (default: after x, 64-byte aligned) and
        is returned as a view of the region (valid until the region is next written)."""
        if x is not None:
            if not isinstance(x, np.ndarray) and not hasattr(x, "__cuda_array_interface__"):
                x = np.asarray(x)
            shape, dtype = (int(x.shape[0]), int(x.shape[1])), x.dtype
            if isinstance(x, np.ndarray) and isinstance(self.region, ShmRegion):
                dst, addr = self._x_place(x_offset, x.dtype, shape)  # (region.put, kept)
                # x copied unless it is the region's x already: may_share_memory (~0.2 us)
                # first, the address (__array_interface__: ~1.1 us a side) only if it may
                if x is not dst and (not np.may_share_memory(x, dst)
                                     or x.__array_interface__["data"][0] != addr):
                    dst[...] = x
            else:
                self.region.put(x_offset, x)
        if shape is None or dtype is None:
            raise ValueError("lane matmul needs x, or shape and dtype of the x in the region")
        codes = self._codes.get((weight, dtype, out_dtype, precision))
        if codes is None:
            codes = self._record_codes(weight, dtype, out_dtype, precision)
        wname, x_code, out_code, prec_code, itemsize = codes
        n, k = shape
        if y_offset is None:
            y_offset = x_offset + -(-n * k * itemsize // ALIGN) * ALIGN
        self._seq += 1
        req = REQUEST.pack(self._seq, n, k, x_offset, y_offset, x_code, out_code, prec_code, 0,
                           len(wname), 0)
        try:
            if self._ring is not None:
                got = self._ring_call(req, wname)
            else:
                got = self._sock_call(req, wname)
            seq, code, cols, rows, reqs, queue, kernel, device, msg = got
        except OSError as e:
            raise core.Q6ServeError(grpc.StatusCode.UNAVAILABLE,
                                    f"the lane broke: {e}") from None
        if seq != self._seq:
            raise core.Q6ServeError(grpc.StatusCode.INTERNAL,
                                    f"lane reply {seq} for request {self._seq}")
        if code:
            raise core.Q6ServeError(_CODES.get(code, grpc.StatusCode.UNKNOWN), msg)
        self._last = (queue, kernel, device, rows, reqs)  # (LaneTiming made when read)
        return self._view(y_offset, core.DTYPES[out_dtype], (n, cols)).view()

    def _sock_call(self, req: bytes, wname: bytes) -> tuple[Any, ...]:
        """One request over the socket: the record written, the reply read."""
        data = req + wname
        try:  # one write(2): sendall on a socket with a timeout would poll() first
            sent = os.write(self.sock.fileno(), data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            self.sock.sendall(data[sent:])
        self._read_head()
        seq, code, msg_len, cols, rows, reqs, _, queue, kernel, device = REPLY.unpack(
            self._head)
        msg = self._read(msg_len).decode("utf-8", "replace") if msg_len else ""
        return seq, code, cols, rows, reqs, queue, kernel, device, msg

    @property
    def last(self) -> LaneTiming | None:
        """The worker's figures of the last call (made when read: a frozen dataclass costs
        the call ~0.7 us, and most callers never look)."""
        got = self._last
        if got is None:
            return None
        queue, kernel, device, rows, reqs = got
        return LaneTiming(queue, None if math.isnan(kernel) else kernel,
                          None if math.isnan(device) else device, rows, reqs)

    def _record_codes(self, weight: str, dtype: Any, out_dtype: str, precision: str,
                      ) -> tuple[bytes, int, int, int, int]:
        """What a request record says of (weight, x dtype, out dtype, precision): checked once
        per combination, then kept (a handful per lane)."""
        dt = np.dtype(dtype)
        name = core.dtype_name(dt)
        if name is None:
            raise ValueError(f"dtype {dt} is not one of f32, f16, bf16")
        codes = (weight.encode(), core._DTYPE_TO_PB[name],
                 core._choice(core._DTYPE_TO_PB, out_dtype, "out_dtype"),
                 core._choice(core.PRECISIONS, precision, "precision"), dt.itemsize)
        if len(self._codes) >= MAX_KEPT:
            self._codes.clear()
        self._codes[(weight, dtype, out_dtype, precision)] = codes
        return codes

    def _view(self, offset: int, dtype: Any, shape: tuple[int, int]) -> Any:
        """The region's view at ``offset`` (Region.ndarray, checked once per place and kept:
        a lane reuses a handful of places)."""
        key = (offset, dtype, shape)
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= MAX_KEPT:
                self._views.clear()
            v = self._views[key] = self.region.ndarray(offset, dtype, shape)
        return v

    def _x_place(self, offset: int, dtype: Any, shape: tuple[int, int],
                 ) -> tuple[np.ndarray, int]:
        """x's view of the region at ``offset`` and its address (kept, as :meth:`_view`)."""
        key = (offset, dtype, shape)
        got = self._xs.get(key)
        if got is None:
            if len(self._xs) >= MAX_KEPT:
                self._xs.clear()
            v = self._view(offset, dtype, shape)
            got = self._xs[key] = (v, int(v.__array_interface__["data"][0]))
        return got

    def _read_head(self) -> None:
        """The reply's fixed part: polled for without blocking for up to ``spin_us``, then
        read blocking (the socket's timeout) from where the spin left off."""
        buf = self._head
        view, got = memoryview(buf), 0
        # a socket with a timeout has a non-blocking descriptor (its recv would poll(), i.e.
        # sleep, first): readv takes what is there or raises BlockingIOError at once. A socket
        # without a timeout blocks in readv: no spin then.
        if self.spin_us > 0 and self.sock.gettimeout() is not None:
            fd, now = self.sock.fileno(), time.perf_counter
            end = now() + self.spin_us * 1e-6
            while got < len(buf):
                try:
                    n = os.readv(fd, (view[got:],))
                except BlockingIOError:
                    if now() >= end:
                        break
                    continue
                if n == 0:
                    raise ConnectionError("the worker closed the lane")
                got += n
            else:
                self.spun += 1
                return
        self.slept += 1
        self._read_into(view[got:])

    def _read_into(self, buf: bytearray | memoryview) -> None:
        view, got = memoryview(buf), 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("the worker closed the lane")
            got += n

    def _read(self, n: int) -> bytes:
        buf = bytearray(n)
        self._read_into(buf)
        return bytes(buf)

    def close(self) -> None:
        if self._ring is not None:
            self._ring.release()
            self._ring = None
        if self._ring_mm is not None:
            self._ring_mm.close()  # (the block has no descriptor or name left)
            self._ring_mm = None
        self._views.clear()
        self._xs.clear()  # (the region's mapping may close once nothing views it)
        self.sock.close()

    def __enter__(self) -> Lane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
