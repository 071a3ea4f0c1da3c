"""Worker configuration: one frozen dataclass built from the CLI and the environment.

Secrets (tokens) come from the environment or files only, never the command line, and are
redacted when the configuration is logged at start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from q6serve.kernels.errors import InvalidArgument

from . import config_limits as lim
from .affinity import parse_cpus
from .flags import FlagState

DEFAULT_FRACTION = 0.9  # of the device memory free at start, when no budget is given


@dataclass(frozen=True)
class Budget:
    """A VRAM budget: absolute bytes, or a fraction of the device memory free at start
    (neither given: DEFAULT_FRACTION)."""

    nbytes: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> Budget:
        """``"0.9"`` (fraction of free memory), ``"8GiB"``, ``"500M"`` or ``"1048576"`` bytes."""
        if text is None or text == "":
            return cls(fraction=DEFAULT_FRACTION)
        m = lim.SIZE.match(text)
        if not m:
            raise InvalidArgument(f"--vram-budget {text!r}: use bytes (8GiB, 500M, 123456) "
                                  "or a fraction of free memory in (0, 1]")
        value, unit = float(m.group(1)), (m.group(2) or "").lower().rstrip("b")
        if not unit and "." in m.group(1):
            if not 0.0 < value <= 1.0:
                raise InvalidArgument(f"--vram-budget fraction {value} is not in (0, 1]")
            return cls(fraction=value)
        nbytes = int(value * lim.UNITS[unit])
        if nbytes < 1:  # (0 bytes: nothing could ever load)
            raise InvalidArgument(f"--vram-budget {text!r}: give bytes >= 1 (8GiB, 500M, "
                                  "123456) or a fraction of free memory in (0, 1]")
        return cls(nbytes=nbytes)

    def resolve(self, device_free: int) -> int:
        if self.nbytes is not None:
            return self.nbytes
        return int(device_free * (self.fraction or DEFAULT_FRACTION))

    def __str__(self) -> str:
        if self.nbytes is not None:
            return f"{self.nbytes} B"
        return f"{self.fraction or DEFAULT_FRACTION} of free"


@dataclass(frozen=True)
class WorkerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = None  # None: no HTTP /metrics; 0: a free port
    metrics_host: str | None = None  # default: same as host
    metrics_enabled: bool = True  # False: no series at all (the overhead benchmark's baseline)
    backend: str = "auto"
    model_dir: Path | None = None
    vram_budget: Budget = field(default_factory=Budget)
    max_batch_rows: int = 64
    max_batch_delay_us: int = 200
    # a batch expected to keep the device busy at most this long runs on the event loop's
    # thread when the device thread is idle (service/batcher.py, Device); 0: always the thread
    inline_device_us: int = 3000
    # cores every thread of the worker runs on (service/affinity.py); (): wherever the OS likes
    cpus: tuple[int, ...] = ()
    max_request_rows: int = 256  # N limit of one request
    max_queue_rows: int = 8192  # per weight; beyond: RESOURCE_EXHAUSTED
    # limits: defaults and meanings in service/config_limits.py (the CLI's --help too)
    max_message_bytes: int = lim.MAX_MESSAGE_BYTES
    max_request_bytes: int = lim.MAX_REQUEST_BYTES  # read at most min(this, max_message_bytes)
    max_concurrent_streams: int = lim.MAX_CONCURRENT_STREAMS
    max_inflight_rpcs: int = lim.MAX_INFLIGHT_RPCS  # unary RPCs in the worker; more wait
    # a connection's fair share of them: limit / active connections, within [min, max] (min
    # is clamped to max)
    max_inflight_rpcs_per_connection: int = lim.MAX_INFLIGHT_RPCS_PER_CONNECTION
    min_inflight_rpcs_per_connection: int = lim.MIN_INFLIGHT_RPCS_PER_CONNECTION
    reply_timeout_s: float = lim.REPLY_TIMEOUT_S  # unwritten replies dropped while calls wait
    max_reading_rpcs: int = lim.MAX_READING_RPCS  # unary requests read at once
    read_timeout_s: float = lim.READ_TIMEOUT_S  # ... a slow one cancelled while others wait
    max_upload_bytes: int = lim.MAX_UPLOAD_BYTES
    max_weights: int = lim.MAX_WEIGHTS
    max_stream_bytes: int = lim.MAX_STREAM_BYTES
    max_stream_bytes_per_connection: int = lim.MAX_STREAM_BYTES_PER_CONNECTION
    max_stream_bytes_total: int = lim.MAX_STREAM_BYTES_TOTAL
    max_streams: int = lim.MAX_STREAMS  # streaming calls open in the worker ...
    max_streams_per_connection: int = lim.MAX_STREAMS_PER_CONNECTION  # ... and per connection
    load_chunk_bytes: int = 16 * 2**20  # bounded AoS chunks for loads and relayouts
    grace_period_s: float = 10.0
    flags: FlagState = field(default_factory=FlagState)
    token: str | None = None  # bearer token for every RPC (health excepted)
    admin_token: str | None = None  # bearer token for load/upload/unload/flags
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # set: mutual TLS, client certificates required
    # shared-memory regions (service/regions.py): off unless asked for
    allow_shm: bool = False
    max_regions: int = 64
    max_region_bytes: int = 4 * 2**30  # mapped bytes of all regions together
    # front-end processes (service/frontends.py): 1 = the gRPC server runs in this process
    frontends: int = 1
    frontend_shm_bytes: int = 64 * 2**20  # shared-memory arena of each front end

    def __post_init__(self) -> None:
        for name in ("max_batch_rows", "max_request_rows", "max_queue_rows", "load_chunk_bytes",
                     "max_stream_bytes", "max_regions", "max_region_bytes",
                     "max_stream_bytes_per_connection", "max_stream_bytes_total",
                     "max_inflight_rpcs", "max_inflight_rpcs_per_connection", "frontends",
                     "max_streams", "max_streams_per_connection",
                     "frontend_shm_bytes", "max_weights", "max_message_bytes",
                     "max_request_bytes", "max_reading_rpcs",
                     "max_concurrent_streams", "max_upload_bytes",
                     "min_inflight_rpcs_per_connection"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name}={getattr(self, name)} must be >= 1")
        lim.check_port(self.port, "port")
        lim.check_port(self.metrics_port, "metrics_port")
        for name in ("max_batch_delay_us", "inline_device_us"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name}={getattr(self, name)} must be >= 0")
        if self.frontends > lim.MAX_FRONTENDS:
            raise InvalidArgument(f"frontends={self.frontends} must be <= {lim.MAX_FRONTENDS} "
                                  "(each is a process with its own shared-memory arena)")
        if self.frontend_shm_bytes < lim.MIN_FRONTEND_SHM_BYTES:
            raise InvalidArgument(
                f"frontend_shm_bytes={self.frontend_shm_bytes} must be >= "
                f"{lim.show_size(lim.MIN_FRONTEND_SHM_BYTES)}: a smaller arena holds no call")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidArgument("TLS needs both a certificate and a key")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise InvalidArgument("mutual TLS (client CA) needs a server certificate and key")

    @property
    def receive_limit(self) -> int:
        """Bytes of the largest request message the worker reads (gRPC refuses larger)."""
        return min(self.max_request_bytes, self.max_message_bytes)

    def describe(self) -> str:
        """One log line; secrets redacted."""
        parts = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("token", "admin_token") and v is not None:
                v = "<set>"
            parts.append(f"{f.name}={v}")
        return "config: " + " ".join(parts)


def _read_secret(env: Mapping[str, str], name: str) -> str | None:
    """``NAME`` or the contents of the file named by ``NAME_FILE``."""
    if env.get(name):
        return env[name]
    path = env.get(f"{name}_FILE")
    return Path(path).read_text().strip() if path else None


def config_from(args: Mapping[str, object], env: Mapping[str, str]) -> WorkerConfig:
    """Build the config from parsed CLI options (None = not given) over environment defaults.

    Environment: Q6SERVE_TOKEN[_FILE], Q6SERVE_ADMIN_TOKEN[_FILE], Q6SERVE_TLS_CERT,
    Q6SERVE_TLS_KEY, Q6SERVE_TLS_CLIENT_CA and the three kill-switch flags.
    """
    kw: dict[str, object] = {k: v for k, v in args.items() if v is not None}
    if "vram_budget" in kw:
        kw["vram_budget"] = Budget.parse(str(kw["vram_budget"]))
    if isinstance(kw.get("cpus"), str):
        kw["cpus"] = parse_cpus(str(kw["cpus"]))
    for key in ("model_dir", "tls_cert", "tls_key", "tls_client_ca"):
        env_key = f"Q6SERVE_{key.upper()}"
        if key not in kw and env.get(env_key):
            kw[key] = env[env_key]
        if key in kw:
            kw[key] = Path(str(kw[key]))
    kw.setdefault("token", _read_secret(env, "Q6SERVE_TOKEN"))
    kw.setdefault("admin_token", _read_secret(env, "Q6SERVE_ADMIN_TOKEN"))
    kw["flags"] = FlagState.from_env(env)
    known = {f.name for f in dataclasses.fields(WorkerConfig)}
    unknown = set(kw) - known
    if unknown:
        raise InvalidArgument(f"unknown config keys: {sorted(unknown)}")
    cfg = WorkerConfig(**kw)  # type: ignore[arg-type]
    _check_given(cfg, kw)
    return cfg


def _check_given(cfg: WorkerConfig, given: Mapping[str, object]) -> None:
    """Limits given above the limit that caps them (a default that caps one stays a cap: the
    worker takes the smaller, as before): --max-request-bytes above --max-message-bytes, and
    --min-inflight-rpcs-per-connection above --max-inflight-rpcs-per-connection."""
    if "max_request_bytes" in given and cfg.max_request_bytes > cfg.max_message_bytes:
        raise InvalidArgument(f"max_request_bytes={cfg.max_request_bytes} must be <= "
                              f"max_message_bytes={cfg.max_message_bytes}, its ceiling")
    if ("min_inflight_rpcs_per_connection" in given and cfg.min_inflight_rpcs_per_connection
            > cfg.max_inflight_rpcs_per_connection):
        raise InvalidArgument(
            f"min_inflight_rpcs_per_connection={cfg.min_inflight_rpcs_per_connection} must be "
            f"<= max_inflight_rpcs_per_connection={cfg.max_inflight_rpcs_per_connection}")
