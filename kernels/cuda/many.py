"""A multi-weight call: one x, several weights of its K (q/k/v, gate/up), one launch sequence
(kernels/cuda/launch.py, point 9). :class:`ManyLaunches` (one of the parts
``launcher.Launcher`` is made of) binds and runs it (``Launcher.launch_many``, called by
``CudaBackend.launch_many``); :class:`ManyBound` is the bound sequence, :class:`ManyCall` its
cached whole host path once captured (cached in every part's plans by
``CudaBackend.launch_many``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..api import (
    BFLOAT16,
    KernelTiming,
    LaunchedMany,
    Layout,
    MatmulResult,
    Precision,
    ResidentWeight,
)
from ..errors import DeviceError
from . import launch
from .dispatch import Cfg
from .driver import _D2H, _H2D
from .plans import Step
from .storage import CudaWeight

if TYPE_CHECKING:
    from .launcher import Launcher



@dataclass
class ManyBound:
    """A multi-weight call's launch sequence (:meth:`Launcher.launch_many`) bound to one
    workspace generation: x's upload, each part's launches (:meth:`Launcher.steps`) with an
    event before the first part, between parts and after the last (part i's kernel time is
    events i .. i + 1), every part's f32 y adjacent in the workspace's "y" (part i at
    N x (rows of the parts before it)), then y's f16 conversion and, for a small y, its one
    download into the slot's pinned out buffer. Kept in every part's ``CudaWeight.plans``
    under its key: it holds no weight, and is live while each part's plans still hold it
    (a relayout or a freed weight ends it)."""

    gen: int
    x_bytes: int
    steps: list[Step]
    events: list[Any]
    xd: int
    y: int  # the workspace's f32 y of all parts
    y16: int  # its f16 conversion ("y16b"), 0 for none
    out: np.ndarray | None  # the slot's pinned out buffer (a small y), flat, host dtype
    rows: tuple[int, ...]
    n: int
    counts: tuple[int, ...]  # each part's steps, in order
    calls: int = 0
    graph: Any = None  # cupy Graph once captured; False once capture was refused


class ManyCall:
    """A multi-weight call's whole host path once its :class:`ManyBound` is a captured graph
    (cached by ``CudaBackend.launch_many`` in its first weight's plans per (weights, x's shape
    and dtype, precision, flags, out dtype, slot), and in every part's plans under itself): x
    into the slot's staging buffer unless built there, the graph launch, y's one copy into a
    pinned block (``Workspace.y_block``) unless the graph downloads it, the slot's completion
    event; after the sync each part's kernel time and result."""

    __slots__ = ("_elapsed", "_memcpy", "b", "bf16", "dev", "done", "host", "key",
                 "lc", "parts", "slot", "stream", "ws", "x_bytes", "xv")

    def __init__(self, lc: Launcher, b: ManyBound, slot: int, key: tuple,
                 parts: list[tuple[str, Layout, Precision]], out_dtype: np.dtype | None) -> None:
        cp = lc.ctx.cp
        self.lc, self.b, self.ws, self.slot, self.key = lc, b, lc.ws, slot, key
        self.stream, self.dev = lc.ctx.stream, lc.ctx.dev
        self.done = lc.ws.done_event(slot)
        self.host = lc.ws.host(b.x_bytes, slot)
        self.x_bytes, self.xv = b.x_bytes, None  # (stage_into)
        self.parts = parts
        self.bf16 = out_dtype is not None and np.dtype(out_dtype) == BFLOAT16
        self._memcpy = cp.cuda.runtime.memcpyAsync
        self._elapsed = cp.cuda.get_elapsed_time

    def live(self, weights: Any) -> bool:
        """Whether it still holds for ``weights`` (the call's, the first of which held it under
        its key): the workspace did not grow, the graph stands, and every part's plans still
        hold it under itself (a relayout clears them, a freed weight has none; an identity
        lookup: no key tuple hashed again per part)."""
        return (self.b.gen == self.ws.gen and bool(self.b.graph)
                and all(type(w.data) is CudaWeight and w.data.plans.get(self) is self
                        for w in weights))

    def launch(self, x: np.ndarray | None = None) -> LaunchedMany:
        """Launch (``x``: copied into the slot's staging buffer first; None: built there)."""
        ws, slot, stream, b = self.ws, self.slot, self.stream, self.b
        if ws._held[slot]:
            raise DeviceError("x was staged in a buffer a launch in flight still uses")
        if x is not None:
            launch.stage_into(self, x)
        ws._held[slot] = True
        try:
            with self.dev:
                b.graph.launch(stream)
                flat = None if b.out is not None else self.lc._many_y_out(b)
                self.done.record(stream)
        except BaseException:
            ws._held[slot] = False
            raise
        return LaunchedMany(lambda: self._wait(flat))

    def _wait(self, flat: np.ndarray | None) -> list[MatmulResult]:
        b = self.b
        try:
            self.done.synchronize()
            secs = self.lc._many_seconds(b)
            if flat is None:
                flat = b.out.copy()  # the buffer is reused  # type: ignore[union-attr]
        finally:
            self.ws._held[self.slot] = False
        return [MatmulResult(y, kernel, layout, precision, KernelTiming(host_seconds=sec))
                for y, sec, (kernel, layout, precision) in zip(
                    _many_split(flat, b.n, b.rows, self.bf16), secs, self.parts, strict=True)]


def _many_split(flat: np.ndarray, n: int, rows: tuple[int, ...],
                bf16: bool = False) -> list[np.ndarray]:
    """Each part's [N, rows] y out of a multi-weight call's one flat y (views; bf16:
    converted copies)."""
    out, off = [], 0
    for r in rows:
        y = flat[n * off : n * (off + r)].reshape(n, r)
        out.append(y.astype(BFLOAT16) if bf16 else y)
        off += r
    return out


class ManyLaunches:
    """The launcher's multi-weight calls (see the module docstring)."""

    # -- a multi-weight call: one x, several weights of its K, one sequence --------------------
    def launch_many(self, weights: list[ResidentWeight], cws: list[CudaWeight], x: np.ndarray,
                    parts: list[tuple[str, Cfg]], out_dtype: np.dtype | None,
                    slot: int, staged: bool) -> Callable[[], Any]:
        """A multi-weight call in ``slot`` (``CudaBackend.launch_many``; every part a tile path
        with its launch shape, x checked): x's one upload, every part's launches between its
        events on the stream, all y's in one device buffer and one download; the returned
        function waits for the slot's completion event and returns (y, kernel seconds) per
        part. A :class:`ManyBound` per (parts, N, dtype, y's way out, slot), captured as a
        graph from its second call (``GRAPH_AFTER``). Call under the device and stream."""
        in_t = launch.IN_TYPES[x.dtype]
        host = self._stage_x(x, slot, staged)
        return self._in_slot(slot, lambda: self._many_in(weights, cws, x, in_t, parts,
                                                         out_dtype, slot, host))

    def many_key(self, cws: list[CudaWeight], parts: list[tuple[str, Cfg]], n: int, in_t: str,
                 small: Any, slot: int) -> tuple:
        return ("many", tuple(map(id, cws)), tuple(parts), n, in_t, small, slot)

    def _many_in(self, weights: list[ResidentWeight], cws: list[CudaWeight], x: np.ndarray,
                 in_t: str, parts: list[tuple[str, Cfg]], out_dtype: np.dtype | None,
                 slot: int, host: np.ndarray) -> Callable[[], Any]:
        stream = self.ctx.stream
        n = int(x.shape[0])
        rows = sum(w.rows for w in weights)
        key = self.many_key(cws, parts, n, in_t, launch.many_out(n, rows, out_dtype), slot)
        b = cws[0].plans.get(key)
        if (b is None or b.gen != self.ws.gen
                or not all(cw.plans.get(key) is b for cw in cws)):
            b = self._bind_many(weights, cws, parts, key, x.nbytes)
        if b.graph:
            b.graph.launch(stream)
            flat = None if b.out is not None else self._many_y_out(b)
        else:
            self._copy(b.xd, host.ctypes.data, b.x_bytes, _H2D)
            self._many_kernels(b, lambda ev: ev.record(stream))
            flat = None if b.out is not None else self._many_y_out(b)  # (before a capture)
            b.calls += 1
            if self.graphs and b.graph is None and b.calls > launch.GRAPH_AFTER:
                self._capture_many(b, host)
        bf16 = out_dtype is not None and np.dtype(out_dtype) == BFLOAT16

        def done() -> list[tuple[np.ndarray, float | None]]:
            self._wait(slot)
            secs = self._many_seconds(b)
            out = b.out.copy() if flat is None else flat  # (the slot's buffer is reused)
            return list(zip(_many_split(out, n, b.rows, bf16), secs, strict=True))

        return done

    def _many_y_out(self, b: ManyBound) -> np.ndarray:
        """Enqueue a multi-weight call's y's one copy into a new pinned block after the
        sequence and return the block (flat; f16 where the sequence converts y)."""
        half = bool(b.y16)
        size = b.n * sum(b.rows)
        ptr, blk = self.ws.y_block(size * (2 if half else 4))
        flat = blk.view(np.float16 if half else np.float32)
        self.ctx.cp.cuda.runtime.memcpyAsync(ptr, b.y16 if half else b.y, flat.nbytes, _D2H,
                                             self.ctx.stream.ptr)
        return flat

    def _many_seconds(self, b: ManyBound) -> list[float | None]:
        """Each part's kernel seconds (after the sync); a graph whose event nodes did not
        record is dropped (direct launches from then on) and its parts have no figure."""
        ev = b.events
        try:
            el = self.ctx.cp.cuda.get_elapsed_time
            return [el(ev[i], ev[i + 1]) / 1e3 for i in range(len(b.rows))]
        except Exception:
            if b.graph:
                b.graph = False
            return [None] * len(b.rows)

    def _bind_many(self, weights: list[ResidentWeight], cws: list[CudaWeight],
                   parts: list[tuple[str, Cfg]], key: tuple, x_bytes: int) -> ManyBound:
        n, in_t, small, slot = key[3], key[4], key[5], key[6]
        cp, ws = self.ctx.cp, self.ws
        lps = [self.plan(w.rows, w.k, w.layout, in_t, path, cfg, n, cw.pairs)
               for w, cw, (path, cfg) in zip(weights, cws, parts, strict=True)]
        rows = tuple(w.rows for w in weights)
        total = sum(rows)
        for _ in range(2):  # all buffers first (any growth bumps the generation)
            gen = ws.gen
            ws.host(x_bytes, slot)
            xd = ws.ptr("x", x_bytes)
            y = ws.ptr("y", 4 * n * total)
            steps: list[list[Step]] = []
            off = 0
            for lp, w, cw in zip(lps, weights, cws, strict=True):
                steps.append(self.steps(lp, w, cw, xd, y + 4 * n * off, n))
                off += w.rows
            half = small == "y16" or (not isinstance(small, str) and small is not None
                                      and small == np.float16)
            y16 = ws.ptr("y16b", 2 * n * total) if half else 0
            out = None
            if small is not None and not isinstance(small, str):  # a small y, downloaded here
                nbytes = n * total * small.itemsize
                out = ws.host_out(nbytes, slot)[:nbytes].view(small)
            if gen == ws.gen:
                break
        for cw in cws:
            if len(cw.plans) >= launch.MAX_PLANS_PER_WEIGHT:
                cw.plans.clear()
        b = ManyBound(ws.gen, x_bytes, [s for st in steps for s in st],
                      [cp.cuda.Event() for _ in range(len(rows) + 1)], xd, y, y16, out, rows, n,
                      tuple(map(len, steps)))
        for cw in cws:
            cw.plans[key] = b
        return b

    def _many_kernels(self, b: ManyBound, record: Callable[[Any], None]) -> None:
        """Each part's launches after its event, the last event, then y's f16 conversion and a
        small y's download (``record``: a plain record, or a graph node under capture)."""
        cp, ws = self.ctx.cp, self.ws
        i = 0
        for ev, count in zip(b.events, b.counts, strict=False):  # (the last event: after)
            record(ev)
            for st in b.steps[i : i + count]:
                st()
            i += count
        record(b.events[-1])
        size = b.n * sum(b.rows)
        if (b.y16 and b.out is not None
                and self._y16_out(b.out.ctypes.data, b.y, size)):  # (one kernel: Y16_COPY)
            return
        if b.y16:  # ("y16b" at the bound size: nothing grows)
            cp.copyto(ws.array("y16b", (size,), np.float16),
                      ws.array("y", (size,), np.float32), casting="same_kind")
        if b.out is not None:
            self._copy(b.out.ctypes.data, b.y16 or b.y, b.out.nbytes, _D2H)

    def _capture_many(self, b: ManyBound, host: np.ndarray) -> None:
        def enqueue(record: Callable[[Any], None]) -> None:
            if not self._copy(b.xd, host.ctypes.data, b.x_bytes, _H2D):
                self._anchor_step()  # (a copy kernel's upload needs none: _capture)
            self._many_kernels(b, record)

        b.graph = self.capture(enqueue)

    def many_call(self, key: tuple, call_key: tuple, slot: int,
                  parts: list[tuple[str, Layout, Precision]], out_dtype: np.dtype | None,
                  cws: list[CudaWeight]) -> ManyCall | None:
        """The :class:`ManyCall` (cached under ``call_key``) of a multi-weight call just
        launched by :meth:`launch_many` in ``slot`` with bind key ``key``, or None while its
        sequence is not a captured graph."""
        b = cws[0].plans.get(key)
        if not isinstance(b, ManyBound) or not b.graph or b.gen != self.ws.gen:
            return None
        return ManyCall(self, b, slot, call_key, parts, out_dtype)
