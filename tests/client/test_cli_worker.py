"""The worker and admin commands end to end: a `q6serve worker --port 0` subprocess driven by
`q6serve health/load/list/matmul/status/flags/unload`, then SIGTERM drains and stops it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from q6serve.client import grpc_env
from q6serve.client.cli import build_parser, main
from q6serve.kernels import q6k
from q6serve.kernels.gguf_io import write_q6k_gguf

ADMIN_COMMANDS = ("health", "load", "list", "unload", "matmul", "status", "flags")


def _blocks(rows: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(rows * k // q6k.QK_K, q6k.BLOCK_BYTES), dtype=np.uint8)
    b[:, 208:210] = np.full(b.shape[0], 1e-3, np.float16).view(np.uint8).reshape(-1, 2)
    return b


@pytest.fixture
def worker_proc(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str, Path]]:
    models = tmp_path / "models"
    models.mkdir()
    env = {**os.environ, "Q6SERVE_DYNAMIC_BATCHING": "1"}
    env.pop("GRPC_EXPERIMENTS", None)  # the worker's own (client/grpc_env.py)
    proc = subprocess.Popen(
        [sys.executable, "-m", "q6serve.client.cli", "worker", "--port", "0", "--backend",
         "numpy", "--model-dir", str(models), "--vram-budget", "64MiB",
         "--max-batch-delay-us", "100"],
        stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    first = proc.stderr.readline()  # the FIRST log line names the address
    m = re.search(r"listening on (\S+:\d+)$", first.strip())
    assert m, first
    try:
        yield proc, m.group(1), models
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_every_command_has_help_with_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    build_parser()
    for cmd in ("worker", *ADMIN_COMMANDS):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert "example:" in out and f"q6serve {cmd}" in out, cmd


def test_worker_and_admin_commands(worker_proc, tmp_path: Path,  # type: ignore[no-untyped-def]
                                   capsys: pytest.CaptureFixture[str]) -> None:
    proc, target, models = worker_proc
    blocks = _blocks(16, 512, 1)
    write_q6k_gguf(models / "m.gguf", {"blk.0.w": (blocks, 16, 512)})
    t = ["--target", target]

    assert main(["health", *t]) == 0
    assert "SERVING" in capsys.readouterr().out
    assert main(["load", *t, "--gguf", "m.gguf", "--tensor", "blk.0.w"]) == 0
    assert "loaded blk.0.w: 16x512" in capsys.readouterr().out
    assert main(["load", *t, "--gguf", "m.gguf"]) == 1
    assert "ALREADY_EXISTS" in capsys.readouterr().err
    assert main(["list", *t, "--json"]) == 0
    (w,) = json.loads(capsys.readouterr().out)
    assert (w["name"], w["rows"], w["k"], w["layout"]) == ("blk.0.w", 16, 512, "soa")

    x = np.random.default_rng(2).standard_normal((3, 512)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    for dtype in ("f32", "f16", "bf16"):
        out = tmp_path / f"y_{dtype}.npy"
        assert main(["matmul", *t, "--weight", "blk.0.w", "--input", str(tmp_path / "x.npy"),
                     "--output", str(out), "--dtype", dtype, "--precision", "exact"]) == 0
        y = np.load(out)
        xs = x.astype({"f32": np.float32, "f16": np.float16}.get(dtype, np.float32))
        want = xs.astype(np.float64) @ q6k.dequantize_aos(blocks, 16, 512).T.astype(np.float64)
        tol = 1e-5 if dtype != "bf16" else 2e-2
        assert np.abs(y - want).max() <= tol * max(1.0, np.abs(want).max()), dtype
    assert "kernel numpy.exact" in capsys.readouterr().out

    assert main(["status", *t, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["backend"] == "numpy" and status["weights_loaded"] == 1
    assert int(status["vram"]["weights_bytes"]) == w["nbytes"]

    assert main(["flags", *t, "Q6SERVE_DECODE_MMQ=0", "DYNAMIC_BATCHING=0"]) == 0
    assert capsys.readouterr().out.split() == [
        "Q6SERVE_Q6K_SOA=1", "Q6SERVE_DECODE_MMQ=0", "Q6SERVE_DYNAMIC_BATCHING=0"]
    assert main(["matmul", *t, "--weight", "blk.0.w", "--input", str(tmp_path / "x.npy"),
                 "--output", str(tmp_path / "q.npy"), "--precision", "q8_1"]) == 1
    assert "FAILED_PRECONDITION" in capsys.readouterr().err
    assert main(["flags", *t, "NOPE=1"]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err

    assert main(["unload", *t, "blk.0.w"]) == 0
    assert main(["unload", *t, "blk.0.w"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    assert main(["load", *t, "--gguf", "../escape.gguf"]) == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().err

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert proc.stderr is not None
    rest = proc.stderr.read()
    assert "draining" in rest and "stopped" in rest
    # every call above ran on the gRPC the worker set up before importing it (grpc_env.py)
    assert f"gRPC: GRPC_EXPERIMENTS='{grpc_env.EVENT_ENGINE_OFF}'" in rest, rest
    assert main(["health", *t, "--timeout", "2"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_worker_rejects_cuda_without_gpu(tmp_path: Path) -> None:
    from q6serve.kernels.backends import cuda_available

    if cuda_available():
        pytest.skip("a GPU is present")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "q6serve.client.cli", "worker", "--port", "0",
                        "--backend", "cuda"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "UNAVAILABLE" in r.stderr
    assert time.monotonic() - t0 < 60


def test_listening_line_comes_first_even_after_early_logs() -> None:
    import logging

    from q6serve.client.cmd_worker import _ListeningFirst

    seen: list[str] = []

    class Sink(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    h = _ListeningFirst(Sink())
    log = logging.getLogger("test.listening")
    log.propagate = False
    log.addHandler(h)
    log.warning("backend warming up")
    log.warning("listening on 127.0.0.1:1234")
    log.warning("after")
    assert seen == ["listening on 127.0.0.1:1234", "backend warming up", "after"]


def test_missing_input_file_is_one_line_error(capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    rc = main(["matmul", "--target", "127.0.0.1:1", "--weight", "w", "--input",
               str(tmp_path / "absent.npy"), "--output", str(tmp_path / "y.npy")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("q6serve matmul: error:") and err.count("\n") == 1


def _allowed_cpus(pid: int) -> set[int]:
    """The cores every thread of ``pid`` may run on (their union)."""
    got: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        got |= os.sched_getaffinity(int(tid))
    return got


def test_worker_cpus_from_the_environment(tmp_path: Path) -> None:
    """Q6SERVE_CPUS pins the worker as --cpus does (every thread); --cpus given wins."""
    from q6serve.client.cmd_worker import CPUS_ENV
    from q6serve.client.worker_process import WorkerProcess

    cores = sorted(os.sched_getaffinity(0))
    first, last = cores[0], cores[-1]
    with WorkerProcess(["--backend", "numpy"], tmp_path / "env.log",
                       env={CPUS_ENV: str(first)}) as w:
        assert w.proc is not None
        assert _allowed_cpus(w.proc.pid) == {first}
    with WorkerProcess(["--backend", "numpy", "--cpus", str(last)], tmp_path / "opt.log",
                       env={CPUS_ENV: str(first)}) as w:
        assert w.proc is not None
        assert _allowed_cpus(w.proc.pid) == {last}


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (their /proc/N/stat: no CONFIG_PROC_CHILDREN
    needed)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{d}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d))
    return out


def test_worker_keep_cpus_awake_runs_idle_class_spinners_for_its_life(tmp_path: Path) -> None:
    """--keep-cpus-awake (or Q6SERVE_KEEP_CPUS_AWAKE=1): a SCHED_IDLE spinner child on each
    CPU the worker may use (its --cpus narrowing only its own threads), gone when it stops."""
    from q6serve.client.worker_process import WorkerProcess

    cpus = sorted(os.sched_getaffinity(0))
    for args, env in ((["--keep-cpus-awake", "--cpus", str(cpus[0])], {}),
                      ([], {"Q6SERVE_KEEP_CPUS_AWAKE": "1"})):
        with WorkerProcess(["--backend", "numpy", *args], tmp_path / "w.log", env=env) as w:
            assert w.proc is not None
            kids = _children(w.proc.pid)
            deadline = time.monotonic() + 10  # (each sets its class and CPU first thing)
            while time.monotonic() < deadline and any(
                    os.sched_getscheduler(k) != os.SCHED_IDLE for k in kids):
                time.sleep(0.05)
            assert {os.sched_getscheduler(k) for k in kids} == {os.SCHED_IDLE}, w.log()
            assert sorted(os.sched_getaffinity(k).pop() for k in kids) == cpus, w.log()
            assert f"a SCHED_IDLE spinner on each of {len(cpus)} CPUs" in w.log()
        for k in kids:
            with pytest.raises(ProcessLookupError):
                os.kill(k, 0)


def test_worker_refuses_a_bad_keep_cpus_awake_value_in_one_line() -> None:
    env = {"Q6SERVE_KEEP_CPUS_AWAKE": "maybe", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "q6serve.client.cli", "worker", "--port", "0"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().startswith("q6serve worker: error: Q6SERVE_KEEP_CPUS_AWAKE='maybe': "
                                       "write 0 or 1"), r.stderr
