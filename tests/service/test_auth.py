"""Bearer tokens (admin token for load/upload/unload/flags) and TLS / mutual TLS."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import numpy as np
import pytest
from svc_util import random_q6k

from q6serve.client.client import Client, Q6ServeError
from q6serve.service.auth import TokenAuth


def test_token_auth_rules() -> None:
    auth = TokenAuth(token="user", admin_token="root")
    md = lambda tok: [("authorization", f"Bearer {tok}")]  # noqa: E731
    auth.check("/grpc.health.v1.Health/Check", "Check", False, None)  # health stays open
    auth.check("/q6serve.v1.Q6Serve/Matmul", "Matmul", False, md("user"))
    auth.check("/q6serve.v1.Q6Serve/Matmul", "Matmul", False, md("root"))
    auth.check("/q6serve.v1.Q6Serve/SetFlags", "SetFlags", True, md("root"))
    for method, admin, meta, err in (
        ("Matmul", False, None, "Unauthenticated"),
        ("Matmul", False, md("wrong"), "Unauthenticated"),
        ("SetFlags", True, md("user"), "PermissionDenied"),
        ("SetFlags", True, None, "Unauthenticated"),
    ):
        with pytest.raises(Exception) as e:
            auth.check(f"/q6serve.v1.Q6Serve/{method}", method, admin, meta)
        assert type(e.value).__name__ == err
    TokenAuth().check("/q6serve.v1.Q6Serve/SetFlags", "SetFlags", True, None)  # open default


def test_tokens_end_to_end(start_worker) -> None:  # type: ignore[no-untyped-def]
    worker = start_worker(token="user-token", admin_token="admin-token")
    anon, user = Client(worker.target), Client(worker.target, token="user-token")
    admin = Client(worker.target, token="admin-token")
    try:
        assert anon.health()
        with pytest.raises(Q6ServeError) as e:
            anon.list()
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(Q6ServeError) as e:
            user.upload("w", random_q6k(8, 256, 1), 8, 256)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        admin.upload("w", random_q6k(8, 256, 1), 8, 256)
        assert user.matmul("w", np.ones((1, 256), np.float32)).shape == (1, 8)
        with pytest.raises(Q6ServeError) as e:
            user.flags({"Q6SERVE_Q6K_SOA": False})
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert admin.flags({"Q6SERVE_Q6K_SOA": False})["Q6SERVE_Q6K_SOA"] is False
    finally:
        for c in (anon, user, admin):
            c.close()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    d = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
        (d / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext",
                 "-out", f"{name}.pem", cwd=d)
    return d


def test_mutual_tls(start_worker, certs: Path) -> None:  # type: ignore[no-untyped-def]
    worker = start_worker(tls_cert=certs / "server.pem", tls_key=certs / "server.key",
                          tls_client_ca=certs / "ca.pem")
    ca = (certs / "ca.pem").read_bytes()
    with Client(worker.target, root_certificates=ca,
                certificate_chain=(certs / "client.pem").read_bytes(),
                private_key=(certs / "client.key").read_bytes()) as c:
        assert c.health()
    with Client(worker.target, root_certificates=ca, timeout=5) as no_cert, \
            pytest.raises(Q6ServeError):
        no_cert.list()
    with Client(worker.target, timeout=5) as plain, pytest.raises(Q6ServeError):
        plain.list()
