"""The CUDA backend: Q6_K weights resident in VRAM, kernels from ``kernels/cuda/*.cu``.

:class:`CudaBackend` is the :class:`Backend` API over three parts, one job each:

- ``kernels/cuda/storage.py`` - resident weights (slabs, SoA/AoS), load, relayout, read-back
  and the exact VRAM figures;
- ``kernels/cuda/dispatch.py`` - **which kernel and launch shape a call gets**: the measured
  table ``kernels/cuda/dispatch_h200.json`` (``bench/kernels.py --tune``) and the heuristics
  for shapes far from it, under the kill switches;
- ``kernels/cuda/launcher.py`` - how a call runs: launch plans (grid, K split; plans.py),
  the per-backend pinned/device buffers (workspace.py), the launch sequence per (weight, N)
  (a CUDA graph from its second call; sequence.py), the kernel-only events and the one sync
  per batch, and the cached calls (bound_call.py, region_call.py, many.py); its design and
  measured settings are ``kernels/cuda/launch.py``'s.

Kernel names carry the layout (``cuda.mma_f16.soa``); the AoS twins run the same code with
the AoS address arithmetic and the same grid, so their results are bit-identical.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import q6k
from .api import (
    DEFAULT_FLAGS,
    AosChunks,
    Backend,
    FlagsArg,
    KernelFlags,
    KernelTiming,
    Launched,
    LaunchedMany,
    Layout,
    MatmulResult,
    MemoryInfo,
    Precision,
    ResidentWeight,
    check_many,
    check_matmul,
    flags_of,
    part_error,
)
from .cuda import launch as launch_mod
from .cuda import storage
from .cuda.context import DeviceContext
from .cuda.dispatch import (
    KERNELS,
    Cfg,
    Choice,
    Dispatch,
    DispatchTable,
    default_cfg,
    load_default_table,
)
from .cuda.launch import BATCH_SLOTS, IN_TYPES, SLOTS
from .cuda.launcher import Launcher
from .cuda.region_call import RegionCall
from .cuda.storage import CudaWeight, Storage, pairs_from_env, weight_data
from .errors import DeviceError, FormatError
from .hostio import HostIO

__all__ = ["IN_TYPES", "Cfg", "CudaBackend", "default_cfg", "fill_gathered"]


def fill_gathered(x: np.ndarray, pieces: Sequence[tuple[int, int]]) -> None:
    """x's bytes from its pieces ((address, bytes) each, in order): a gathered placeholder
    (``CudaBackend.gathered``) filled on the host, for a launch that takes the staged way."""
    flat = x.reshape(-1).view(np.uint8)
    at = 0
    for p, nb in pieces:
        flat[at : at + nb] = np.ctypeslib.as_array((ctypes.c_uint8 * nb).from_address(p))
        at += nb


def _call_key(x: np.ndarray, precision: Precision, flags: KernelFlags,
              out_dtype: np.dtype | None, topk: int, slot: int,
              chunks: int) -> tuple[Any, ...]:
    """A :class:`BoundCall`'s key in its weight's ``plans``: what settles the call's path
    (``chunks``: a large call's split, ``Launcher.chunks_for``: row chunks or token halves,
    none while another launch is in flight, so an idle and a busy launch each keep their
    own)."""
    return (x.shape, x.dtype, precision, flags, out_dtype, topk, slot, chunks)


class CudaBackend(Backend):
    """Q6_K matmuls on one CUDA device through CuPy; see the module docstring.

    ``table``: the dispatch table (default: the committed one; None: heuristics only; a path:
    that file). ``graphs``: capture each launch sequence as a CUDA graph (the wall bench
    turns it off to compare)."""

    launch_slots = BATCH_SLOTS  # the batcher's launches in flight (kernels/cuda/launch.py)
    now_slots = SLOTS  # a launch_now pipeline's (the lane's full batches)

    name = "cuda"
    # the precisions a call never resolves to Q8_1 at on this backend (dispatch's COLUMNS:
    # AUTO's paths are exact, mma_f16 and cublas_f16 only): api.launch_ieee needs neither
    # plan() nor a non-finite scan for them, so a call at AUTO costs the host what one at F16
    # does (tests/kernels/test_cuda_backend_host.py holds the dispatch to it)
    no_q8_1 = frozenset((Precision.EXACT, Precision.F16, Precision.AUTO))
    # gathered(): the placeholder x it handed out and its pieces, (address, bytes) each,
    # until the next launch of it or staging (None: none out)
    _gather: tuple[np.ndarray, tuple[tuple[int, int], ...]] | None = None

    def __init__(self, device: int = 0, table: DispatchTable | str | Path | bool | None = True,
                 graphs: bool = True) -> None:
        self.ctx = DeviceContext(device)
        self.device = device
        self.sm_count = self.ctx.sm_count
        self.cc = self.ctx.cc
        if table is True:
            table = load_default_table()
        elif isinstance(table, str | Path):
            table = DispatchTable.load(table)
        self.storage = Storage(self.ctx, pairs_from_env())
        self.dispatch = Dispatch(table or None, self.sm_count)
        self.launcher = Launcher(self.ctx, graphs=graphs,
                                 anchor=launch_mod.timing_anchor_from_env(),
                                 copy_max=launch_mod.copy_kernel_from_env())
        # callers' page-locked host memory (the service's shm regions): x and y DMA'd
        # straight from/to it (Launcher.launch_host); portable: pinned for every context
        rt = self.ctx.cp.cuda.runtime
        self.hostio = HostIO(lambda p, n: self._on_dev(rt.hostRegister, p, n, 1),
                             lambda p: self._on_dev(rt.hostUnregister, p),
                             self.launcher.sync)  # (its copy streams too: RegionCall)

    def _on_dev(self, fn: Any, *args: Any) -> Any:
        with self.ctx.dev:
            return fn(*args)

    @property
    def stream(self) -> Any:
        """The CuPy stream every call of this backend is enqueued on."""
        return self.ctx.stream

    # -- device and memory --------------------------------------------------------------------
    def device_name(self) -> str:
        c = self.ctx
        return f"{c.name} (cuda:{self.device}, sm_{c.cc}, {c.sm_count} SMs)"

    def memory(self) -> MemoryInfo:
        with self.ctx.dev:
            free, total = self.ctx.cp.cuda.runtime.memGetInfo()
        pool = self.ctx.pool
        return MemoryInfo(free=int(free), total=int(total), pool_used=pool.used_bytes(),
                          pool_total=pool.total_bytes())

    def weight_nbytes(self, rows: int, k: int, layout: Layout) -> int:
        return storage.weight_nbytes(rows, k, layout)

    def load_scratch_nbytes(self, rows: int, k: int, chunk_bytes: int) -> int:
        """Device staging for one chunk (the pinned host buffer is not VRAM)."""
        return storage.pool_round(storage.staging_rows(rows, k, chunk_bytes) *
                                  q6k.aos_nbytes(1, k))

    # -- weights ------------------------------------------------------------------------------
    def load(self, chunks: AosChunks, rows: int, k: int, layout: Layout,
             chunk_bytes: int = 64 << 20) -> ResidentWeight:
        return self.storage.load(chunks, rows, k, layout, chunk_bytes)

    def relayout(self, w: ResidentWeight, layout: Layout,
                 chunk_bytes: int = 64 << 20) -> ResidentWeight:
        return self.storage.relayout(w, layout)

    def free(self, w: ResidentWeight) -> None:
        w.data = None

    def read_aos(self, w: ResidentWeight) -> np.ndarray:
        return self.storage.read_aos(w)

    # -- dispatch -----------------------------------------------------------------------------
    def choose(self, n: int, precision: Precision, flags: KernelFlags, rows: int = 0,
               k: int = 0) -> Choice:
        """Kernel path, resolved precision and launch shape of a call (kernels/cuda/dispatch)."""
        return self.dispatch.choose(n, precision, flags, rows, k)

    def plan(self, n: int, precision: Precision, flags: KernelFlags, rows: int = 0,
             k: int = 0) -> tuple[str, Precision]:
        c = self.choose(n, precision, flags, rows, k)
        return f"cuda.{c.path}.{flags.layout.value}", c.precision

    # -- matmul -------------------------------------------------------------------------------
    def matmul(self, w: ResidentWeight, x: np.ndarray, *, precision: Precision = Precision.AUTO,
               flags: KernelFlags = DEFAULT_FLAGS, out_dtype: np.dtype | None = None,
               topk: int = 0) -> MatmulResult:
        return self.launch(w, x, precision=precision, flags=flags, out_dtype=out_dtype,
                           topk=topk).wait()

    def launch(self, w: ResidentWeight, x: np.ndarray, *, precision: Precision = Precision.AUTO,
               flags: KernelFlags = DEFAULT_FLAGS, out_dtype: np.dtype | None = None,
               topk: int = 0) -> Launched:
        lc = self.launcher
        ws = lc.ws
        g = self._gather
        if g is not None and x is g[0]:  # gathered()'s placeholder: by its pieces, or filled
            self._gather = None
            got = self._launch_gathered(w, x, g[1], precision, flags, out_dtype, topk)
            if got is not None:
                return got
            fill_gathered(x, g[1])  # the usual staged launch from here
        staged = x is ws.staged  # built by staging(): C-contiguous [N, K]
        cw = w.data
        # A repeated call first: its cached BoundCall (the whole path after its first calls)
        # is looked up before check_matmul, which its key makes redundant for a C-contiguous
        # x: a key of this weight's plans holds x's shape and dtype and the top-k, which passed
        # the checks when it was made (an x of another K never matches; a strided x takes the
        # checks' contiguous copy); x in a caller's page-locked region takes launch_host's
        # path (_launch); with every slot held, _launch refuses it after the checks, as before.
        if type(cw) is CudaWeight and (staged or (
                type(x) is np.ndarray and x.ndim == 2 and x.flags.c_contiguous
                and not self.hostio.covers(x))):
            slot = ws.staged_slot if staged else ws.first_free()
            if slot >= 0:
                # the hottest way: the call this x shape and slot took last, its arguments
                # the same objects (BoundCall.same; its chunk state read as the key's is)
                call = cw.plans.get((x.shape, slot)) if launch_mod.HOT_CALLS else None
                if call is not None and call.same(cw, precision, flags, out_dtype, topk,
                                                   x.dtype):
                    return call.launch() if staged else call.launch(x)
                n = x.shape[0]
                call = cw.plans.get(_call_key(x, precision, flags, out_dtype, topk, slot,
                                              lc.chunks_for(cw, slot, n * w.rows, x.nbytes, n)))
                if call is not None and call.live():
                    cw.plans[x.shape, slot] = call.hot(precision, flags, out_dtype)
                    return call.launch() if staged else call.launch(x)
        x = check_matmul(w, x, topk)
        return self._launch(w, weight_data(w), x, staged, precision, flags, out_dtype, topk)

    def _launch(self, w: ResidentWeight, cw: CudaWeight, x: np.ndarray, staged: bool,
                precision: Precision, flags: KernelFlags, out_dtype: np.dtype | None,
                topk: int) -> Launched:
        """:meth:`launch`'s full path for a checked ``x``: dispatch, the launcher (binding,
        capture); once the call's sequence is a graph, its :class:`BoundCall` is cached on the
        weight."""
        c = self.choose(x.shape[0], precision, flags, w.rows, w.k)
        kernel = f"cuda.{c.path}.{w.layout.value}"
        io = self.hostio
        if (not topk and c.path != "cublas_f16" and c.cfg is not None and x.dtype in IN_TYPES
                and io.covers(x)):  # x in page-locked host memory: no staging copy
            with io.lock, self.ctx.dev, self.ctx.stream:
                if io.covers(x):  # (still: an unpin may have come in between)
                    r = io.take(x, w.rows, out_dtype)
                    y_out = None if r is None else r.y
                    finish = self.launcher.launch_host(w, cw, x, c.path, c.cfg, out_dtype,
                                                       y_out)
                    if r is not None and r.want and c.precision is not Precision.Q8_1:
                        # the caller repeats this call at these places: the whole of it as
                        # one graph from now on (a Q8_1 call is left out: launch_ieee
                        # checks its x for non-finite rows per call)
                        r.call = RegionCall(self.launcher, w, cw, x, y_out, c.path, c.cfg,
                                            kernel, c.precision, io)
                else:
                    finish = self.launcher.launch(w, cw, x, c.path, c.cfg, out_dtype, topk)
        else:
            lc = self.launcher
            slot = lc.ws.staged_slot if staged else lc.ws.free_slot()
            chunks = lc.chunks_for(cw, slot, x.shape[0] * w.rows, x.nbytes, x.shape[0])
            with self.ctx.dev, self.ctx.stream:
                finish = lc.launch(w, cw, x, c.path, c.cfg, out_dtype, topk, chunks)
            call = lc.bound_call(w, cw, x, c.path, c.cfg, out_dtype, topk, slot, kernel,
                                 c.precision, chunks)
            if call is not None:
                cw.plans[_call_key(x, precision, flags, out_dtype, topk, slot, chunks)] = call
                cw.plans[x.shape, slot] = call.hot(precision, flags, out_dtype)

        def wait() -> MatmulResult:
            y, top, seconds = finish()
            return MatmulResult(y, kernel, w.layout, c.precision,
                                KernelTiming(host_seconds=seconds), topk=top)

        return Launched(wait)

    def launch_many(self, weights: Sequence[ResidentWeight], x: np.ndarray, *,
                    precision: Precision = Precision.AUTO, flags: FlagsArg = DEFAULT_FLAGS,
                    out_dtype: np.dtype | None = None, topk: int = 0) -> LaunchedMany:
        """:meth:`Backend.launch_many` in one launch sequence (``Launcher.launch_many``): x
        uploaded once, every part's kernels between its own events, every y in one device
        buffer and one download, one sync; a CUDA graph from its second call, and from then
        on the cached :class:`ManyCall` (a dict lookup and the graph launch). One weight, a
        top-k epilogue, a part on cuBLAS (N > 256, the kill switch) or x in a caller's
        page-locked region: each part's :meth:`launch` and wait in turn (the default)."""
        lc = self.launcher
        ws = lc.ws
        staged = x is ws.staged
        fl = flags if isinstance(flags, KernelFlags) else tuple(flags)
        if not topk and len(weights) > 1 and type(weights[0].data) is CudaWeight:
            slot = ws.staged_slot if staged else -1
            if staged or not self.hostio.covers(x):
                if not staged:
                    slot = ws.free_slot()
                call = weights[0].data.plans.get(
                    (tuple([id(w.data) for w in weights]), x.shape, x.dtype, precision, fl,
                     out_dtype, slot))
                if call is not None and call.live(weights):
                    return call.launch(None if staged else x)
        fls = flags_of(flags, len(weights))
        x = check_many(weights, x, topk)
        n = int(x.shape[0])
        cws, cs = [], []
        for i, (w, f) in enumerate(zip(weights, fls, strict=True)):
            with part_error(i):
                cws.append(weight_data(w))
                cs.append(self.choose(n, precision, f, w.rows, w.k))
        if (topk or len(weights) < 2 or x.dtype not in IN_TYPES or self.hostio.covers(x)
                or any(c.path == "cublas_f16" or c.cfg is None for c in cs)):
            return super().launch_many(weights, x, precision=precision, flags=fls,
                                       out_dtype=out_dtype, topk=topk)
        parts = [(c.path, c.cfg) for c in cs]
        slot = ws.staged_slot if staged else ws.free_slot()
        with self.ctx.dev, self.ctx.stream:
            finish = lc.launch_many(list(weights), cws, x, parts, out_dtype, slot, staged)
        names = [(f"cuda.{c.path}.{w.layout.value}", w.layout, c.precision)
                 for c, w in zip(cs, weights, strict=True)]
        key = lc.many_key(cws, parts, n, IN_TYPES[x.dtype],
                          launch_mod.many_out(n, sum(w.rows for w in weights), out_dtype), slot)
        ckey = (tuple(map(id, cws)), x.shape, x.dtype, precision, fl, out_dtype, slot)
        call = lc.many_call(key, ckey, slot, names, out_dtype, cws)
        if call is not None:  # (found under its key in the first part's plans; live while
            cws[0].plans[ckey] = call  # every part's plans hold it under itself)
            for cw in cws:
                cw.plans[call] = call

        def wait() -> list[MatmulResult]:
            return [MatmulResult(y, kernel, layout, prec, KernelTiming(host_seconds=sec))
                    for (y, sec), (kernel, layout, prec) in zip(finish(), names, strict=True)]

        return LaunchedMany(wait)  # type: ignore[arg-type]

    def gathered(self, pieces: Sequence[tuple[int, int]], n: int, k: int,
                 dtype: np.dtype) -> np.ndarray | None:
        """x [n, k] of ``dtype`` (C-contiguous) whose rows lie, in order, in the ``pieces`` of
        page-locked host memory ((address, bytes) each; the service's pinned front-end
        arenas, kernels/hostio.py): a placeholder in the staging buffer, NOT filled, which
        the next launch of exactly it (F16 or EXACT precision: a Q8_1 call reads x on the
        host first) takes by :meth:`Launcher.launch_pieces` (each piece DMA'd into its rows of
        the device's x: no concatenation on the host); a launch that cannot (cuBLAS, a
        top-k epilogue, a piece unpinned meanwhile) fills it from the pieces first and goes
        the staged way. None (nothing handed out): a piece outside the page-locked ranges,
        or a dtype the kernels do not take."""
        dt = np.dtype(dtype)
        io = self.hostio
        if dt not in IN_TYPES or not pieces or sum(nb for _, nb in pieces) != n * k * dt.itemsize:
            return None
        for p, nb in pieces:
            if not io.covers_range(p, nb):
                return None
        x = self.staging(n, k, dt)
        self._gather = (x, tuple(pieces))
        return x

    def _launch_gathered(self, w: ResidentWeight, x: np.ndarray,
                         pieces: tuple[tuple[int, int], ...], precision: Precision,
                         flags: KernelFlags, out_dtype: np.dtype | None,
                         topk: int) -> Launched | None:
        """:meth:`launch` of a :meth:`gathered` placeholder by its pieces; None: not so (fill
        it and launch it staged)."""
        cw = w.data
        n = int(x.shape[0])
        if topk or type(cw) is not CudaWeight or x.shape[1] != w.k:
            return None
        c = self.choose(n, precision, flags, w.rows, w.k)
        if c.path == "cublas_f16" or c.cfg is None:
            return None
        io, lc = self.hostio, self.launcher
        if lc.ws.held(lc.ws.staged_slot):  # (the staged way refuses it, as any staged x)
            return None
        with io.lock, self.ctx.dev, self.ctx.stream:
            for p, nb in pieces:  # (still: an unpin may have come in between)
                if not io.covers_range(p, nb):
                    return None
            finish = lc.launch_pieces(w, cw, pieces, n, IN_TYPES[x.dtype], c.path, c.cfg,
                                      out_dtype, lc.ws.staged_slot)
        kernel = f"cuda.{c.path}.{w.layout.value}"

        def wait() -> MatmulResult:
            y, _, seconds = finish()
            return MatmulResult(y, kernel, w.layout, c.precision,
                                KernelTiming(host_seconds=seconds))

        return Launched(wait)

    def staging(self, n: int, k: int, dtype: np.dtype) -> np.ndarray:
        """A view of the pinned buffer ``matmul`` uploads x from: activations built in it
        are not copied again (see :meth:`Backend.staging`)."""
        self._gather = None  # (a gathered placeholder not launched: never to be)
        dt = np.dtype(dtype)
        ws = self.launcher.ws
        ws.staged_slot = ws.free_slot()  # the next launch's: not one a launch in flight uses
        buf = ws.host(n * k * dt.itemsize, ws.staged_slot)
        ws.staged = buf[: n * k * dt.itemsize].view(dt).reshape(n, k)
        return ws.staged

    def run(self, w: ResidentWeight, xd: Any, dtype: np.dtype, path: str,
            cfg: Cfg | None = None) -> Any:
        """Device-side matmul: ``xd`` [N, K] on the device (bf16 as uint16 bits) -> f32 y.

        ``cfg`` None: the launch shape the dispatch gives ``path`` for this call. Enqueues on
        the backend's stream and returns without synchronizing (bench and tests)."""
        cw = weight_data(w)
        if path not in KERNELS:
            raise DeviceError(f"unknown kernel path {path!r}")
        in_t = IN_TYPES.get(np.dtype(dtype))
        if in_t is None:
            raise FormatError(f"unsupported activation dtype {dtype}")
        n = int(xd.shape[0])
        if cfg is None and path != "cublas_f16":
            c = self.choose(n, KERNELS[path], DEFAULT_FLAGS, w.rows, w.k)
            cfg = c.cfg if c.path == path else default_cfg(path, n, w.rows, self.sm_count)
        with self.ctx.dev, self.ctx.stream:
            return self.launcher.enqueue(w, cw, xd, in_t, path, cfg)

    def launch_device(self, w: ResidentWeight, xd: Any, dtype: np.dtype, path: str,
                      cfg: Cfg | None, slot: int | None = None) -> tuple[Any, Any, Any]:
        """:meth:`run` for the service's CUDA regions: (f32 y on the device, start, end), the
        events around the kernels only (``Launcher.launch_device``; y is the workspace's, valid
        until the next launch). cuBLAS (the kill switch) keeps direct launches between its
        events. Call under the device thread's exclusivity; no sync. ``slot``: the launch
        slot the caller holds (``Launcher.launch_device``)."""
        cp = self.ctx.cp
        in_t = IN_TYPES.get(np.dtype(dtype))
        if path == "cublas_f16" or cfg is None or in_t is None:
            with self.ctx.dev, self.ctx.stream:
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record(self.ctx.stream)
                y = self.run(w, xd, dtype, path, cfg)
                end.record(self.ctx.stream)
            return y, start, end
        with self.ctx.dev, self.ctx.stream:
            return self.launcher.launch_device(w, weight_data(w), xd, in_t, path, cfg, slot)

    def close(self) -> None:
        """Drop the per-backend buffers (weights are freed by their owner)."""
        self.launcher.ws.clear()

