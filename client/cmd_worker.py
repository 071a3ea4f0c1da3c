"""``q6serve worker``: run the gRPC worker until SIGTERM/SIGINT (then drain and stop)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import socket
import sys
from collections.abc import Mapping

from q6serve.service import config_limits as lim
from q6serve.service import envvars

from . import grpc_env
from .cli_target import EXIT_FAILED, UsageError, port_arg, seconds_arg

EXAMPLE = """example:
  q6serve worker --port 50051 --metrics-port 9400 --model-dir /models --vram-budget 0.9
  q6serve worker --port 0 --backend numpy --vram-budget 2GiB     # prints `listening on H:P`

environment: Q6SERVE_Q6K_SOA, Q6SERVE_DECODE_MMQ, Q6SERVE_DYNAMIC_BATCHING (0/1, default 1);
  Q6SERVE_TOKEN[_FILE], Q6SERVE_ADMIN_TOKEN[_FILE] (bearer tokens; admin: load/unload/flags);
  Q6SERVE_TLS_CERT, Q6SERVE_TLS_KEY, Q6SERVE_TLS_CLIENT_CA (TLS; client CA = mutual TLS)."""


def size_arg(text: str) -> int:
    """Bytes: 64MiB, 1G, 1048576 (service/config_limits.py)."""
    from q6serve.kernels.errors import InvalidArgument

    try:
        return lim.parse_size(text, "")
    except InvalidArgument:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes >= 1 (64MiB, "
                                         "1G, 1048576)") from None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker", help="run the gRPC worker (keeps Q6_K weights resident, serves matmuls)",
        description="Run the q6serve gRPC worker. The first log line is `listening on H:P`.",
        epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--host", help="bind address (default 127.0.0.1)")
    a("--port", type=port_arg, help="gRPC port 0..65535; 0 picks a free one (default 50051)")
    a("--metrics-port", type=port_arg,
      help="serve Prometheus /metrics on this port (0: free port)")
    a("--metrics-host", help="bind address of /metrics (default: --host)")
    a("--backend", choices=("auto", "numpy", "cuda"), help="compute backend (default auto)")
    a("--model-dir", help="directory LoadWeights paths are relative to (and confined to)")
    a("--vram-budget", help="bytes (8GiB, 500M, 123456) or a fraction of free memory (0.9)")
    a("--max-batch-rows", type=int, help="rows per coalesced launch (default 64)")
    a("--max-batch-delay-us", type=int,
      help="longest wait for more rows while the device is busy (default 200; 0 = never)")
    a("--inline-device-us", type=int,
      help="run a batch expected to take at most this long on the event loop's thread when "
           "the device thread is idle, saving two thread hand-offs (default 3000; 0 = never)")
    a("--cpus", metavar="LIST",
      help="CPU cores for every thread of the worker (and its front ends), e.g. 2 or 2,3 or "
           "8-11: wake-ups between the gRPC and event-loop threads stay on warm cores. It can "
           "cut one caller's latency (with the callers pinned too, and Q6SERVE_BUSY_POLL_US="
           "1000 on fewer than 8 cores) and can cost some; measure first (default: "
           f"${CPUS_ENV}, else any core; docs/SERVICE.md, Pinning)")
    a("--max-request-rows", type=int, help="N limit of one request (default 256)")
    a("--max-queue-rows", type=int, help="queued rows per weight (default 8192)")
    sz = lim.show_size
    a("--max-message-bytes", type=size_arg,
      help=f"largest gRPC message the worker sends (replies), and the ceiling of "
           f"--max-request-bytes (default {sz(lim.MAX_MESSAGE_BYTES)})")
    a("--max-request-bytes", type=size_arg,
      help="largest request message the worker reads; gRPC refuses a larger one before "
           "it is read into the worker (RESOURCE_EXHAUSTED). Reading costs the event loop "
           f"~1 ms per MiB (default {sz(lim.MAX_REQUEST_BYTES)})")
    a("--max-concurrent-streams", type=int,
      help=f"HTTP/2 streams per connection (default {lim.MAX_CONCURRENT_STREAMS}; unary calls "
           "beyond --max-inflight-rpcs wait in the worker's admission queue)")
    a("--max-inflight-rpcs", type=int,
      help=f"unary calls read and running at once, replies not yet written (default "
           f"{lim.MAX_INFLIGHT_RPCS}); more wait, before their request is read")
    a("--max-streams", type=int,
      help="streaming calls (MatmulStream, UploadWeight, health Watch) open at once in the "
           "worker; when full, a connection below its fair share takes the place of the "
           f"longest-idle stream of the one holding most (default {lim.MAX_STREAMS})")
    a("--max-streams-per-connection", type=int,
      help="streaming calls one connection may hold open; more are refused with "
           f"RESOURCE_EXHAUSTED (default {lim.MAX_STREAMS_PER_CONNECTION})")
    a("--max-inflight-rpcs-per-connection", type=int,
      help="most of those one connection holds; its fair share is --max-inflight-rpcs / "
           f"active connections within [min, max] (default {lim.MAX_INFLIGHT_RPCS_PER_CONNECTION})")
    a("--min-inflight-rpcs-per-connection", type=int,
      help="the fair share never drops below this many places per connection (default "
           f"{lim.MIN_INFLIGHT_RPCS_PER_CONNECTION})")
    a("--max-reading-rpcs", type=int,
      help="unary calls whose request is read at once (default "
           f"{lim.MAX_READING_RPCS}): each big request is copied into the worker in one step "
           "of its event loop, so this bounds how many such copies can delay a health check")
    a("--read-timeout", dest="read_timeout_s", type=seconds_arg,
      help="seconds a request may take to arrive once its read began, while other calls "
           f"wait to be read; then it is cancelled (default {lim.READ_TIMEOUT_S:g})")
    a("--reply-timeout", dest="reply_timeout_s", type=seconds_arg,
      help="seconds a computed reply may wait for its client to take it while other calls "
           "wait for a place; then it is dropped (CANCELLED) and its place given to them "
           f"(default {lim.REPLY_TIMEOUT_S:g})")
    a("--max-stream-bytes", type=size_arg,
      help="MatmulStream: bytes of requests admitted and replies not yet written, per stream "
           f"(default {sz(lim.MAX_STREAM_BYTES)})")
    a("--max-stream-bytes-per-connection", type=size_arg,
      help=f"the same for all streams of one connection (default "
           f"{sz(lim.MAX_STREAM_BYTES_PER_CONNECTION)})")
    a("--max-stream-bytes-total", type=size_arg,
      help=f"the same for all streams of the worker (default {sz(lim.MAX_STREAM_BYTES_TOTAL)})")
    a("--max-upload-bytes", type=size_arg,
      help=f"largest UploadWeight payload (default {sz(lim.MAX_UPLOAD_BYTES)})")
    a("--max-weights", type=int,
      help=f"resident weights (default {lim.MAX_WEIGHTS}); more are RESOURCE_EXHAUSTED. Each "
           "holds ~2 KiB of host memory outside --vram-budget, +4 KiB while it has a batcher "
           "(GetStatus host_overhead_bytes)")
    a("--grace-period", dest="grace_period_s", type=_grace_arg,
      help="seconds to drain in-flight work on SIGTERM (default 10)")
    a("--devices", metavar="I,J,...",
      help="serve several devices (e.g. 0,1): one backend, executor and VRAM accountant "
           "each; --vram-budget applies per device (NumPy: independent CPU 'devices')")
    a("--placement", choices=("shard", "replicate"), default="shard",
      help="with --devices: split each weight's rows over the devices (default) or replicate")
    a("--allow-shm", action="store_true", default=None,
      help="let co-located callers register shared-memory regions and name them in matmuls "
           "instead of sending bytes (docs/SERVICE.md, data plane)")
    a("--max-regions", type=int, help="registered regions, all callers together (default 64)")
    a("--max-region-bytes", type=int,
      help="mapped bytes of all regions together (default 4GiB)")
    a("--frontends", type=int, metavar="N",
      help="N gRPC front-end processes on the one port (SO_REUSEPORT) feeding this process, "
           "which alone holds the device, through shared memory (default 1: no extra "
           "process; docs/SERVICE.md)")
    a("--frontend-shm-bytes", type=int,
      help="shared-memory arena of each front end for activations and results "
           "(default 64MiB; committed in /dev/shm at start)")
    a("--keep-cpus-awake", action="store_true", default=None,
      help="a spinner of the lowest scheduling class (SCHED_IDLE) on every CPU the worker may "
           "use while it runs: no CPU ever idles, so on a VM no vCPU halts between calls (for "
           "a host without a cpuidle driver, where /dev/cpu_dma_latency changes nothing); any "
           "thread preempts a spinner at once. Burns every idle CPU (default: "
           "$Q6SERVE_KEEP_CPUS_AWAKE, else off; docs/SERVICE.md)")
    a("--log-level", default=os.environ.get("Q6SERVE_LOG_LEVEL", "INFO"),
      help="logging level (default INFO)")
    p.set_defaults(func=run)


# the worker's --cpus when the option is not given (a deployment's environment, as a container
# sets it)
CPUS_ENV = "Q6SERVE_CPUS"

CONFIG_KEYS = ("host", "port", "metrics_port", "metrics_host", "backend", "model_dir",
               "vram_budget", "max_batch_rows", "max_batch_delay_us", "inline_device_us",
               "cpus", "max_request_rows",
               "max_queue_rows", "max_message_bytes", "max_request_bytes",
               "max_concurrent_streams",
               "max_upload_bytes", "grace_period_s", "allow_shm", "max_regions",
               "max_region_bytes", "frontends", "frontend_shm_bytes", "max_weights",
               "max_inflight_rpcs", "max_inflight_rpcs_per_connection", "max_streams",
               "max_streams_per_connection",
               "min_inflight_rpcs_per_connection", "reply_timeout_s", "max_reading_rpcs",
               "read_timeout_s", "max_stream_bytes",
               "max_stream_bytes_per_connection", "max_stream_bytes_total")


class _ListeningFirst(logging.Handler):
    """Holds log records back until the worker's `listening on H:P` record, writes that one
    first and then the held ones, then passes everything straight through: whatever the
    backend or its imports log (warnings included) during start-up, the first line names the
    address. A start-up that fails before listening gets its held records flushed as well."""

    def __init__(self, target: logging.Handler) -> None:
        super().__init__()
        self.target = target
        self.held: list[logging.LogRecord] | None = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.held is None:
            self.target.handle(record)
        elif record.getMessage().startswith("listening on "):
            self.target.handle(record)
            self.flush_held()
        else:
            self.held.append(record)

    def flush_held(self) -> None:
        held, self.held = self.held or [], None
        for r in held:
            self.target.handle(r)


def _setup_logging(level: str) -> _ListeningFirst:
    out = logging.StreamHandler(sys.stderr)
    out.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    first = _ListeningFirst(out)
    root = logging.getLogger()
    root.handlers[:] = [first]
    root.setLevel(level.upper())
    logging.captureWarnings(True)
    return first


def _grace_arg(text: str) -> float:
    """--grace-period: seconds, finite and >= 0 (0: no drain)."""
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 <= v < float("inf"):  # (nan fails it too)
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds >= 0 (a finite number)")
    return v


def check_free(host: str, port: int | None, what: str, host_option: str = "--host") -> None:
    """Refuse, in one line, before the worker starts: a host that is no address to listen on
    (``host_option`` named; with port 0 too, where gRPC's failure read as a port in use) and a
    port another process holds (gRPC's own failure is a C-core log line plus a RuntimeError
    from deep inside the server)."""
    if not host.strip("[]"):
        raise UsageError(f"{host_option} {host!r} is empty: give an address to listen on "
                         "(127.0.0.1, 0.0.0.0, ::)")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port or 0, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"{host_option} {host!r} is no address to listen on: "
                         f"{e.strerror}") from None
    if not port:
        return
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's listener
            try:
                s.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise PortInUse(f"cannot listen on {host}:{port}: the port is in use "
                                    f"(another worker?): pick another {what} (0 = a free "
                                    "one) or stop the process holding it") from None
                if e.errno == errno.EACCES:
                    raise PortInUse(f"cannot listen on {host}:{port}: permission denied "
                                    f"(ports below 1024 need privileges): pick another "
                                    f"{what}") from None
                raise UsageError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def _gil_switch_interval(env: Mapping[str, str]) -> None:
    """Q6SERVE_GIL_SWITCH_US: the interpreter's switch interval of the worker process (the
    device process with --frontends), in microseconds. Its device thread waits for the GIL
    behind a busy event loop for up to this long (Python's default: 5000 us; measured in
    bench/RESULTS.md, issue 15)."""
    us = envvars.GIL_SWITCH_US.read(env)
    if us is not None:
        sys.setswitchinterval(float(us) * 1e-6)


def _keep_awake(cpus: list[int] | None) -> contextlib.AbstractContextManager[object]:
    """--keep-cpus-awake (else Q6SERVE_KEEP_CPUS_AWAKE): a SCHED_IDLE spinner on each of
    ``cpus`` for the worker's life (service/keep_awake.py; its line logged); None: nothing."""
    if not cpus:
        return contextlib.nullcontext()
    from q6serve.service.keep_awake import keep_awake

    return keep_awake(cpus)


def _check_pems(config: object) -> None:
    """The worker's TLS files (Q6SERVE_TLS_CERT/KEY/CLIENT_CA) hold PEM text: an empty or
    garbage one made gRPC's server fail to bind, which read as a host or port problem."""
    for field, var in (("tls_cert", "Q6SERVE_TLS_CERT"), ("tls_key", "Q6SERVE_TLS_KEY"),
                       ("tls_client_ca", "Q6SERVE_TLS_CLIENT_CA")):
        path = getattr(config, field)
        if path is not None and b"-----BEGIN " not in path.read_bytes():
            raise UsageError(f"{var}={path} is not a PEM file (no '-----BEGIN' line)")


class PortInUse(Exception):
    """The worker cannot listen where it was told to."""


def run(args: argparse.Namespace) -> int:
    # before anything imports gRPC, which reads GRPC_EXPERIMENTS once (client/grpc_env.py)
    grpc_tuned = grpc_env.apply()
    first = _setup_logging(args.log_level)
    envvars.check()  # a bad tuning variable: one line naming it, before anything starts
    awake = envvars.KEEP_CPUS_AWAKE.read() if args.keep_cpus_awake is None else args.keep_cpus_awake
    all_cpus = sorted(os.sched_getaffinity(0))  # (before --cpus narrows this process's)
    from q6serve.kernels.backends import make_backend
    from q6serve.service.affinity import check_cpus, cores_of, pin_process
    from q6serve.service.config import config_from
    from q6serve.service.worker import run_worker

    try:
        if args.cpus is None and os.environ.get(CPUS_ENV):
            args.cpus = os.environ[CPUS_ENV]
        config = config_from({k: getattr(args, k) for k in CONFIG_KEYS}, os.environ)
        if config.cpus:  # before the backend and the server start their threads
            check_cpus(config.cpus)  # here, not in the config: front ends narrow their own
            pin_process(cores_of(config.cpus, 0, config.frontends))
        _gil_switch_interval(os.environ)
        check_free(config.host, config.port, "--port")
        if config.metrics_port is not None:
            check_free(config.metrics_host or config.host, config.metrics_port,
                       "--metrics-port", "--metrics-host" if config.metrics_host else "--host")
        if config.model_dir is not None and not config.model_dir.is_dir():
            raise UsageError(f"--model-dir {config.model_dir} is not a directory")
        _check_pems(config)
        worker = None
        if args.devices is not None and not args.devices.strip():
            raise UsageError("--devices '' names no device: give indices like 0,1")
        if args.devices and config.frontends > 1:
            raise UsageError("--frontends with --devices is not supported yet: run one worker "
                             "per device")
        if args.devices:  # several devices: service/devices.py (docs/SCALEOUT.md)
            from q6serve.service.devices import DevicesWorker, make_backends, parse_devices

            ordinals = parse_devices(args.devices)
            backends = make_backends(config.backend, ordinals)
            worker = DevicesWorker(config, backends, args.placement, ordinals)
            backend = backends[0]
        else:
            backend = make_backend(config.backend)
            if config.frontends > 1:  # service/frontends.py
                from q6serve.service.frontends import FrontendsWorker

                worker = FrontendsWorker(config, backend)
        logging.getLogger("q6serve.worker").info(  # (held until "listening on" is logged)
            "gRPC: %s=%r%s", grpc_env.VAR, os.environ.get(grpc_env.VAR, ""),
            "" if grpc_tuned else " (gRPC was imported before the worker set it: not read)")
        with _keep_awake(all_cpus if awake else None):
            if not asyncio.run(run_worker(config, backend, worker)):
                return EXIT_FAILED  # the drain abandoned work (logged): not a clean stop
    except PortInUse as e:
        first.flush_held()
        print(f"q6serve worker: {e}", file=sys.stderr)
        return EXIT_FAILED
    except RuntimeError as e:
        if "Failed to bind" not in str(e):  # lost a race for the port after the check above
            raise
        first.flush_held()
        print(f"q6serve worker: cannot listen on {config.host}:{config.port}: gRPC could not "
              "bind it (the port taken since the check, or the address not this machine's): "
              "check --host and --port (0 = a free one)", file=sys.stderr)
        return EXIT_FAILED
    finally:
        first.flush_held()
    return 0
