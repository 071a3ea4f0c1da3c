"""The worker process: grpc.aio server + health + reflection + /metrics around one Engine.

Start-up logs ``listening on H:P`` first (``--port 0`` picks a free port), then the config.
Stop (SIGTERM/SIGINT): health goes NOT_SERVING, new requests get UNAVAILABLE, in-flight work
drains for up to the grace period, then the server stops and every weight is freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from q6serve.kernels.api import Backend
from q6serve.kernels.errors import Unavailable

from . import wire, wire_standard
from .admission import Admission, StreamBudget, StreamSlots
from .auth import TokenAuth
from .config import WorkerConfig
from .engine import Engine, version
from .interceptor import STREAM_REQUEST_SUFFIX, ErrorInterceptor
from .metrics import Metrics
from .regions import RegionTable, table_for
from .servicer import Q6ServeServicer

log = logging.getLogger("q6serve.worker")
PENDING_CALLS = 1 << 16

WATCH_LINGER_S = 0.25  # a drained worker's last wait: health watchers get NOT_SERVING out
CLOSE_S = 3.0  # after the grace period: freeing what is held, at most
HARD_EXIT_S = 4.5  # after the grace period: the watchdog's deadline (SIGTERM exits by +5 s)
EXIT_ABANDONED = 1  # the process's exit code when work was abandoned


def _credentials(cfg: WorkerConfig) -> grpc.ServerCredentials | None:
    if cfg.tls_cert is None or cfg.tls_key is None:
        return None
    ca = cfg.tls_client_ca.read_bytes() if cfg.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(cfg.tls_key.read_bytes(), cfg.tls_cert.read_bytes())], root_certificates=ca,
        require_client_auth=ca is not None)


def build_server(cfg: WorkerConfig, servicer: object, interceptor: ErrorInterceptor,
                 reuseport: bool = False) -> tuple[grpc.aio.Server, Any, int]:
    """The gRPC server of a worker (or of one front-end process, ``reuseport``: several
    processes listen on one port, service/frontends.py): ``interceptor``, ``servicer``,
    health and reflection, bound to cfg.host:cfg.port. Returns (server, health, port)."""
    opts = [("grpc.max_receive_message_length", cfg.receive_limit),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.max_concurrent_streams", cfg.max_concurrent_streams),
            ("grpc.so_reuseport", 1 if reuseport else 0),
            # calls gRPC has taken but not yet handed to us: cancelled beyond these
            # (defaults 1000/3000); a burst of calls waits in the admission queue instead
            ("grpc.server.max_pending_requests", PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", PENDING_CALLS)]
    server = grpc.aio.server(interceptors=[interceptor], options=opts)
    wire.add_to_server(servicer, server)
    health = wire_standard.health_servicer()
    wire_standard.add_health_and_reflection(server, health)
    address = f"{cfg.host}:{cfg.port}"
    creds = _credentials(cfg)
    port = (server.add_secure_port(address, creds) if creds
            else server.add_insecure_port(address))
    if not port:
        raise Unavailable(f"cannot bind {address}")
    return server, health, port


async def stop_server(server: grpc.aio.Server, interceptor: ErrorInterceptor,
                      grace: float) -> None:
    """Stop ``server`` once its calls are done (at most ``grace`` seconds). Health Watch calls
    never end on their own, so server.stop(grace) alone would always take the whole grace
    period: wait for the other calls, then give the watchers a moment to send NOT_SERVING
    before the server cancels what is left."""
    loop = asyncio.get_running_loop()
    end = loop.time() + grace
    await interceptor.wait_idle(grace)
    await server.stop(min(max(0.0, end - loop.time()), WATCH_LINGER_S))


class Worker:
    def __init__(self, config: WorkerConfig, backend: Backend,
                 registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.backend = backend
        self.registry = registry if registry is not None else CollectorRegistry()
        self.engine: Engine | None = None
        self.metrics: Metrics | None = None
        self.server: grpc.aio.Server | None = None
        self.regions: RegionTable | None = None
        self.port = 0
        self.metrics_port: int | None = None
        self._metrics_http: Any = None
        self._health: Any = None
        self._interceptor = ErrorInterceptor()  # replaced in start()
        self._stopped = asyncio.Event()
        self._clean = True  # set by stop(): everything in flight finished in the grace period
        self._health_tasks: set[asyncio.Task[None]] = set()

    @property
    def target(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> None:
        cfg = self.config
        self._init_metrics()
        self.engine = self.make_engine()
        auth = TokenAuth(cfg.token, cfg.admin_token)
        self.admission = Admission(cfg.max_inflight_rpcs, cfg.max_inflight_rpcs_per_connection,
                                   cfg.min_inflight_rpcs_per_connection, cfg.reply_timeout_s)
        self.reads = Admission(cfg.max_reading_rpcs, cfg.max_reading_rpcs, 1,
                               cfg.read_timeout_s, "requests not received")
        self._interceptor = ErrorInterceptor(
            self.metrics, auth, self.admission, cfg.receive_limit, self.reads,
            StreamSlots(cfg.max_streams, cfg.max_streams_per_connection))
        self.regions = table_for(cfg.allow_shm, cfg.max_regions, cfg.max_region_bytes,
                                 self.backend, self.engine)
        self.stream_budget = StreamBudget(cfg.max_stream_bytes_total,
                                          cfg.max_stream_bytes_per_connection)
        servicer = Q6ServeServicer(self.engine, max_stream_bytes=cfg.max_stream_bytes,
                                   regions=self.regions, auth=auth,
                                   stream_budget=self.stream_budget)
        self.server, self._health, self.port = build_server(cfg, servicer, self._interceptor)
        await self.server.start()
        log.info("listening on %s:%d", cfg.host, self.port)  # must stay the first line
        log.info("%s", cfg.describe())
        log.info("%s", self.engine.describe())
        self._start_metrics_http()
        await self._set_health(True)
        self.engine.on_health(lambda ok: self._spawn_health(ok))

    def _init_metrics(self) -> None:
        if self.config.metrics_enabled:
            self.metrics = Metrics(self.registry, version=version(),
                                   backend=self.backend.name, device=self.backend.device_name())
            self.metrics.init_labels(wire.SERVICE_NAME, (
                *wire.METHODS, *(m + STREAM_REQUEST_SUFFIX for m in wire.BIDI_METHODS)))

    def _start_metrics_http(self) -> None:
        cfg = self.config
        if cfg.metrics_port is not None and self.metrics is not None:
            host = cfg.metrics_host or cfg.host
            self.metrics_port, self._metrics_http = self.metrics.serve_http(host,
                                                                            cfg.metrics_port)
            log.info("metrics on http://%s:%d/metrics", host, self.metrics_port)

    def _stop_metrics_http(self) -> None:
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()

    async def _set_health(self, ok: bool) -> None:
        for service in ("", wire.SERVICE_NAME):
            await self._health.set(service, wire_standard.health_status(ok))

    def _spawn_health(self, ok: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._set_health(ok))
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    def make_engine(self) -> Engine:
        """The core this worker serves (service/devices.py serves several devices)."""
        return Engine(self.backend, self.config, self.metrics)

    async def stop(self, grace: float | None = None) -> bool:
        """Drain and stop (idempotent). True if everything in flight finished within the
        grace period; otherwise what was abandoned is logged and False returned. Bounded:
        the grace period, then at most CLOSE_S to free what is held, whatever a thread does
        (parses, quantizes and loads poll the engine's abandon flag)."""
        if self._stopped.is_set() or self.server is None or self.engine is None:
            return self._clean
        grace = self.config.grace_period_s if grace is None else grace
        log.info("draining: health NOT_SERVING, grace %.1f s", grace)
        await self._health.enter_graceful_shutdown()
        self.engine.begin_drain()
        # Health Watch calls never end on their own, so server.stop(grace) alone would always
        # take the whole grace period: wait for the other calls, then give the watchers a
        # moment to send NOT_SERVING before the server cancels what is left.
        loop = asyncio.get_running_loop()
        end = loop.time() + grace
        clean = await self._interceptor.wait_idle(grace)
        if not clean:
            log.warning("drain: the grace period of %.1f s is over; abandoning %s", grace,
                        self.engine.in_flight_summary())
            self.engine.abandon()
        await self.server.stop(min(max(0.0, end - loop.time()), WATCH_LINGER_S))
        if self.regions is not None:
            self.regions.close()
        try:
            await asyncio.wait_for(self.engine.close(), CLOSE_S)
        except TimeoutError:
            clean = False
            log.warning("drain: freeing the weights took over %.1f s; exiting without it",
                        CLOSE_S)
        self._stop_metrics_http()
        self._clean = clean
        self._stopped.set()
        log.info("stopped (%s)", "everything in flight finished" if clean
                 else "work was abandoned")
        return clean

    async def wait(self) -> None:
        await self._stopped.wait()


async def run_worker(config: WorkerConfig, backend: Backend,
                     worker: Worker | None = None) -> bool:
    """Run until SIGTERM/SIGINT, then drain; True if everything in flight finished.

    From the signal on, a watchdog (a daemon timer) ends the process with EXIT_ABANDONED at
    grace + HARD_EXIT_S whatever still runs (a thread stuck in a native call, an exit hook):
    an orchestrator's SIGKILL comes later than that."""
    worker = worker or Worker(config, backend)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before start() logs "listening on"
        loop.add_signal_handler(sig, stop.set)
    await worker.start()
    await stop.wait()
    watchdog = threading.Timer(config.grace_period_s + HARD_EXIT_S, _hard_exit,
                               (worker, config.grace_period_s))
    watchdog.daemon = True
    watchdog.start()
    return await worker.stop()


def _hard_exit(worker: Worker, grace: float) -> None:
    what = "unknown work"
    with contextlib.suppress(Exception):  # read from this thread: figures only
        what = worker.engine.in_flight_summary() if worker.engine is not None else what
    log.error("drain did not end within the grace period of %.1f s + %.1f s: exiting now, "
              "abandoning %s", grace, HARD_EXIT_S, what)
    logging.shutdown()
    os._exit(EXIT_ABANDONED)
