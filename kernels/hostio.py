"""Host memory the device reads and writes directly: page-locked ranges and y routes (issue 15).

The service registers a caller's system shared-memory region with the backend
(:meth:`HostIO.pin`: ``cudaHostRegister`` on the CUDA backend), so a call whose x views such
a region is DMA'd straight from it into the device (no memcpy into the staging buffer), and
a y region can take y straight from the device (no pinned block, no host copy).

How a y destination reaches the backend without new arguments through the engine and the
batcher: the service *routes* it by x's address for the duration of one call
(:meth:`route` before the call is queued, :meth:`unroute` when it is answered). The backend
asks :meth:`y_for` at launch; it answers only for an x of exactly the routed address, shape
and dtype, and only while that address is routed by one call (two calls in flight on the same
x bytes make the route ambiguous: neither gets it, both take the usual way). A batch of
several requests is concatenated elsewhere, so its x never matches a route.

Every call whose x lies in a region routes, with its y destination or with None (its y comes
back in the reply), so that no call can take another's route.

Thread safety: pins and routes change on the event loop; launches may run on the device
thread. :attr:`lock` is held by the backend from "is x pinned?" to the end of enqueueing its
copies, and by :meth:`unpin` around "wait for the stream, unregister", so a range is never
unregistered under a copy that was enqueued while it was pinned.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

log = logging.getLogger("q6serve.hostio")

Register = Callable[[int, int], None]  # (address, bytes): page-lock, raise on failure
Unregister = Callable[[int], None]  # (address)
Sync = Callable[[], None]  # wait for every copy the device has queued


class HostIO:
    """Page-locked host ranges of one backend and the y routes of the calls in flight.

    ``register`` None: ranges are only recorded (the NumPy backend, tests), which is what the
    routes and the accounting need; a backend that cannot DMA ignores them."""

    def __init__(self, register: Register | None = None, unregister: Unregister | None = None,
                 sync: Sync | None = None) -> None:
        self._register, self._unregister, self._sync = register, unregister, sync
        self._ranges: dict[int, int] = {}  # start address -> end address
        # x address -> [calls routing it, (x shape, x dtype, y) or None once ambiguous]
        self._routes: dict[int, list] = {}
        self.lock = threading.Lock()

    # -- page-locked ranges ------------------------------------------------------------------
    @property
    def pinned_bytes(self) -> int:
        return sum(e - s for s, e in self._ranges.items())

    @property
    def pinned(self) -> int:
        return len(self._ranges)

    def pin(self, address: int, nbytes: int) -> bool:
        """Page-lock ``[address, address + nbytes)``; False (logged) if the backend refuses,
        and the range then works as before (staged copies)."""
        if nbytes <= 0 or address in self._ranges:
            return False
        if self._register is not None:
            try:
                self._register(address, nbytes)
            except Exception as e:  # e.g. out of pinnable memory: correct, only slower
                log.warning("cannot page-lock %d bytes of a region (%s): its copies are "
                            "staged", nbytes, e)
                return False
        self._ranges[address] = address + nbytes
        return True

    def unpin(self, address: int) -> None:
        """Undo :meth:`pin` (call before the range is unmapped): waits for the device's
        queued copies first, under :attr:`lock`."""
        if address not in self._ranges:
            return
        with self.lock:
            try:
                if self._sync is not None:
                    self._sync()
            finally:
                del self._ranges[address]
                if self._unregister is not None:
                    try:
                        self._unregister(address)
                    except Exception as e:  # (the device may be gone at drain)
                        log.warning("unregistering a page-locked region failed: %s", e)

    def covers(self, a: np.ndarray) -> bool:
        """Is all of ``a`` (C-contiguous) inside one page-locked range?"""
        if not self._ranges or not a.flags.c_contiguous:
            return False
        p = a.ctypes.data
        end = p + a.nbytes
        return any(s <= p and end <= e for s, e in self._ranges.items())

    # -- y routes ----------------------------------------------------------------------------
    def route(self, x: np.ndarray, y: np.ndarray | None) -> int:
        """Ask that the call whose activations are ``x`` writes its output into ``y``; returns
        the key for :meth:`unroute` (call it exactly once, when the call is answered). ``y``
        None: the call's y goes the usual way, and no other call on these x bytes gets a
        route meanwhile (every call whose x is in a region says so: else a call with its y in
        the reply could take another call's route)."""
        key = x.ctypes.data
        got = self._routes.get(key)
        if got is None:
            self._routes[key] = [1, None if y is None else (x.shape, x.dtype, y)]
        else:  # two calls on the same x bytes: which launch is whose is unknown
            got[0] += 1
            got[1] = None
        return key

    def unroute(self, key: int) -> None:
        got = self._routes.get(key)
        if got is None:
            return
        got[0] -= 1
        if got[0] <= 0:
            del self._routes[key]

    @property
    def routes(self) -> int:
        return len(self._routes)

    def y_for(self, x: np.ndarray) -> np.ndarray | None:
        """The y routed for exactly this x (address, shape, dtype), or None."""
        if not self._routes:
            return None
        got = self._routes.get(x.ctypes.data)
        if got is None or got[1] is None:
            return None
        shape, dtype, y = got[1]
        if x.shape != shape or x.dtype != dtype:
            return None
        return y

    def output(self, x: np.ndarray, rows: int, out_dtype: np.dtype | None) -> np.ndarray | None:
        """:meth:`y_for` if the backend can write it directly: ``[N, rows]`` of the call's
        out dtype (f32 or f16), C-contiguous, writable and page-locked."""
        y = self.y_for(x)
        if y is None:
            return None
        dt = np.dtype(np.float32) if out_dtype is None else np.dtype(out_dtype)
        if (y.shape != (x.shape[0], rows) or y.dtype != dt or dt.itemsize not in (2, 4)
                or dt.kind != "f" or not y.flags.writeable or not self.covers(y)):
            return None
        return y
