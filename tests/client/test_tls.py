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


@pytest.mark.parametrize("field", ["root_certificates", "private_key", "certificate_chain"])
def test_an_empty_pem_is_refused_not_read_as_plaintext(field: str) -> None:
    """An empty PEM (``--tls-ca /dev/null``, an empty file) used to read as "no TLS": the
    channel went out in plaintext, the bearer token with it. It is refused, naming the field."""
    from q6serve.client.channel import make_channel

    pems = {"root_certificates": b"-", "private_key": b"-", "certificate_chain": b"-"}
    pems[field] = b""
    if field == "root_certificates":
        pems.pop("private_key"), pems.pop("certificate_chain")
    with pytest.raises(ValueError, match=f"{field} is empty"):
        tls_credentials(**pems)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"{field} is empty"):
        make_channel("127.0.0.1:1", **pems)  # type: ignore[arg-type]


def test_cli_tls_options_refuse_an_empty_file(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from q6serve.client.cli import main

    empty = tmp_path / "empty.pem"
    empty.write_bytes(b"")
    full = tmp_path / "x.pem"
    full.write_bytes(b"-")
    for opts, name in ((["--tls-ca", str(empty)], "--tls-ca"),
                       (["--tls-cert", str(empty), "--tls-key", str(full)], "--tls-cert"),
                       (["--tls-cert", str(full), "--tls-key", str(empty)], "--tls-key")):
        assert main(["list", "--target", "127.0.0.1:1", "--timeout", "2", *opts]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith("q6serve list: ") and f"{name} {empty}: the file is empty" in err
