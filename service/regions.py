"""Registered shared-memory regions: the data plane for co-located callers (issue 15).

A caller creates a POSIX shared-memory object, registers (a byte range of) it once under a
name, then names ``(region, offset)`` for a request's activations and/or output instead of
sending bytes. This module maps, checks and releases those regions; it knows nothing of gRPC
(the ``wire*.py`` modules convert, ``servicer.py`` delegates here, the engine sees plain arrays).

Rules, one place each (the .proto comments state them for callers):
- refused unless the worker runs with ``--allow-shm`` (FAILED_PRECONDITION);
- a region belongs to the caller identity that registered it (``auth.caller_identity``):
  another identity gets PERMISSION_DENIED;
- at most ``max_regions`` regions and ``max_bytes`` mapped bytes per worker
  (RESOURCE_EXHAUSTED);
- every access is bounds-checked (``Region.array``), and the object is checked to still exist
  at its registered size (one ``fstat`` per access: unlinked or shrunk is FAILED_PRECONDITION);
- ``unregister`` takes the name away at once and closes the mapping when the requests using
  it finish; ``close`` (drain) closes everything. The caller's object is never unlinked here.

Linux only for system regions (the objects live in /dev/shm). Used from the event loop thread
only, except that arrays handed out are read by the device thread while a request holds
the region (``use``), which keeps the mapping open until then.

Safety note: the worker opens only objects its own user may open (``multiprocessing``
creates them 0600), so a caller that could shrink an object between the size check and the
copy could equally signal the worker; the per-access ``fstat`` catches every shrink that is not
such a deliberate race.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import mmap
import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from q6serve.kernels.api import dtype_name
from q6serve.kernels.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from q6serve.kernels.hostio import HostIO, Route

from . import envvars

log = logging.getLogger("q6serve.regions")

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_KEY = re.compile(r"^/?([A-Za-z0-9._-]{1,255})$")
CUDA_IPC_HANDLE_BYTES = 64
SYSTEM, CUDA = "system", "cuda"
VIEW_CACHE = 64  # cached views per region (Region.array); all dropped when full


@dataclass(frozen=True)
class ShmSource:
    """A POSIX shared-memory object's bytes [offset, offset + byte_size)."""

    key: str
    offset: int
    byte_size: int


@dataclass(frozen=True)
class CudaIpcSource:
    """Bytes [offset, offset + byte_size) of a caller's device allocation on the worker's GPU,
    exported as a cudaIpcMemHandle_t."""

    handle: bytes
    device: int
    byte_size: int
    offset: int = 0


@dataclass(frozen=True)
class RegionRef:
    """Where a tensor lives: ``offset`` bytes into the region called ``region``."""

    region: str
    offset: int


@dataclass(frozen=True)
class RegionView:
    name: str
    kind: str  # SYSTEM or CUDA
    key: str
    offset: int
    byte_size: int
    in_use: int


class Mapping:
    """What a region's bytes are: host memory (system regions) or device memory (CUDA
    regions, service/cuda_regions.py), viewed as arrays, and a liveness check."""

    addr: int | None = None  # a host mapping's first byte (the region's offset 0)

    def view(self, offset: int, nbytes: int, dtype: np.dtype, shape: tuple[int, ...],
             writable: bool) -> Any:
        """``shape`` of ``dtype`` at ``offset`` (bounds checked by the caller): a NumPy array
        of host memory, a CuPy array of device memory."""
        raise NotImplementedError

    def check_alive(self, what: str, name: str | None = None) -> None:
        """Raise FailedPrecondition when the backing object went away or shrank; the message
        names ``what`` (with ``name``: "<what> region '<name>'", formatted only then)."""

    def close(self) -> None:
        raise NotImplementedError


def open_shm_object(key: str) -> tuple[int, os.stat_result]:
    """``SHM_DIR/key`` opened for reading and writing, with its stat: a regular file (NOT_FOUND
    where there is none, FAILED_PRECONDITION where it cannot be opened, INVALID_ARGUMENT where
    it is no plain object). The caller closes the descriptor."""
    try:
        # O_NOFOLLOW: a symlink planted in /dev/shm cannot redirect the worker elsewhere
        fd = os.open(SHM_DIR / key, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFound(f"no shared-memory object {key!r} (in {SHM_DIR})") from None
    except OSError as e:
        raise FailedPrecondition(f"cannot open shared-memory object {key!r}: "
                                 f"{e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise InvalidArgument(f"{key!r} is not a shared-memory object")
    return fd, st


class _ShmMapping(Mapping):
    def __init__(self, src: ShmSource, hostio: HostIO | None = None) -> None:
        m = _KEY.match(src.key)
        if m is None or m.group(1) in (".", ".."):
            raise InvalidArgument(f"shared-memory key {src.key[:64]!r} must be 1..255 "
                                  "characters of [A-Za-z0-9._-] after an optional '/'")
        self.key = m.group(1)
        self.end = src.offset + src.byte_size
        fd, st = open_shm_object(self.key)
        try:
            # another user's object: its owner could shrink it under a call, and the worker's
            # next access to the lost pages is a SIGBUS (the device process dies: session 30)
            if st.st_uid != os.getuid():
                raise InvalidArgument(f"shared-memory object {self.key!r} belongs to uid "
                                      f"{st.st_uid}, not to this worker's user "
                                      f"({os.getuid()}): a region must be its user's")
            if st.st_size < self.end:
                raise InvalidArgument(f"region [{src.offset}, {self.end}) does not fit "
                                      f"shared-memory object {self.key!r} of {st.st_size} "
                                      "bytes")
            start = src.offset - src.offset % mmap.ALLOCATIONGRANULARITY
            self._mm = mmap.mmap(fd, self.end - start, offset=start)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._view = memoryview(self._mm)
        self.buf = self._view[src.offset - start : self.end - start]
        # the region as bytes, writable and read-only: a view is then one ndarray(...) call
        # (np.frombuffer on a slice + reshape cost ~3 us per tensor, twice per request)
        self._rw: np.ndarray | None = np.frombuffer(self.buf, np.uint8)
        self._ro: np.ndarray | None = self._rw.view()
        self._ro.flags.writeable = False
        self.addr = self._rw.ctypes.data
        # page-locked for the device's copies (kernels/hostio.py): the whole mapping, from
        # its page-aligned start; unlocked in close(), before the unmap
        self._hostio, self._pinned = hostio, 0
        if hostio is not None:
            addr = self._rw.ctypes.data - (src.offset - start)
            if hostio.pin(addr, self.end - start):
                self._pinned = addr

    def view(self, offset: int, nbytes: int, dtype: np.dtype, shape: tuple[int, ...],
             writable: bool) -> np.ndarray:
        base = self._rw if writable else self._ro
        if base is None:
            raise FailedPrecondition(f"shared-memory object {self.key!r} is closed")
        return np.ndarray(shape, dtype.newbyteorder("<"), base, offset)

    def check_alive(self, what: str, name: str | None = None) -> None:
        st = os.fstat(self._fd)
        if st.st_nlink and st.st_size >= self.end:
            return  # (per call: no message made)
        if name is not None:
            what = f"{what} region {name!r}"
        if st.st_nlink == 0:
            raise FailedPrecondition(f"{what}: its shared-memory object {self.key!r} was "
                                     "unlinked; unregister the region")
        if st.st_size < self.end:
            raise FailedPrecondition(f"{what}: its shared-memory object {self.key!r} shrank "
                                     f"to {st.st_size} bytes (the region ends at {self.end}); "
                                     "unregister the region")

    def close(self) -> None:
        if self._pinned and self._hostio is not None:
            self._hostio.unpin(self._pinned)  # waits for the device's copies first
            self._pinned = 0
        os.close(self._fd)
        self._rw = self._ro = None  # (the arrays that view self.buf)
        for attempt in range(2):
            try:
                self.buf.release()
                self._view.release()
                self._mm.close()
                return
            except BufferError:
                # an array still views it: typically a failed request's traceback holds the
                # frame with x in a reference cycle. Collect once (rare path) and retry.
                if attempt == 0:
                    gc.collect()
        # still viewed (e.g. a cancelled request's x in a batch): the mapping closes when
        # that array is freed (mmap's own export count); the descriptor is closed already
        log.debug("mapping of %s closes when its last array is freed", self.key)


class CudaPlane(Protocol):
    """CUDA IPC regions on the worker's device (service/cuda_regions.py; None: refused)."""

    def open(self, src: CudaIpcSource) -> Mapping: ...

    async def matmul(self, engine: Any, call: Any, yd: Any) -> Any: ...

    def start(self, engine: Any, call: Any, yd: Any,
              done: Callable[[Any, BaseException | None], None]) -> None: ...


class Region:
    """One registered region; ``users`` requests hold it open."""

    def __init__(self, name: str, owner: str, kind: str, key: str, offset: int,
                 byte_size: int, mapping: Mapping) -> None:
        self.name, self.owner, self.kind = name, owner, kind
        self.key, self.offset, self.byte_size = key, offset, byte_size
        self.mapping = mapping
        self.users = 0
        self.removed = False
        # a region's views by (offset, dtype, shape, writable), bounds-checked once: a lane or
        # front-end caller names the same x and y places call after call, and a view is ~1.6
        # us (NumPy; a CUDA region's CuPy view more) and its checks ~0.6 us, twice per
        # request (CUDA regions: with Q6SERVE_DP_LEAN, session 18's A/B). Dropped before the
        # mapping closes (a cached view would keep it mapped); at most VIEW_CACHE entries.
        self._views: dict[tuple[Any, ...], Any] | None = (
            {} if kind == SYSTEM or envvars.DP_LEAN.read() else None)
        # a fast lane's plans of its repeated requests on this system region (service/lane.py:
        # request fields -> what the first such call settled); dropped with the views, at
        # most VIEW_CACHE entries
        self.plans: dict[tuple[Any, ...], Any] | None = {} if kind == SYSTEM else None

    def view(self) -> RegionView:
        return RegionView(self.name, self.kind, self.key, self.offset, self.byte_size,
                          self.users)

    def span(self, offset: int, dtype: np.dtype, shape: tuple[int, ...], what: str) -> int:
        """Bounds-check a tensor at ``offset``; return its byte count."""
        nbytes = math.prod(shape) * dtype.itemsize  # (Python ints: ~10x np.prod's cost less)
        if offset + nbytes > self.byte_size:
            raise InvalidArgument(f"{what} {list(shape)} {dtype_name(dtype)} ({nbytes} bytes) "
                                  f"at offset {offset} overruns region {self.name!r} of "
                                  f"{self.byte_size} bytes")
        if (self.offset + offset) % dtype.itemsize:
            raise InvalidArgument(f"{what} at offset {offset} of region {self.name!r} is not "
                                  f"aligned to its {dtype.itemsize}-byte elements")
        return nbytes

    def array(self, offset: int, dtype: np.dtype, shape: tuple[int, ...], what: str,
              writable: bool = False, alive: bool = False) -> Any:
        """A little-endian ``shape`` array of ``dtype`` viewing the region at ``offset``
        (NumPy; CuPy for a CUDA region), bounds-checked, after checking the backing object is
        still there (``alive``: the caller checked it in this loop trip: one fstat less).
        A system region hands out the same view again for the same place (the fstat is
        still per call: a shrunk object must be refused, not read)."""
        views = self._views
        if views is None:
            nbytes = self.span(offset, dtype, shape, what)
            if not alive:
                self.mapping.check_alive(what, self.name)
            return self.mapping.view(offset, nbytes, dtype, shape, writable)
        if type(shape) is not tuple:
            shape = tuple(shape)
        key = (offset, dtype, shape, writable)
        a = views.get(key)
        if a is None:
            nbytes = self.span(offset, dtype, shape, what)
        if not alive:
            self.mapping.check_alive(what, self.name)
        if a is None:
            a = self.mapping.view(offset, nbytes, dtype, shape, writable)
            if len(views) >= VIEW_CACHE:
                views.clear()
            views[key] = a
        return a

    def forget_views(self) -> None:
        """Drop the cached views and plans (before the mapping closes)."""
        if self._views:
            self._views.clear()
        if self.plans:
            self.plans.clear()


class RegionTable:
    def __init__(self, allowed: bool, max_regions: int, max_bytes: int,
                 cuda: CudaPlane | None = None, hostio: HostIO | None = None) -> None:
        self.allowed = allowed
        self.max_regions = max_regions
        self.max_bytes = max_bytes
        self.cuda = cuda
        # the backend's page-locked ranges and y routes (system regions; None: plain copies)
        self.hostio = hostio
        self._regions: dict[str, Region] = {}
        self._mapped = 0  # bytes of every region still mapped (removed ones in use included)
        self.on_close: list[Callable[[], None]] = []  # run by close() first (lane.py)
        self._closing: list[Region] = []  # removed, waiting for their users to finish

    def _check_allowed(self) -> None:
        if not self.allowed:
            raise FailedPrecondition("shared-memory regions are off on this worker (start it "
                                     "with --allow-shm)")

    @property
    def mapped_bytes(self) -> int:
        return self._mapped

    def __len__(self) -> int:
        return len(self._regions)

    def register(self, owner: str, name: str, src: ShmSource | CudaIpcSource) -> RegionView:
        self._check_allowed()
        if not _NAME.match(name):
            raise InvalidArgument(f"region name {name[:64]!r} must be 1..128 characters of "
                                  "[A-Za-z0-9._-]")
        if name in self._regions:
            raise AlreadyExists(f"region {name!r} is already registered")
        if src.byte_size < 1:
            raise InvalidArgument(f"region {name!r} needs byte_size >= 1")
        if len(self._regions) + len(self._closing) >= self.max_regions:
            raise ResourceExhausted(f"the worker holds {self.max_regions} regions already "
                                    "(--max-regions)")
        if self._mapped + src.byte_size > self.max_bytes:
            raise ResourceExhausted(f"region {name!r} of {src.byte_size} bytes exceeds the "
                                    f"mapped-bytes limit: {self._mapped} of {self.max_bytes} "
                                    "in use (--max-region-bytes)")
        if isinstance(src, ShmSource):
            mapping: Mapping = _ShmMapping(src, self.hostio)
            kind, key, offset = SYSTEM, src.key, src.offset
        else:
            if self.cuda is None:
                raise InvalidArgument("CUDA IPC regions need the CUDA backend; this worker "
                                      "maps system shared memory only")
            if len(src.handle) != CUDA_IPC_HANDLE_BYTES:
                raise InvalidArgument(f"CUDA IPC handle has {len(src.handle)} bytes, needs "
                                      f"{CUDA_IPC_HANDLE_BYTES}")
            mapping = self.cuda.open(src)
            kind, key, offset = CUDA, "", src.offset
        region = Region(name, owner, kind, key, offset, src.byte_size, mapping)
        self._regions[name] = region
        self._mapped += src.byte_size
        log.info("registered %s region %s: %d bytes (%s)", kind, name, src.byte_size,
                 key or "device buffer")
        return region.view()

    def _owned(self, owner: str, name: str) -> Region:
        self._check_allowed()
        region = self._regions.get(name)
        if region is None:
            raise NotFound(f"no region {name[:128]!r} is registered")
        if region.owner != owner:
            raise PermissionDenied(f"region {name!r} belongs to another caller")
        return region

    def unregister(self, owner: str, name: str) -> RegionView:
        region = self._owned(owner, name)
        del self._regions[name]
        region.removed = True
        view = region.view()
        if region.users == 0:
            self._release(region)
        else:
            self._closing.append(region)
        log.info("unregistered region %s", name)
        return view

    def list(self, owner: str) -> list[RegionView]:
        self._check_allowed()
        return [r.view() for n, r in sorted(self._regions.items()) if r.owner == owner]

    @contextlib.contextmanager
    def use(self, owner: str, ref: RegionRef | None) -> Iterator[Region | None]:
        """Hold ``ref``'s region open for one request (None in, None out)."""
        region = self.hold(owner, ref)
        try:
            yield region
        finally:
            self.let_go(region)

    def hold(self, owner: str, ref: RegionRef | None) -> Region | None:
        """:meth:`use` without a with-block (a request answered from a callback): ``ref``'s
        region stays open until :meth:`let_go` (None in, None out)."""
        if ref is None:
            return None
        region = self._owned(owner, ref.region)
        region.users += 1
        return region

    def hold_name(self, owner: str, name: str) -> Region:
        """:meth:`hold` of the region called ``name`` (no RegionRef made: per call of the
        device process's region calls)."""
        region = self._owned(owner, name)
        region.users += 1
        return region

    def let_go(self, region: Region | None) -> None:
        """The end of one :meth:`hold`."""
        if region is None:
            return
        region.users -= 1
        if region.removed and region.users == 0:
            self._closing.remove(region)
            self._release(region)

    def _release(self, region: Region) -> None:
        region.forget_views()
        region.mapping.close()
        self._mapped -= region.byte_size

    # -- y straight from the device (kernels/hostio.py) --------------------------------------
    def route(self, x: np.ndarray, y: np.ndarray | None, x_addr: int | None = None,
              y_addr: int | None = None) -> Route | None:
        """Ask the backend to write the output of the call on ``x`` (a system region's view)
        into ``y`` (a system region's writable view; None: y comes back in the reply, and no
        other call on these x bytes is routed meanwhile); returns the key for :meth:`unroute`
        (None: nothing routed). ``x_addr`` / ``y_addr``: their addresses, if known
        (``Mapping.addr`` plus the offset: ``HostIO.route``)."""
        if self.hostio is None:
            return None
        return self.hostio.route(x, y, x_addr, y_addr)

    def unroute(self, key: Route | None) -> bool:
        """The end of ``key``'s call: whether the backend wrote its y into the y region."""
        if key is not None and self.hostio is not None:
            return self.hostio.unroute(key)
        return False

    def close(self) -> None:
        """Drain: close every region (requests are over by now)."""
        for fn in self.on_close:
            with contextlib.suppress(Exception):
                fn()
        self.on_close.clear()
        for region in [*self._regions.values(), *self._closing]:
            with contextlib.suppress(Exception):
                self._release(region)
        if self._regions:
            log.info("closed %d shared-memory regions", len(self._regions))
        self._regions.clear()
        self._closing.clear()


def pin_regions(env: Any = None) -> bool:
    """Page-lock system regions for the device's copies (``Q6SERVE_PIN_REGIONS``, default 1;
    0: x is staged and y copied on the host, as before)."""
    return bool(envvars.PIN_REGIONS.read(env))


def table_for(allowed: bool, max_regions: int, max_bytes: int, backend: Any,
              engine: Any) -> RegionTable:
    """The worker's table: CUDA IPC regions too where the backend can open them; system
    regions page-locked where the backend DMAs host memory (``backend.hostio``)."""
    from .cuda_regions import support  # imports this module

    hostio = getattr(backend, "hostio", None) if pin_regions() else None
    return RegionTable(allowed, max_regions, max_bytes, support(backend, engine), hostio)


def written(y: Any, dest: np.ndarray) -> bool:
    """Is the reply's ``y`` the bytes of ``dest`` already (the backend wrote it there)?"""
    return (isinstance(y, np.ndarray) and y.shape == dest.shape and y.dtype == dest.dtype
            and y.ctypes.data == dest.ctypes.data)


def place_y(yr: Region, y_off: int, y: np.ndarray, dest: np.ndarray, taken: bool) -> None:
    """A system-region call's ``y`` into its region at ``y_off``, unless it is there already:
    the backend took the route to ``dest`` (``taken``, from :meth:`RegionTable.unroute`) or
    returned ``dest``'s own bytes."""
    if not taken and not written(y, dest):
        yr.array(y_off, y.dtype, y.shape, "y", writable=True)[...] = y


@dataclass(frozen=True)
class RegionIO:
    """The region side of one matmul request: where x is read and/or y written."""

    x: RegionRef | None
    x_dtype: np.dtype | None  # x's dtype and shape as the request states them (x in a region)
    x_shape: tuple[int, int] | None
    y: RegionRef | None


@dataclass(frozen=True)
class YSpec:
    """What a reply says of a y written to a region: dtype and shape, no bytes."""

    dtype: np.dtype
    shape: tuple[int, ...]


class _MatmulEngine(Protocol):
    def get(self, name: str) -> Any: ...

    async def matmul(self, call: Any) -> Any: ...


async def matmul(table: RegionTable, engine: _MatmulEngine, owner: str, io: RegionIO,
                 make_call: Callable[[Any], Any]) -> Any:
    """Run one matmul whose x and/or y live in regions. ``make_call(x)`` builds the engine's
    MatmulCall (x: the region's view, or None to decode the request's bytes). Every check runs
    before the request is queued, y's bounds included, so a bad region costs no device work;
    y is written (bounds checked again) after the device finishes. With a CUDA region on
    either side the call runs on the device end to end (service/cuda_regions.py). Returns
    the engine's reply; when y went to a region, its y is a YSpec (dtype and shape only)."""
    with table.use(owner, io.x) as xr, table.use(owner, io.y) as yr:
        # the arrays viewing the regions live in _run's frame only, which is gone when the
        # regions are let go (an unregistered region unmaps right then)
        return await _run(table, engine, io, xr, yr, make_call)


async def _run(table: RegionTable, engine: _MatmulEngine, io: RegionIO, xr: Region | None,
               yr: Region | None, make_call: Callable[[Any], Any]) -> Any:
    x = None
    if xr is not None:
        assert io.x is not None and io.x_dtype is not None and io.x_shape is not None
        x = xr.array(io.x.offset, io.x_dtype, io.x_shape, "x")
    call = make_call(x)
    shape = None
    if yr is not None:
        assert io.y is not None
        shape = (int(call.x.shape[0]), engine.get(call.weight).rows)
        yr.span(io.y.offset, call.out_dtype, shape, "y")
    if CUDA in (xr and xr.kind, yr and yr.kind):
        assert table.cuda is not None  # a CUDA region exists only where it is set
        yd = None
        if yr is not None and yr.kind == CUDA:
            assert io.y is not None and shape is not None
            yd = yr.array(io.y.offset, call.out_dtype, shape, "y", writable=True)
        reply = await table.cuda.matmul(engine, call, yd)
    elif yr is not None:  # a system region: the backend may write y there itself
        assert io.y is not None and shape is not None
        dest = yr.array(io.y.offset, call.out_dtype, shape, "y", writable=True)
        key = table.route(call.x, dest)
        try:
            reply = await engine.matmul(call)
        finally:
            table.unroute(key)
        if written(reply.y, dest):
            return dataclasses.replace(reply, y=YSpec(np.dtype(call.out_dtype), shape))
    elif xr is not None:  # x in a system region, y in the reply: no other call's y route
        key = table.route(call.x, None)
        try:
            reply = await engine.matmul(call)
        finally:
            table.unroute(key)
    else:
        reply = await engine.matmul(call)
    if yr is None:
        return reply
    assert io.y is not None and shape is not None
    if yr.kind == SYSTEM:
        y = reply.y
        yr.array(io.y.offset, y.dtype, y.shape, "y", writable=True)[...] = y
    return dataclasses.replace(reply, y=YSpec(np.dtype(call.out_dtype), shape))
