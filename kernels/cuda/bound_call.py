"""A repeated call's whole host path once its bound sequence is a captured graph
(kernels/cuda/launch.py, point 6): :class:`BoundCall`, made by ``Launcher.bound_call`` and
cached on the weight by ``CudaBackend.launch`` (kernels/cuda_backend.py), which finds it by
(x's shape, slot) and the identity of its arguments first (``HOT_CALLS``). Its launch is x's
fill into the slot's staging buffer (launch.py's ``stage_into``), the graph launch, y's way out
and the slot's event; its wait the sync, the kernel time and the result."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .. import cuda_topk
from ..api import BFLOAT16, KernelTiming, Launched, Layout, MatmulResult, Precision
from ..errors import DeviceError
from . import launch
from .driver import _D2H
from .sequence import Bound
from .storage import CudaWeight

if TYPE_CHECKING:
    from .launcher import Launcher



class BoundCall:
    """A call's whole host path once its bound sequence is a captured graph
    (:meth:`Launcher.bound_call`; cached on the weight by ``CudaBackend.launch`` per (x's shape
    and dtype, precision, flags, out dtype, top-k, launch slot)): x into the slot's staging
    buffer unless built there, the graph launch, y's way out unless the graph downloads it,
    the slot's completion event; after the sync the kernel time and the result. The plan, the
    binding, the dispatch and the checks of the key were settled by the call that made it;
    :meth:`live` says whether the binding still holds (the workspace did not grow, the graph
    was not dropped)."""

    __slots__ = ("_elapsed", "_memcpy", "asked", "b", "bf16", "big", "chunked", "chunks",
                 "dev", "done", "dtype", "flags", "half", "host", "kernel", "layout", "lc", "n",
                 "nbytes", "out", "out_dtype", "precision", "rows", "slot", "stream", "topk",
                 "ws", "x_bytes", "xv", "y", "y16")

    def __init__(self, lc: Launcher, b: Bound, slot: int, n: int, rows: int,
                 out_dtype: np.dtype | None, topk: int, kernel: str, layout: Layout,
                 precision: Precision, dtype: np.dtype | None = None, chunks: int = 0) -> None:
        cp = lc.ctx.cp
        # what same() compares (hot() sets the caller's objects); the chunk state it was
        # launched with (Launcher.chunks_for, read again per call) and its x's bytes
        self.asked: Any = None
        self.flags: Any = None
        self.out_dtype, self.dtype, self.chunks = out_dtype, dtype, chunks
        self.x_bytes = b.x_bytes
        self.lc, self.b, self.ws, self.slot = lc, b, lc.ws, slot
        self.stream, self.dev = lc.ctx.stream, lc.ctx.dev
        self.done = lc.ws.done_event(slot)
        self.host = lc.ws.host(b.x_bytes, slot)
        self.xv: np.ndarray | None = None  # x's place in it, typed (stage_into)
        self.out = None if b.extra["out"] is None else b.extra["out"][1]  # in-graph download
        self.topk, self.rows, self.n, self.y = topk, rows, n, b.extra["y"]
        self.y16 = b.extra.get("y16")  # y's f16 conversion bound into the graph (y16_graph)
        dt = np.dtype(np.float32) if out_dtype is None else np.dtype(out_dtype)
        self.half, self.bf16 = dt == np.float16, dt == BFLOAT16
        self.big = self.out is None  # y DMA'd into a pinned block that becomes the result
        self.chunked = bool(b.extra.get("copies"))  # ... part by part (Launcher._chunks_out)
        self.nbytes = n * rows * (2 if self.half else 4)
        self.kernel, self.layout, self.precision = kernel, layout, precision
        self._memcpy = cp.cuda.runtime.memcpyAsync
        self._elapsed = cp.cuda.get_elapsed_time

    def live(self) -> bool:
        # (the row chunks' setting is part of its key: CudaBackend's _call_key)
        return (self.b.gen == self.ws.gen and bool(self.b.graph)
                and (not self.topk or cuda_topk.bindable()))

    def hot(self, precision: Precision, flags: Any, out_dtype: Any) -> BoundCall:
        """This call, to be found by (x's shape, slot) in its weight's plans
        (``CudaBackend.launch``): ``same`` holds for these very objects from now on (the call
        was found under its key with them, so they equal what made it)."""
        self.asked, self.flags, self.out_dtype = precision, flags, out_dtype
        return self

    def same(self, cw: CudaWeight, precision: Precision, flags: Any, out_dtype: Any,
             topk: int, dtype: np.dtype) -> bool:
        """Whether a call of this x shape in this slot is this one, by identity of its
        arguments (an equal but other object: False, and the keyed lookup decides), with the
        chunk state the launcher gives it now (``Launcher.chunks_for``, as the key holds it),
        while :meth:`live`."""
        b = self.b
        return (precision is self.asked and flags is self.flags and out_dtype is self.out_dtype
                and topk == self.topk and dtype is self.dtype and b.gen == self.ws.gen
                and bool(b.graph) and (not topk or cuda_topk.bindable())
                and self.lc.chunks_for(cw, self.slot, self.n * self.rows, self.x_bytes,
                                       self.n) == self.chunks)

    def launch(self, x: np.ndarray | None = None) -> Launched:
        """Launch (``x``: copied into the slot's staging buffer first; None: built there)."""
        ws, slot, stream = self.ws, self.slot, self.stream
        if ws._held[slot]:
            raise DeviceError("x was staged in a buffer a launch in flight still uses")
        if x is not None:
            launch.stage_into(self, x)
        ws._held[slot] = True
        try:
            with self.dev:
                self.b.graph.launch(stream)
                y = None
                if self.big:
                    src = self.y
                    if self.y16 is not None:  # converted by the graph
                        src = self.y16
                    elif self.half:  # (a CuPy conversion: on the backend's stream)
                        with stream:
                            src = self.lc._y_out(src, self.n, self.rows, True)
                    ptr, blk = ws.y_block(self.nbytes)
                    y = blk.view(np.float16 if self.half else np.float32).reshape(
                        self.n, self.rows)
                    if self.chunked:
                        self.lc._chunks_out(self.b, ptr)
                    else:
                        self._memcpy(ptr, src, self.nbytes, _D2H, stream.ptr)
                self.done.record(stream)
        except BaseException:
            ws._held[slot] = False
            raise
        return Launched(lambda: self._wait(y))

    def _wait(self, y: np.ndarray | None) -> MatmulResult:
        top = None
        try:
            self.done.synchronize()
            try:
                seconds = self._elapsed(self.b.start, self.b.end) / 1e3
            except Exception:  # its event nodes did not record: direct launches from now
                seconds, self.b.graph = None, False
            if self.topk:  # (a copy: the buffer is the slot's, and unpack may return views)
                top = cuda_topk.unpack(self.out.copy(), self.topk)
            elif y is None:
                y = self.out.copy()  # the buffer is reused
            elif self.bf16:
                y = y.astype(BFLOAT16)
        finally:
            self.ws._held[self.slot] = False
        return MatmulResult(y, self.kernel, self.layout, self.precision,
                            KernelTiming(host_seconds=seconds), topk=top)
