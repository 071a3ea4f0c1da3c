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

import collections
import functools
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import generate_latest, start_http_server

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
        self.kernel_duration = Histogram(
            "q6serve_kernel_duration_seconds",
            "Kernel time of one batched matmul launch (device events on CUDA, host timer on "
            "NumPy).", ["kernel", "layout", "n_bucket"], buckets=LATENCY_BUCKETS, registry=r)
        # service: the full gRPC service name (q6serve.v1.Q6Serve, grpc.health.v1.Health,
        # grpc.reflection.v1.ServerReflection, ...); method: the RPC, or "<RPC>/request" for one
        # request inside a MatmulStream (the RPC's own series then counts whole streams).
        self.request_duration = Histogram(
            "q6serve_request_duration_seconds",
            "Handling time of RPCs and of requests inside streams, by service, method and "
            "status code.", ["service", "method", "code"], buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter(
            "q6serve_requests", "RPCs and requests inside streams finished, by service, method "
            "and the status code the caller saw.", ["service", "method", "code"], registry=r)
        self.queue_delay = Histogram(
            "q6serve_queue_delay_seconds", "Time a matmul request waited before its batch ran.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.batch_rows = Histogram(
            "q6serve_batch_rows", "Activation rows (N) per kernel launch after coalescing.",
            buckets=ROW_BUCKETS, registry=r)
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
        self._request_series: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        # (kernel, layout, n_bucket) -> its kernel-duration series' observe (bounded: labels)
        self._kernel_series: dict[tuple[str, str, str], Callable[[float], None]] = {}

    # -- filled by the core -----------------------------------------------------------------
    def observe_request(self, service: str, method: str, code: str, seconds: float) -> None:
        self.observe_requests(service, method, code, (seconds,))

    def observe_requests(self, service: str, method: str, code: str,
                         seconds: Sequence[float]) -> None:
        """Several finished requests of one (service, method, code) (a front end's batch)."""
        key = (service, method, code)
        series = self._request_series.get(key)
        if series is None:
            series = self._request_series[key] = (self.request_duration.labels(*key),
                                                  self.requests.labels(*key))
        for s in seconds:
            series[0].observe(s)
        series[1].inc(len(seconds))

    def observe_batch(self, stats: BatchStats) -> None:
        res = stats.result
        labels = (res.kernel, res.layout.value, n_bucket(stats.rows))
        self.batch_rows.observe(stats.rows)
        for q in stats.queue_seconds:
            self.queue_delay.observe(max(0.0, q))
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
