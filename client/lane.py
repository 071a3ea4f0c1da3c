"""The fast lane's client side (issue 15 item 3): Matmuls without RPCs for a co-located
caller, over the worker's Unix socket, x and y in one of the caller's regions.

    with Client(target) as c, c.register_shm("io", 1 << 20) as region, \\
            c.open_lane(region) as lane:
        y = lane.matmul("blk.0.ffn_down.weight", x)   # a view of the region, as with y_region

The record layouts are in the .proto's "Fast lane" section (service/lane.py is the worker's
side). One call at a time per Lane (it is not thread-safe); open one lane per thread.

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

import math
import os
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
SPIN_ENV = "Q6SERVE_LANE_SPIN_US"
LANE_SPIN_US = 1000.0  # default spin where the caller may run on SPIN_MIN_CPUS cores or more
MAX_KEPT = 64  # record codes and region views a lane keeps (cleared beyond)
_CODES = {c.value[0]: c for c in grpc.StatusCode}


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
    blocking."""

    def __init__(self, region: Region, path: str, ticket: bytes,
                 timeout: float | None = 60.0, spin_us: float | None = None) -> None:
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
        try:
            self.sock.connect(path)
            self.sock.sendall(ticket)
            if self.sock.recv(1) != ACCEPTED:
                raise core.Q6ServeError(grpc.StatusCode.PERMISSION_DENIED,
                                        "the worker refused the lane (ticket used, expired or "
                                        "from another user)")
        except OSError as e:
            self.sock.close()
            raise core.Q6ServeError(grpc.StatusCode.UNAVAILABLE,
                                    f"cannot open the lane at {path}: {e}") from None
        except BaseException:
            self.sock.close()
            raise

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
        self._views.clear()
        self._xs.clear()  # (the region's mapping may close once nothing views it)
        self.sock.close()

    def __enter__(self) -> Lane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
