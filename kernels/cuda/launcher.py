"""The launcher of one device: :class:`Launcher` plans, binds and runs the kernels of a call
(the design: kernels/cuda/launch.py's docstring; its settings: launch.py's constants, read per
call). Made by ``CudaBackend`` (kernels/cuda_backend.py, one per device) and by the benches and
tests on a fake device. It is made of parts, one module each, whose methods are its own:

- plans.py ``Planner``: the plan of a call by host arithmetic (grid, K split, row chunks,
  token halves) and its steps;
- sequence.py ``Sequences``: the bound sequence of a (weight, N, dtype, path, shape), its graph
  capture and timing events;
- copies.py ``Copies``: x's way in and y's way out (copy engine or copy kernel);
- many.py ``ManyLaunches``: multi-weight calls;

and here the direct job: the entry points (``matmul``, ``launch``, ``launch_host``,
``launch_pieces``, ``launch_device``), the launch slots, the cached call (``bound_call``),
the unbound paths (direct launches, cuBLAS) and the copy streams. The workspace's buffers are
workspace.py's; the cached calls are bound_call.py's, region_call.py's and many.py's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import q6k
from ..api import BFLOAT16, Layout, Precision, ResidentWeight
from ..errors import DeviceError, FormatError
from . import launch
from .bound_call import BoundCall
from .copies import Copies
from .dispatch import Cfg
from .driver import (
    _CUBLAS_COMPUTE_32F,
    _CUBLAS_GEMM_DEFAULT,
    _CUDA_R_16F,
    _CUDA_R_32F,
    _D2D,
    _D2H,
    _H2D,
)
from .many import ManyLaunches
from .plans import Planner
from .sequence import Bound, Done, Sequences
from .storage import CudaWeight
from .workspace import Workspace


class Launcher(Planner, Sequences, Copies, ManyLaunches):
    """Plans, binds and runs the kernels of one device (see the module docstring)."""

    def __init__(self, ctx: Any, graphs: bool = True, anchor: int = 0,
                 copy_max: int | None = 0) -> None:
        self.ctx = ctx
        self._grids: dict[tuple, tuple[int, int, int]] = {}
        self.ws = Workspace(ctx)
        self.graphs = graphs  # the wall bench compares both
        self._record_ext: Any = None
        # The split-K sum (q6k_sum_parts) of the PDL_SRCS tiles is launched with programmatic
        # stream serialization (launch_pdl), so its launch overlaps the tile's tail: on by
        # default (H200, session 10: 1.00-1.04x on every such AUTO cell, bits unchanged);
        # Q6SERVE_PDL=0 turns it off. Read when a call's steps are built: a bound sequence
        # keeps what it was bound with.
        self.pdl = launch.pdl_from_env()
        # RegionCall's copies on streams of their own beside a launch in flight
        # (Q6SERVE_REGION_STREAMS; on by default)
        self.region_streams = launch.region_streams_from_env()
        self._copy_streams: tuple[Any, Any] | None = None
        # A larger f16 y (> SMALL_Y) converted inside the bound sequence (its graph) instead
        # of by a CuPy launch per call: on the H200 (bench/device_gap.py, session 10) the
        # 18944-row gate at N=8 spent 47-76 instead of 89-218 us outside its kernel per call.
        # Part of the binding key (_small_out): flipping it binds new sequences.
        self.y16_graph = True
        self._launch_ex: Any = None
        # row chunks of a large y (launch.py's docstring, point 8): Q6SERVE_Y_CHUNKS, else
        # launch.Y_CHUNKS at each call (the wall bench's in-process variants set it), else
        # the weight's own
        self.y_chunks = launch.y_chunks_from_env()
        self._y_stream: Any = None
        self._x_stream: Any = None
        # An empty kernel before a captured sequence's start event (anchor 1; 2: also after
        # its end event): compiled on first use. CudaBackend passes Q6SERVE_TIMING_ANCHOR's
        # value; a launcher built without one (the host tests' fake device) has none
        self.timing_anchor = anchor
        self._anchor: Any = None
        # x's upload / a small y's download by a kernel up to this many bytes (None:
        # launch.COPY_KERNEL_MAX at each binding; see launch.COPY_SRC); compiled on first use.
        # CudaBackend passes Q6SERVE_COPY_KERNEL_MAX's value (unset: None); a launcher built
        # without one (the host tests' fake device) has none
        self.copy_kernel_max = copy_max
        self._copy_fn: Any = None
        self._copy_h_fn: Any = None
        self._dev_ptr: Any = None

    def y_stream(self) -> Any:
        """The copy stream of the row chunks' downloads (made on first use, under the
        device)."""
        if self._y_stream is None:
            self._y_stream = self.ctx.cp.cuda.Stream(non_blocking=True)
        return self._y_stream

    def x_stream(self) -> Any:
        """The copy stream of the token halves' second x upload (point 10; made on first use,
        under the device; a captured sequence forks onto it and joins back)."""
        if self._x_stream is None:
            self._x_stream = self.ctx.cp.cuda.Stream(non_blocking=True)
        return self._x_stream

    def copy_streams(self) -> tuple[Any, Any]:
        """The copy-in and copy-out streams of ``RegionCall`` (made on first use, under the
        device)."""
        if self._copy_streams is None:
            cp = self.ctx.cp
            self._copy_streams = (cp.cuda.Stream(non_blocking=True),
                                  cp.cuda.Stream(non_blocking=True))
        return self._copy_streams

    def sync(self) -> None:
        """Wait for everything queued on the backend's stream and the copy streams."""
        self.ctx.stream.synchronize()
        for s in (*(self._copy_streams or ()), self._y_stream, self._x_stream):
            if s is not None:
                s.synchronize()

    # -- device-side call (bench, tests) -------------------------------------------------------
    def enqueue(self, w: ResidentWeight, cw: CudaWeight, xd: Any, in_t: str, path: str,
                cfg: Cfg | None) -> Any:
        """``y = xd · Wᵀ`` (f32, a new device array) enqueued on the stream, no sync."""
        cp = self.ctx.cp
        n = int(xd.shape[0])
        y = cp.empty((n, w.rows), cp.float32)
        if path == "cublas_f16":
            self.cublas(w, cw, xd, in_t, y)
            return y
        if cfg is None:
            raise DeviceError(f"{path} needs a launch shape")
        lp = self.plan(w.rows, w.k, w.layout, in_t, path, cfg, n, cw.pairs)
        for s in self.steps(lp, w, cw, int(xd.data.ptr), int(y.data.ptr), n):
            s()
        return y

    def cublas(self, w: ResidentWeight, cw: CudaWeight, xd: Any, in_t: str, y: Any) -> None:
        cp = self.ctx.cp
        from cupy_backends.cuda.libs import cublas

        n = int(xd.shape[0])
        if in_t == "InF16":
            x16 = xd
        elif in_t == "InF32":
            x16 = xd.astype(cp.float16)
        else:  # bf16 bits -> f32 (exact) -> f16
            x16 = (xd.astype(cp.uint32) << 16).view(cp.float32).astype(cp.float16)
        x16 = cp.ascontiguousarray(x16)
        soa = "true" if w.layout is Layout.SOA else "false"
        tile_rows = max(16, min(w.rows, launch.CUBLAS_TILE_BYTES // (2 * w.k)))
        w16 = cp.empty((tile_rows, w.k), cp.float16)
        handle = cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, self.ctx.stream.ptr)
        one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)
        bpr = w.k // q6k.QK_K
        soa = "2" if cw.pairs else soa  # pair-stream slabs
        dequant = self.ctx.fn(launch.MATMUL_FILE, f"q6k_dequant_f16<{soa}>")
        for r0 in range(0, w.rows, tile_rows):
            rt = min(tile_rows, w.rows - r0)
            total = rt * bpr * 4
            dequant((min(65535 * 8, -(-total // 256)),), (256,),
                    (cw.table, np.int32(w.rows), np.int32(bpr), np.int32(cw.rps),
                     np.int32(r0), np.int32(rt), w16))
            # column-major: C[rt, n] (ldc = rows) = W16[rt, K] (op T of [K, rt]) . X16[K, n]
            cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, rt, n, w.k,
                          one.ctypes.data, w16.data.ptr, _CUDA_R_16F, w.k,
                          x16.data.ptr, _CUDA_R_16F, w.k,
                          zero.ctypes.data, y.data.ptr + 4 * r0, _CUDA_R_32F, w.rows,
                          _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)

    # -- the host path of one batch ------------------------------------------------------------
    def matmul(self, w: ResidentWeight, cw: CudaWeight, x: np.ndarray, path: str,
               cfg: Cfg | None, out_dtype: np.dtype | None, topk: int = 0) -> Done:
        """Host x -> (host y, None, kernel seconds), one stream sync (see the module
        docstring); ``topk`` > 0: (None, the epilogue's result, kernel seconds), the epilogue
        run on the device y (kernels/cuda_topk.py). Call under the device and stream."""
        return self.launch(w, cw, x, path, cfg, out_dtype, topk)()

    def launch(self, w: ResidentWeight, cw: CudaWeight, x: np.ndarray, path: str,
               cfg: Cfg | None, out_dtype: np.dtype | None, topk: int = 0,
               chunks: int | None = None) -> Callable[[], Done]:
        """:meth:`matmul` up to its sync: everything is enqueued (upload, kernels, epilogue,
        download into pinned memory) in a free launch slot; the returned function waits for
        this launch's completion event and returns what :meth:`matmul` does (call it once,
        from any thread; at most ``SLOTS`` launches may await their wait). ``chunks``: the
        row chunks of a large y (None: :meth:`chunks_for` the slot now)."""
        in_t = launch.IN_TYPES.get(x.dtype)
        if in_t is None:
            raise FormatError(f"unsupported activation dtype {x.dtype}")
        ws = self.ws
        staged = x is ws.staged  # built in place (CudaBackend.staging): by identity, as
        slot = ws.staged_slot if staged else ws.free_slot()  # ndarray.ctypes costs ~4 us
        host = self._stage_x(x, slot, staged)
        if chunks is None:
            chunks = self.chunks_for(cw, slot, int(x.shape[0]) * w.rows, x.nbytes,
                                     int(x.shape[0]))
        return self._in_slot(slot, lambda: self._launch_in(w, cw, x, in_t, path, cfg,
                                                           out_dtype, topk, slot, host,
                                                           chunks))

    def _stage_x(self, x: np.ndarray, slot: int, staged: bool) -> np.ndarray:
        """``slot``'s pinned staging buffer with x in it (``staged``: built there already, and
        refused while a launch in flight still uses it)."""
        ws = self.ws
        if staged and ws.held(slot):
            raise DeviceError("x was staged in a buffer a launch in flight still uses")
        xb = x.reshape(-1).view(np.uint8)
        host = ws.host(xb.size, slot)
        if not staged:
            launch.fill_x(host, xb)
        return host

    def bound_call(self, w: ResidentWeight, cw: CudaWeight, x: np.ndarray, path: str,
                   cfg: Cfg | None, out_dtype: np.dtype | None, topk: int, slot: int,
                   kernel: str, precision: Precision, chunks: int = 0) -> BoundCall | None:
        """The :class:`BoundCall` of a call just launched by :meth:`launch` in ``slot`` (the
        same arguments; ``chunks``: the row chunks it was launched with, :meth:`chunks_for`),
        or None while its sequence is not a captured graph (or has none: cuBLAS, an epilogue
        that cannot be bound)."""
        if path == "cublas_f16" or cfg is None or x.dtype not in launch.IN_TYPES:
            return None
        n = int(x.shape[0])
        small = launch._small_out(n, w.rows, out_dtype, topk, self.y16_graph, chunks)
        if topk and small is None:
            return None
        b = cw.plans.get((path, cfg, n, launch.IN_TYPES[x.dtype], small, slot))
        if b is None or not b.graph or b.gen != self.ws.gen:
            return None
        return BoundCall(self, b, slot, n, w.rows, out_dtype, topk, kernel, w.layout, precision,
                         x.dtype, chunks)

    def _in_slot(self, slot: int, enqueue: Callable[[], Callable[[], Done]],
                 ) -> Callable[[], Done]:
        """``enqueue()`` (a launch's work, enqueued in ``slot``; returns its finish) with the
        slot held until the returned wait has run, and the slot's completion event after it."""
        ws = self.ws
        ws.take(slot)
        try:
            finish = enqueue()
            ws.done_event(slot).record(self.ctx.stream)
        except BaseException:
            ws.release(slot)
            raise

        def done() -> Done:
            try:
                return finish()
            finally:
                ws.release(slot)

        return done

    def _launch_in(self, w: ResidentWeight, cw: CudaWeight, x: np.ndarray, in_t: str,
                   path: str, cfg: Cfg | None, out_dtype: np.dtype | None, topk: int,
                   slot: int, host: np.ndarray, chunks: int) -> Callable[[], Done]:
        """:meth:`launch`'s enqueueing in ``slot`` (x already in its staging buffer ``host``;
        ``chunks``: a large y's split, :meth:`chunks_for`)."""
        stream = self.ctx.stream
        n = int(x.shape[0])
        if path == "cublas_f16":
            return self._matmul_direct(w, cw, x, in_t, out_dtype, topk, slot)
        if cfg is None:
            raise DeviceError(f"{path} needs a launch shape")
        key = (path, cfg, n, in_t, launch._small_out(n, w.rows, out_dtype, topk, self.y16_graph,
                                               chunks), slot)
        b = cw.plans.get(key)
        if b is None or b.gen != self.ws.gen:
            b = self._bind(w, cw, key, x.nbytes)
        if b.graph:
            b.graph.launch(stream)
            finish = self._finish_bound(b, n, w.rows, out_dtype, topk, slot)

            def graph_done() -> Done:
                done = finish()
                if done[2] is None:
                    b.graph = False  # its event nodes did not record: direct launches from now
                return done

            return graph_done
        self._upload(b, host.ctypes.data)
        self._kernels(b, lambda ev: ev.record(stream))
        self._download(b)
        b.calls += 1
        if self.graphs and b.graph is None and b.calls > launch.GRAPH_AFTER:
            self._capture(b, host)
        return self._finish_bound(b, n, w.rows, out_dtype, topk, slot)

    def launch_device(self, w: ResidentWeight, cw: CudaWeight, xd: Any, in_t: str,
                      path: str, cfg: Cfg, slot: int | None = None) -> tuple[Any, Any, Any]:
        """A tile call on activations already on the device (a caller's CUDA IPC region):
        ``xd`` is copied into the workspace's x, then the bound sequence runs (a graph from
        its second call), so the events around its kernels time the kernels only (events
        around direct launches also timed the Python between them: 272 vs 63 us at N=64).
        Returns (y, start, end): y a view of the workspace's f32 output [N, rows], valid until
        the next launch on this launcher. Call under the device and stream; no sync.
        ``slot``: the launch slot the caller holds (``Workspace.take``), whose own bound
        sequence and events this call uses, so that two calls can be in flight (None: one
        waited for before anything else launches)."""
        n = int(xd.shape[0])
        b = self.run_copied_x(w, cw, path, cfg, n, in_t, int(xd.data.ptr), int(xd.nbytes),
                              _D2D, slot)
        return self.ws.array("y", (n, w.rows), np.float32), b.start, b.end

    def run_copied_x(self, w: ResidentWeight, cw: CudaWeight, path: str, cfg: Cfg, n: int,
                     in_t: str, src: int, nbytes: int, kind: int, slot: int | None,
                     more: tuple[tuple[int, int], ...] = ()) -> Bound:
        """x copied from ``src`` (``kind``: device or page-locked host memory) into the
        workspace's x, then the kernels of the bound sequence that has no upload of its own
        (:meth:`launch_device`, :meth:`launch_host`): its graph, or direct launches between
        its events (captured from the call after ``GRAPH_AFTER``), of launch slot ``slot``
        (None: a call waited for before anything else launches). Returns the sequence, whose
        ``extra["y"]`` is the device address of its f32 y [N, rows] (valid until the next
        launch) and ``start`` / ``end`` the events around its kernels. Public: a caller that
        already chose the path and shape for a repeated call (service/cuda_regions.py's
        ``CudaSupport._launch_known``) runs it without the backend's checks. Call under the
        device and stream; no sync. ``more``: x's further pieces, (address, bytes) each, copied
        after ``src``'s ``nbytes`` in order (x's rows from several page-locked places:
        :meth:`launch_pieces`)."""
        key = (path, cfg, n, in_t, "device", slot)
        b = cw.plans.get(key)
        if b is None or b.gen != self.ws.gen:
            b = self._bind(w, cw, key, nbytes + sum(nb for _, nb in more))
            b.extra["device_x"] = True
        stream = self.ctx.stream
        copy = self.ctx.cp.cuda.runtime.memcpyAsync
        copy(b.extra["xd"], src, nbytes, kind, stream.ptr)
        if more:
            at = b.extra["xd"] + nbytes
            for p, nb in more:
                copy(at, p, nb, kind, stream.ptr)
                at += nb
        if b.graph:
            b.graph.launch(stream)
            return b
        b.start.record(stream)
        for s in b.steps:
            s()
        b.end.record(stream)
        b.calls += 1
        if self.graphs and b.graph is None and b.calls > launch.GRAPH_AFTER:
            self._capture(b, self.ws.host(b.x_bytes, slot or 0))
        return b

    def launch_host(self, w: ResidentWeight, cw: CudaWeight, x: np.ndarray, path: str,
                    cfg: Cfg, out_dtype: np.dtype | None,
                    y_out: np.ndarray | None) -> Callable[[], Done]:
        """:meth:`launch` for an x in page-locked host memory (a caller's registered shm
        region, kernels/hostio.py): DMA'd straight from there into the workspace's x (no copy
        into the staging buffer), then :meth:`launch_device`'s bound sequence (its graph has no
        upload); ``y_out`` (page-locked, [N, rows] f32/f16): y is DMA'd straight into it and
        returned as the result (else the usual way out, :meth:`_finish`). Call under the
        device and stream; the returned function makes the one sync (a launch slot's, as
        :meth:`launch`)."""
        slot = self.ws.free_slot()
        return self._in_slot(slot, lambda: self._launch_host_in(w, cw, x, path, cfg, out_dtype,
                                                                y_out, slot))

    def launch_pieces(self, w: ResidentWeight, cw: CudaWeight,
                      pieces: tuple[tuple[int, int], ...], n: int, in_t: str, path: str,
                      cfg: Cfg, out_dtype: np.dtype | None, slot: int) -> Callable[[], Done]:
        """:meth:`launch_host` for an x of ``n`` rows whose pieces, (address, bytes) each in
        row order, lie in page-locked host memory (a merged batch's rows in the service's
        front-end arenas: ``CudaBackend.gathered``): each DMA'd straight into its rows of the
        workspace's x (no concatenation on the host), then :meth:`launch_device`'s bound
        sequence; y the usual way out (:meth:`_finish`). In launch slot ``slot`` (free). Call
        under the device and stream; the returned function makes the one sync."""
        def enqueue() -> Callable[[], Done]:
            b = self.run_copied_x(w, cw, path, cfg, n, in_t, pieces[0][0], pieces[0][1], _H2D,
                                  slot, pieces[1:])
            return self._finish(b.extra["y"], n, w.rows, out_dtype, b.start, b.end, 0, slot)

        return self._in_slot(slot, enqueue)

    def _launch_host_in(self, w: ResidentWeight, cw: CudaWeight, x: np.ndarray, path: str,
                        cfg: Cfg, out_dtype: np.dtype | None, y_out: np.ndarray | None,
                        slot: int) -> Callable[[], Done]:
        n = int(x.shape[0])
        b = self.run_copied_x(w, cw, path, cfg, n, launch.IN_TYPES[x.dtype], x.ctypes.data,
                              x.nbytes, _H2D, slot)
        cp, stream = self.ctx.cp, self.ctx.stream
        if y_out is None:
            return self._finish(b.extra["y"], n, w.rows, out_dtype, b.start, b.end, 0, slot)
        src = self._y_out(b.extra["y"], n, w.rows, y_out.dtype == np.float16)
        cp.cuda.runtime.memcpyAsync(y_out.ctypes.data, src, y_out.nbytes, _D2H, stream.ptr)
        start, end = b.start, b.end

        def done() -> Done:
            self._wait(slot)
            seconds = self._seconds(start, end)
            if seconds is None and b.graph:
                b.graph = False  # its event nodes did not record: direct launches from now
            return y_out, None, seconds

        return done

    def _wait(self, slot: int | None) -> None:
        """Block until the launch in ``slot`` is done (None: everything on the stream)."""
        if slot is None:
            self.ctx.stream.synchronize()
        else:
            self.ws.done_event(slot).synchronize()

    def _matmul_direct(self, w: ResidentWeight, cw: CudaWeight, x: np.ndarray, in_t: str,
                       out_dtype: np.dtype | None, topk: int, slot: int) -> Callable[[], Done]:
        cp, stream = self.ctx.cp, self.ctx.stream
        n = int(x.shape[0])
        xdt = np.dtype(np.uint16) if x.dtype == BFLOAT16 else x.dtype
        xd = self.ws.array("x", x.shape, xdt)
        cp.cuda.runtime.memcpyAsync(xd.data.ptr, self.ws.host(x.nbytes, slot).ctypes.data,
                                    x.nbytes, _H2D, stream.ptr)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        y = self.ws.array("y", (n, w.rows), np.float32)
        self.cublas(w, cw, xd, in_t, y)
        end.record(stream)
        return self._finish(int(y.data.ptr), n, w.rows, out_dtype, start, end, topk, slot)
