"""The fast lane's client side (issue 15 item 3): Matmuls without RPCs for a co-located
caller, over the worker's Unix socket, x and y in one of the caller's regions.

    with Client(target) as c, c.register_shm("io", 1 << 20) as region, \\
            c.open_lane(region) as lane:
        y = lane.matmul("blk.0.ffn_down.weight", x)   # a view of the region, as with y_region

The record layouts are in the .proto's "Fast lane" section (service/lane.py is the worker's
side). One call at a time per Lane (it is not thread-safe); open one lane per thread.
"""

from __future__ import annotations

import math
import socket
import struct
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from . import core
from .shm import ALIGN, Region

REQUEST = struct.Struct("<QIIQQBBBBHH")
REPLY = struct.Struct("<QIIIIIIddd")
ACCEPTED = b"\x00"
_CODES = {c.value[0]: c for c in grpc.StatusCode}


@dataclass(frozen=True)
class LaneTiming:
    """The worker's figures of the last lane call (MatmulTiming's)."""

    queue_seconds: float
    kernel_seconds: float | None
    device_seconds: float | None
    batch_rows: int
    batch_requests: int


class Lane:
    """An open lane on ``region``; ``matmul`` returns y as a view of the region."""

    def __init__(self, region: Region, path: str, ticket: bytes,
                 timeout: float | None = 60.0) -> None:
        self.region, self.path = region, path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self._seq = 0
        self.last: LaneTiming | None = None
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
            self.region.put(x_offset, x)
            shape, dtype = (int(x.shape[0]), int(x.shape[1])), x.dtype
        if shape is None or dtype is None:
            raise ValueError("lane matmul needs x, or shape and dtype of the x in the region")
        dt = np.dtype(dtype)
        name = core.dtype_name(dt)
        if name is None:
            raise ValueError(f"dtype {dt} is not one of f32, f16, bf16")
        n, k = shape
        if y_offset is None:
            y_offset = x_offset + -(-n * k * dt.itemsize // ALIGN) * ALIGN
        wname = weight.encode()
        self._seq += 1
        req = REQUEST.pack(self._seq, n, k, x_offset, y_offset, core._DTYPE_TO_PB[name],
                           core._DTYPE_TO_PB[out_dtype],
                           core._choice(core.PRECISIONS, precision, "precision"), 0,
                           len(wname), 0)
        try:
            self.sock.sendall(req + wname)
            self._read_into(self._head)
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
        self.last = LaneTiming(queue, None if math.isnan(kernel) else kernel,
                               None if math.isnan(device) else device, rows, reqs)
        return self.region.ndarray(y_offset, core.DTYPES[out_dtype], (n, cols))

    def _read_into(self, buf: bytearray) -> None:
        view, got = memoryview(buf), 0
        while got < len(buf):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("the worker closed the lane")
            got += n

    def _read(self, n: int) -> bytes:
        buf = bytearray(n)
        self._read_into(buf)
        return bytes(buf)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Lane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
