"""Prometheus metrics: the ONE module that owns the (injected) CollectorRegistry.

The core hands over plain stats (BatchStats, VramStats, FlagState, request outcomes); this
module turns them into series. Kernel times come from ``KernelTiming.seconds()``, which on the
CUDA backend returns None until the end event has completed: such timings are parked and read
by :meth:`Metrics.poll` from a background task, so no kernel is ever synchronised for metrics.
Labels are bounded: kernel and layout names come from the backend's fixed set, N is bucketed,
services and methods are the handlers registered on the server (plus ``<Method>/request`` for
each request inside a request/reply stream), codes come from grpc.StatusCode.
"""

from __future__ import annotations

import bisect
import collections
import functools
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Info
from prometheus_client.exposition import generate_latest, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from q6serve.kernels.api import KernelTiming

from .batcher import BatchStats
from .flags import FlagState
from .vram import VramStats

# 5 µs .. 1 s, roughly 1-2.5-5 per decade.
LATENCY_BUCKETS: tuple[float, ...] = (
    5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)
ROW_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
N_BUCKETS: tuple[tuple[int, str], ...] = (
    (1, "1"), (2, "2"), (4, "3-4"), (8, "5-8"), (16, "9-16"), (32, "17-32"), (64, "33-64"))
MAX_PARKED = 4096  # unread device timings kept; beyond this the oldest are dropped


# prometheus_client's own switch for the *_created series (its default: exported)
_CREATED = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in (
    "true", "1", "t")


class HistogramSeries:
    """One labelled series of a :class:`PlainHistogram`: per-bucket counts and the sum, as
    plain Python numbers (``observe`` is one bisect and two additions; prometheus_client's
    takes two locks and walks the bounds in Python)."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf only)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        # bucket i counts amount <= bounds[i] (Prometheus' `le`); a NaN is counted in no
        # bucket (nor the count), only added to the sum, as prometheus_client does
        if amount == amount:
            self.counts[bisect.bisect_left(self.bounds, amount)] += 1
        self.sum += amount


class CounterSeries:
    """One labelled series of a :class:`PlainCounter`."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class _PlainFamily(Collector):
    """A metric family whose series are plain Python objects, turned into samples only when
    scraped (the hot path pays no prometheus_client call: per request it was 4 histogram
    observes and a counter increment, each taking its locks). The exposition is
    prometheus_client's for the same Histogram or Counter: names, label order, ``le``
    formatting, ``_created``.

    One writer: the series are updated on the event loop's thread only (every observation
    of the worker's request and batch metrics happens there); a scrape (prometheus_client's
    HTTP thread) reads them. Copies made with the GIL held (``list()`` of a dict's items, of a
    series' counts) give it a consistent view of each series' buckets: its ``_count`` is their
    total, its ``_sum`` at most an observation apart, as with prometheus_client's own locks."""

    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], Any] = {}
        if not self.labelnames:
            self._series[()] = self._new()
        registry.register(self)

    def _new(self) -> Any:
        raise NotImplementedError

    def labels(self, *values: str) -> Any:
        """The series of these label values (made on first use)."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected, "
                             f"got {len(values)}")
        key = tuple(str(v) for v in values)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = self._new()
        return series

    def describe(self) -> Iterable[Metric]:
        return [Metric(self.name, self.documentation, self.kind)]

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self.name, self.documentation, self.kind)
        for key, series in list(self._series.items()):
            self._samples(metric, dict(zip(self.labelnames, key, strict=True)), series)
        return [metric]

    def _samples(self, metric: Metric, labels: dict[str, str], series: Any) -> None:
        raise NotImplementedError


class PlainHistogram(_PlainFamily):
    kind = "histogram"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry, buckets: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in buckets if b != math.inf)
        super().__init__(name, documentation, labelnames, registry)

    def _new(self) -> HistogramSeries:
        return HistogramSeries(self.bounds)

    def observe(self, amount: float) -> None:
        """The unlabelled family's one series."""
        self._series[()].observe(amount)

    def _samples(self, metric: Metric, labels: dict[str, str], series: HistogramSeries,
                 ) -> None:
        counts, total = list(series.counts), series.sum
        acc = 0
        for bound, n in zip((*self.bounds, math.inf), counts, strict=True):
            acc += n
            metric.add_sample(self.name + "_bucket", {**labels, "le": floatToGoString(bound)},
                              float(acc))
        metric.add_sample(self.name + "_count", labels, float(acc))
        metric.add_sample(self.name + "_sum", labels, total)
        if _CREATED:
            metric.add_sample(self.name + "_created", labels, series.created)


class PlainCounter(_PlainFamily):
    kind = "counter"

    def _new(self) -> CounterSeries:
        return CounterSeries()

    def _samples(self, metric: Metric, labels: dict[str, str], series: CounterSeries) -> None:
        metric.add_sample(self.name + "_total", labels, series.value)
        if _CREATED:
            metric.add_sample(self.name + "_created", labels, series.created)


def n_bucket(n: int) -> str:
    for top, label in N_BUCKETS:
        if n <= top:
            return label
    return "65+"


class Metrics:
    def __init__(self, registry: CollectorRegistry, *, version: str, backend: str,
                 device: str) -> None:
        self.registry = registry
        r = registry
        # The families observed per request and per batch are plain series read at scrape
        # time (PlainHistogram, PlainCounter: no prometheus_client call on the hot path)
        self.kernel_duration = PlainHistogram(
            "q6serve_kernel_duration_seconds",
            "Kernel time of one batched matmul launch (device events on CUDA, host timer on "
            "NumPy).", ["kernel", "layout", "n_bucket"], r, LATENCY_BUCKETS)
        # service: the full gRPC service name (q6serve.v1.Q6Serve, grpc.health.v1.Health,
        # grpc.reflection.v1.ServerReflection, ...); method: the RPC, or "<RPC>/request" for one
        # request inside a MatmulStream (the RPC's own series then counts whole streams).
        self.request_duration = PlainHistogram(
            "q6serve_request_duration_seconds",
            "Handling time of RPCs and of requests inside streams, by service, method and "
            "status code.", ["service", "method", "code"], r, LATENCY_BUCKETS)
        self.requests = PlainCounter(
            "q6serve_requests", "RPCs and requests inside streams finished, by service, method "
            "and the status code the caller saw.", ["service", "method", "code"], r)
        self.queue_delay = PlainHistogram(
            "q6serve_queue_delay_seconds", "Time a matmul request waited before its batch ran.",
            [], r, LATENCY_BUCKETS)
        self.batch_rows = PlainHistogram(
            "q6serve_batch_rows", "Activation rows (N) per kernel launch after coalescing.",
            [], r, ROW_BUCKETS)
        self.vram = {
            name: Gauge(f"q6serve_vram_{name}_bytes", help_, registry=r)
            for name, help_ in (
                ("budget", "VRAM budget of the accountant."),
                ("weights", "Bytes held by resident weights."),
                ("scratch", "Bytes reserved for matmul workspace."),
                ("staging", "Bytes reserved by loads and relayouts in progress."),
                ("pool", "Bytes held by the backend's allocator pool."),
                ("device_used", "Device memory in use (all processes)."),
                ("device_total", "Device memory in total."),
            )}
        self.weights_loaded = Gauge("q6serve_weights_loaded", "Resident weights.", registry=r)
        self.flag_enabled = Gauge("q6serve_flag_enabled", "Kill-switch flag state (1 = on).",
                                  ["flag"], registry=r)
        Info("q6serve_build", "Version, backend and device of this worker.", registry=r).info(
            {"version": version, "backend": backend, "device": device})
        self._parked: collections.deque[tuple[KernelTiming, Callable[[float], None]]] = \
            collections.deque(maxlen=MAX_PARKED)
        self._lock = threading.Lock()
        # (service, method, code) -> its duration and count series: labels() costs more
        # than the observation (bounded: the labels are)
        self._request_series: dict[tuple[str, str, str],
                                   tuple[HistogramSeries, CounterSeries]] = {}
        # (kernel, layout, n_bucket) -> its kernel-duration series' observe (bounded: labels)
        self._kernel_series: dict[tuple[str, str, str], Callable[[float], None]] = {}
        self._batch_rows = self.batch_rows.labels()
        self._queue_delay = self.queue_delay.labels()

    # -- filled by the core -----------------------------------------------------------------
    def _requests_of(self, key: tuple[str, str, str]) -> tuple[HistogramSeries, CounterSeries]:
        series = self._request_series.get(key)
        if series is None:
            series = self._request_series[key] = (self.request_duration.labels(*key),
                                                  self.requests.labels(*key))
        return series

    def observe_request(self, service: str, method: str, code: str, seconds: float) -> None:
        """One finished request (per request of a MatmulStream: kept to one lookup)."""
        duration, count = self._requests_of((service, method, code))
        duration.observe(seconds)
        count.value += 1

    def observe_requests(self, service: str, method: str, code: str,
                         seconds: Sequence[float]) -> None:
        """Several finished requests of one (service, method, code) (a front end's batch)."""
        duration, count = self._requests_of((service, method, code))
        for s in seconds:
            duration.observe(s)
        count.value += len(seconds)

    def observe_batch(self, stats: BatchStats) -> None:
        res = stats.result
        labels = (res.kernel, res.layout.value, n_bucket(stats.rows))
        self._batch_rows.observe(stats.rows)
        for q in stats.queue_seconds:
            self._queue_delay.observe(max(0.0, q))
        series = self._kernel_series.get(labels)
        if series is None:  # the labelled series appears with its first value
            series = functools.partial(self._kernel_first, labels)
        self.when_timed(res.timing, series)

    def _kernel_first(self, labels: tuple[str, str, str], seconds: float) -> None:
        child = self._kernel_series.get(labels)
        if child is None:
            child = self._kernel_series[labels] = self.kernel_duration.labels(*labels).observe
        child(seconds)

    def when_timed(self, timing: KernelTiming, observe: Callable[[float], None]) -> None:
        """``observe(seconds)`` now if the kernel time is known, else from :meth:`poll` once
        its device events complete (no sync on the hot path; one parking lot per worker, also
        for the device-labelled series of multi-device workers)."""
        seconds = timing.seconds()
        if seconds is None:
            with self._lock:
                self._parked.append((timing, observe))
        else:
            observe(seconds)

    def poll(self) -> int:
        """Record parked device timings that have completed; returns how many are left."""
        with self._lock:
            parked = list(self._parked)
            self._parked.clear()
        still = []
        for timing, observe in parked:
            s = timing.seconds()
            if s is None:
                still.append((timing, observe))
            else:
                observe(s)
        with self._lock:
            self._parked.extendleft(reversed(still))
        return len(still)

    def set_vram(self, v: VramStats) -> None:
        for name, value in (("budget", v.budget), ("weights", v.weights),
                            ("scratch", v.scratch), ("staging", v.staging),
                            ("pool", v.pool_used), ("device_used", v.device_used),
                            ("device_total", v.device_total)):
            self.vram[name].set(value)

    def set_weights_loaded(self, n: int) -> None:
        self.weights_loaded.set(n)

    def set_flags(self, flags: FlagState) -> None:
        for name, on in flags.as_dict().items():
            self.flag_enabled.labels(name).set(1 if on else 0)

    def init_labels(self, service: str, methods: Iterable[str]) -> None:
        """Pre-create the OK series so dashboards see zeros before the first call."""
        for m in methods:
            self.requests.labels(service, m, "OK")

    # -- exposition -------------------------------------------------------------------------
    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def serve_http(self, host: str, port: int) -> tuple[int, object]:
        """Start HTTP /metrics; returns (bound port, server with .shutdown())."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port), server
