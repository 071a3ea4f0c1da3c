"""A worker over several local devices: one Engine per device behind the Engine interface.

Each device keeps everything an Engine has on its own: backend, single-thread executor (and so
its own CUDA stream), VRAM accountant, registry and batchers. This module only places weights
and routes calls (composition: no rule of an Engine is re-implemented here; a file is opened
and an upload received once, then each device's Engine loads its rows of it); the servicer
cannot tell it from one Engine.

Placement, per weight (LoadWeights' ``placement``, else the worker's ``--placement``):
- ``shard``: the weight's rows are split evenly over the devices (service/shards.py's rule);
  a matmul runs on every device at once and the outputs concatenate along y's columns.
- ``replicate``: every device holds all rows; each matmul goes to the replica with the fewest
  requests in flight (ties: round robin), so independent requests use every device.
Each device's part is registered on that device under the weight's name, with its global row
range, so per-device views stay truthful.

Metrics: the worker's families get totals over the devices (kernel times, batches, VRAM sums);
families with a ``device`` label ("0", "1", ...: bounded by --devices) give each device's VRAM,
resident parts, batches, rows and kernel times.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TypeVar

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from q6serve.kernels.api import Backend
from q6serve.kernels.epilogue import check_k, merge_topk
from q6serve.kernels.errors import (
    InvalidArgument,
    Unavailable,
)

from .batcher import BatchStats
from .config import WorkerConfig
from .engine import Engine, MatmulReply
from .engine_types import MatmulCall, StatusView, UploadSpec, WeightView, check_upload_spec
from .flags import FlagState
from .metrics import LATENCY_BUCKETS, ROW_BUCKETS, Metrics
from .registry import Registry
from .shards import RowRange, RowSelect, even_split
from .uploads import UploadBuffer
from .vram import VramStats
from .weight_sources import WeightSource, gguf_sources
from .worker import Worker

log = logging.getLogger("q6serve.devices")

T = TypeVar("T")
PLACEMENTS = ("shard", "replicate")


def parse_devices(text: str) -> tuple[int, ...]:
    """``"0,1"`` -> (0, 1): distinct device indices >= 0."""
    try:
        devices = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise InvalidArgument(f"--devices {text!r}: write device indices like 0,1") from None
    if not devices or any(d < 0 for d in devices) or len(set(devices)) != len(devices):
        raise InvalidArgument(f"--devices {text!r}: give distinct device indices >= 0")
    return devices


@dataclass(frozen=True)
class Part:
    device: int  # position in MultiDeviceEngine.engines (not the CUDA ordinal)
    rows: RowRange  # global rows held there


@dataclass(eq=False)
class Placed:
    """A weight of the worker: where its rows live. Kept in a :class:`Registry` (the naming
    rules of one Engine); the device engines hold the parts and their memory."""

    name: str
    mode: str
    k: int
    parts: list[Part]
    sha256: str
    source: str
    tensor_rows: int
    turn: itertools.count = field(default_factory=itertools.count)  # replicate: ties
    refs: int = 0  # Registry bookkeeping (requests hold the device engines' entries instead)
    removed: bool = False

    @property
    def rows(self) -> RowRange:
        return RowRange(self.parts[0].rows.begin, self.parts[-1].rows.end)


def split_parts(r: RowRange, devices: int, mode: str) -> list[Part]:
    """Where rows ``r`` go: the even split over the devices, or all of them on each."""
    if mode == "replicate":
        return [Part(d, r) for d in range(devices)]
    n = min(devices, r.rows)  # fewer rows than devices: not every device gets a part
    return [Part(d, RowRange(r.begin + p.begin, r.begin + p.end))
            for d, p in enumerate(even_split(r.rows, n))]


class DeviceFamilies:
    """The ``device``-labelled metric families (registered once on the worker's registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.vram = {
            name: Gauge(f"q6serve_device_vram_{name}_bytes", help_, ["device"], registry=r)
            for name, help_ in (("budget", "VRAM budget of one device's accountant."),
                                ("reserved", "Bytes reserved on one device (weights + scratch "
                                             "+ staging)."),
                                ("weights", "Bytes held by resident weights on one device."),
                                ("device_total", "Memory of one device in total."))}
        self.parts = Gauge("q6serve_device_weights_loaded",
                           "Resident weights (or row-sharded parts of them) on one device.",
                           ["device"], registry=r)
        self.batches = Counter("q6serve_device_batches", "Kernel launches on one device.",
                               ["device"], registry=r)
        self.rows = Counter("q6serve_device_batch_rows",
                            "Activation rows (N) computed on one device.", ["device"],
                            registry=r)
        self.kernel = Histogram("q6serve_device_kernel_duration_seconds",
                                "Kernel time of one launch on one device.", ["device"],
                                buckets=LATENCY_BUCKETS, registry=r)
        self.batch_rows = Histogram("q6serve_device_batch_rows_per_launch",
                                    "Activation rows (N) per launch on one device.",
                                    ["device"], buckets=ROW_BUCKETS, registry=r)

    def observe(self, main: Metrics, device: str, stats: BatchStats) -> None:
        self.batches.labels(device).inc()
        self.rows.labels(device).inc(stats.rows)
        self.batch_rows.labels(device).observe(stats.rows)
        # kernel time now, or when its device events complete (the main metrics' one poll)
        main.when_timed(stats.result.timing, lambda s: self.kernel.labels(device).observe(s))


class DeviceMetrics:
    """What one device's Engine reports to: its device-labelled series, and the worker's
    families with totals over every device."""

    def __init__(self, main: Metrics, families: DeviceFamilies, device: int,
                 owner: MultiDeviceEngine) -> None:
        self.main = main
        self.families = families
        self.label = str(device)
        self.device = device
        self.owner = owner

    def set_vram(self, v: VramStats) -> None:
        f = self.families.vram
        f["budget"].labels(self.label).set(v.budget)
        f["reserved"].labels(self.label).set(v.reserved)
        f["weights"].labels(self.label).set(v.weights)
        f["device_total"].labels(self.label).set(v.device_total)
        self.owner.publish_totals()

    def set_weights_loaded(self, n: int) -> None:
        self.families.parts.labels(self.label).set(n)

    def set_flags(self, flags: FlagState) -> None:
        self.main.set_flags(flags)

    def observe_batch(self, stats: BatchStats) -> None:
        self.main.observe_batch(stats)
        self.families.observe(self.main, self.label, stats)

    def poll(self) -> int:
        if self.device == 0:  # one poller for the worker's parked timings is enough
            return self.main.poll()
        return 0


def sum_vram(stats: Sequence[VramStats]) -> VramStats:
    return VramStats(**{f.name: sum(getattr(s, f.name) for s in stats)
                        for f in fields(VramStats)})


@dataclass(frozen=True)
class DeviceStatus:
    index: int  # position in --devices
    ordinal: int  # the device number given to --devices
    device: str
    vram: VramStats
    weights_loaded: int


class MultiDeviceEngine:
    """The Engine interface over one Engine per device (see the module docstring).

    A thin placement layer: names follow one :class:`Registry`'s rules; a GGUF file is opened
    and an upload read once (service/engine.py's ``gguf_sources`` / ``receive_upload``), and
    each device's Engine loads its rows of it (``Engine.load_sources``: the budget, staging,
    hashing and rollback rules of one device); every matmul runs through the device engines'
    own fast path (``Engine.start_matmul``).
    """

    def __init__(self, backends: Sequence[Backend], config: WorkerConfig,
                 metrics: Metrics | None = None, placement: str = "shard",
                 ordinals: Sequence[int] | None = None) -> None:
        if not backends:
            raise InvalidArgument("a multi-device worker needs at least one device")
        if placement not in PLACEMENTS:
            raise InvalidArgument(f"placement {placement!r}; use one of {PLACEMENTS}")
        self.config = config
        self.placement = placement
        self.ordinals = tuple(ordinals) if ordinals is not None else tuple(range(len(backends)))
        self.metrics = metrics
        self.registry = Registry(lambda _: None)  # parts are freed by the device engines
        self._families = DeviceFamilies(metrics.registry) if metrics is not None else None
        self.engines: list[Engine] = []
        for i, b in enumerate(backends):
            m = (DeviceMetrics(metrics, self._families, i, self)
                 if metrics is not None and self._families is not None else None)
            e = Engine(b, config, m)  # type: ignore[arg-type]
            # no GIL hand-off yield (device_thread.Device): a sharded call queues a job on every
            # device in one loop trip, and yielding after the first would run that device's
            # host path before the next device's job is even queued
            e.device.handoff_yield = len(backends) == 1 and e.device.handoff_yield
            # nor inline jobs: a sharded call's parts must run on all devices at once, not one
            # after the other on the loop's thread
            if len(backends) > 1:
                e.device.inline_s = 0.0
            self.engines.append(e)
        self.backend = backends[0]
        self.version = self.engines[0].version
        self._admin = asyncio.Lock()
        self._serving = True
        self._tasks: set[asyncio.Task[object]] = set()
        self.publish_totals()

    # -- helpers ----------------------------------------------------------------------------
    def describe(self) -> str:
        devs = ", ".join(f"{o}: {e.backend.device_name()} (budget {e.vram.budget} B)"
                         for o, e in zip(self.ordinals, self.engines, strict=True))
        return (f"engine: backend {self.backend.name} on {len(self.engines)} devices [{devs}], "
                f"default placement {self.placement}, flags {self.engines[0].flags.state}")

    def publish_totals(self) -> None:
        # also called by the device engines while they are being built: sums of those so far
        if self.metrics is not None and self.engines:
            self.metrics.set_vram(sum_vram([e.vram.stats() for e in self.engines]))
            self.metrics.set_weights_loaded(len(self.registry))

    async def _shielded(self, coro: Awaitable[T]) -> T:
        """Run an admin operation to completion even if its caller goes away (the device
        engines' loads are shielded too: a half-placed weight must not be left behind)."""
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)  # type: ignore[return-value]

    def _check_serving(self) -> None:
        if not self._serving:
            raise Unavailable("the worker is draining and takes no new requests")

    def _mode(self, placement: str | None) -> str:
        mode = placement or self.placement
        if mode not in PLACEMENTS:
            raise InvalidArgument(f"placement {mode!r}; use one of {PLACEMENTS}")
        return mode

    def _parts(self, src: WeightSource, mode: str) -> list[Part]:
        return split_parts(RowRange(src.row_begin, src.row_begin + src.rows),
                           len(self.engines), mode)

    async def _on_each(self, name: str, parts: list[Part],
                       make: Callable[[Part], Awaitable[T]]) -> list[T]:
        """Load ``name`` with ``make(part)`` on every part's device at once; on any failure
        unload the parts that did load, then raise the first error (all or nothing)."""
        results = await asyncio.gather(*(make(p) for p in parts), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for p, r in zip(parts, results, strict=True):
                if not isinstance(r, BaseException):
                    with contextlib.suppress(Exception):
                        await self.engines[p.device].unload(name)
            raise failed[0]
        return results  # type: ignore[return-value]

    # -- loading ----------------------------------------------------------------------------
    async def load_gguf(self, rel_path: str, tensors: list[str], prefix: str = "",
                        rows: RowSelect | None = None, placement: str | None = None,
                        ) -> list[WeightView]:
        self._check_serving()
        mode = self._mode(placement)
        sources = await gguf_sources(self.config.model_dir, rel_path, tensors, prefix, rows,
                                     self.engines[0].abandoned)
        return await self._shielded(self._place(sources, mode))

    async def upload(self, spec: UploadSpec, chunks: AsyncIterator[bytes],
                     placement: str | None = None) -> WeightView:
        """Check the header, the name and every device's budget for its rows before reading
        a byte; receive (and quantize) the upload once in the segmented buffer one Engine
        uses (service/uploads.py; unaccounted here: each device's Engine accounts the rows it
        loads); each device loads its rows from that one buffer."""
        self._check_serving()
        mode = self._mode(placement)
        check_upload_spec(spec, self.config.max_upload_bytes)
        self.registry.check_available([spec.name])
        for p in split_parts(RowRange(0, spec.rows), len(self.engines), mode):
            self.engines[p.device].check_fits(p.rows.rows, spec.k)
        buf = UploadBuffer(spec.name, spec.rows, spec.k, spec.fmt, spec.total_bytes,
                           spec.sha256, None, self.engines[0].abandoned)
        await buf.receive(chunks)
        src = WeightSource(spec.name, spec.rows, spec.k, "upload", buf.row_chunks)

        async def place() -> list[WeightView]:
            try:
                return await self._place([src], mode)
            finally:
                buf.release()

        return (await self._shielded(place()))[0]

    async def _place(self, sources: list[WeightSource], mode: str) -> list[WeightView]:
        """Load every source's parts on their devices, all or nothing."""
        done: list[Placed] = []
        with self.registry.claim([s.name for s in sources]):
            async with self._admin:
                try:
                    for s in sources:
                        parts = self._parts(s, mode)

                        def load(p: Part, s: WeightSource = s) -> Awaitable[list[WeightView]]:
                            local = RowRange(p.rows.begin - s.row_begin,
                                             p.rows.end - s.row_begin)
                            return self.engines[p.device].load_sources([s.part(local)])

                        views = await self._on_each(s.name, parts, load)
                        sha = (views[0][0].sha256 if len(parts) == 1 or mode == "replicate"
                               else await asyncio.to_thread(_sha_source, s))
                        done.append(Placed(s.name, mode, s.k, parts, sha, s.source,
                                           s.whole_rows))
                except BaseException:
                    for pl in done:
                        await self._unload_parts(pl)
                    raise
                for pl in done:
                    self.registry.add(pl)
                    log.info("placed %s (%s) rows %s of %d over devices %s", pl.name, mode,
                             pl.rows, pl.tensor_rows, [str(p.rows) for p in pl.parts])
        self.publish_totals()
        return [self._view(pl) for pl in done]

    # -- queries ----------------------------------------------------------------------------
    def _view(self, pl: Placed) -> WeightView:
        views = [self.engines[p.device].get(pl.name) for p in pl.parts]
        # a replicated request runs on one replica; a sharded one on every part
        flight = (sum if pl.mode == "replicate" else max)(v.in_flight for v in views)
        r = pl.rows
        return WeightView(pl.name, r.rows, pl.k, sum(v.nbytes for v in views), views[0].layout,
                          pl.sha256, pl.source, flight, r.begin, pl.tensor_rows)

    def list(self) -> list[WeightView]:
        return [self._view(pl) for pl in self.registry.entries()]

    def get(self, name: str) -> WeightView:
        return self._view(self.registry.get(name))

    def placement_of(self, name: str) -> Placed:
        return self.registry.get(name)  # type: ignore[return-value]

    async def _unload_parts(self, pl: Placed) -> list[WeightView]:
        res = await asyncio.gather(*(self.engines[p.device].unload(pl.name) for p in pl.parts),
                                   return_exceptions=True)
        errors = [r for r in res if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        return res  # type: ignore[return-value]

    async def unload(self, name: str) -> WeightView:
        pl: Placed = self.registry.get(name)  # type: ignore[assignment]
        view = self._view(pl)
        self.registry.remove(name)  # new requests get NOT_FOUND at once
        await self._shielded(self._unload_parts(pl))  # freed when in-flight work ends
        self.publish_totals()
        return view

    def status(self) -> StatusView:
        first = self.engines[0].status()
        devs = "; ".join(f"{o}: {e.backend.device_name()}"
                         for o, e in zip(self.ordinals, self.engines, strict=True))
        return replace(first, device=f"{len(self.engines)} devices [{devs}]",
                       vram=sum_vram([e.vram.stats() for e in self.engines]),
                       weights_loaded=len(self.registry),
                       serving=self._serving and self.healthy,
                       relayout_in_progress=any(e.status().relayout_in_progress
                                                for e in self.engines),
                       host_overhead_bytes=sum(e.host_overhead_bytes() for e in self.engines),
                       devices=tuple(self.device_status()))

    def device_status(self) -> list[DeviceStatus]:
        return [DeviceStatus(i, o, e.backend.device_name(), e.vram.stats(), len(e.registry))
                for i, (o, e) in enumerate(zip(self.ordinals, self.engines, strict=True))]

    # -- matmul -----------------------------------------------------------------------------
    def _pick(self, pl: Placed) -> int:
        """The replica with the fewest requests in flight; ties go round robin."""
        turn = next(pl.turn)
        n = len(pl.parts)
        order = [pl.parts[(turn + i) % n].device for i in range(n)]
        return min(order, key=lambda d: self.engines[d].in_flight(pl.name))

    async def matmul(self, call: MatmulCall) -> MatmulReply:
        return await self.start_matmul(call)

    @contextlib.contextmanager
    def grouped(self) -> Iterator[None]:
        """Every device's ``Engine.grouped``: the parts of one multi-weight call that land on
        one device (its replicas' picks, its shard of each weight) run in one job there."""
        with contextlib.ExitStack() as stack:
            for e in self.engines:
                stack.enter_context(e.grouped())
            yield

    def start_matmul(self, call: MatmulCall,
                     sink: Callable[[asyncio.Future[MatmulReply]], None] | None = None,
                     ) -> asyncio.Future[MatmulReply]:
        """Replicated: the chosen replica's own future. Sharded: every part is queued now on
        its device; one future resolves when the last part has (outputs side by side; ``sink``
        is not used: the caller's done callback hears of it)."""
        self._check_serving()
        pl: Placed = self.registry.get(call.weight)  # type: ignore[assignment]
        if pl.mode == "replicate":
            return self.engines[self._pick(pl)].start_matmul(call, sink)
        if call.topk:  # each part's top-k of its columns, merged in _join (kernels/epilogue.py)
            check_k(call.topk, pl.rows.rows, weight=pl.name)
        parts: list[asyncio.Future[MatmulReply]] = []
        try:
            for p in pl.parts:
                parts.append(self.engines[p.device].start_matmul(
                    replace(call, topk=min(call.topk, p.rows.rows)) if call.topk else call))
        except BaseException:
            for f in parts:
                f.cancel()
            raise
        whole: asyncio.Future[MatmulReply] = asyncio.get_running_loop().create_future()
        left = [len(parts)]

        def part_done(f: asyncio.Future[MatmulReply]) -> None:
            left[0] -= 1
            if whole.done():
                return
            if f.cancelled() or f.exception() is not None:
                for g in parts:  # one part failed: the call has failed
                    g.cancel()
                if f.cancelled():
                    whole.cancel()
                else:
                    whole.set_exception(f.exception())  # type: ignore[arg-type]
            elif left[0] == 0:
                whole.set_result(_join([g.result() for g in parts], pl, call.topk))

        def whole_done(f: asyncio.Future[MatmulReply]) -> None:
            if f.cancelled():  # the caller went away: drop the parts not run yet
                for g in parts:
                    g.cancel()

        for f in parts:
            f.add_done_callback(part_done)
        whole.add_done_callback(whole_done)
        return whole

    # -- flags ------------------------------------------------------------------------------
    @property
    def flags(self):  # type: ignore[no-untyped-def]
        return self.engines[0].flags

    def set_flags(self, changes: Mapping[str, bool], who: str = "SetFlags") -> FlagState:
        state = self.engines[0].set_flags(changes, who)  # validates before any device changes
        for e in self.engines[1:]:
            e.set_flags(changes, who)
        return state

    # -- lifecycle --------------------------------------------------------------------------
    def on_health(self, fn: Callable[[bool], None]) -> None:
        """``fn(False)`` when any device fails (its engine refuses work; the worker's health
        goes NOT_SERVING, as with one device)."""
        for e in self.engines:
            e.on_health(fn)

    @property
    def healthy(self) -> bool:
        return all(e.healthy for e in self.engines)

    def begin_drain(self) -> None:
        self._serving = False
        for e in self.engines:
            e.begin_drain()

    @property
    def serving(self) -> bool:
        return self._serving

    def abandon(self) -> None:
        for e in self.engines:
            e.abandon()

    def in_flight_summary(self) -> str:
        return "; ".join(f"device {i}: {e.in_flight_summary()}"
                         for i, e in enumerate(self.engines))

    async def close(self) -> None:
        self._serving = False
        await asyncio.gather(*(e.close() for e in self.engines))


def _join(replies: list[MatmulReply], pl: Placed, topk: int = 0) -> MatmulReply:
    """One sharded call's reply from its parts' (outputs side by side, in row order; with
    the top-k epilogue, the parts' top-k merged over global columns)."""
    kernel_s = [r.kernel_seconds for r in replies]
    first = replies[0]
    top = None if not topk else merge_topk(
        [r.topk for r in replies],  # type: ignore[misc]
        [p.rows.begin - pl.rows.begin for p in pl.parts], topk)
    y = None if top is not None else np.concatenate([r.y for r in replies], axis=1)
    return MatmulReply(
        y, first.kernel, first.layout, first.precision, max(r.queue_seconds for r in replies),
        None if None in kernel_s else max(kernel_s),  # type: ignore[type-var]
        min(r.batch_rows for r in replies), min(r.batch_requests for r in replies), topk=top)


def _sha_source(s: WeightSource) -> str:
    """sha256 of a source's AoS bytes (what one Engine reports for those rows)."""
    h = hashlib.sha256()
    for chunk in s.chunks(16 << 20):
        h.update(np.ascontiguousarray(chunk).data)
    return h.hexdigest()


class DevicesWorker(Worker):
    """The gRPC worker over several devices: ``Worker`` with a MultiDeviceEngine core."""

    def __init__(self, config: WorkerConfig, backends: Sequence[Backend],
                 placement: str = "shard", ordinals: Sequence[int] | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        super().__init__(config, backends[0], registry)
        self.backends = list(backends)
        self.placement = placement
        self.ordinals = ordinals

    def make_engine(self) -> Engine:
        return MultiDeviceEngine(self.backends, self.config, self.metrics,  # type: ignore[return-value]
                                 self.placement, self.ordinals)


def make_backends(name: str, devices: Sequence[int]) -> list[Backend]:
    """One backend per device; on NumPy each "device" is an independent NumPy backend."""
    from q6serve.kernels.backends import make_backend

    return [make_backend(name, d) for d in devices]
