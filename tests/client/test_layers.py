"""The import-layer rule of DESIGN.md, checked: the client library talks to the worker through
the proto stubs only (never the service), and on the service side only the wire modules import
``*_pb2``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIBRARY = ("core", "client", "async_client", "sharded", "channel", "retry", "targets", "shm",
           "lane")


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names; relative ones resolved in its package)."""
    package = "q6serve." + path.parent.name
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = f"{package}.{base}" if base else package
            out |= {f"{base}.{a.name}" for a in node.names} | {base}
    return out


def test_client_library_never_imports_the_service() -> None:
    for name in LIBRARY:
        path = REPO / "client" / f"{name}.py"
        if not path.exists():
            continue
        bad = sorted(m for m in imports(path) if m.startswith("q6serve.service"))
        assert not bad, (name, bad)
    # and at run time: importing every library module loads neither the service nor CuPy
    code = ("import sys\n" + "".join(f"import q6serve.client.{n}\n" for n in LIBRARY
                                     if (REPO / "client" / f"{n}.py").exists()) +
            "bad = [m for m in sys.modules if m.startswith(('q6serve.service', 'cupy'))]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_only_wire_modules_import_pb2_on_the_service_side() -> None:
    for path in sorted((REPO / "service").glob("*.py")):
        pb2 = sorted(m for m in imports(path) if m.split(".")[-1].endswith(("_pb2", "_pb2_grpc")))
        if not path.stem.startswith("wire"):
            assert not pb2, (path.name, pb2)
