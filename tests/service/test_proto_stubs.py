"""The committed stubs are exactly what scripts/gen_proto.sh makes from the .proto."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUBS = ("q6serve_pb2.py", "q6serve_pb2.pyi", "q6serve_pb2_grpc.py")


def test_committed_stubs_match_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "proto"),
         f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
         str(ROOT / "proto/q6serve/v1/q6serve.proto")],
        check=True, cwd=ROOT,
    )
    for name in STUBS:
        fresh = (tmp_path / "q6serve/v1" / name).read_text()
        committed = (ROOT / "proto/q6serve/v1" / name).read_text()
        assert fresh == committed, f"{name} is stale: run scripts/gen_proto.sh and commit"


def test_stubs_import_as_package() -> None:
    from q6serve.v1 import q6serve_pb2, q6serve_pb2_grpc

    assert q6serve_pb2.DESCRIPTOR.package == "q6serve.v1"
    assert hasattr(q6serve_pb2_grpc, "Q6ServeStub")


def test_only_wire_imports_pb2() -> None:
    """Layer rule: in service/, only the wire modules (wire*.py) touch the generated protobuf
    modules."""
    imports = re.compile(r"^\s*(from|import)\s+\S*_pb2|import\s+\S*_pb2", re.MULTILINE)
    offenders = [p.name for p in (ROOT / "service").glob("*.py")
                 if not p.name.startswith("wire") and imports.search(p.read_text())]
    assert offenders == []
