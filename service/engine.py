"""The core of the worker: registry + VRAM accountant + batchers + flags on one backend.

No gRPC here: the servicer converts wire messages into the dataclasses below and calls these
coroutines on the event loop. Device work (loads, relayouts, matmuls, frees) all runs in the
device's single worker thread, so it is serialised on the device and never blocks the loop.
Admin operations (load, upload, unload, relayout) hold one asyncio lock: they are rare, and it
keeps the VRAM figures exact without reasoning about interleavings.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any

import numpy as np

from q6serve.kernels.api import (
    DTYPES,
    Backend,
    KernelFlags,
    Launched,
    Layout,
    MatmulResult,
    Precision,
    dtype_name,
    launch_ieee,
    launch_many_ieee,
)
from q6serve.kernels.epilogue import check_k
from q6serve.kernels.errors import (
    Cancelled,
    DeviceError,
    FailedPrecondition,
    FormatError,
    InvalidArgument,
    NotFound,
    Q6Error,
    ResourceExhausted,
    Unavailable,
)

from . import envvars, gcfreeze
from .batcher import (
    Batcher,
    BatchKey,
    BatchSettings,
    BatchStats,
    DeadlineExceeded,
    DirectCall,
    Group,
    MatmulReply,
)
from .config import WorkerConfig
from .device_thread import Device, handoff_yield_for
from .engine_types import MatmulCall, StatusView, UploadSpec, WeightView, check_upload_spec
from .flags import Flags, FlagState
from .heap import fix_heap_thresholds, malloc_trim, mmap_threshold
from .metrics import Metrics
from .registry import (
    BATCHER_HOST_BYTES,
    WEIGHT_HOST_BYTES,
    Registry,
    WeightEntry,
)
from .shards import RowSelect
from .threads import busy_poll, run_in_thread
from .uploads import UploadBuffer
from .vram import VramAccountant
from .weight_sources import WeightSource, gguf_sources

if TYPE_CHECKING:
    pass

log = logging.getLogger("q6serve.engine")

LOG_EACH = 16  # loads of more weights log these one by one, then one line for the rest
LOOP_STEP = 64  # per-weight work on the event loop yields after this many weights
# Weights that have a batcher at once. A batcher (its task, queue, events, closures) is ~25
# objects for the cyclic GC to walk and ~3 KB: a weight gets one at load while fewer than this
# many have one, else on its first matmul, and beyond this many the oldest idle ones are
# closed (made again when next used). 65536 weights with a batcher each made full
# collections of ~0.4 s on the event loop (docs/RELIABILITY.md, "Many weights").
MAX_LIVE_BATCHERS = 4096
MAX_MANY_GOS = 256  # _launch_many's functions kept (one per multi-weight call kind)
RETIRE_STEP = 8  # batchers looked at per new one beyond the cap (busy ones go to the back)


TRIM_EVERY_S = 5.0  # the heap trim loop's period (_trim_heap; service/heap.py)


_NAME_OF = {dt: name for name, dt in DTYPES.items()}
# the kernels' flags by (soa, decode_mmq): made once, not per launch
_FLAGS = {(soa, mmq): KernelFlags(soa=soa, decode_mmq=mmq)
          for soa in (False, True) for mmq in (False, True)}  # the native dtypes' names, by dict


def _watched(started: Launched, failed: Callable[[DeviceError], None]) -> Launched:
    """``started`` with a device error at its wait passed to ``failed`` (then raised)."""
    if started.finished:
        return started

    def wait() -> Any:
        try:
            return started.wait()
        except DeviceError as err:
            failed(err)
            raise

    return Launched(wait)


# Engine._key's BatchKeys by (x dtype, precision, out dtype, top-k k)
_BATCH_KEYS: dict[tuple[np.dtype, Precision, np.dtype, int], BatchKey] = {}
MAX_BATCH_KEYS = 1024


def _dtype_name(dt: np.dtype) -> str:
    """``dtype_name`` by dict lookup (per request on the loop; the scan for the rest)."""
    return _NAME_OF.get(dt) or dtype_name(dt)


def version() -> str:
    try:
        return metadata.version("q6serve")
    except metadata.PackageNotFoundError:
        return "0+unknown"



class Engine:
    def __init__(self, backend: Backend, config: WorkerConfig, metrics: Metrics | None = None,
                 ) -> None:
        self.backend = backend
        self.config = config
        self.metrics = metrics
        self.flags = Flags(config.flags)
        self.version = version()
        self.device = Device(backend.name, handoff_yield_for(backend.name),
                             inline_s=config.inline_device_us * 1e-6,
                             launch_slots=backend.launch_slots,
                             now_slots=backend.now_slots)
        self.vram = VramAccountant(config.vram_budget.resolve(backend.memory().free),
                                   backend.memory)
        self.registry = Registry(self._on_unused, config.max_weights)
        self._settings = BatchSettings(max_rows=config.max_batch_rows,
                                       max_delay_s=config.max_batch_delay_us * 1e-6,
                                       max_queue_rows=config.max_queue_rows)
        self._admin = asyncio.Lock()
        self._abandon = threading.Event()  # set when a drain's grace period is over
        self._receiving = 0  # uploads reading their stream
        self._scratch = 0  # matmul workspace reserved for the largest resident weight
        self._workspaces: collections.Counter[int] = collections.Counter()  # size -> weights
        self._serving = True
        self._relayouts = 0
        self._tasks: set[asyncio.Task[object]] = set()
        # weights with a batcher, oldest first (an ordered set: O(1) pop of the oldest)
        self._live: collections.OrderedDict[WeightEntry, None] = collections.OrderedDict()
        self.healthy = True  # False after a device error (health NOT_SERVING)
        self._device_error = ""
        self._health_listeners: list[Callable[[bool], None]] = []
        self._group: Group | None = None  # set inside grouped(): calls queued as one job
        # (N, precision, flags) the backend's dispatch accepted (start_matmul; bounded: N <=
        # max_request_rows, four precisions, the flags' states)
        self._planned: dict[FlagState, set[tuple[int, Precision]]] = {}
        self._plan_state: FlagState | None = None  # the last state _admit looked up, and its set
        self._plan_set: set[tuple[int, Precision]] = set()
        self.flags.subscribe(self._on_flags)
        # Q6SERVE_BUSY_POLL_US: the loop busy-polls while no job is in the device thread
        self.busy_poll = busy_poll(asyncio.get_running_loop(), self.device.thread_idle)
        self._mmap_threshold = mmap_threshold()  # (a bad value fails the start)
        # Q6SERVE_MULTI_PIPELINE=1 (off by default): multi.run_weights_now launches a call's
        # parts behind each other (launch_direct) and waits for them in order, where the one
        # backend call (MULTI_LAUNCH) is off or declined (H200, session 14, the 28-layer
        # replay: no gain, S=1 69.6 -> 69.9 ms, S=8 115.4 -> 121.6)
        self.multi_pipeline = bool(envvars.MULTI_PIPELINE.read())
        # Q6SERVE_MULTI_LAUNCH (on by default since session 27; =0: each part its own
        # launch and wait): a multi-weight call's parts that run together (the direct path; a
        # group job of the same requests) are one backend call (Backend.launch_many: x
        # uploaded once, every part's kernel, one sync). H200, session 27, the 28-layer replay
        # alternated (11 runs): S=1 step p50 38.19 -> 34.24 ms, S=8 80.71 -> 70.35, the
        # worker's window -8% / -19%; earlier A/Bs tied or split by host (bench/RESULTS.md)
        self.multi_launch = bool(envvars.MULTI_LAUNCH.read())
        self._loop = asyncio.get_running_loop()
        self._batch_stats: list[BatchStats] = []  # recorded in the next trip (_defer_batch)
        # _launch_many's function per (key, entries): (the workspace it needs, it); let go
        # when any weight is freed (its entries are not reached again), bounded
        self._many_gos: dict[tuple[Any, ...], tuple[int, Callable[[np.ndarray], Launched]]] = {}
        self._poller = self._spawn(self._poll_metrics())
        self._trimmer = self._spawn(self._trim_heap())
        self._publish()

    def describe(self) -> str:
        return (f"engine: backend {self.backend.name} on {self.backend.device_name()}, "
                f"VRAM budget {self.vram.budget} bytes ({self.config.vram_budget}), "
                f"flags {self.flags.state}")

    # -- helpers ----------------------------------------------------------------------------
    def _spawn(self, coro: object) -> asyncio.Task[object]:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _shielded(self, coro: object) -> object:
        """Run an admin operation to completion even if its caller goes away."""
        return await asyncio.shield(self._spawn(coro))

    def _check_serving(self) -> None:
        if not self._serving:
            raise Unavailable("the worker is draining and takes no new requests")
        if not self.healthy:
            raise Unavailable(f"the device failed ({self._device_error}); this worker takes "
                              "no new work until it is restarted")

    def _workspace(self, rows: int, k: int) -> int:
        n = max(self.config.max_batch_rows, self.config.max_request_rows)
        return n * (k + rows) * 4  # f32 activations + f32 output of the largest launch

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.set_vram(self.vram.stats())
            self.metrics.set_weights_loaded(len(self.registry))
            self.metrics.set_flags(self.flags.state)

    async def _trim_heap(self) -> None:
        """Every TRIM_EVERY_S, in a thread: hand the C heap's free pages back to the OS. glibc
        keeps what big transient buffers (replies, requests, upload segments) freed in its
        arenas: after 8 non-reading streams the RSS stayed 350 MB up although every figure
        was back (docs/RELIABILITY.md, "The targets, measured")."""
        if self._mmap_threshold:
            fix_heap_thresholds(self._mmap_threshold)
        if malloc_trim is None:
            return
        while True:
            await asyncio.sleep(TRIM_EVERY_S)
            gcfreeze.collect_if_asked()  # abandoned calls' cycles first, then the trim
            await run_in_thread(malloc_trim, 0)

    async def _poll_metrics(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            if self.metrics is not None:
                self.metrics.poll()
                self._publish()

    def _view(self, e: WeightEntry) -> WeightView:
        return WeightView(e.name, e.rows, e.k, e.nbytes, e.resident.layout, e.sha256, e.source,
                          e.batcher.in_flight if e.batcher is not None else 0,
                          e.row_begin, e.tensor_rows or e.rows)

    # -- loading ----------------------------------------------------------------------------
    async def load_gguf(self, rel_path: str, tensors: list[str], prefix: str = "",
                        rows: RowSelect | None = None, placement: str | None = None,
                        ) -> list[WeightView]:
        """Load tensors of a GGUF file; ``rows`` narrows each to a row range (sharding).
        ``placement`` matters on multi-device workers only (service/devices.py)."""
        self._check_serving()
        sources = await gguf_sources(self.config.model_dir, rel_path, tensors, prefix, rows,
                                     self.abandoned)
        return await self.load_sources(sources)

    async def load_sources(self, sources: list[WeightSource]) -> list[WeightView]:
        """Load every source or none (shielded: it completes even if the caller goes away)."""
        self._check_serving()
        return await self._shielded(self._load_all(sources))  # type: ignore[return-value]

    def check_fits(self, rows: int, k: int) -> None:
        """RESOURCE_EXHAUSTED now if loading a rows x k weight cannot fit the budget."""
        self.vram.check(**self._load_needs(rows, k))

    async def upload(self, spec: UploadSpec, chunks: AsyncIterator[bytes]) -> WeightView:
        """Receive, check and load an upload. The data is held in segments reserved as
        ``staging`` as it arrives (service/uploads.py): a header commits nothing, and the
        figures show what an upload holds."""
        self._check_serving()
        buf = self.upload_buffer(spec)
        self.check_fits(spec.rows, spec.k)  # nor buffer what cannot fit
        self._receiving += 1
        try:
            await buf.receive(chunks)
        finally:
            self._receiving -= 1
        src = WeightSource(spec.name, spec.rows, spec.k, "upload", buf.row_chunks)

        async def load() -> list[WeightView]:
            try:
                buf.hand_over()
                return await self._load_all([src])
            finally:
                buf.release()

        views = await self._shielded(load())
        return views[0]  # type: ignore[index]

    def upload_buffer(self, spec: UploadSpec, accounted: bool = True) -> UploadBuffer:
        """Check an upload header (before any data is read) and make its buffer."""
        check_upload_spec(spec, self.config.max_upload_bytes)
        self.registry.check_available([spec.name])  # fail before reading the stream
        return UploadBuffer(spec.name, spec.rows, spec.k, spec.fmt, spec.total_bytes,
                            spec.sha256, self.vram if accounted else None, self.abandoned)

    async def _load_all(self, sources: list[WeightSource]) -> list[WeightView]:
        """Load every source or none: a failure frees what this call loaded and re-raises."""
        async with self._admin:
            with self.registry.claim([s.name for s in sources]):
                done: list[WeightEntry] = []
                try:
                    for s in sources:
                        done.append(await self._load_one(s))
                        if len(done) % gcfreeze.FREEZE_AT == 0:
                            gcfreeze.freeze()  # a long load: freeze as it goes
                except BaseException:
                    for e in done:
                        await self._free(e)
                    self._shrink_scratch()
                    self._settle_gc()
                    raise
                for i, e in enumerate(done):
                    if len(self._live) < MAX_LIVE_BATCHERS:
                        self._batcher(e)  # else made by its first matmul
                    self.registry.add(e)
                    self._count_workspace(e, +1)
                    if i < LOG_EACH:
                        log.info("loaded %s: %dx%d, %d bytes %s from %s", e.name, e.rows, e.k,
                                 e.nbytes, e.resident.layout.value, e.source)
                    if i % LOOP_STEP == LOOP_STEP - 1:
                        await asyncio.sleep(0)  # many weights: let the loop breathe
                if len(done) > LOG_EACH:
                    log.info("loaded %d more weights (%d bytes) from %s", len(done) - LOG_EACH,
                             sum(e.nbytes for e in done[LOG_EACH:]), done[-1].source)
                self._settle_gc()
        self._publish()
        views = []
        for i, e in enumerate(done):
            views.append(self._view(e))
            if i % LOOP_STEP == LOOP_STEP - 1:
                await asyncio.sleep(0)
        return views

    def _count_workspace(self, e: WeightEntry, delta: int) -> None:
        ws = self._workspace(e.rows, e.k)
        self._workspaces[ws] += delta
        if self._workspaces[ws] <= 0:
            del self._workspaces[ws]

    def _load_needs(self, rows: int, k: int) -> dict[str, int]:
        """What loading a rows x k weight reserves now, per accountant category."""
        layout = self.flags.state.kernel_flags().layout
        return {"weights": self.backend.weight_nbytes(rows, k, layout),
                "staging": self.backend.load_scratch_nbytes(rows, k,
                                                            self.config.load_chunk_bytes),
                "scratch": max(0, self._workspace(rows, k) - self._scratch)}

    async def _load_one(self, s: WeightSource) -> WeightEntry:
        layout = self.flags.state.kernel_flags().layout
        chunk = self.config.load_chunk_bytes
        needs = self._load_needs(s.rows, s.k)
        wbytes, staging, extra = needs["weights"], needs["staging"], needs["scratch"]
        h = hashlib.sha256()

        def hashed() -> Iterator[np.ndarray]:
            for c in s.chunks(chunk):
                if self._abandon.is_set():  # a drain's grace period is over
                    raise Cancelled(f"loading {s.name!r} abandoned: the worker is stopping")
                h.update(np.ascontiguousarray(c).data)
                yield c

        with self.vram.reserve(weights=wbytes, staging=staging, scratch=extra) as res:
            resident = await self.device.run(self.backend.load, hashed(), s.rows, s.k, layout,
                                             chunk)
            res.keep("weights", resident.nbytes)
            res.keep("scratch", extra)
            self._scratch += extra
        return WeightEntry(s.name, s.rows, s.k, h.hexdigest(), s.source, resident,
                           row_begin=s.row_begin, tensor_rows=s.whole_rows)

    def _make_batcher(self, e: WeightEntry) -> Batcher:
        loop = asyncio.get_running_loop()

        def failed(err: DeviceError) -> None:
            loop.call_soon_threadsafe(self._device_failed, err)  # from either thread

        def launch(x: np.ndarray, key: BatchKey) -> Launched:
            w = e.resident  # read where the job runs: relayouts swap it on the device thread
            flags = _FLAGS[w.layout is Layout.SOA, self.flags.state.decode_mmq]
            try:
                started = launch_ieee(self.backend, w, x, precision=key.precision, flags=flags,
                                      out_dtype=DTYPES[key.out_dtype], topk=key.topk)
            except DeviceError as err:
                failed(err)
                raise
            return _watched(started, failed)

        def run(x: np.ndarray, key: BatchKey) -> MatmulResult:
            return launch(x, key).wait()

        def bind(key: BatchKey) -> Callable[[np.ndarray], MatmulResult]:
            """``run`` with ``key``'s fields bound: a direct-path job (Batcher.direct)."""
            backend, flags, soa = self.backend, self.flags, Layout.SOA
            precision, out, topk = key.precision, DTYPES[key.out_dtype], key.topk
            def job(x: np.ndarray) -> MatmulResult:
                w = e.resident  # (as launch: read where the job runs)
                try:
                    return launch_ieee(backend, w, x, precision=precision, out_dtype=out,
                                       flags=_FLAGS[w.layout is soa, flags.state.decode_mmq],
                                       topk=topk).wait()
                except DeviceError as err:
                    failed(err)
                    raise

            return job

        return Batcher(e.name, self.device, run, self._settings, self._dynamic_batching,
                       self._defer_batch, self.backend.staging, launch, bind,
                       self._launch_many if self.multi_launch else None, e)

    def _launch_many(self, batchers: Sequence[Batcher], key: BatchKey,
                     ) -> Callable[[np.ndarray], Launched] | None:
        """``Batcher.many`` (on the loop): the function that runs an ``x`` on every batcher's
        weight as one backend call (``launch_many_ieee``: ``Backend.launch_many``, x's
        non-finite rows looked for once), called where the job runs (the loop or the device
        thread); its ``wait()`` gives one result per batcher, in order. The call's y (N x
        the weights' rows together) must fit the matmul workspace: where it exceeds the one
        reserved for the largest weight, the reservation grows to it now (VRAM accounting
        stays exact; the next unload shrinks it back to the largest weight's), or, over the
        budget, None: the parts run each as usual. A device error marks the worker
        unhealthy, as a part's own launch does."""
        entries = [b.entry for b in batchers]
        ck = (key, *entries)
        got = self._many_gos.get(ck)  # (per multi-weight direct call on the loop: the
        if got is not None and got[0] <= self._scratch:  # closure made once a kind)
            return got[1]
        need = self._workspace(sum(e.rows for e in entries), entries[0].k)
        if need > self._scratch:
            try:
                self.vram.reserve(scratch=need - self._scratch)  # (kept: it is ours now)
            except ResourceExhausted:
                return None
            self._scratch = need
            self._publish()
        backend, precision = self.backend, key.precision
        out, topk, failed = DTYPES[key.out_dtype], key.topk, self._failed_anywhere

        def go(x: np.ndarray) -> Launched:
            # (read where the job runs, as launch's: relayouts swap them on the device thread)
            ws = [e.resident for e in entries]
            mmq = self.flags.state.decode_mmq
            try:
                started = launch_many_ieee(
                    backend, ws, x, precision=precision, out_dtype=out, topk=topk,
                    flags=[_FLAGS[w.layout is Layout.SOA, mmq] for w in ws])
            except DeviceError as err:
                failed(err)
                raise
            return _watched(started, failed)

        if len(self._many_gos) >= MAX_MANY_GOS:
            self._many_gos.clear()
        self._many_gos[ck] = (need, go)
        return go

    def _failed_anywhere(self, err: DeviceError) -> None:
        """A device error heard on either thread: the worker marked unhealthy, on the loop."""
        self._loop.call_soon_threadsafe(self._device_failed, err)

    def _dynamic_batching(self) -> bool:
        return self.flags.state.dynamic_batching

    def _batcher(self, e: WeightEntry) -> Batcher:
        """The weight's batcher, made now if it has none (see MAX_LIVE_BATCHERS)."""
        b = e.batcher
        if b is None:
            b = e.batcher = self._make_batcher(e)
            self._live[e] = None
            if len(self._live) > MAX_LIVE_BATCHERS:
                self._retire_idle()
        return b

    def _retire_idle(self) -> None:
        """Close the oldest idle batchers beyond MAX_LIVE_BATCHERS: a bounded look per call,
        busy ones go to the back. Taken off their weight first, so no request can reach a
        batcher that is closing; an idle batcher has nothing queued or running."""
        for _ in range(RETIRE_STEP):
            if len(self._live) <= MAX_LIVE_BATCHERS:
                return
            e, _ = self._live.popitem(last=False)
            b = e.batcher
            if b is None:
                continue
            if b.in_flight:
                self._live[e] = None
                continue
            e.batcher = None
            self._spawn(b.close())

    def on_health(self, fn: Callable[[bool], None]) -> None:
        """``fn(False)`` runs (on the loop) when the device fails: the worker turns its health
        NOT_SERVING so load balancers stop sending work here."""
        self._health_listeners.append(fn)

    def _device_failed(self, err: DeviceError) -> None:
        log.error("device error, marking the worker unhealthy: %s", err)
        self.healthy = False
        self._device_error = str(err)[:200]
        for fn in self._health_listeners:
            fn(False)

    def _defer_batch(self, stats: BatchStats) -> None:
        """A batch's stats (every batcher's ``on_batch``, called on the loop as its replies
        are resolved): kept, and recorded by :meth:`_flush_batches` in the next loop trip,
        one trip for every batch of this one (off the replies' path: a direct call's reply
        is written before it; the histograms stay exact, only later by a trip)."""
        pending = self._batch_stats
        pending.append(stats)
        if len(pending) == 1:
            self._loop.call_soon(self._flush_batches)

    def _flush_batches(self) -> None:
        pending, self._batch_stats = self._batch_stats, []
        for stats in pending:
            self._on_batch(stats)

    def _on_batch(self, stats: BatchStats) -> None:
        if self.metrics is not None:
            self.metrics.observe_batch(stats)

    async def _free(self, e: WeightEntry) -> None:
        b, e.batcher = e.batcher, None  # also breaks the entry <-> batcher (closure) cycle
        self._many_gos.clear()
        self._live.pop(e, None)
        if not self._live:
            self._live = collections.OrderedDict()  # nor keep its largest table
        if b is not None:
            await b.close()
        nbytes = e.nbytes

        def job() -> None:
            self.backend.free(e.resident)

        await self.device.run(job)
        self.vram.release({"weights": nbytes})
        if e.freed is not None and not e.freed.done():
            e.freed.set_result(None)

    def _shrink_scratch(self) -> None:
        # the largest workspace among resident weights, from a count per size: O(sizes), not
        # O(weights) per unload (65536 weights made every unload cost ~10 ms, a close minutes)
        want = max(self._workspaces, default=0)
        if want < self._scratch:
            self.vram.release({"scratch": self._scratch - want})
            self._scratch = want

    def _settle_gc(self) -> None:
        """Short full collections with very many weights (service/gcfreeze.py)."""
        gcfreeze.settle(id(self), len(self.registry))

    def _on_unused(self, e: WeightEntry) -> None:
        self._spawn(self._free(e))

    # -- queries ----------------------------------------------------------------------------
    def list(self) -> list[WeightView]:
        return [self._view(e) for e in self.registry.entries()]

    def get(self, name: str) -> WeightView:
        return self._view(self.registry.get(name))

    def in_flight(self, name: str) -> int:
        """Requests of weight ``name`` queued or running (NOT_FOUND if it is not loaded)."""
        b = self.registry.get(name).batcher
        return b.in_flight if b is not None else 0

    async def unload(self, name: str) -> WeightView:
        """Remove at once; return after the memory is freed (in-flight requests finish)."""
        async def run() -> WeightView:
            async with self._admin:
                freed = asyncio.get_running_loop().create_future()
                e = self.registry.remove(name)  # a free it starts runs in a later loop trip
                e.freed = freed
                self._count_workspace(e, -1)
                view = self._view(e)
                log.info("unloading %s (%d requests in flight)", name, view.in_flight)
                await freed
                self._shrink_scratch()
                self._settle_gc()
            self._publish()
            return view

        return await self._shielded(run())  # type: ignore[return-value]

    def status(self) -> StatusView:
        return StatusView(self.backend.name, self.backend.device_name(), self.version,
                          self.vram.stats(), self.flags.state, len(self.registry),
                          self._serving and self.healthy, self.config.max_batch_rows,
                          self.config.max_batch_delay_us, self._relayouts > 0,
                          max_weights=self.config.max_weights,
                          host_overhead_bytes=self.host_overhead_bytes())

    def host_overhead_bytes(self) -> int:
        """Host memory of the weights' bookkeeping, from its documented fixed costs."""
        return len(self.registry) * WEIGHT_HOST_BYTES + len(self._live) * BATCHER_HOST_BYTES

    # -- matmul -----------------------------------------------------------------------------
    async def matmul(self, call: MatmulCall) -> MatmulReply:
        return await self.start_matmul(call)

    @contextlib.contextmanager
    def grouped(self) -> Iterator[None]:
        """The calls started inside (on the loop, with no await between them: the parts of
        one multi-weight call) run in one device job; each still batches with other callers'
        requests for its weight (``batcher.Group``). They are launched on leaving, also when
        a part was refused (the parts queued before it are cancelled by the caller)."""
        if self._group is not None:  # nested: the outer block launches
            yield
            return
        self._group = g = Group()
        try:
            yield
        finally:
            self._group = None
            g.launch()

    def _admit(self, call: MatmulCall, key: BatchKey | None = None,
               ) -> tuple[WeightEntry, BatchKey]:
        """The checks of a call before it may run (refusals raise here), and its batch key
        (``key``: made already); the weight's entry is acquired (the caller releases it
        when the call is done)."""
        if not self._serving or not self.healthy:
            self._check_serving()  # (its refusal)
        x = call.x
        if x.ndim != 2 or x.shape[0] < 1:
            raise InvalidArgument(f"activations must be [N, K] with N >= 1, got {x.shape}")
        n = int(x.shape[0])
        if n > self.config.max_request_rows:
            raise InvalidArgument(f"N={n} exceeds the per-request limit of "
                                  f"{self.config.max_request_rows} rows")
        if call.topk and call.out_dtype != DTYPES["f32"]:
            raise InvalidArgument(f"out_dtype {dtype_name(call.out_dtype)} with topk: the "
                                  "top-k values are always f32 (leave out_dtype unset)")
        if call.timeout is not None and call.timeout <= 0:
            raise DeadlineExceeded("deadline already passed")
        if key is None:
            key = self._key(call)
        e = self.registry.acquire(call.weight)  # kept alive until the call is done
        try:
            if x.shape[1] != e.k:
                raise FormatError(f"activations have K={x.shape[1]}, weight {e.name!r} has "
                                  f"K={e.k}")
            if call.topk:
                check_k(call.topk, e.rows, weight=e.name)
            # refuse what the current flags forbid before queueing (clear status, no batch);
            # what passed once passes again (the dispatch is a pure function of these)
            state = self.flags.state
            if state is self._plan_state:  # (a FlagState's hash is a Python call: ~1 us)
                planned = self._plan_set
            else:
                planned = self._planned.get(state)  # by state: (N, precision) passed under it
                if planned is None:
                    planned = self._planned[state] = set()
                self._plan_state, self._plan_set = state, planned
            if (n, call.precision) not in planned:
                self.backend.plan(n, call.precision, state.kernel_flags())
                planned.add((n, call.precision))
        except BaseException:
            self.registry.release(e)
            raise
        return e, key

    def start_matmul(self, call: MatmulCall,
                     sink: Callable[[asyncio.Future[MatmulReply]], None] | None = None,
                     ) -> asyncio.Future[MatmulReply]:
        """Check ``call`` and queue it now (on an idle device its launch is already submitted
        when this returns); the future resolves with the reply. A call that is refused raises
        here. Cancelling the future drops the request if it has not run yet. ``sink(fut)``
        runs in the loop trip that resolves the future (``Batcher.enqueue``)."""
        e, key = self._admit(call)
        try:
            fut = self._batcher(e).enqueue(call.x, key, call.timeout, sink, self._group)
        except BaseException:
            self.registry.release(e)
            raise
        fut.add_done_callback(lambda _: self.registry.release(e))
        return fut

    def run_now(self, call: MatmulCall, own: object = None,
                launch: Callable[[np.ndarray, BatchKey], Launched] | None = None,
                ) -> MatmulReply | None:
        """The direct path (issue 14): run a single-weight ``call`` here and now, on the
        loop's thread, and return its reply -- when it would run at once as an inline job
        anyway (``Batcher.direct_cost``: the device idle, nothing of its weight queued or
        running, a like batch's cost known and short, no task woken in this loop trip that
        could join its batch; ``own``: the caller's task, which cannot). Otherwise None:
        nothing was done, queue it (``start_matmul``). A multi-weight call's direct path
        is ``multi.run_weights_now`` (on :meth:`direct_batchers` and :meth:`run_direct`).
        Refusals and failures raise, as ``start_matmul``'s future would fail. ``launch``:
        as :meth:`launch_now`'s."""
        # direct_batchers and run_direct for one call, written out (no list, loop or sum;
        # per request on the loop)
        got = self._direct_target(call)
        if got is None:
            return None
        e, b, key, rows = got
        if b.direct_cost(rows, key, own) is None:
            return None
        d = b.direct(key)
        self._admit_direct(call, e, d, rows)
        try:
            return b.run_direct(d, call.x, launch)
        finally:
            self.registry.release(e)

    def _direct_target(self, call: MatmulCall,
                       ) -> tuple[WeightEntry, Batcher, BatchKey, int] | None:
        """The weight entry (not acquired), batcher, batch key and rows of a single-weight
        ``call`` that may take a direct path (:meth:`run_now`, :meth:`launch_now`); None:
        queue it (a missing weight is refused by ``start_matmul``, after the checks that come
        first)."""
        x = call.x
        if call.weights or x.ndim != 2 or self._group is not None:
            return None
        try:
            e = self.registry.get(call.weight)
        except NotFound:
            return None
        b = e.batcher
        if b is None:
            return None
        return e, b, self._key(call), int(x.shape[0])

    def _admit_direct(self, call: MatmulCall, e: WeightEntry, d: DirectCall, rows: int,
                      ) -> None:
        """:meth:`_admit` of a call of weight ``e`` (looked up in this loop trip) with ``rows``
        rows, ``d`` its key's DirectCall: once ``_admit`` passed for this weight, key, N and
        flag state, only the checks of the call itself remain (serving, K, deadline); the
        entry is acquired as there (the caller releases it)."""
        state = self.flags.state
        if (d.state is state and rows in d.rows and self._serving and self.healthy
                and call.x.shape[1] == e.k and (call.timeout is None or call.timeout > 0)):
            self.registry.acquire(call.weight)
            return
        self._admit(call, d.key)
        if d.state is not state:
            d.state, d.rows = state, set()
        d.rows.add(rows)

    def launch_now(self, call: MatmulCall,
                   launch: Callable[[np.ndarray, BatchKey], Launched] | None = None,
                   ) -> Callable[[], MatmulReply] | None:
        """:meth:`run_now` in two halves, for a full batch (``Batcher.can_launch_now``): check
        ``call`` and launch it now, returning the function that waits for it and returns its
        reply; None: nothing was done (queue it). Refusals raise here, failures from the
        function. The caller waits for each launch in order within its loop callback
        (``Device.launch_now``): the fast lane pipelines full batches so (service/lane.py).
        ``launch(x, key)``: the launch itself, in place of the weight's own (the lane's
        region call, which repeats a call of this weight launched before; the checks, the
        accounting and the reply are the same)."""
        got = self._direct_target(call)
        if got is None:
            return None
        e, b, key, rows = got
        if not b.can_launch_now(rows, key):
            return None
        self._admit_direct(call, e, b.direct(key), rows)
        return self._launch_held(e, b, call.x, key, launch)

    def _launch_held(self, e: WeightEntry, b: Batcher, x: np.ndarray, key: BatchKey,
                     launch: Callable[[np.ndarray, BatchKey], Launched] | None = None,
                     ) -> Callable[[], MatmulReply]:
        """``b.launch_now(x, key, launch)`` for a call that holds ``e`` (admitted): the
        function returned waits and lets go of ``e``, as a failed launch does at once."""
        try:
            wait = b.launch_now(x, key, launch)
        except BaseException:
            self.registry.release(e)
            raise

        def finish() -> MatmulReply:
            try:
                return wait()
            finally:
                self.registry.release(e)

        return finish

    def direct_batchers(self, calls: Sequence[MatmulCall], key: BatchKey, own: object = None,
                        ) -> list[Batcher] | None:
        """The batchers of single-weight ``calls`` (of one x and ``key``: the parts of a
        multi-weight call, or one call) when each may take the direct path now and, run one
        after the other on this thread, their like jobs together are short enough to inline
        (what a group's one job would be held to); else None."""
        if self._group is not None:
            return None
        rows = int(calls[0].x.shape[0])
        out: list[Batcher] = []
        total = 0.0
        for call in calls:
            try:
                b = self.registry.get(call.weight).batcher
            except NotFound:
                return None  # (start_matmul says so, after the checks that come first)
            cost = None if b is None else b.direct_cost(rows, key, own)
            if cost is None:
                return None
            total += cost
            out.append(b)  # type: ignore[arg-type]
        return out if len(out) == 1 or self.device.inlines(total) else None

    def run_direct(self, b: Batcher, call: MatmulCall, key: BatchKey) -> MatmulReply:
        """Check ``call`` (as ``start_matmul`` does) and run it now through ``b``, its weight's
        batcher, which :meth:`direct_batchers` gave."""
        e, d = self._admit_part(b, call, key)
        try:
            return b.run_direct(d, call.x)
        finally:
            self.registry.release(e)

    def run_direct_many(self, batchers: Sequence[Batcher], calls: Sequence[MatmulCall],
                        key: BatchKey) -> list[MatmulReply] | None:
        """:meth:`run_direct` of every part of a multi-weight call (``calls``, their
        ``batchers`` from :meth:`direct_batchers`) as one backend call
        (``Batcher.run_direct_many``): the same checks (a refusal raises with ``e.part``, the
        index of its part), then one reply per part, in order. None: not as one call, or the
        one call refused its input (run the parts each: the refusal then names its part,
        and the parts before it answer as they did part by part)."""
        held: list[WeightEntry] = []
        try:
            ds = []
            for i, (b, call) in enumerate(zip(batchers, calls, strict=True)):
                try:
                    e, d = self._admit_part(b, call, key)
                except Q6Error as err:
                    err.part = i  # type: ignore[attr-defined]
                    raise
                held.append(e)
                ds.append((b, d))
            try:
                return batchers[0].run_direct_many(ds, calls[0].x)
            except (InvalidArgument, FailedPrecondition):
                return None
        finally:
            for e in held:
                self.registry.release(e)

    def _admit_part(self, b: Batcher, call: MatmulCall, key: BatchKey,
                    ) -> tuple[WeightEntry, DirectCall]:
        """:meth:`_admit` of a multi-weight call's part (a 2-D x: ``multi.check_parts``) for
        the direct path, through its key's DirectCall (``_admit_direct``: once the full
        checks passed for this weight, key, N and flag state, only the call's own remain)."""
        d = b.direct(key)
        e = self.registry.get(call.weight)
        self._admit_direct(call, e, d, int(call.x.shape[0]))
        return e, d

    def launch_direct(self, b: Batcher, call: MatmulCall, key: BatchKey,
                      ) -> Callable[[], MatmulReply]:
        """:meth:`run_direct` in two halves (``Batcher.launch_now``): check ``call`` and launch
        it now; the function returned waits for it and returns its reply (a failure raises).
        For the parts of a multi-weight call on the direct path (``multi.run_weights_now``
        with ``multi_pipeline``): each part's launch goes behind the previous one, so the GPU
        runs them back to back while the host launches the next."""
        e, d = self._admit_part(b, call, key)
        return self._launch_held(e, b, call.x, d.key)

    def batch_key(self, call: MatmulCall) -> BatchKey:
        return self._key(call)

    @staticmethod
    def _key(call: MatmulCall) -> BatchKey:
        # per request on the loop: a NamedTuple's construction (a Python __new__) and two
        # dtype names cost ~3x the lookup of the one made before (VM: 1.26 -> 0.45 us)
        sig = (call.x.dtype, call.precision, call.out_dtype, call.topk)
        key = _BATCH_KEYS.get(sig)
        if key is None:
            if len(_BATCH_KEYS) >= MAX_BATCH_KEYS:  # (topk spans many values: bounded)
                _BATCH_KEYS.clear()
            key = _BATCH_KEYS[sig] = BatchKey(_dtype_name(call.x.dtype), call.precision,
                                              _dtype_name(call.out_dtype), call.topk)
        return key

    def rows_of(self, name: str) -> int:
        """The rows of weight ``name`` (NOT_FOUND if it is not loaded): ``get(name).rows``
        without building the view (per stream request, for its window share)."""
        return self.registry.get(name).rows

    def shape_of(self, name: str) -> tuple[int, int]:
        """(rows, K) of weight ``name`` (NOT_FOUND if it is not loaded), without building its
        view (a WeightView is ~7 us; per part of each multi-weight request)."""
        e = self.registry.get(name)
        return e.rows, e.k

    # -- flags ------------------------------------------------------------------------------
    def set_flags(self, changes: Mapping[str, bool], who: str = "SetFlags") -> FlagState:
        return self.flags.set(changes, who)

    def _on_flags(self, old: FlagState, new: FlagState) -> None:
        self._publish()
        if old.kernel_flags() != new.kernel_flags():
            # other kernels from now on (maybe never compiled yet): no batch runs inline on the
            # loop until one like it has run on the device thread (Device.inline_s)
            for e in self._live:
                if e.batcher is not None:
                    e.batcher.forget_costs()
        if old.q6k_soa != new.q6k_soa:
            self._relayouts += 1
            self._spawn(self._relayout_all())

    async def _relayout_all(self) -> None:
        """Re-lay resident weights one by one to the current SOA flag; matmuls keep running
        between them (each relayout is one job on the device thread)."""
        try:
            async with self._admin:
                for e in self.registry.entries():
                    target = self.flags.state.kernel_flags().layout
                    if e.removed or e.resident.layout is target:
                        continue
                    await self._relayout(e, target)
        except Exception:
            log.exception("relayout failed; weights stay in their current layouts")
        finally:
            self._relayouts -= 1
            self._publish()

    async def _relayout(self, e: WeightEntry, target: Layout) -> None:
        old = e.nbytes
        grow = max(0, self.backend.weight_nbytes(e.rows, e.k, target) - old)
        staging = self.backend.relayout_scratch_nbytes(e.rows, e.k, target,
                                                       self.config.load_chunk_bytes)
        t0 = time.perf_counter()
        with self.vram.reserve(weights=grow, staging=staging) as res:
            def job() -> None:
                e.resident = self.backend.relayout(e.resident, target,
                                                   self.config.load_chunk_bytes)

            await self.device.run(job)
            res.keep("weights", grow)
            self.vram.adjust("weights", e.nbytes - old - grow)
        log.info("relaid %s to %s in %.3f s", e.name, target.value, time.perf_counter() - t0)

    # -- lifecycle --------------------------------------------------------------------------
    def begin_drain(self) -> None:
        self._serving = False

    def abandon(self) -> None:
        """The drain's grace period is over: parses, quantizes and loads still running stop
        at their next check (Cancelled), so the worker can free what it holds and exit."""
        self._abandon.set()

    def abandoned(self) -> bool:
        return self._abandon.is_set()

    def in_flight_summary(self) -> str:
        """What is still running, for the drain's log line."""
        loading = self.registry.claimed()
        matmuls = sum(e.batcher.in_flight for e in self.registry.entries()
                      if e.batcher is not None)
        return (f"{matmuls} matmul request(s) queued or running, "
                f"{len(loading)} weight(s) loading {sorted(loading)[:8]}, "
                f"{self._receiving} upload(s) receiving")

    @property
    def serving(self) -> bool:
        return self._serving

    async def close(self) -> None:
        """Free every weight and stop the device thread."""
        self._serving = False
        self._poller.cancel()
        self._trimmer.cancel()
        for e in self.registry.entries():
            with contextlib.suppress(Exception):
                await self.unload(e.name)
        pending = [t for t in self._tasks if not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await run_in_thread(self.device.close)  # a daemon: exit never waits on the device
        self.backend.close()
