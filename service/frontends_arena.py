"""A front end's arena: fixed slots of POSIX shared memory that carry a matmul's x to the
device process and its y back (service/frontends.py). The front end creates it
(service/frontends_front.py), the device process maps it (``FrontendsWorker._hello``) and may
page-lock it for the device's copies.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import secrets
import sys

import numpy as np

from q6serve.kernels.errors import InvalidArgument, Unavailable
from q6serve.kernels.hostio import HostIO

from .regions import SHM_DIR

SLOT_BYTES = 4 << 20  # one matmul's x, then its y; bigger ones travel in the message
_LITTLE = sys.byteorder == "little"


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
