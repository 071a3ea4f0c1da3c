"""A call whose x and y lie at fixed page-locked host addresses (a fast lane's region places;
kernels/cuda/launch.py, point 7): :class:`RegionCall`, made by ``CudaBackend`` for a lane's
plan (service/lane.py, service/frontends.py through kernels/cuda_backend.py): x's DMA, the
kernels and y's DMA as one graph per launch slot, or with the copies on copy streams of their
own beside another launch in flight (``Q6SERVE_REGION_STREAMS``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..api import KernelTiming, Launched, MatmulResult, Precision, ResidentWeight
from . import launch
from .dispatch import Cfg
from .driver import _D2H, _H2D
from .plans import Step
from .storage import CudaWeight

if TYPE_CHECKING:
    from .launcher import Launcher



class _RegionSeq:
    """One launch slot's sequence of a :class:`RegionCall`: its pointers' generation, its
    timing events, its steps and, once captured, its graph (False: capture refused); with copy
    streams, the slot's own device buffers' names and the events that hand x and y between the
    streams."""

    __slots__ = ("calls", "end", "ev_x", "ev_y", "gen", "graph", "hx", "hy", "names", "start",
                 "steps", "xd", "y16", "yd")

    def __init__(self, gen: int, start: Any, end: Any, steps: list[Step], xd: int, yd: int,
                 y16: int, names: tuple[str, str, str]) -> None:
        self.gen, self.start, self.end, self.steps = gen, start, end, steps
        self.xd, self.yd, self.y16, self.names = xd, yd, y16, names
        self.graph: Any = None
        self.calls = 0
        self.ev_x: Any = None
        self.ev_y: Any = None
        # the region's x and y at the device's addresses, where the one-stream sequence copies
        # them by the copy kernel (Launcher.by_kernel; None: the copy engine)
        self.hx: int | None = None
        self.hy: int | None = None


class RegionCall:
    """A call whose x and y lie at fixed page-locked host addresses (a fast lane's region
    slots, kernels/hostio.py) repeated with its settled path: x's DMA from the region, the
    kernels between their timing events, y's f16 conversion and y's DMA into the region are
    ONE captured graph per launch slot, so a call is a free slot, one graph launch and the
    slot's completion event; the wait is the event's sync and the kernel time. The
    page-locked path of :meth:`Launcher.launch_host` enqueues the copies around its graph
    each call, and ``CudaBackend.launch`` re-runs the checks, the dispatch and the route
    lookups before it. Made by ``CudaBackend`` for a route that asked for it
    (``Route.want``), from a call it just launched that way (its modules loaded); valid
    while :meth:`live` (the caller checks it before each launch): the weight's data is the
    one bound, no page-locked range was unpinned since (``HostIO.epoch``) and the timing
    events recorded. Each slot's first ``GRAPH_AFTER`` + 1 calls run directly, the last of
    them captured; a refused capture keeps direct launches.

    With ``Launcher.region_streams`` (``Q6SERVE_REGION_STREAMS=1``) a call launched while
    another launch is in flight has x's DMA on a copy-in stream and y's on a copy-out stream,
    into and out of device buffers of the launch slot's own, handed over by events; only the
    kernels (and y's conversion) run on the backend's stream, as the slot's graph (each slot
    keeps a sequence of each kind). Two calls in flight (the lane's pipeline) then overlap:
    call i + 1's x DMA and call i's y DMA run beside the other's kernels, where one stream runs
    each call's copies and kernels one after the other. A call launched alone runs on the one
    stream (nothing to overlap; the streams' hand-offs cost a lone call ~20 us). A slot's
    buffers are reused only after its wait (the slot's completion event, recorded on the
    copy-out stream)."""

    __slots__ = ("_seqs", "_sseqs", "broken", "cfg", "cw", "epoch", "half", "in_t", "io",
                 "kernel", "layout", "lc", "n", "path", "precision", "rows", "streams", "w",
                 "x_addr", "x_bytes", "y", "y_addr", "y_bytes")

    def __init__(self, lc: Launcher, w: ResidentWeight, cw: CudaWeight, x: np.ndarray,
                 y: np.ndarray, path: str, cfg: Cfg, kernel: str, precision: Precision,
                 io: Any) -> None:
        self.lc, self.w, self.cw, self.io, self.epoch = lc, w, cw, io, io.epoch
        self.x_addr, self.x_bytes = int(x.ctypes.data), int(x.nbytes)
        self.in_t = launch.IN_TYPES[x.dtype]
        self.y, self.y_addr, self.y_bytes = y, int(y.ctypes.data), int(y.nbytes)
        self.n, self.rows, self.half = int(x.shape[0]), w.rows, y.dtype == np.float16
        self.path, self.cfg = path, cfg
        self.kernel, self.layout, self.precision = kernel, w.layout, precision
        self._seqs: list[_RegionSeq | None] = [None] * launch.SLOTS  # one stream
        self._sseqs: list[_RegionSeq | None] = [None] * launch.SLOTS  # with the copy streams
        self.broken = False
        self.streams = lc.region_streams

    def live(self) -> bool:
        return not self.broken and self.io.epoch == self.epoch and self.w.data is self.cw

    def launch(self) -> Launched:
        lc = self.lc
        ws, stream = lc.ws, lc.ctx.stream
        slot = ws.free_slot()
        # the copy streams only beside another launch in flight: alone, there is nothing to
        # overlap and one stream's serialized copies and kernels cost less (H200, session 11:
        # a lone lane caller's p50 - kernel 71 us on one stream, 92 with the copy streams)
        streams = self.streams and any(ws.held(o) for o in range(launch.SLOTS) if o != slot)
        ws.take(slot)
        try:
            with self.io.lock, lc.ctx.dev:
                s = self._seqs[slot]
                if streams:
                    s = self._run_streams(slot, self._sseqs[slot])
                elif s is not None and s.graph and s.gen == ws.gen:
                    s.graph.launch(stream)
                    ws.done_event(slot).record(stream)
                else:
                    s = self._run(slot, s)
                    ws.done_event(slot).record(stream)
        except BaseException:
            ws.release(slot)
            raise
        return Launched(lambda: self._wait(slot, s))

    def _wait(self, slot: int, s: _RegionSeq) -> MatmulResult:
        lc = self.lc
        try:
            lc.ws.done_event(slot).synchronize()
            seconds = lc._seconds(s.start, s.end)
            if seconds is None:  # its event nodes did not record: not this way again
                self.broken = True
        finally:
            lc.ws.release(slot)
        return MatmulResult(self.y, self.kernel, self.layout, self.precision,
                            KernelTiming(host_seconds=seconds))

    def _run(self, slot: int, s: _RegionSeq | None) -> _RegionSeq:
        """Slot ``slot``'s sequence launched directly (bound first if it is not, or its
        buffers moved), and captured as its graph once it ran ``GRAPH_AFTER`` times."""
        lc = self.lc
        ws, stream = lc.ws, lc.ctx.stream
        with stream:
            if s is None or s.gen != ws.gen:
                s = self._seqs[slot] = self._bind(("x", "y", "y16b"))
                s.hx, s.hy = self._mapped(s.xd, self.x_addr, self.x_bytes), self._mapped(
                    s.y16 if self.half else s.yd, self.y_addr, self.y_bytes)
            self._enqueue(s, lambda ev: ev.record(stream))
            s.calls += 1
            if lc.graphs and s.graph is None and s.calls > launch.GRAPH_AFTER:
                self._capture(s)
        return s

    def _mapped(self, dev: int, host: int, nbytes: int) -> int | None:
        """The device's address of the region's ``host`` where the copy kernel is to move its
        ``nbytes`` to or from ``dev`` (``Launcher.by_kernel``), else None (the copy engine)."""
        lc = self.lc
        if not lc.by_kernel(nbytes, dev, host):
            return None
        d = lc.device_ptr(host)
        return d if d is not None and d % 16 == 0 else None

    def _bind(self, names: tuple[str, str, str]) -> _RegionSeq:
        """A sequence on the workspace's buffers ``names`` (x, f32 y, f16 y); call under the
        device and stream."""
        lc = self.lc
        ws, cp = lc.ws, lc.ctx.cp
        lp = lc.plan(self.rows, self.w.k, self.w.layout, self.in_t, self.path, self.cfg,
                     self.n, self.cw.pairs)
        n, rows = self.n, self.rows
        for _ in range(2):  # all buffers first (any growth bumps the generation)
            gen = ws.gen
            xd = ws.ptr(names[0], self.x_bytes)
            yd = ws.ptr(names[1], 4 * n * rows)
            y16 = ws.ptr(names[2], 2 * n * rows) if self.half else 0
            steps = lc.steps(lp, self.w, self.cw, xd, yd, n)
            if gen == ws.gen:
                break
        return _RegionSeq(ws.gen, cp.cuda.Event(), cp.cuda.Event(), steps, xd, yd, y16, names)

    def _run_streams(self, slot: int, s: _RegionSeq | None) -> _RegionSeq:
        """One call with its copies on the copy streams: x in on the copy-in stream, the
        kernels (the slot's graph, or direct launches captured after ``GRAPH_AFTER`` calls)
        on the backend's stream once x is in, y out on the copy-out stream once the kernels
        are done, the slot's completion event after it."""
        lc = self.lc
        ws, cp, stream = lc.ws, lc.ctx.cp, lc.ctx.stream
        rt = cp.cuda.runtime
        cin, cout = lc.copy_streams()
        if s is None or s.gen != ws.gen:
            with stream:
                s = self._bind((f"rx{slot}", f"ry{slot}", f"ry16{slot}"))
            s.ev_x, s.ev_y = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)
            self._sseqs[slot] = s
        rt.memcpyAsync(s.xd, self.x_addr, self.x_bytes, _H2D, cin.ptr)
        s.ev_x.record(cin)
        stream.wait_event(s.ev_x)
        if s.graph:
            s.graph.launch(stream)
        else:
            with stream:  # (CuPy launches on the current stream: a capture's too)
                self._kernels(s, lambda ev: ev.record(stream))
                s.calls += 1
                if lc.graphs and s.graph is None and s.calls > launch.GRAPH_AFTER:
                    s.graph = lc.capture(lambda record: self._kernels(s, record))
        s.ev_y.record(stream)
        cout.wait_event(s.ev_y)
        rt.memcpyAsync(self.y_addr, s.y16 if self.half else s.yd, self.y_bytes, _D2H, cout.ptr)
        ws.done_event(slot).record(cout)
        return s

    def _enqueue(self, s: _RegionSeq, record: Callable[[Any], None],
                 captured: bool = False) -> None:
        """The whole call on the stream: x in, the kernels between the events, y out. x and
        y by the copy kernel where ``Launcher.by_kernel`` takes them and the driver maps the
        region (``s.hx`` / ``s.hy``); ``captured``: the timing anchor after a copy engine's
        upload, as a bound sequence's (``Launcher._capture``)."""
        lc = self.lc
        rt, stream = lc.ctx.cp.cuda.runtime, lc.ctx.stream
        ysrc = s.y16 if self.half else s.yd
        if s.hx is not None:
            lc._kernel_copy(s.xd, s.hx, self.x_bytes)
        else:
            rt.memcpyAsync(s.xd, self.x_addr, self.x_bytes, _H2D, stream.ptr)
            if captured:
                lc._anchor_step()
        self._kernels(s, record)
        if s.hy is not None:
            lc._kernel_copy(s.hy, ysrc, self.y_bytes)
        else:
            rt.memcpyAsync(self.y_addr, ysrc, self.y_bytes, _D2H, stream.ptr)

    def _kernels(self, s: _RegionSeq, record: Callable[[Any], None]) -> None:
        """The kernels between the timing events, then y's f16 conversion where asked."""
        record(s.start)
        for st in s.steps:
            st()
        record(s.end)
        if self.half:  # (at the bound size: nothing grows)
            ws, shape = self.lc.ws, (self.n, self.rows)
            self.lc.ctx.cp.copyto(ws.array(s.names[2], shape, np.float16),
                                  ws.array(s.names[1], shape, np.float32), casting="same_kind")

    def _capture(self, s: _RegionSeq) -> None:
        """Capture ``s`` (:meth:`_enqueue`); on any refusal it keeps direct launches."""
        s.graph = self.lc.capture(lambda record: self._enqueue(s, record, True))
