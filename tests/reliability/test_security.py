"""Security: default bind, bearer and admin tokens on every RPC (constant-time), TLS and mutual
TLS with certificates generated here (openssl CLI), model-dir confinement, size/N/queue/stream
limits, and no deserialisation of untrusted data beyond protobuf and GGUF."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from q6serve.client.client import Client, Q6ServeError
from q6serve.kernels.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from q6serve.service import auth as auth_mod
from q6serve.service import wire
from q6serve.service.auth import TokenAuth
from q6serve.service.config import Budget, WorkerConfig, config_from
from q6serve.service.weight_sources import confine
from q6serve.v1 import q6serve_pb2 as pb
from tests.reliability.faulty import FaultyBackend
from tests.reliability.gguf_corpus import File, Tensor, q6k_blocks
from tests.reliability.harness import RunningWorker, random_q6k

REPO = Path(__file__).resolve().parents[2]
K = 256
C = grpc.StatusCode
USER, ADMIN = "user-secret-token", "admin-secret-token"


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., RunningWorker]]:
    started: list[RunningWorker] = []
    models = tmp_path / "models"
    models.mkdir(exist_ok=True)

    def go(backend: Any = None, **kw: Any) -> RunningWorker:
        kw.setdefault("model_dir", models)
        kw.setdefault("vram_budget", Budget(nbytes=64 << 20))
        cfg = WorkerConfig(host=kw.pop("host", "127.0.0.1"), port=0, grace_period_s=2.0, **kw)
        w = RunningWorker(cfg, backend)
        started.append(w)
        return w

    yield go
    for w in started:
        w.stop()


# -- default bind ---------------------------------------------------------------------------------
# 127.0.0.1, ::ffff:127.0.0.1 and ::1 as /proc/net/tcp{,6} spell them
LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp{,6}) listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            local, state = ln.split()[1], ln.split()[3]
            addr, p = local.rsplit(":", 1)
            if state == "0A" and int(p, 16) == port:
                out.append(addr)
    return out


def test_default_bind_is_loopback_only(start: Callable[..., RunningWorker]) -> None:
    assert WorkerConfig().host == "127.0.0.1"
    assert config_from({"port": 0}, {}).host == "127.0.0.1"
    w = RunningWorker(config_from({"port": 0, "vram_budget": "64MiB"}, {}))
    try:
        assert w.target.startswith("127.0.0.1:")
        port = int(w.target.rsplit(":", 1)[1])
        found = _listeners(port)
        assert found and set(found) <= LOOPBACK, found  # no 0.0.0.0, no [::]
        host_ip = _non_loopback_ip()
        if host_ip:
            with pytest.raises(OSError), socket.create_connection((host_ip, port), timeout=2):
                pass
    finally:
        w.stop()


def test_default_config_starts() -> None:
    w = RunningWorker(config_from({"port": 0}, {}))
    try:
        assert w.client().health()
    finally:
        w.stop()


def _non_loopback_ip() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent for UDP connect
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


# -- tokens ---------------------------------------------------------------------------------------
_DESC = pb.DESCRIPTOR.services_by_name["Q6Serve"]


def _call_raw(ch: grpc.Channel, method: str, metadata: tuple[tuple[str, str], ...]) -> C:
    """Call ``method`` with an empty message; return the status code (OK if it answered)."""
    m = _DESC.methods_by_name[method]
    path = f"/{_DESC.full_name}/{method}"
    kind = {(False, False): ch.unary_unary, (True, False): ch.stream_unary,
            (False, True): ch.unary_stream, (True, True): ch.stream_stream}[
        (m.client_streaming, m.server_streaming)]
    call = kind(path)
    req: Any = iter([b""]) if m.client_streaming else b""
    try:
        out = call(req, timeout=10, metadata=metadata)
        if m.server_streaming:
            list(out)
    except grpc.RpcError as e:
        return e.code()  # type: ignore[attr-defined, no-any-return]
    return C.OK


def _bearer(tok: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {tok}"),)


BAD_CREDENTIALS = (_bearer("wrong"), _bearer(USER[:-1]), _bearer(USER + "x"),
                   (("authorization", f"Basic {USER}"),), (("x-token", USER),),
                   (("authorization", "Bearer"),))


def test_every_rpc_needs_a_token_and_admin_rpcs_the_admin_token(
        start: Callable[..., RunningWorker]) -> None:
    w = start(token=USER, admin_token=ADMIN)
    assert set(wire.ADMIN_METHODS) == {"LoadWeights", "UploadWeight", "UnloadWeight",
                                       "SetFlags"}
    auth_codes = (C.UNAUTHENTICATED, C.PERMISSION_DENIED)
    with grpc.insecure_channel(w.target) as ch:
        for method in wire.METHODS:
            admin = method in wire.ADMIN_METHODS
            assert _call_raw(ch, method, ()) == C.UNAUTHENTICATED, method
            for md in BAD_CREDENTIALS:  # invalid credentials: UNAUTHENTICATED, admin or not
                assert _call_raw(ch, method, md) == C.UNAUTHENTICATED, (method, md)
            user = _call_raw(ch, method, _bearer(USER))
            assert (user == C.PERMISSION_DENIED) if admin else (user not in auth_codes), \
                (method, user)
            assert _call_raw(ch, method, _bearer(ADMIN)) not in auth_codes, method
            # RFC 6750: the scheme is case-insensitive
            assert _call_raw(ch, method, (("authorization", f"bearer {ADMIN}"),)) \
                not in auth_codes
        # reflection describes the API: it needs the token too; health stays open (probes)
        refl = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
        with pytest.raises(grpc.RpcError) as info:
            list(ch.stream_stream(refl)(iter([b""]), timeout=10))
        assert info.value.code() == C.UNAUTHENTICATED  # type: ignore[attr-defined]
    assert Client(w.target).health()


def test_invalid_credentials_on_admin_rpcs_are_unauthenticated(
        start: Callable[..., RunningWorker]) -> None:
    w = start(token=USER, admin_token=ADMIN)
    with grpc.insecure_channel(w.target) as ch:
        for method in sorted(wire.ADMIN_METHODS):
            for md in BAD_CREDENTIALS:
                assert _call_raw(ch, method, md) == C.UNAUTHENTICATED, (method, md)
            assert _call_raw(ch, method, _bearer(USER)) == C.PERMISSION_DENIED


def test_unauthenticated_bytes_are_never_parsed(start: Callable[..., RunningWorker]) -> None:
    """Auth runs before the request is decoded: junk from a caller without a token gets
    UNAUTHENTICATED, the same junk with the token INVALID_ARGUMENT."""
    w = start(token=USER)
    junk = b"\x12\xff\xff\xff\xff\x0f"
    with grpc.insecure_channel(w.target) as ch:
        for md, code in (((), C.UNAUTHENTICATED), (_bearer(USER), C.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as info:
                ch.unary_unary("/q6serve.v1.Q6Serve/Matmul")(junk, timeout=10, metadata=md)
            assert info.value.code() == code  # type: ignore[attr-defined]


def test_admin_token_alone_and_user_token_alone(start: Callable[..., RunningWorker]) -> None:
    """Only an admin token set: data RPCs are open, admin RPCs need it. Only a user token:
    it opens everything (there is no separate admin)."""
    w = start(admin_token=ADMIN)
    with grpc.insecure_channel(w.target) as ch:
        assert _call_raw(ch, "ListWeights", ()) == C.OK
        assert _call_raw(ch, "SetFlags", ()) == C.UNAUTHENTICATED
        assert _call_raw(ch, "SetFlags", _bearer("nope")) == C.UNAUTHENTICATED
        assert _call_raw(ch, "SetFlags", _bearer(ADMIN)) == C.OK
    w2 = start(token=USER)
    with grpc.insecure_channel(w2.target) as ch:
        assert _call_raw(ch, "ListWeights", ()) == C.UNAUTHENTICATED
        assert _call_raw(ch, "SetFlags", _bearer(USER)) == C.OK


def test_tokens_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = auth_mod.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth_mod.hmac, "compare_digest", spy)
    a = TokenAuth(token=USER, admin_token=ADMIN)
    a.check("/q6serve.v1.Q6Serve/Matmul", "Matmul", False, _bearer(USER))
    with pytest.raises(Exception, match="bearer token"):
        a.check("/q6serve.v1.Q6Serve/Matmul", "Matmul", False, _bearer("u" * len(USER)))
    assert (USER.encode(), USER.encode()) in calls
    assert ("u" * len(USER)).encode() in {x for x, _ in calls}
    # No token ever reaches an ordinary == comparison in the module.
    src = Path(auth_mod.__file__).read_text()
    assert not re.search(r"(token|given|want)\s*[!=]=\s*(?!None)", src), "non-constant compare"


def test_secrets_come_from_env_or_files_and_are_redacted(tmp_path: Path) -> None:
    (tmp_path / "admin").write_text(ADMIN + "\n")
    cfg = config_from({}, {"Q6SERVE_TOKEN": USER, "Q6SERVE_ADMIN_TOKEN_FILE":
                           str(tmp_path / "admin")})
    assert (cfg.token, cfg.admin_token) == (USER, ADMIN)
    line = cfg.describe()
    assert USER not in line and ADMIN not in line and "token=<set>" in line
    helptext = subprocess.run(
        [str(REPO / ".venv/bin/python"), "-m", "q6serve.client.cli", "worker", "--help"],
        capture_output=True, text=True, timeout=60).stdout
    assert "--token" not in helptext  # never on a command line (ps, shell history)


# -- TLS and mutual TLS ---------------------------------------------------------------------------
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-days", "1", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.pem", cwd=d)


def _leaf(d: Path, name: str, ca: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
    (d / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext", "-out",
             f"{name}.pem", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca -> server, client; a second, unrelated ca2 -> rogue client."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "ca2")
    _leaf(d, "server", "ca")
    _leaf(d, "client", "ca")
    _leaf(d, "rogue", "ca2")
    return d


def _rb(d: Path, name: str) -> bytes:
    return (d / name).read_bytes()


def _refused(c: Client) -> None:
    with pytest.raises(Q6ServeError) as info:
        c.list()
    assert info.value.code == C.UNAVAILABLE
    c.close()


def test_tls(start: Callable[..., RunningWorker], pki: Path) -> None:
    w = start(tls_cert=pki / "server.pem", tls_key=pki / "server.key")
    with Client(w.target, root_certificates=_rb(pki, "ca.pem")) as c:
        c.upload("w", random_q6k(4, K, 1), 4, K)
        assert c.matmul("w", np.ones((1, K), np.float32)).shape == (1, 4)
        assert c.health()
    _refused(Client(w.target, timeout=5))  # plaintext to a TLS port
    _refused(Client(w.target, timeout=5, root_certificates=_rb(pki, "ca2.pem")))  # wrong CA


def test_mutual_tls_and_tokens(start: Callable[..., RunningWorker], pki: Path) -> None:
    w = start(tls_cert=pki / "server.pem", tls_key=pki / "server.key",
              tls_client_ca=pki / "ca.pem", token=USER)
    ca = _rb(pki, "ca.pem")

    def client(cert: str | None, token: str | None = USER) -> Client:
        kw: dict[str, Any] = {"root_certificates": ca, "timeout": 5, "token": token}
        if cert:
            kw |= {"certificate_chain": _rb(pki, f"{cert}.pem"),
                   "private_key": _rb(pki, f"{cert}.key")}
        return Client(w.target, **kw)

    with client("client") as c:
        assert c.list() == []
    _refused(client(None))  # no client certificate
    _refused(client("rogue"))  # a certificate from another CA
    with client("client", token=None) as c, pytest.raises(Q6ServeError) as info:
        c.list()  # a valid certificate does not replace the token
    assert info.value.code == C.UNAUTHENTICATED


def test_tls_config_is_checked() -> None:
    with pytest.raises(InvalidArgument, match="both a certificate and a key"):
        WorkerConfig(tls_cert=Path("c.pem"))
    with pytest.raises(InvalidArgument, match="needs a server certificate"):
        WorkerConfig(tls_client_ca=Path("ca.pem"))


# -- model-dir confinement ------------------------------------------------------------------------
@pytest.fixture
def jail(tmp_path: Path) -> Path:
    root = tmp_path / "jail"
    models, outside = root / "models", root / "outside"
    (models / "sub").mkdir(parents=True)
    outside.mkdir()
    m = File([Tensor("w", [K, 2], data=q6k_blocks(2, K))]).build()
    for p in (models / "m.gguf", models / "sub" / "m.gguf", outside / "secret.gguf"):
        p.write_bytes(m)
    (models / "inside-link.gguf").symlink_to(models / "sub" / "m.gguf")
    (models / "relative-link.gguf").symlink_to("sub/m.gguf")
    (models / "escape.gguf").symlink_to(outside / "secret.gguf")
    (models / "escape-rel.gguf").symlink_to("../outside/secret.gguf")
    (models / "outdir").symlink_to(outside, target_is_directory=True)
    (models / "etc").symlink_to("/etc", target_is_directory=True)
    (models / "loop-a").symlink_to(models / "loop-b")
    (models / "loop-b").symlink_to(models / "loop-a")
    return models


ALLOWED = ("m.gguf", "./m.gguf", "sub/m.gguf", "inside-link.gguf", "relative-link.gguf")
DENIED = ("../outside/secret.gguf", "sub/../m.gguf", "/etc/passwd", "//etc/passwd",
          "escape.gguf", "escape-rel.gguf", "outdir/secret.gguf", "etc/passwd",
          str(Path("..") / ".." / "etc" / "passwd"))


def test_confine_allows_inside_and_refuses_escapes(jail: Path) -> None:
    for rel in ALLOWED:
        assert confine(jail, rel).is_relative_to(jail.resolve()), rel
    for rel in DENIED:
        with pytest.raises(PermissionDenied, match="model dir"):
            confine(jail, rel)
    with pytest.raises(InvalidArgument):
        confine(jail, "")
    with pytest.raises(InvalidArgument):
        confine(jail, "m.gguf\x00.txt")
    with pytest.raises(FailedPrecondition, match="no --model-dir"):
        confine(None, "m.gguf")
    for rel, match in (("loop-a", r"'loop-a' cannot be resolved"),
                       ("x" * 5000, r"of 5000 characters is too long \(at most 1024"),
                       ("d/" + "x" * 300, r"too long \(at most 1024, 255 per component\)")):
        with pytest.raises(InvalidArgument, match=match):
            confine(jail, rel)


def test_load_weights_confined(start: Callable[..., RunningWorker], jail: Path) -> None:
    w = start(model_dir=jail)
    c = w.client()
    for i, rel in enumerate(ALLOWED):
        assert [x.name for x in c.load(rel, prefix=f"{i}.")] == [f"{i}.w"]
    for rel in DENIED:
        with pytest.raises(Q6ServeError) as info:
            c.load(rel)
        assert info.value.code == C.PERMISSION_DENIED, (rel, info.value)
        assert "secret" not in info.value.message or rel.endswith("secret.gguf")
    assert len(c.list()) == len(ALLOWED)


def test_hostile_paths_are_client_errors(start: Callable[..., RunningWorker],
                                         jail: Path) -> None:
    w = start(model_dir=jail)
    c = w.client()
    for rel, code in (("loop-a", C.INVALID_ARGUMENT), ("x" * 5000, C.INVALID_ARGUMENT),
                      ("y/" * 3000 + "m.gguf", C.INVALID_ARGUMENT),
                      ("sub", C.NOT_FOUND), ("missing.gguf", C.NOT_FOUND)):
        with pytest.raises(Q6ServeError) as info:
            c.load(rel)
        assert info.value.code == code, (rel[:20], info.value)
        assert len(info.value.message) < 400


def test_no_model_dir_refuses_server_side_loads(start: Callable[..., RunningWorker]) -> None:
    w = start(model_dir=None)
    with pytest.raises(Q6ServeError) as info:
        w.client().load("m.gguf")
    assert info.value.code == C.FAILED_PRECONDITION


# -- limits ---------------------------------------------------------------------------------------
def test_message_size_limit_both_ways(start: Callable[..., RunningWorker]) -> None:
    w = start(max_message_bytes=128 << 10, max_request_rows=256)
    c = w.client()
    c.upload("w", random_q6k(512, K, 3), 512, K)
    assert c.matmul("w", np.ones((16, K), np.float32)).shape == (16, 512)
    with pytest.raises(Q6ServeError) as info:  # request over the limit
        c.matmul("w", np.ones((129, K), np.float32))
    assert info.value.code == C.RESOURCE_EXHAUSTED and "larger than max" in info.value.message
    with pytest.raises(Q6ServeError) as info:  # reply over the limit (64 x 512 f32 = 128 KiB+)
        c.matmul("w", np.ones((64, K), np.float32))
    assert info.value.code == C.RESOURCE_EXHAUSTED
    assert c.health()


def test_queue_length_limit(start: Callable[..., RunningWorker]) -> None:
    backend = FaultyBackend(matmul_delay_s=0.8)  # long enough for all 6 callers to arrive
    w = start(backend, max_queue_rows=8, max_batch_rows=8)
    c = w.client()
    c.upload("w", random_q6k(4, K, 4), 4, K)
    x = np.ones((4, K), np.float32)
    results: list[Any] = []

    def call() -> None:
        try:
            results.append(c.matmul("w", x, timeout=30))
        except Q6ServeError as e:
            results.append(e)

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join(30)
    full = [r for r in results if isinstance(r, Q6ServeError)]
    assert full and all(e.code == C.RESOURCE_EXHAUSTED for e in full)
    assert re.search(r"queue of weight 'w' is full: \d+ rows queued, 4 more would exceed 8",
                     full[0].message)
    assert len(results) - len(full) >= 2  # the running one and those that fitted succeeded
    assert c.matmul("w", x).shape == (4, 4)


@pytest.mark.parametrize("limit", [2, 0])
def test_concurrent_streams_limit(limit: int, start: Callable[..., RunningWorker]) -> None:
    """--max-concurrent-streams caps the RPCs one connection has in the worker at once (0 =
    the default limit, as a control that the measurement can see more)."""
    backend = FaultyBackend(matmul_delay_s=0.15)
    kw = {"max_concurrent_streams": limit} if limit else {}
    w = start(backend, flags=config_from({}, {"Q6SERVE_DYNAMIC_BATCHING": "0"}).flags, **kw)
    c = w.client()
    c.upload("w", random_q6k(4, K, 5), 4, K)
    entry = w.run(lambda: w.engine.registry.get("w"))
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], w.run(lambda: entry.refs))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    calls = [threading.Thread(target=c.matmul, args=("w", np.ones((1, K), np.float32)))
             for _ in range(6)]
    for t in calls:
        t.start()
    for t in calls:
        t.join(30)
    stop.set()
    watcher.join(5)
    assert len(backend.launches) == 6  # every call was served
    if limit:
        assert peak[0] <= limit, peak[0]
    else:
        assert peak[0] > 2, peak[0]


# -- nothing but protobuf and GGUF is deserialised ------------------------------------------------
UNSAFE = re.compile(r"\b(pickle|cPickle|marshal|shelve|dill|cloudpickle|jsonpickle)\b|"
                    r"allow_pickle\s*=\s*True|\byaml\.(load|unsafe_load)\(|\btorch\.load\(|"
                    r"(?<![\w.])(eval|exec)\(")


# The one exception: messages between a --frontends worker's own processes (pickled over a
# Unix socket in a 0700 directory; the device process accepts only its children's pids,
# checked with SO_PEERCRED). Nothing a client sends is unpickled.
FRONTEND_IPC = "service/frontends_ipc.py"


def test_no_unsafe_deserialisation_in_the_worker() -> None:
    offenders = []
    for pkg in ("service", "kernels", "client"):
        for p in sorted((REPO / pkg).rglob("*.py")):
            if p.relative_to(REPO).as_posix() == FRONTEND_IPC:
                continue
            for i, line in enumerate(p.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if UNSAFE.search(code):
                    offenders.append(f"{p.relative_to(REPO)}:{i}: {line.strip()}")
    assert offenders == []


def test_upload_refused_before_buffering_what_cannot_fit(
        start: Callable[..., RunningWorker]) -> None:
    """An upload whose weight cannot fit the budget fails right after its header: the worker
    does not buffer gigabytes it will refuse anyway."""
    import hashlib

    w = start(vram_budget=Budget(nbytes=1 << 20))
    rows, chunk = 64 * 1024 * 4, b"\0" * (1 << 20)  # 64 MiB of declared Q6_K rows (K=256)
    total = rows * 210
    sent = [0]

    def messages() -> Iterator[pb.UploadWeightRequest]:
        yield pb.UploadWeightRequest(header=pb.UploadHeader(
            name="big", rows=rows, k=K, format=pb.UPLOAD_FORMAT_Q6_K, total_bytes=total,
            sha256=hashlib.sha256(b"").hexdigest()))
        for _ in range(total // len(chunk)):
            sent[0] += 1
            yield pb.UploadWeightRequest(chunk=chunk)

    with grpc.insecure_channel(w.target) as ch:
        call = ch.stream_unary("/q6serve.v1.Q6Serve/UploadWeight",
                               request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as info:
            call(messages(), timeout=60)
    err: Any = info.value
    assert err.code() == C.RESOURCE_EXHAUSTED and "VRAM budget" in err.details()
    assert sent[0] < 16, f"{sent[0]} MiB were sent before the refusal"


def test_limit_flags_on_the_command_line(tmp_path: Path) -> None:
    """Every limit is a `q6serve worker` flag, and the flags reach the running worker."""
    py = str(REPO / ".venv/bin/python")
    helptext = subprocess.run([py, "-m", "q6serve.client.cli", "worker", "--help"],
                              capture_output=True, text=True, timeout=60).stdout
    for flag in ("--max-message-bytes", "--max-concurrent-streams", "--max-upload-bytes",
                 "--max-request-rows", "--max-queue-rows"):
        assert flag in helptext, flag
    proc = subprocess.Popen(
        [py, "-m", "q6serve.client.cli", "worker", "--port", "0", "--backend", "numpy",
         "--vram-budget", "16MiB", "--max-message-bytes", "65536", "--max-upload-bytes",
         "4096"], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        target = ""
        for _ in range(50):
            m = re.search(r"listening on (\S+:\d+)", proc.stderr.readline())
            if m:
                target = m.group(1)
                break
        assert target
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining
        with Client(target, timeout=30) as c:
            with pytest.raises(Q6ServeError) as info:
                c.upload("w", random_q6k(32, K, 6), 32, K)  # 6720 bytes > 4096
            assert info.value.code == C.RESOURCE_EXHAUSTED and "4096" in info.value.message
            c.upload("w", random_q6k(16, K, 6), 16, K)
            with pytest.raises(Q6ServeError) as info:
                c.matmul("w", np.ones((80, K), np.float32))  # 80 KiB > 64 KiB
            assert info.value.code == C.RESOURCE_EXHAUSTED
            assert c.matmul("w", np.ones((8, K), np.float32)).shape == (8, 16)
    finally:
        proc.terminate()
        proc.wait(20)
