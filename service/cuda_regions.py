"""CUDA IPC regions: a co-located caller's device buffer as a region (issue 15, item 1).

The caller exports an allocation on the worker's GPU (``cudaIpcGetMemHandle``) and registers
(handle, device, offset, byte_size); the worker opens it once (``cudaIpcOpenMemHandle``),
checks that the region lies inside the allocation, and from then on a matmul naming it reads
x from / writes y into the caller's memory on the device: no host copy of either. Closing
(unregister, drain) is ``cudaIpcCloseMemHandle``; the caller keeps owning (and freeing) its
allocation.

Such a request does not go through the batcher (its x is device memory, the batcher
concatenates host arrays): it runs as one device job of its own on the engine's device thread,
in order with the batches, with the same checks (weight, K, rows limit, precision the flags
allow, q8_1 with non-finite rows as exact), and its reply carries the same timing fields
(batch_rows = N, batch_requests = 1). Where x or y is on the host (inline bytes or a system
region), it is copied to or from the device in that job.

Only the CUDA backend has this (``support``); elsewhere RegionTable refuses CUDA regions.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from q6serve.kernels.api import BFLOAT16, KernelFlags, Layout, Precision
from q6serve.kernels.cuda_ipc import allocation_range
from q6serve.kernels.errors import FormatError, InvalidArgument, Unavailable

from . import envvars
from .batcher import DeadlineExceeded, MatmulReply
from .device_thread import Deferred
from .regions import CudaIpcSource, Mapping
from .threads import settle

log = logging.getLogger("q6serve.regions")

_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
# place graphs a launch slot's bound sequence keeps (CudaSupport._launch_known): T3's hosts
# each call at one place; a caller moving its buffers each call gets direct launches past this
PLACES = 64
_D2D = 3  # cudaMemcpyDeviceToDevice


def device_dtype(dtype: np.dtype) -> np.dtype:
    """What CuPy views a ``dtype`` tensor as: bf16 as its uint16 bits (CuPy has no bf16)."""
    return np.dtype(np.uint16) if dtype == BFLOAT16 else np.dtype(dtype)


class CudaIpcMapping(Mapping):
    """A caller's device allocation opened in the worker: bytes [offset, offset + byte_size)
    of it are the region."""

    def __init__(self, cp: Any, device: int, src: CudaIpcSource) -> None:
        if src.device != device:
            raise InvalidArgument(f"CUDA IPC region on device {src.device}; this worker's "
                                  f"device is {device}")
        self.cp, self.dev = cp, cp.cuda.Device(device)
        with self.dev:
            try:
                self.base = int(cp.cuda.runtime.ipcOpenMemHandle(src.handle, _LAZY_PEER_ACCESS))
            except cp.cuda.runtime.CUDARuntimeError as e:
                raise InvalidArgument(f"cannot open the CUDA IPC handle: {e} (a handle from "
                                      "cudaIpcGetMemHandle of a live allocation on this GPU, "
                                      "exported by another process)") from None
            try:
                _, size = allocation_range(self.base)
                if src.offset + src.byte_size > size:
                    raise InvalidArgument(f"region [{src.offset}, {src.offset + src.byte_size}) "
                                          f"does not fit the CUDA allocation of {size} bytes")
            except BaseException:
                cp.cuda.runtime.ipcCloseMemHandle(self.base)
                raise
        self.ptr = self.base + src.offset
        self.byte_size = src.byte_size
        self.open = True

    def view(self, offset: int, nbytes: int, dtype: np.dtype, shape: tuple[int, ...],
             writable: bool) -> Any:
        cp = self.cp
        mem = cp.cuda.UnownedMemory(self.ptr + offset, nbytes, self, self.dev.id)
        return cp.ndarray(shape, device_dtype(dtype), cp.cuda.MemoryPointer(mem, 0))

    def close(self) -> None:
        if self.open:
            self.open = False
            with self.dev:
                self.cp.cuda.runtime.ipcCloseMemHandle(self.base)


class CudaSupport:
    """CUDA IPC regions on one CudaBackend: opening them, and matmuls reading/writing them."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.cp = backend.ctx.cp
        # a like job's seconds as last measured, per (weight, N, dtypes, where y goes, flags):
        # Device.call's expect_s, so a short one runs inline on the loop (Device.inline_s).
        # On the device thread each CUDA call that releases the GIL waits to get it back from
        # the loop: 537 us around a 59 us kernel per N=64 call under T3 (H200, bench/RESULTS.md)
        self._job_s: dict[tuple[Any, ...], float] = {}
        # the launch choice per (cost key, the weight's layout and shape): a repeated call's
        # dispatch is not looked up twice a call again (``_admit``'s refusal check and the
        # launch's); bounded as _job_s
        self._choice: dict[tuple[Any, ...], Any] = {}
        self.lean = bool(envvars.DP_LEAN.read())  # (Q6SERVE_DP_LEAN: session 18's A/B)
        # (Q6SERVE_DP_PLACE_GRAPH, session 21's A/B: the launch's three CUDA runtime calls,
        # ~37 us of a CUDA-region call's ~175 in the device process in session 20, made one)
        self.place_graphs = self.lean and bool(envvars.DP_PLACE_GRAPH.read())
        self.place_launches = 0  # calls launched as their place's graph (Q6SERVE_DP_STATS)
        # per call, the Python around a launch (session 20: ~40 us of the device process's
        # ~175 a CUDA-region call): the kernel flags built once per flag state, and the
        # choice _admit looked up kept for the same call's launch (its cost key, by identity:
        # the memo holds it, so no other key can take its id)
        self._state: Any = None
        self._flags = KernelFlags()
        self._memo: tuple[Any, Any] = ((), None)
        from q6serve.kernels.cuda.launch import IN_TYPES
        from q6serve.kernels.cuda.storage import weight_data

        self._in_types, self._weight_data = IN_TYPES, weight_data

    def open(self, src: CudaIpcSource) -> Mapping:
        return CudaIpcMapping(self.cp, self.backend.device, src)

    async def matmul(self, engine: Any, call: Any, yd: Any) -> MatmulReply:
        """``call`` (x: a CuPy view of a region, or a host array) as one device job; y goes
        into ``yd`` (a CuPy view of a region) when given, else back to the host (reply.y)."""
        done: asyncio.Future[MatmulReply] = asyncio.get_running_loop().create_future()
        self.start(engine, call, yd, functools.partial(settle, done))
        return await asyncio.shield(done)  # the job finishes even if the caller goes

    def start(self, engine: Any, call: Any, yd: Any,
              done: Callable[[Any, BaseException | None], None]) -> None:
        """:meth:`matmul` without a task or future (the device process's "rm" calls,
        service/frontends.py): the checks run now (a refusal raises here), the job is queued,
        and ``done(reply, exception)`` runs on the loop when it ends; the weight is held
        until then."""
        e, flags, cost = self._admit(engine, call, yd)
        try:
            def finished(reply: Any, exc: BaseException | None) -> None:
                engine.registry.release(e)
                done(reply, exc)

            dev = engine.device
            # under load (Device.pipeline_short, the device busy), a call whose y goes to a
            # CUDA region is launched on the loop and waited for on the device thread, the
            # next one launched behind it (Device.launch_slots): the loop does not wait for
            # the GPU inline. Alone on an idle device it runs inline whole, as before.
            launch = (self._launch if yd is not None and dev.pipeline_short and not dev.idle
                      else None)
            dev.call(asyncio.get_running_loop(), self._job,
                     (e, call, yd, flags, time.perf_counter(), cost), finished,
                     expect_s=self._job_s.get(cost), launch=launch)
        except BaseException:
            engine.registry.release(e)
            raise

    def launch_now(self, engine: Any, call: Any, yd: Any) -> Callable[[], MatmulReply] | None:
        """:meth:`start` in two halves for a y in a CUDA region (the device process's
        pipeline of CUDA-region calls, ``FrontendsWorker._launch_cuda_due``): the checks,
        then - when the device may launch here now (``Device.may_launch_now``: at most
        launch_now's own launches out, fewer than its slots) and a like job was measured
        short - the launch in a slot of its own
        (:meth:`_launch`), returning the function that waits for it and returns the reply
        (a failure raises); the weight is held until then. None: nothing was done
        (:meth:`start` it). A refusal raises here."""
        if yd is None:  # (y back to the host: a whole job, :meth:`_job`)
            return None
        dev = engine.device
        e, flags, cost = self._admit(engine, call, yd)
        try:
            if not (dev.may_launch_now() and dev.inlines(self._job_s.get(cost))):
                engine.registry.release(e)
                return None
            finish = dev.launch_now(self._launch, e, call, yd, flags, time.perf_counter(),
                                    cost, True)
        except BaseException:
            engine.registry.release(e)
            raise

        def wait() -> MatmulReply:
            try:
                return finish()  # type: ignore[return-value]
            finally:
                engine.registry.release(e)

        return wait

    def _admit(self, engine: Any, call: Any, yd: Any,
               ) -> tuple[Any, KernelFlags, tuple[Any, ...]]:
        """The checks of a call (a refusal raises): its weight's entry, held (the caller lets
        go of it), the flags it runs under and its cost key (``_job_s``)."""
        if not engine.serving:
            raise Unavailable("the worker is draining and takes no new requests")
        x = call.x
        n = int(x.shape[0])
        if x.ndim != 2 or n < 1:
            raise InvalidArgument(f"activations must be [N, K] with N >= 1, got {x.shape}")
        if n > engine.config.max_request_rows:
            raise InvalidArgument(f"N={n} exceeds the per-request limit of "
                                  f"{engine.config.max_request_rows} rows")
        if call.timeout is not None and call.timeout <= 0:
            raise DeadlineExceeded("deadline already passed")
        e = engine.registry.acquire(call.weight)
        try:
            if x.shape[1] != e.k:
                raise FormatError(f"activations have K={x.shape[1]}, weight {e.name!r} has "
                                  f"K={e.k}")
            state = engine.flags.state
            if state is not self._state:  # (a FlagState is replaced on a change, never edited)
                self._state, self._flags = state, state.kernel_flags()
            flags = self._flags
            cost = (e.name, n, x.dtype, call.out_dtype, yd is None, call.precision, flags)
            c = self._choice.get(self._choice_key(cost, e)) if self.lean else None
            if c is None:
                # what the flags forbid: refused now (a cached choice passed it already)
                engine.backend.plan(n, call.precision, flags)
            self._memo = (cost, c)
        except BaseException:
            engine.registry.release(e)
            raise
        return e, flags, cost

    @staticmethod
    def _choice_key(cost: tuple[Any, ...], e: Any) -> tuple[Any, ...]:
        """``_choice``'s key: the call's cost key and the resident weight's layout and shape
        (a relayout or a reload of the name under other rows or K chooses again)."""
        return (cost, e.resident.layout, e.rows, e.k)

    def _known(self, e: Any, call: Any, yd: Any, cost: tuple[Any, ...],
               ) -> tuple[Any, str] | None:
        """(choice, kernel input type) of a repeated call whose choice is known (``_choice``:
        a tile path, not q8_1, which checks x per call), x a contiguous CUDA view and y an f32
        CUDA view; None: not such a call."""
        memo = self._memo  # (this call's own _admit looked it up: the same cost key object)
        c = memo[1] if memo[0] is cost else self._choice.get(self._choice_key(cost, e))
        x = call.x
        if (c is None or yd.dtype != np.float32 or not yd.flags.c_contiguous
                or isinstance(x, np.ndarray) or not x.flags.c_contiguous):
            return None
        in_t = self._in_types.get(BFLOAT16 if x.dtype == np.uint16 else np.dtype(x.dtype))
        return None if in_t is None else (c, in_t)

    def _launch_place(self, e: Any, call: Any, yd: Any, cost: tuple[Any, ...], slot: int,
                      ) -> tuple[Any, Any, Any, tuple[Any, Any]] | None:
        """A repeated call at a place (x's and y's device addresses and sizes) whose graph
        was captured (:meth:`_launch_known`) as ONE graph launch on the backend's stream
        (under the device only): x's copy, the kernels between their events, y's copy and
        the slot's completion event are its nodes. Valid while the slot's bound sequence is
        the one it was captured from (the same weight data, bound at the workspace's
        generation): the graph lives in that sequence's ``extra``, so a reload or a rebind
        drops it with the sequence. Returns (choice, start, end, (places, key)) or None:
        none captured for it (launch it the usual way)."""
        known = self._known(e, call, yd, cost)
        if known is None:
            return None
        c, in_t = known
        x, w, lc = call.x, e.resident, self.backend.launcher
        bound = self._weight_data(w).plans.get((c.path, c.cfg, int(x.shape[0]), in_t,
                                                "device", slot))
        if bound is None or bound.gen != lc.ws.gen or not bound.graph:
            return None
        places = bound.extra.get("places")
        pk = (int(x.data.ptr), int(yd.data.ptr), int(x.nbytes), int(yd.nbytes))
        g = places.get(pk) if places else None
        if not g:
            return None
        g.launch(self.backend.ctx.stream)
        self.place_launches += 1
        return c, bound.start, bound.end, (places, pk)

    def _launch_known(self, e: Any, call: Any, yd: Any, cost: tuple[Any, ...], slot: int,
                      ) -> tuple[Any, Any, Any] | None:
        """A repeated call's launch (under the device and stream) whose choice is known
        (:meth:`_known`): x's copy into the workspace and the bound sequence
        (``Launcher.run_copied_x``, as ``CudaBackend.launch_device``), then y's one copy
        into ``yd`` from the workspace's address, without the backend's y view or a CuPy
        launch. The second call at a place (``place_graphs``) also captures its place's
        graph (:meth:`_launch_place`: the same copies and kernels, the slot's completion
        event after them), once the bound sequence is a graph. Returns (choice, start, end),
        or None: not such a call (``_enqueue``)."""
        known = self._known(e, call, yd, cost)
        if known is None:
            return None
        c, in_t = known
        w, x = e.resident, call.x
        b = self.backend
        xp, xn, yp, yn = int(x.data.ptr), int(x.nbytes), int(yd.data.ptr), int(yd.nbytes)
        bound = b.launcher.run_copied_x(w, self._weight_data(w), c.path, c.cfg,
                                        int(x.shape[0]), in_t, xp, xn, _D2D, slot)
        self.cp.cuda.runtime.memcpyAsync(yp, bound.extra["y"], yn, _D2D, b.ctx.stream.ptr)
        if self.place_graphs and bound.graph and not (bound.extra.get("marks")
                                                      or bound.extra.get("waits")):
            places = bound.extra.setdefault("places", {})
            pk = (xp, yp, xn, yn)
            seen = places.get(pk)
            if seen is None and len(places) < PLACES:
                places[pk] = 0  # seen once: captured at its next call
            elif seen == 0:
                places[pk] = self._capture_place(bound, slot, pk)
        return c, bound.start, bound.end

    def _capture_place(self, bound: Any, slot: int, pk: tuple[int, int, int, int]) -> Any:
        """The place graph of ``bound``'s sequence for the place ``pk`` (under the device
        and stream), as the launcher captures a sequence with an upload
        (``Launcher._capture``: the timing anchor after x's copy-engine copy, so the start
        event does not record before the copy's hand-off); False where refused."""
        lc = self.backend.launcher
        rt, stream = self.cp.cuda.runtime, self.backend.ctx.stream
        xp, yp, xn, yn = pk
        done = lc.ws.done_event(slot)
        # the anchor's module loaded outside the capture (a first use under it would load it
        # there): one empty kernel on the stream, once a place
        lc._anchor_step()

        def enqueue(record: Callable[[Any], None]) -> None:
            rt.memcpyAsync(bound.extra["xd"], xp, xn, _D2D, stream.ptr)
            lc._anchor_step()
            lc._kernels(bound, record)
            lc._anchor_step(after_end=True)
            rt.memcpyAsync(yp, bound.extra["y"], yn, _D2D, stream.ptr)
            record(done)

        return lc.capture(enqueue)

    def _enqueue(self, e: Any, call: Any, flags: KernelFlags, slot: int | None,
                 cost: tuple[Any, ...] | None = None) -> tuple[Any, Any, Any, Any]:
        """The job's launch (under the device and stream): (choice, f32 y [N, rows] on the
        device - the workspace's, valid until the next launch -, start, end events around
        the kernels only). ``cost``: the call's cost key, under which a tile path's choice
        is kept for :meth:`_launch_known`."""
        b, cp = self.backend, self.cp
        w = e.resident
        flags = KernelFlags(soa=w.layout is Layout.SOA, decode_mmq=flags.decode_mmq)
        x = call.x
        # a CUDA region's view of bf16 x is its uint16 bits (device_dtype)
        dtype = BFLOAT16 if x.dtype == np.uint16 else np.dtype(x.dtype)
        if isinstance(x, np.ndarray):  # inline bytes or a system region: upload once
            x = cp.asarray(np.ascontiguousarray(x).view(device_dtype(dtype)))
        n = int(x.shape[0])
        c = b.choose(n, call.precision, flags, w.rows, w.k)
        if c.precision is Precision.Q8_1 and not bool(_finite(cp, x, dtype)):
            # q8_1 cannot carry NaN/Inf (kernels.api.matmul_ieee): the call runs exact
            c = b.choose(n, Precision.EXACT, flags, w.rows, w.k)
        elif (cost is not None and c.precision is not Precision.Q8_1
              and c.path != "cublas_f16" and c.cfg is not None):
            if len(self._choice) >= 4096:  # bounded: forget all, choose again
                self._choice.clear()
            self._choice[self._choice_key(cost, e)] = c
        return (c, *b.launch_device(w, x, dtype, c.path, c.cfg, slot))

    def _launch(self, e: Any, call: Any, yd: Any, flags: KernelFlags, t_enq: float,
                cost: tuple[Any, ...], own_time: bool = False) -> Deferred:
        """:meth:`_job` for a y in a CUDA region, launched on the loop in a launch slot of its
        own (its bound sequence and events; held until the wait): the returned wait, run on
        the device thread, synchronises on the slot's completion event only (a call
        launched behind this one keeps running). ``own_time``: the job's time is the
        launch's and the wait's only (:meth:`launch_now`: a wait a loop trip later, the trip
        not the job's)."""
        t0 = time.perf_counter()
        b, cp = self.backend, self.cp
        ws = b.launcher.ws
        slot = ws.free_slot()
        ws.take(slot)
        place = None
        try:
            with b.ctx.dev:
                got = (self._launch_place(e, call, yd, cost, slot) if self.place_graphs
                       else None)
                if got is not None:  # (its graph recorded the slot's completion event)
                    c, start, end, place = got
                else:
                    with b.ctx.stream:
                        known = (self._launch_known(e, call, yd, cost, slot) if self.lean
                                 else None)
                        if known is None:
                            c, y, start, end = self._enqueue(e, call, flags, slot, cost)
                            _store(cp, y, yd, np.dtype(call.out_dtype))
                        else:
                            c, start, end = known
                        ws.done_event(slot).record(b.ctx.stream)
        except BaseException:
            ws.release(slot)
            raise
        kernel = f"cuda.{c.path}.{e.resident.layout.value}"
        layout, n = e.resident.layout, int(call.x.shape[0])
        t_launch = time.perf_counter() - t0

        def wait() -> MatmulReply:
            tw = time.perf_counter()
            try:
                ws.done_event(slot).synchronize()
                kernel_s = self._seconds(start, end)
                if kernel_s is None and place is not None:  # its event nodes did not record
                    place[0][place[1]] = False  # (not this way again)
            finally:
                ws.release(slot)
            t1 = time.perf_counter()
            job_s = t_launch + t1 - tw if own_time else t1 - t0
            self._cost(cost, job_s)
            return MatmulReply(None, kernel, layout, c.precision, t0 - t_enq, kernel_s, n, 1,
                               job_s)

        return Deferred(wait)

    def _seconds(self, start: Any, end: Any) -> float | None:
        try:
            return self.cp.cuda.get_elapsed_time(start, end) / 1e3
        except Exception:  # a graph's event node that did not record: no figure
            return None

    def _cost(self, cost: tuple[Any, ...], seconds: float) -> None:
        if len(self._job_s) >= 4096:  # bounded: forget all, re-measure (first on the thread)
            self._job_s.clear()
        self._job_s[cost] = seconds

    def _job(self, e: Any, call: Any, yd: Any, flags: KernelFlags, t_enq: float,
             cost: tuple[Any, ...]) -> MatmulReply:
        """In the device thread, or inline on the loop when a like job was short: launch, y to
        its place, one sync; its seconds go to ``_job_s[cost]``."""
        t0 = time.perf_counter()
        b, cp = self.backend, self.cp
        w = e.resident
        with b.ctx.dev, b.ctx.stream:
            c, y, start, end = self._enqueue(e, call, flags, None)
            out = np.dtype(call.out_dtype)
            host = None
            if yd is not None:
                _store(cp, y, yd, out)
            else:
                host = cp.asnumpy(y.astype(np.float16) if out == np.float16 else y,
                                  stream=b.ctx.stream)
            b.ctx.stream.synchronize()
            kernel_s = self._seconds(start, end)
        if host is not None and out == BFLOAT16:
            host = host.astype(BFLOAT16)
        t1 = time.perf_counter()
        self._cost(cost, t1 - t0)
        return MatmulReply(host, f"cuda.{c.path}.{w.layout.value}", w.layout, c.precision,
                           t0 - t_enq, kernel_s, int(call.x.shape[0]), 1, t1 - t0)


def _finite(cp: Any, x: Any, dtype: np.dtype) -> Any:
    xf = _bf16_to_f32(cp, x) if dtype == BFLOAT16 else x.astype(cp.float32)
    return cp.isfinite(xf.sum(axis=1)).all()


def _bf16_to_f32(cp: Any, bits: Any) -> Any:
    return (bits.astype(cp.uint32) << 16).view(cp.float32)


def _store(cp: Any, y: Any, yd: Any, out: np.dtype) -> None:
    """f32 ``y`` into the region view ``yd`` as ``out`` (bf16: round to nearest even, NaN
    kept NaN, as ml_dtypes rounds the host path's y)."""
    if out == BFLOAT16:
        u = y.view(cp.uint32)
        rne = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16)
        cp.copyto(yd, cp.where(cp.isnan(y), cp.uint16(0x7FC0), rne))
    elif out == np.float32 and yd.flags.c_contiguous:  # a plain copy: no kernel to launch
        cp.cuda.runtime.memcpyAsync(int(yd.data.ptr), int(y.data.ptr), int(y.nbytes),
                                    _D2D, cp.cuda.get_current_stream().ptr)
    else:
        cp.copyto(yd, y.astype(out, copy=False))


def support(backend: Any, engine: Any) -> CudaSupport | None:
    """CUDA IPC regions for this backend: the CUDA backend of a one-device worker (a
    --devices worker's engines place weights on several devices: not yet)."""
    from .engine import Engine

    if (getattr(backend, "name", "") == "cuda" and hasattr(backend, "launcher")
            and type(engine) is Engine):
        return CudaSupport(backend)
    return None
