"""kernels/cuda/loader.py without a GPU: a stand-in CuPy counts what the loader asks of it."""

from __future__ import annotations

import sys
import types
from typing import Any

from q6serve.kernels.cuda import loader


class _FakeCupy(types.ModuleType):
    """``cupy`` as far as the loader touches it: Device, RawModule, CompileException."""

    def __init__(self) -> None:
        super().__init__("cupy")
        self.compiled: list[tuple[str, ...]] = []
        fake = self

        class Device:
            def __init__(self, device: int) -> None:
                self.compute_capability = "90"

            def __enter__(self) -> Any:
                return self

            def __exit__(self, *exc: object) -> None:
                pass

        class RawModule:
            def __init__(self, code: str, options: tuple[str, ...],
                         name_expressions: tuple[str, ...] | None) -> None:
                self.names = name_expressions or ()

            def compile(self) -> None:
                fake.compiled.append(tuple(self.names))

        self.cuda = types.SimpleNamespace(Device=Device, compiler=types.SimpleNamespace(
            CompileException=RuntimeError))
        self.RawModule = RawModule


def test_a_repeated_request_reads_and_compiles_nothing_again(monkeypatch):
    fake = _FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(loader, "_cache", {})
    monkeypatch.setattr(loader, "_by_request", {})
    reads: list[str] = []
    real = loader.source_text

    def counted(name: str, _seen: frozenset[str] = frozenset()) -> str:
        if not _seen:
            reads.append(name)
        return real(name, _seen)

    monkeypatch.setattr(loader, "source_text", counted)
    first = loader.load("q6_topk.cu", (), 0)
    for _ in range(3):
        assert loader.load("q6_topk.cu", (), 0) is first
    assert reads == ["q6_topk.cu"] and fake.compiled == [()]
    # another device is another request and another module (compiled for that device)
    assert loader.load("q6_topk.cu", (), 1) is not first
    assert reads == ["q6_topk.cu"] * 2 and fake.compiled == [(), ()]
