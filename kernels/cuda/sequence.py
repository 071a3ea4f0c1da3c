"""The bound launch sequence of a (weight, N, dtype, path, launch shape) (kernels/cuda/launch.py,
points 2-4): :class:`Bound` holds its steps and timing events on one workspace generation;
:class:`Sequences` binds it (:meth:`Sequences._bind`: the plan's steps, x's upload, y's way
out, row chunks and token halves), runs and finishes it, captures it as a CUDA graph from its
second call (:meth:`Sequences.capture`: the events as external graph nodes, the timing anchor)
and reads the kernel time between its events.

:class:`Sequences` is one of the parts ``launcher.Launcher`` is made of (its methods are the
launcher's); the direct job (launcher.py) and the cached calls call them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import cuda_topk
from ..api import BFLOAT16, ResidentWeight
from ..epilogue import TopK
from . import launch
from .driver import _D2H
from .plans import Step
from .storage import CudaWeight

Done = tuple[np.ndarray | None, TopK | None, float | None]  # y, top-k, kernel seconds


@dataclass
class Bound:
    """A (weight, N, dtype, path, shape) launch sequence bound to one workspace generation."""

    gen: int
    x_bytes: int
    steps: list[Step]
    start: Any  # timing events, re-recorded every call (read right after the sync)
    end: Any
    calls: int = 0
    graph: Any = None  # cupy Graph once captured; False once capture was refused
    extra: dict = field(default_factory=dict)


class Sequences:
    """The launcher's bound sequences: binding, graph capture, timing (see the module
    docstring)."""

    def _bind(self, w: ResidentWeight, cw: CudaWeight, key: tuple, x_bytes: int) -> Bound:
        path, cfg, n, in_t, small, slot = key
        small = small if small != "device" else None  # launch_device: y stays on the device
        slot = slot or 0  # (None: launch_device's, which has no host buffers of its own)
        cp = self.ctx.cp
        lp = self.plan(w.rows, w.k, w.layout, in_t, path, cfg, n, cw.pairs)
        # All buffers first (any growth bumps the generation), then the pointers.
        kind = small[0] if isinstance(small, tuple) else None
        if (kind == "tokens" and lp.src not in launch.X_SPLIT_Y_SRCS
                and not (launch.X_SPLIT_MIN and x_bytes >= launch.X_SPLIT_MIN)):
            # halves by y's size on a tile whose halves re-read the weight on its full width
            # (src 8): the weight's own row chunks instead (X_SPLIT_Y_SRCS; none: whole). The
            # call's key keeps its state (Launcher.chunks_for knows no tile).
            want = small[2] if len(small) > 2 else self.chunks_wanted(cw)
            small = ("rows", want) if want > 1 else None
            kind = small[0] if small else None
        chunks = (self.row_chunks(lp, w.rows, w.k, w.layout, in_t, path, cfg, n, cw.rps,
                                  small[1], cw.pairs) if kind == "rows" else None)
        halves = (self.token_parts(lp, w.rows, w.k, w.layout, in_t, path, cfg, n, small[1],
                                   cw.pairs) if kind == "tokens" else None)
        sub = small[2] if kind == "tokens" and len(small) > 2 else 0  # X_SPLIT_ROWS's chunks
        # each half's row chunks (its own plan's rounds; None: the half whole)
        parts = [(t0, t1, tp, self.row_chunks(tp, w.rows, w.k, w.layout, in_t, path,
                                               self.part_cfg(cfg, tp.grid[1], t1 - t0), t1 - t0,
                                               cw.rps, sub, cw.pairs) if sub > 1 else None)
                 for t0, t1, tp in halves or ()]
        isz = x_bytes // (n * w.k)
        for _ in range(2):
            gen = self.ws.gen
            self.ws.host(x_bytes, slot)
            xd = self.ws.ptr("x", x_bytes)
            y = self.ws.ptr("y", 4 * n * w.rows)
            marks: dict[int, Any] = {}
            waits: dict[int, Any] = {}
            xparts: list[tuple[int, int, Any]] = []
            copies: list[tuple[int, int, int, int, int, int]] = []
            if chunks:  # point 8: each chunk's launches, then its event (not the last's)
                steps = []
                for r0, r1, cp_ in chunks:
                    steps += self.steps(cp_, w, cw, xd, y + 4 * n * r0, n, r0, r1)
                    if r1 < w.rows:
                        marks[len(steps) - 1] = cp.cuda.Event(disable_timing=True)
                    width = 4 * (r1 - r0)  # its [N, r1 - r0] block into its columns
                    copies.append((4 * r0, 4 * n * r0, 4 * w.rows, width, width, n))
            elif halves:  # point 10: each half's x, launches and y
                steps = []
                for t0, t1, tp, rcs in parts:
                    m, xh, yh = t1 - t0, xd + t0 * w.k * isz, y + 4 * t0 * w.rows
                    ev = cp.cuda.Event(disable_timing=True) if t0 else None
                    xparts.append((t0 * w.k * isz, m * w.k * isz, ev))
                    if ev is not None:  # its x uploaded on the x stream: waited for here
                        waits[len(steps)] = ev
                    row = 4 * w.rows
                    if not rcs:  # its tokens' rows of y, in place
                        steps += self.steps(tp, w, cw, xh, yh, m)
                        if t1 < n:
                            marks[len(steps) - 1] = cp.cuda.Event(disable_timing=True)
                        copies.append((4 * t0 * w.rows, 4 * t0 * w.rows, row, row, row, m))
                        continue
                    for r0, r1, rp in rcs:  # (X_SPLIT_ROWS) its [m, r1 - r0] blocks in turn
                        steps += self.steps(rp, w, cw, xh, yh + 4 * m * r0, m, r0, r1)
                        if t1 < n or r1 < w.rows:
                            marks[len(steps) - 1] = cp.cuda.Event(disable_timing=True)
                        width = 4 * (r1 - r0)  # into its tokens' rows, its columns
                        copies.append((4 * (t0 * w.rows + r0), 4 * (t0 * w.rows + m * r0), row,
                                       width, width, m))
            else:
                steps = self.steps(lp, w, cw, xd, y, n)
            out, post, y16big = None, [], None
            if kind in ("rows", "tokens"):  # y's way out enqueued per call (_chunks_out/_finish)
                pass
            elif small == "y16":  # a larger f16 y: converted in the sequence, copied per call
                y16big = self.ws.ptr("y16b", 2 * n * w.rows)
            elif kind == "topk":  # the top-k epilogue and its download, bound in
                k = small[1]
                packed = self.ws.ptr("topk_packed", cuda_topk.packed_bytes(n, k))
                scratch = self.ws.ptr("topk_scratch", cuda_topk.scratch_bytes(n, w.rows))
                post = [Step(self.ctx.fn(cuda_topk.TOPK_FILE, name), grid, threads, args)
                        for name, grid, threads, args in cuda_topk.group_launches(
                            y, n, w.rows, k, packed, scratch)]
                nbytes = cuda_topk.packed_bytes(n, k)
                out = (packed, self.ws.host_out(nbytes, slot)[:nbytes].view(np.int32)
                       .reshape(n, 2 * k + 1))
            elif small is not None:  # y's way out is part of the sequence (SMALL_Y)
                y16 = self.ws.ptr("y16b", 2 * n * w.rows) if small == np.float16 else 0
                nbytes = n * w.rows * small.itemsize
                out = (y16, self.ws.host_out(nbytes, slot)[:nbytes].view(small).reshape(n,
                                                                                     w.rows))
            if gen == self.ws.gen:
                break
        if len(cw.plans) >= launch.MAX_PLANS_PER_WEIGHT:
            cw.plans.clear()
        b = Bound(self.ws.gen, x_bytes, steps, cp.cuda.Event(), cp.cuda.Event(),
                  extra={"xd": xd, "y": y, "out": out, "post": post, "y16": y16big,
                         "shape": (n, w.rows)})
        if copies:
            evs = [*marks.values(), None]  # (the last chunk's copy follows its kernels)
            b.extra.update(marks=marks, join=cp.cuda.Event(disable_timing=True),
                           copies=[(*c, ev) for c, ev in zip(copies, evs, strict=True)])
        if chunks:
            b.extra["chunks"] = [(r0, r1, ev) for (r0, r1, _), ev in zip(chunks, evs,
                                                                         strict=True)]
        if halves:
            b.extra.update(waits=waits, xparts=xparts, tokens=[(t0, t1) for t0, t1, _ in halves],
                           fork=cp.cuda.Event(disable_timing=True),
                           token_rows=[(t0, t1, r0, r1) for t0, t1, _, rcs in parts
                                       for r0, r1, _ in rcs or ()])
        cw.plans[key] = b
        return b

    def _finish_bound(self, b: Bound, n: int, rows: int, out_dtype: np.dtype | None,
                      topk: int, slot: int) -> Callable[[], Done]:
        """:meth:`_finish` of a bound sequence: a small y is already on its way to the pinned
        out buffer (``_download``); the sync, then a copy of it, is all that is left."""
        out = b.extra["out"]
        if out is None and b.extra.get("y16") is not None:  # converted by the sequence
            return self._finish(b.extra["y16"], n, rows, out_dtype, b.start, b.end, topk, slot,
                                converted=True)
        if out is None:
            return self._finish(b.extra["y"], n, rows, out_dtype, b.start, b.end, topk, slot,
                                bound=b if b.extra.get("copies") else None)
        start, end, host = b.start, b.end, out[1]
        if topk:
            def top_done() -> Done:
                self._wait(slot)
                # (a copy: the buffer is the slot's, and unpack may return views of it)
                return None, cuda_topk.unpack(host.copy(), topk), self._seconds(start, end)

            return top_done

        def done() -> Done:
            self._wait(slot)
            return host.copy(), None, self._seconds(start, end)  # the buffer is reused

        return done

    def _capture(self, b: Bound, host: np.ndarray) -> None:
        """Capture b's sequence as a graph; on any refusal keep direct launches for it."""

        def enqueue(record: Callable[[Any], None]) -> None:
            # x from the host staging (else copied before); a copy kernel's upload has no
            # copy engine's hand-off to keep out of the events (no anchor)
            if not b.extra.get("device_x") and not self._upload(b, host.ctypes.data):
                self._anchor_step()
            self._kernels(b, record)
            self._anchor_step(after_end=True)
            self._download(b)

        b.graph = self.capture(enqueue)

    def _anchor_step(self, after_end: bool = False) -> None:
        """``timing_anchor`` (under capture, after x's upload): an empty one-thread kernel
        before the start event. H200, session 17 (bench/kernel_gap.py): the events around a
        graph's kernel read 22.7 us with no copy before them, 29.3 after x's upload, for a
        kernel of 20.2 us by CUPTI either way; the start event node after the copy node is
        recorded before the copy's hand-off to the kernels' engine. ``after_end``: the one after
        the end event (``timing_anchor`` 2), before y's download."""
        if self.timing_anchor < (2 if after_end else 1):
            return
        if self._anchor is None:
            self._anchor = self.ctx.cp.RawKernel(launch.ANCHOR_SRC, "q6_timing_anchor")
        self._anchor((1,), (1,), ())

    def _kernels(self, b: Bound, record: Callable[[Any], None]) -> None:
        """b's launches between its timing events, with each row chunk's event after its
        launches (point 8; ``record``: a plain record, or a graph node under capture)."""
        record(b.start)
        marks, waits = b.extra.get("marks"), b.extra.get("waits")
        for i, s in enumerate(b.steps):
            if waits and i in waits:  # (point 10: the token half's x, uploaded on the x stream)
                self.ctx.stream.wait_event(waits[i])
            s()
            if marks and i in marks:
                record(marks[i])
        record(b.end)

    def capture(self, enqueue: Callable[[Callable[[Any], None]], None]) -> Any:
        """``enqueue(record)`` captured on the stream as a graph, each ``record(event)`` an
        external event record node (so the events time the graph's kernels); False on any
        refusal (the caller keeps direct launches)."""
        if self._record_ext is None:
            self._record_ext = launch._external_record() or False
        if not self._record_ext:
            return False
        stream, rt = self.ctx.stream, self.ctx.cp.cuda.runtime
        try:
            stream.begin_capture(getattr(rt, "streamCaptureModeRelaxed", 2))
        except Exception:
            return False
        ok, graph = [True], None

        def record(ev: Any) -> None:
            ok[0] = ok[0] and self._record_ext(ev.ptr, stream.ptr, 1) == 0

        try:
            enqueue(record)
        except Exception:
            ok[0] = False
        finally:
            try:
                graph = stream.end_capture()
            except Exception:
                ok[0] = False
        return graph if ok[0] and graph is not None else False

    def _finish(self, y: int, n: int, rows: int, out_dtype: np.dtype | None, start: Any,
                end: Any, topk: int, slot: int | None = None,
                converted: bool = False, bound: Bound | None = None) -> Callable[[], Done]:
        """Enqueue y's way out: the workspace's f32 "y" at ``y`` -> a host array over a pinned
        block (``Workspace.y_block``: reused once no array of it is left; no host copy), or
        the top-k epilogue. The returned function makes the one sync and reads the kernel
        seconds (the events are complete by then). ``bound``: a row-chunked sequence's, y's
        way out chunk by chunk."""
        cp, stream = self.ctx.cp, self.ctx.stream
        if topk:
            from ..cuda_topk import topk_enqueue

            top = topk_enqueue(cp, self.ws.array("y", (n, rows), np.float32), topk, stream)

            def top_done() -> Done:
                self._wait(slot)  # (its own download is enqueued before the slot's event)
                return None, top(), self._seconds(start, end)

            return top_done
        half = out_dtype is not None and np.dtype(out_dtype) == np.float16
        if not converted:  # (converted: y is already the f16 conversion, bound in)
            y = self._y_out(y, n, rows, half)
        item, dt = (2, np.dtype(np.float16)) if half else (4, np.dtype(np.float32))
        nbytes = n * rows * item
        ptr, blk = self.ws.y_block(nbytes)
        out = blk.view(dt).reshape(n, rows)
        if bound is not None:
            self._chunks_out(bound, ptr)
        else:
            cp.cuda.runtime.memcpyAsync(ptr, y, nbytes, _D2H, stream.ptr)

        def done() -> Done:
            self._wait(slot)
            host = out
            if out_dtype is not None and np.dtype(out_dtype) == BFLOAT16:
                host = out.astype(BFLOAT16)
            return host, None, self._seconds(start, end)

        return done

    def _seconds(self, start: Any, end: Any) -> float | None:
        try:
            return self.ctx.cp.cuda.get_elapsed_time(start, end) / 1e3
        except Exception:  # an event a refused graph node never recorded: no figure
            return None
