"""The per-backend buffers every launch uses, allocated once and grown to the largest call
(kernels/cuda/launch.py, point 1): device buffers by name, and per launch slot a pinned host
buffer for x, one for small outputs and the slot's completion event; a large y's pinned blocks
(:meth:`Workspace.y_block`, ``Y_BLOCKS``); write-combined staging (``STAGING_WC_MIN``). Any
growth bumps ``Workspace.gen``: bound sequences hold raw pointers and rebind.

Built by ``launcher.Launcher`` (``Launcher.ws``); the cached calls (bound_call.py, many.py,
region_call.py) take its slots. The settings it reads are launch.py's, read there per call."""

from __future__ import annotations

import contextlib
import ctypes
import sys
from typing import Any

import numpy as np

from ..errors import DeviceError
from . import launch


def _free_refs() -> int:
    """sys.getrefcount of a list's item nothing else holds, read as ``Workspace.y_block``
    reads it (measured, not assumed: interpreters count borrowed references differently)."""
    held = [np.empty(0)]
    return sys.getrefcount(held[0])


_FREE_REFS = _free_refs()


class Workspace:
    """Per-backend device buffers by name and, per launch slot, a pinned host buffer for x and
    one for small outputs, grown to the largest call. Any growth bumps ``gen``: bound
    sequences hold raw pointers and rebind. Device buffers are shared by the slots: the
    stream orders every use of them."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.gen = 0
        self._dev: dict[str, Any] = {}
        self._host: list[Any] = [None] * launch.SLOTS  # per slot: (pinned memory, uint8 view)
        self._host_wc: list[Any] = [None] * launch.SLOTS  # the same, write-combined
        self._wc_min = launch.STAGING_WC_MIN  # the setting the buffers handed out so far followed
        self._out: list[Any] = [None] * launch.SLOTS  # the same for small outputs (SMALL_Y)
        self._yb: list[np.ndarray] = []  # large y's pinned blocks (Y_BLOCKS; uint8, whole)
        self._yb_ptr: list[int] = []  # their addresses (ndarray.ctypes costs ~4 us)
        self._held = [False] * launch.SLOTS  # launched, its wait not yet called
        self._done: list[Any] = [None] * launch.SLOTS  # per slot: event recorded after its launch
        self.staged: np.ndarray | None = None  # the last view CudaBackend.staging handed out
        self.staged_slot = 0

    def first_free(self) -> int:
        """The first slot whose wait was called, or -1 while every slot awaits its wait."""
        held = self._held
        for s in range(launch.SLOTS):
            if not held[s]:
                return s
        return -1

    def free_slot(self) -> int:
        """The slot the next launch takes (the first whose wait was called)."""
        s = self.first_free()
        if s >= 0:
            return s
        raise DeviceError(f"more than {launch.SLOTS} launches in flight on one device: wait for "
                          "one before launching another")

    def take(self, slot: int) -> None:
        self._held[slot] = True

    def held(self, slot: int) -> bool:
        """Whether a launch in ``slot`` still awaits its wait."""
        return self._held[slot]

    def release(self, slot: int) -> None:
        self._held[slot] = False

    def busy(self, slot: int) -> bool:
        """Whether a launch other than ``slot``'s is in flight (launched, not waited for)."""
        held = self._held
        return sum(held) > held[slot]

    def done_event(self, slot: int) -> Any:
        """The slot's completion event (recorded after each launch's last operation)."""
        ev = self._done[slot]
        if ev is None:
            ev = self._done[slot] = self.ctx.cp.cuda.Event(disable_timing=True)
        return ev

    @staticmethod
    def _grown(old: int, need: int) -> int:
        return 2 * old if need <= 2 * old <= need + launch.GROW_SLACK else need

    def ptr(self, name: str, nbytes: int, zero: bool = False, bound: bool = True) -> int:
        """Device address of buffer ``name`` holding at least ``nbytes`` (call under the
        backend's device and stream: the pool is stream-ordered, so a replaced buffer is
        reused only after the work queued on it). ``bound``: bound sequences may hold it."""
        buf = self._dev.get(name)
        if buf is None or buf.nbytes < nbytes:
            size = self._grown(0 if buf is None else buf.nbytes, max(nbytes, 512))
            cp = self.ctx.cp
            buf = cp.zeros(size, cp.uint8) if zero else cp.empty(size, cp.uint8)
            self._dev[name] = buf
            self.gen += bound
        return int(buf.data.ptr)

    def array(self, name: str, shape: tuple[int, ...], dtype: Any, bound: bool = True) -> Any:
        """A CuPy view of buffer ``name`` (grown to fit)."""
        cp = self.ctx.cp
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        self.ptr(name, nbytes, bound=bound)
        return cp.ndarray(shape, dtype, memptr=self._dev[name].data)

    def host(self, nbytes: int, slot: int = 0) -> np.ndarray:
        """The slot's pinned staging buffer for x (uint8, at least ``nbytes``): from
        ``STAGING_WC_MIN`` bytes on a write-combined one of its own."""
        wc = launch.STAGING_WC_MIN
        if wc != self._wc_min:  # (a bench's variants: sequences bound to the other rebind)
            self._wc_min = wc
            self.gen += 1
        if wc and nbytes >= wc:
            self._host_wc[slot] = self._pinned(self._host_wc[slot], nbytes, True)
            return self._host_wc[slot][1]
        self._host[slot] = self._pinned(self._host[slot], nbytes)
        return self._host[slot][1]

    def host_out(self, nbytes: int, slot: int = 0) -> np.ndarray:
        """The slot's pinned buffer small outputs are downloaded into (uint8, >= ``nbytes``)."""
        self._out[slot] = self._pinned(self._out[slot], nbytes)
        return self._out[slot][1]

    def y_block(self, nbytes: int) -> tuple[int, np.ndarray]:
        """A pinned block for a large y of ``nbytes``: (its address, a uint8 array of exactly
        ``nbytes`` over it, to be viewed as y and handed out). The first kept block no array
        refers to any more (every view of a block has its whole array as base) and large
        enough; else a free one too small is replaced by one grown to ``nbytes``, or a new one
        is kept while fewer than ``Y_BLOCKS`` are; else (all in use) a block from CuPy's pool
        for this call only. Call under the backend's device."""
        blocks, free = self._yb, _FREE_REFS
        small = -1
        for i in range(len(blocks)):
            if sys.getrefcount(blocks[i]) == free:
                if blocks[i].size >= nbytes:
                    return self._yb_ptr[i], blocks[i][:nbytes]
                small = i if small < 0 else small
        if small < 0 and len(blocks) >= launch.Y_BLOCKS:  # every kept block in use (or Y_BLOCKS 0)
            mem = self.ctx.cp.cuda.alloc_pinned_memory(nbytes)
            return int(mem.ptr), np.frombuffer(mem, np.uint8, nbytes)
        mem = self.ctx.cp.cuda.alloc_pinned_memory(nbytes)
        arr = np.frombuffer(mem, np.uint8, nbytes)
        if small < 0:
            blocks.append(arr)
            self._yb_ptr.append(int(mem.ptr))
        else:
            blocks[small], self._yb_ptr[small] = arr, int(mem.ptr)
        return int(mem.ptr), arr[:nbytes]

    def _pinned(self, have: Any, nbytes: int, wc: bool = False) -> tuple[Any, np.ndarray]:
        if have is not None and have[1].size >= nbytes:
            return have
        size = self._grown(0 if have is None else have[1].size, nbytes)
        self.gen += 1
        if wc:
            mem = _WriteCombined(self.ctx.cp.cuda.runtime, size)
            return mem, mem.array()
        mem = self.ctx.cp.cuda.alloc_pinned_memory(size)
        return mem, np.frombuffer(mem, np.uint8, size)

    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self._dev.values())

    def clear(self) -> None:
        self._dev.clear()
        self._host, self._out = [None] * launch.SLOTS, [None] * launch.SLOTS
        self._host_wc = [None] * launch.SLOTS
        self._yb, self._yb_ptr = [], []
        self._held, self._done = [False] * launch.SLOTS, [None] * launch.SLOTS
        self.staged = None
        self.gen += 1


class _WriteCombined:
    """Page-locked, write-combined host memory (``cudaHostAlloc(..., WriteCombined |
    Portable)``) as a NumPy uint8 array: the CPU's stores to it bypass its caches (as
    non-temporal stores do) and the GPU's DMA reads it without snooping them; CPU reads of it
    are uncached (slow). Freed once neither it nor any array of it is left (the arrays keep it:
    their base holds it)."""

    def __init__(self, rt: Any, size: int) -> None:
        self._rt, self.size = rt, size
        self.ptr = int(rt.hostAlloc(size, 5))  # cudaHostAllocWriteCombined | Portable

    def array(self) -> np.ndarray:
        """A uint8 array of all of it, which keeps it (no reference back: NumPy's ``base``
        is not seen by the cycle collector, so a cycle through it would never be freed)."""
        raw = (ctypes.c_uint8 * self.size).from_address(self.ptr)
        raw._owner = self  # type: ignore[attr-defined]
        return np.frombuffer(raw, np.uint8)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # (interpreter shutdown, a lost device)
            self._rt.freeHost(self.ptr)
