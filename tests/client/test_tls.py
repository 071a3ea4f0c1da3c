"""TLS and mutual TLS from both clients, with a throwaway CA made by the openssl CLI."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from q6serve.client.channel import tls_credentials
from q6serve.client.client import Q6ServeError

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=q6serve test CA", cwd=tmp_path)
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=tmp_path)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "1",
                 "-extfile", "san.ext", cwd=tmp_path)
    return {p.stem + p.suffix.replace(".", "_"): p for p in tmp_path.iterdir()}


def test_tls(pki: dict[str, Path], start_worker: Callable[..., Any],
             make_client: Callable[..., Any]) -> None:
    w = start_worker(tls_cert=pki["server_pem"], tls_key=pki["server_key"])
    c = make_client(w.target, root_certificates=pki["ca_pem"].read_bytes())
    assert c.health() is True and c.list() == []
    plain = make_client(w.target, timeout=2.0)
    with pytest.raises(Q6ServeError) as e:
        plain.list()
    assert e.value.code.name == "UNAVAILABLE"


def test_mutual_tls(pki: dict[str, Path], start_worker: Callable[..., Any],
                    make_client: Callable[..., Any]) -> None:
    w = start_worker(tls_cert=pki["server_pem"], tls_key=pki["server_key"],
                     tls_client_ca=pki["ca_pem"])
    ca = pki["ca_pem"].read_bytes()
    c = make_client(w.target, root_certificates=ca,
                    certificate_chain=pki["client_pem"].read_bytes(),
                    private_key=pki["client_key"].read_bytes())
    assert c.status().serving
    anonymous = make_client(w.target, root_certificates=ca, timeout=2.0)
    with pytest.raises(Q6ServeError) as e:
        anonymous.status()
    assert e.value.code.name == "UNAVAILABLE"  # handshake refused without a client cert


def test_half_a_client_certificate_is_refused() -> None:
    with pytest.raises(ValueError, match="both"):
        tls_credentials(private_key=b"key only")
