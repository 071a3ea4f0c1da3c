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
back in the reply), so that no call can take another's route. The key :meth:`route` returns
is the call's :class:`Route`: :meth:`unroute` says whether the backend took its y (then the
bytes are in the y region: no check of the reply's y needed). The route of the very x array
object routed is found by identity first (``ndarray.ctypes`` costs ~2 us, and a region call
asked for addresses ~5 times: route, covers twice, y_for, covers of y).

A call the service will repeat at the same places (a fast lane's request, service/lane.py)
marks its route ``want``: a backend that took the route may leave in ``Route.call`` an object
whose ``launch()`` repeats the call with everything settled (the CUDA backend's ``RegionCall``:
x's copy, the kernels and y's copy as one graph launch), valid while its ``live()``; each
unpin bumps :attr:`HostIO.epoch`, which such an object checks.

Thread safety: pins and routes change on the event loop; launches may run on the device
thread. :attr:`lock` is held by the backend from "is x pinned?" to the end of enqueueing its
copies, and by :meth:`unpin` around "wait for the stream, unregister", so a range is never
unregistered under a copy that was enqueued while it was pinned.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable

import numpy as np

log = logging.getLogger("q6serve.hostio")

Register = Callable[[int, int], None]  # (address, bytes): page-lock, raise on failure
Unregister = Callable[[int], None]  # (address)
Sync = Callable[[], None]  # wait for every copy the device has queued


class Route:
    """One call's y route (what :meth:`HostIO.route` returns; give it to :meth:`HostIO.unroute`
    once): ``taken`` once the backend took its y (:meth:`HostIO.output`)."""

    __slots__ = ("addr", "call", "taken", "want", "x", "x_in", "y", "y_addr", "y_in")

    def __init__(self, addr: int, x: np.ndarray, y: np.ndarray | None,
                 y_addr: int | None = None) -> None:
        self.addr, self.x, self.y, self.y_addr = addr, x, y, y_addr
        self.taken = False
        # ``want``: the caller will make this call again with x and y at these places (a
        # fast lane's region slots): a backend that took the route may leave in ``call`` an
        # object whose ``launch()`` repeats the call with its settled path (the CUDA
        # backend's RegionCall: one graph launch), valid while its ``live()``
        self.want = False
        self.call: object | None = None
        self.x_in: bool | None = None  # covers(x) / covers(y), once asked (None: not yet)
        self.y_in: bool | None = None


class HostIO:
    """Page-locked host ranges of one backend and the y routes of the calls in flight.

    ``register`` None: ranges are only recorded (the NumPy backend, tests), which is what the
    routes and the accounting need; a backend that cannot DMA ignores them."""

    def __init__(self, register: Register | None = None, unregister: Unregister | None = None,
                 sync: Sync | None = None) -> None:
        self._register, self._unregister, self._sync = register, unregister, sync
        self._ranges: dict[int, int] = {}  # start address -> end address
        # the starts, sorted: a range covering an address is the last one starting at or
        # before it (ranges are distinct mappings, never overlapping), found by bisection
        # rather than a walk over every region's range (T3's 32 lanes: ~9% of the loop)
        self._starts: list[int] = []
        # x address -> [calls routing it, its Route or None once ambiguous]
        self._routes: dict[int, list] = {}
        self._by_id: dict[int, Route] = {}  # id(x) -> an unambiguous route of that x object
        self.lock = threading.Lock()
        # bumped by every unpin: what a backend bound to page-locked addresses (a route's
        # ``call``) stays valid only while the epoch it saw lasts
        self.epoch = 0

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
        bisect.insort(self._starts, address)
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
                self.epoch += 1
                del self._ranges[address]
                self._starts.remove(address)
                for r in self._by_id.values():  # what routes knew of the ranges is stale
                    r.x_in = r.y_in = None
                if self._unregister is not None:
                    try:
                        self._unregister(address)
                    except Exception as e:  # (the device may be gone at drain)
                        log.warning("unregistering a page-locked region failed: %s", e)

    def covers(self, a: np.ndarray) -> bool:
        """Is all of ``a`` (C-contiguous) inside one page-locked range?"""
        if not self._ranges:
            return False
        r = self._by_id.get(id(a))
        if r is not None and r.x is a:  # a routed x (the object): asked once per route
            if r.x_in is None:
                r.x_in = self._covers(a, r.addr)
            return r.x_in
        return self._covers(a)

    def _covers(self, a: np.ndarray, p: int | None = None) -> bool:
        if not a.flags.c_contiguous:
            return False
        return self.covers_range(a.ctypes.data if p is None else p, a.nbytes)

    def covers_range(self, p: int, nbytes: int) -> bool:
        """Is ``[p, p + nbytes)`` inside one page-locked range?"""
        i = bisect.bisect_right(self._starts, p)
        return i > 0 and p + nbytes <= self._ranges[self._starts[i - 1]]

    # -- y routes ----------------------------------------------------------------------------
    def route(self, x: np.ndarray, y: np.ndarray | None, x_addr: int | None = None,
              y_addr: int | None = None) -> Route:
        """Ask that the call whose activations are ``x`` writes its output into ``y``; returns
        the key for :meth:`unroute` (call it exactly once, when the call is answered). ``y``
        None: the call's y goes the usual way, and no other call on these x bytes gets a
        route meanwhile (every call whose x is in a region says so: else a call with its y in
        the reply could take another call's route). ``x_addr`` / ``y_addr``: their first
        bytes' addresses where the caller knows them (``ndarray.ctypes`` costs ~2.7 us)."""
        r = Route(x.ctypes.data if x_addr is None else x_addr, x, y, y_addr)
        got = self._routes.get(r.addr)
        if got is None:
            self._routes[r.addr] = [1, None if y is None else r]
            if y is not None:
                self._by_id[id(x)] = r
        else:  # two calls on the same x bytes: which launch is whose is unknown
            got[0] += 1
            if got[1] is not None:
                self._by_id.pop(id(got[1].x), None)
            got[1] = None
        return r

    def unroute(self, key: Route) -> bool:
        """The end of ``key``'s call; whether the backend took its y (wrote it there)."""
        got = self._routes.get(key.addr)
        if got is not None:
            got[0] -= 1
            if got[0] <= 0:
                del self._routes[key.addr]
        if self._by_id.get(id(key.x)) is key:
            del self._by_id[id(key.x)]
        return key.taken

    @property
    def routes(self) -> int:
        return len(self._routes)

    def _route_of(self, x: np.ndarray) -> Route | None:
        """The unambiguous route for exactly this x (address, shape, dtype), or None."""
        if not self._routes:
            return None
        r = self._by_id.get(id(x))
        if r is not None and r.x is x:
            got = self._routes.get(r.addr)
            return r if got is not None and got[1] is r else None
        got = self._routes.get(x.ctypes.data)
        if got is None or got[1] is None:
            return None
        r = got[1]
        if x.shape != r.x.shape or x.dtype != r.x.dtype:
            return None
        return r

    def y_for(self, x: np.ndarray) -> np.ndarray | None:
        """The y routed for exactly this x (address, shape, dtype), or None."""
        r = self._route_of(x)
        return None if r is None else r.y

    def output(self, x: np.ndarray, rows: int, out_dtype: np.dtype | None) -> np.ndarray | None:
        """:meth:`y_for` if the backend can write it directly: ``[N, rows]`` of the call's
        out dtype (f32 or f16), C-contiguous, writable and page-locked. A y returned here is
        taken (:meth:`unroute` says so): the backend writes it."""
        r = self.take(x, rows, out_dtype)
        return None if r is None else r.y

    def take(self, x: np.ndarray, rows: int, out_dtype: np.dtype | None) -> Route | None:
        """:meth:`output`, returning the route taken (its ``y``; its ``want`` and ``call``)."""
        r = self._route_of(x)
        if r is None or (y := r.y) is None:
            return None
        dt = np.dtype(np.float32) if out_dtype is None else np.dtype(out_dtype)
        if (y.shape != (x.shape[0], rows) or y.dtype != dt or dt.itemsize not in (2, 4)
                or dt.kind != "f" or not y.flags.writeable):
            return None
        if r.y_in is None:
            r.y_in = self._covers(y, r.y_addr)
        if not r.y_in:
            return None
        r.taken = True
        return r
