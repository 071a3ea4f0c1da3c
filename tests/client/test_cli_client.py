"""The client-side commands end to end: help texts, upload, bench and the demo."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from svc_util import RunningWorker, random_q6k, write_gguf

from q6serve.client import cli, cmd_demo


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_subcommand_has_help_with_an_example() -> None:
    parsers = subcommands()
    assert {"demo", "bench", "upload"} <= set(parsers)
    for name, p in parsers.items():
        text = p.format_help()
        assert "example" in text and f"q6serve {name}" in text, name


def test_parser_and_package_import_no_grpc() -> None:
    """`q6serve quantize`/`--help` stay light: commands import gRPC only when they run."""
    code = ("import sys; import q6serve.client as c; from q6serve.client import cli; "
            "cli.build_parser(); assert 'grpc' not in sys.modules, 'grpc imported'; "
            "assert c.AsyncClient.__name__ == 'AsyncClient'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_upload(worker: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocks = write_gguf(tmp_path / "m.gguf", {"a": (64, 512, 1), "b": (4096, 512, 2)})
    rc = cli.main(["upload", "--target", worker.target, str(tmp_path / "m.gguf"),
                   "--tensor", "b", "--prefix", "up."])
    assert rc == 0
    assert "uploaded up.b" in capsys.readouterr().out
    w = worker.client().get("up.b")
    assert w.sha256 == hashlib.sha256(blocks["b"].tobytes()).hexdigest()
    assert [x.name for x in worker.client().list()] == ["up.b"]


def test_upload_errors(worker: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_gguf(tmp_path / "m.gguf", {"a": (64, 512, 1)})
    args = ["upload", "--target", worker.target, str(tmp_path / "m.gguf")]
    assert cli.main(args) == 0
    assert cli.main(args) == 1  # second time: the name exists
    assert "ALREADY_EXISTS" in capsys.readouterr().err
    assert cli.main([*args, "--tensor", "zz"]) == 2
    assert "zz" in capsys.readouterr().err


@pytest.fixture
def served(worker: Any) -> Any:
    worker.client().upload("w", random_q6k(128, 512, 1), 128, 512)
    return worker


@pytest.mark.parametrize("mode", ["unary", "stream"])
def test_bench_json(served: Any, mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["bench", "--target", served.target, "--duration", "0.3", "--warmup", "0.1",
                   "--concurrency", "1", "3", "--n", "2", "--mode", mode, "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["weight"], doc["mode"], doc["backend"]) == ("w", mode, "numpy")
    assert (doc["planned"], doc["interrupted"]) == (2, False)
    assert [(c["concurrency"], c["n"]) for c in doc["cells"]] == [(1, 2), (3, 2)]
    for c in doc["cells"]:
        assert c["calls"] > 0 and c["errors"] == {}
        assert c["rows_per_s"] == pytest.approx(c["calls"] * 2 / c["seconds"])
        assert 0 < c["p50_ms"] <= c["p99_ms"] and c["batch_rows"] >= 2
        assert 0 <= c["queue_ms"] < c["worker_ms"]  # the worker's share is inside its handler


def test_bench_table_and_missing_weight(served: Any, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "--target", served.target, "--duration", "0.2", "--warmup", "0",
            "--concurrency", "2", "--n", "1"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "p99 ms" in out and "batch rows" in out
    assert cli.main([*args, "--weight", "nope"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_bench_plot(served: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "bench.png"
    rc = cli.main(["bench", "--target", served.target, "--duration", "0.2", "--warmup", "0",
                   "--concurrency", "1", "--n", "1", "2", "--plot", str(png)])
    if importlib.util.find_spec("matplotlib") is None:  # optional extra: a clear refusal
        assert rc == 2 and "matplotlib" in capsys.readouterr().err and not png.exists()
    else:
        assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _demo(capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict[str, Any]]:
    # 6 concurrent callers of N = 1 and 3
    rc = cli.main(["demo", "--backend", "numpy", "--n", "1", "3", "--callers", "6",
                   "--calls", "2", "--max-weight-mib", "0.25", "--json", *extra])
    return rc, json.loads(capsys.readouterr().out)


def test_demo_checks_every_result(capsys: pytest.CaptureFixture[str]) -> None:
    rc, doc = _demo(capsys)
    assert rc == 0 and doc["ok"] and doc["backend"] == "numpy"
    cells = doc["cells"]
    assert {c["weight"] for c in cells} == set(cmd_demo.SHAPES)
    assert all(c["calls"] == 12 and c["ok"] and c["max_rel_err"] < 1e-5 for c in cells)
    # The batch sizes the demo reports are the worker's: at least one request's 3 rows, at most
    # all 6 callers' 3 rows. Whether two callers' calls meet in one batch here depends on the
    # machine's timing (a 2-core CI run saw every call alone); coalescing itself is tested
    # deterministically in tests/service/test_batching.py and test_batcher_core.py.
    assert all(1 <= c["batch_rows_max"] <= 6 * 3 for c in cells)
    assert max(c["batch_rows_max"] for c in cells) >= 3
    assert doc["vram"]["weights_bytes"] > 0


def test_demo_fails_on_a_wrong_result(capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cmd_demo.TOLERANCE, "exact", 0.0)  # every f32 rounding now "wrong"
    rc, doc = _demo(capsys, "--n", "1")
    assert rc == 1 and not doc["ok"]


def test_demo_serves_a_given_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_gguf(tmp_path / "mine.gguf", {"x.weight": (256, 512, 1), "y.weight": (64, 512, 2)})
    rc, doc = _demo(capsys, "--gguf", str(tmp_path / "mine.gguf"), "--tensor", "x.weight")
    assert rc == 0
    assert {(c["weight"], c["rows"]) for c in doc["cells"]} == {("x.weight", 256)}


def test_demo_table(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["demo", "--backend", "numpy", "--n", "2", "--callers", "2", "--calls", "1",
                   "--max-weight-mib", "0.25"])
    out = capsys.readouterr().out
    assert rc == 0
    for text in ("p50 ms", "p99 ms", "rows/s", "kernel %", "batch rows", "host memory used",
                 "reserved memory back to", "match the NumPy reference", "ffn_down"):
        assert text in out, text


def test_demo_reports_a_worker_failure(capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's error reaches the demo's user as one line (its code and words)."""
    from q6serve.client import worker_process
    from q6serve.kernels.errors import DeviceError
    from q6serve.kernels.numpy_backend import NumpyBackend
    from q6serve.service.config import WorkerConfig

    class Broken(NumpyBackend):
        def matmul(self, *a: Any, **kw: Any) -> Any:
            raise DeviceError("injected [kernel] failure")

    class InProcess:  # the worker process's stand-in: the demo's options, a broken backend
        def __init__(self, args: list[str], log_path: Path, start_timeout: float = 0) -> None:
            self.model_dir = Path(args[args.index("--model-dir") + 1])

        def start(self) -> InProcess:
            self.rw = RunningWorker(WorkerConfig(port=0, model_dir=self.model_dir), Broken())
            self.target = self.rw.target
            return self

        def stop(self) -> None:
            self.rw.stop()

    monkeypatch.setattr(worker_process, "WorkerProcess", InProcess)
    rc = cli.main(["demo", "--n", "1", "--callers", "1", "--calls", "1",
                   "--max-weight-mib", "0.25"])
    assert rc == 1
    out = capsys.readouterr().out
    assert "injected [kernel] failure" in out and "Traceback" not in out


def test_demo_reports_a_worker_that_cannot_start(capsys: pytest.CaptureFixture[str]) -> None:
    """The worker process's own last words, one line, exit code 2 (here: no such backend
    device; a machine with a GPU starts it, so the check only holds without one)."""
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed: the CUDA backend may start here")
    rc = cli.main(["demo", "--backend", "cuda", "--n", "1", "--callers", "1", "--calls", "1"])
    out = capsys.readouterr().out
    assert rc == 2 and "the worker did not start" in out and "no CUDA device" in out


@pytest.mark.parametrize("warm_all", [False, True])
def test_demo_cell_counts_only_timed_calls(worker: Any, warm_all: bool) -> None:
    """Warm-up calls (one, or one per caller for GPU backends) never enter the figures."""
    import asyncio

    from q6serve.client.async_client import AsyncClient
    from q6serve.kernels import q6k

    blocks = random_q6k(128, 512, 0)
    w32 = q6k.dequantize_aos(blocks, 128, 512)

    async def go() -> cmd_demo.Cell:
        async with AsyncClient(worker.target) as c:
            await c.upload("w", blocks, 128, 512)
            return await cmd_demo.run_cell(c, "w", w32, 4, 5, 2, w32.dtype, "auto",
                                           np.random.default_rng(0), warm_all=warm_all)

    cell = asyncio.run(go())
    assert cell.calls == 10 and cell.ok and cell.max_rel_err < 1e-5
    assert cell.batch_rows_max <= 4 * 5 and cell.p50_ms <= cell.p99_ms
