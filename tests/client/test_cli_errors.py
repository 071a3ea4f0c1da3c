"""The CLI never shows a traceback for a user error or Ctrl-C: each case of issue 17 is one
line on stderr (what is wrong, what to do) and a documented exit code."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from svc_util import random_q6k

from q6serve.client.cli import build_parser, main
from q6serve.kernels import q6k

K = 512
CLI = [sys.executable, "-m", "q6serve.client.cli"]


def one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def served(worker: Any) -> Any:
    blocks = random_q6k(16, K, 1)
    worker.client().upload("w", blocks, 16, K)
    worker.w32 = q6k.dequantize_aos(blocks, 16, K).astype(np.float64)
    return worker


def test_help_documents_exit_codes_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    text = build_parser().format_help()
    for code in ("0 ", "1 ", "2 ", "130"):
        assert f"  {code}" in text, code
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    from q6serve.client.cli import version

    assert capsys.readouterr().out.strip() == f"q6serve {version()}"


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["worker", "--port", "99999"])  # used to listen on 99999 % 65536 = 34463
    assert e.value.code == 2
    line = one_line(capsys.readouterr().err)
    assert "--port" in line and "0..65535" in line
    with pytest.raises(SystemExit) as e:
        main(["health", "--target", "localhost"])  # used to dial localhost:443
    assert e.value.code == 2
    line = one_line(capsys.readouterr().err)
    assert "no port" in line and "localhost:50051" in line


def test_connection_refused_says_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{s.getsockname()[1]}"
    assert main(["list", "--target", target, "--timeout", "3"]) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith("q6serve list: UNAVAILABLE")
    assert "--target" in line and "q6serve worker" in line and target in line


def test_ctrl_c_is_one_line_and_130(monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    from q6serve.client.client import Client

    def interrupted(*a: Any, **kw: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Client, "health", interrupted)
    assert main(["health"]) == 130
    assert one_line(capsys.readouterr().err) == "q6serve health: interrupted"


def test_status_json_byte_counts_are_numbers(served: Any,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--target", served.target, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert main(["list", "--target", served.target, "--json"]) == 0
    (w,) = json.loads(capsys.readouterr().out)
    assert status["vram"]["weights_bytes"] == w["nbytes"]  # numbers, as list --json prints
    assert all(isinstance(v, int) for k, v in status["vram"].items() if k.endswith("_bytes"))


def _matmul(served: Any, tmp: Path, input_: str, *extra: str) -> int:
    return main(["matmul", "--target", served.target, "--weight", "w", "--input", input_,
                 "--output", str(tmp / "y.npy"), "--precision", "exact", *extra])


def test_matmul_takes_npz(served: Any, tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    x = np.random.default_rng(0).standard_normal((2, K)).astype(np.float32)
    want = x.astype(np.float64) @ served.w32.T
    np.savez(tmp_path / "one.npz", x=x)  # used to raise AttributeError
    assert _matmul(served, tmp_path, str(tmp_path / "one.npz")) == 0
    assert np.allclose(np.load(tmp_path / "y.npy"), want, rtol=1e-5, atol=1e-5)
    np.savez(tmp_path / "two.npz", a=x, b=2 * x)
    assert _matmul(served, tmp_path, f"{tmp_path / 'two.npz'}:b") == 0
    assert np.allclose(np.load(tmp_path / "y.npy"), 2 * want, rtol=1e-5, atol=1e-5)
    capsys.readouterr()
    assert _matmul(served, tmp_path, str(tmp_path / "two.npz")) == 2
    line = one_line(capsys.readouterr().err)
    assert "holds 2 arrays (a, b)" in line and "two.npz:NAME" in line
    assert _matmul(served, tmp_path, f"{tmp_path / 'two.npz'}:c") == 2
    assert "no array 'c'" in one_line(capsys.readouterr().err)
    (tmp_path / "text.npy").write_text("1 2 3")
    assert _matmul(served, tmp_path, str(tmp_path / "text.npy")) == 2
    assert "not a .npy or .npz file" in one_line(capsys.readouterr().err)


def test_bf16_round_trips_through_npy(served: Any, tmp_path: Path) -> None:
    x = np.random.default_rng(1).standard_normal((3, K)).astype(ml_dtypes.bfloat16)
    want = x.astype(np.float64) @ served.w32.T
    np.save(tmp_path / "x.npy", x)  # what an ml_dtypes user writes: the header says <V2
    assert _matmul(served, tmp_path, str(tmp_path / "x.npy"), "--out-dtype", "bf16") == 0
    y = np.load(tmp_path / "y.npy")  # ml_dtypes is imported: a bfloat16 array, not |V2
    assert y.dtype == np.dtype(ml_dtypes.bfloat16) and y.shape == (3, 16)
    assert np.allclose(y.astype(np.float64), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    # the CLI reads its own bf16 output back, and plain NumPy names the missing dtype
    from q6serve.client.npyio import load_array

    assert np.array_equal(load_array(tmp_path / "y.npy"), y)
    np.save(tmp_path / "x32.npy", x.astype(np.float32))  # bf16 values sent as f32: same y
    assert _matmul(served, tmp_path, str(tmp_path / "x32.npy"), "--dtype", "bf16",
                   "--out-dtype", "bf16") == 0
    assert np.array_equal(np.load(tmp_path / "y.npy"), y)
    code = (f"import numpy as np\ntry:\n    np.load({str(tmp_path / 'y.npy')!r})\n"
            "except (TypeError, ValueError) as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60).stdout
    assert "bfloat16" in out


@pytest.mark.parametrize(("value", "why"), [(1e9, "scale overflows"), (1e38, "all zeros")])
def test_quantize_refuses_unrepresentable_values(tmp_path: Path, value: float, why: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    x = np.random.default_rng(2).standard_normal((4, 256)).astype(np.float32)
    x[2, 17] = value
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "o.gguf"
    assert main(["quantize", str(tmp_path / "x.npy"), str(out), "--name", "w"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "row 2, column 17" in line and f"{value:.6g}" in line and why in line, line
    assert not out.exists()


def test_quantize_takes_bf16_and_npz(tmp_path: Path) -> None:
    from q6serve.kernels import gguf_io
    from q6serve.kernels.quantize import quantize_q6_k

    x = np.random.default_rng(3).standard_normal((2, 256)).astype(ml_dtypes.bfloat16)
    np.savez(tmp_path / "x.npz", m=x)
    assert main(["quantize", str(tmp_path / "x.npz"), str(tmp_path / "o.gguf"),
                 "--name", "w"]) == 0
    [t] = gguf_io.read_q6k_tensors(tmp_path / "o.gguf")
    assert np.array_equal(t.aos, quantize_q6_k(x.astype(np.float32)))


def test_worker_on_a_port_in_use_is_one_line() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([*CLI, "worker", "--port", str(port), "--backend", "numpy"],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and "add_port" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert f"127.0.0.1:{port}" in last and "in use" in last and "--port" in last


def test_bench_ctrl_c_prints_the_finished_cells(served: Any) -> None:
    """Each cell is printed as it finishes; Ctrl-C prints the table of those, exit 130, no
    traceback (it used to print 63 lines of asyncio tracebacks and drop every cell)."""
    proc = subprocess.Popen(
        [*CLI, "bench", "--target", served.target, "--duration", "0.3", "--warmup", "0",
         "--concurrency", "1", "2", "--n", *map(str, range(1, 21))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "COLUMNS": "160"},
        # Ctrl-C as in a terminal: a run started in the background of a non-interactive shell
        # (`cmd &`) inherits SIGINT ignored, and Python then never sees it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stderr is not None and proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        assert line, "bench ended before printing a cell"
        seen.append(line)
        if line.startswith("cell 2/40"):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    err = "".join(seen) + err
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "CancelledError" not in err, err
    assert "interrupted after" in err and "of 40 cells" in err
    assert "cell 1/40 C=1 N=1:" in err
    rows = [ln for ln in out.splitlines() if ln.strip().startswith("│") or "|" in ln]
    assert "p99 ms" in out and len(rows) >= 2, out


def test_matmul_float64_input_is_refused_or_converted(served: Any, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    x = np.random.default_rng(4).standard_normal((2, K))  # float64, as NumPy makes it
    np.save(tmp_path / "x.npy", x)
    assert _matmul(served, tmp_path, str(tmp_path / "x.npy")) == 2
    line = one_line(capsys.readouterr().err)
    assert "got float64" in line and "--dtype f32" in line
    assert _matmul(served, tmp_path, str(tmp_path / "x.npy"), "--dtype", "f32") == 0
    want = x.astype(np.float32).astype(np.float64) @ served.w32.T
    assert np.allclose(np.load(tmp_path / "y.npy"), want, rtol=1e-5, atol=1e-4)


def test_status_and_flags_take_several_targets(start_worker: Any,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    a, b = start_worker(), start_worker()
    targets = f"{a.target},{b.target}"
    assert main(["status", "--target", targets, "--json"]) == 0
    docs = json.loads(capsys.readouterr().out)
    assert [d["backend"] for d in docs] == ["numpy", "numpy"]
    assert main(["status", "--target", targets]) == 0
    out = capsys.readouterr().out
    assert f"shard 0 ({a.target}):" in out and f"shard 1 ({b.target}):" in out
    assert main(["flags", "--target", targets, "DECODE_MMQ=0"]) == 0
    assert "Q6SERVE_DECODE_MMQ=0" in capsys.readouterr().out.split()
    assert not b.client().flags()["Q6SERVE_DECODE_MMQ"]  # set on every shard
    b.client().flags({"Q6SERVE_DECODE_MMQ": True})
    assert main(["flags", "--target", targets]) == 1  # the shards disagree: say so
    line = one_line(capsys.readouterr().err)
    assert "FAILED_PRECONDITION: flags differ" in line and b.target in line


# -- the CLI sweep of session 30 (every subcommand, bad values for its options) ---------------
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e309"])
def test_timeout_must_be_finite_seconds(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--timeout nan/inf/<= 0 used to reach gRPC: every call 'took longer than --timeout inf s'
    (DEADLINE_EXCEEDED, rc 1), and 0 raced the call (rc 0 or 1)."""
    with pytest.raises(SystemExit) as e:
        main(["list", "--target", "127.0.0.1:1", "--timeout", value])
    assert e.value.code == 2
    line = one_line(capsys.readouterr().err)
    assert "--timeout" in line and "seconds > 0" in line, line


@pytest.mark.parametrize("opts", [["--duration", "nan"], ["--duration", "inf"],
                                  ["--warmup", "nan"], ["--warmup", "inf"]])
def test_bench_durations_must_be_finite(opts: list[str],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """bench --duration nan measured nothing and said rc 0; inf never ended."""
    assert main(["bench", "--target", "127.0.0.1:1", *opts]) == 2
    line = one_line(capsys.readouterr().err)
    assert "--duration" in line and "finite" in line, line


def test_bench_cell_without_a_call_fails(served: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """A cell that finished no call (its duration over before the first one) measured nothing:
    it used to print 'n/a' and exit 0."""
    rc = main(["bench", "--target", served.target, "--duration", "1e-9", "--warmup", "0",
               "--concurrency", "1", "--n", "1"])
    err = capsys.readouterr().err
    assert rc == 1, err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("q6serve bench: ") and "no call" in last


def test_bench_failed_calls_say_why(served: Any, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--target", served.target, "--duration", "0.1", "--warmup", "0",
               "--concurrency", "1", "--n", "300"])
    err = capsys.readouterr().err
    assert rc == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("q6serve bench: ") and "INVALID_ARGUMENT" in last, err
    assert "N=300 exceeds" in last, last


@pytest.mark.parametrize("output", ["", "DIR", "missing/y.npy"])
def test_matmul_output_is_checked_before_the_call(served: Any, tmp_path: Path, output: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """--output DIR used to write DIR.npy and --output '' a file '.npy' in the working
    directory (np.save adds the suffix), both rc 0; a missing folder failed after the call."""
    np.save(tmp_path / "x.npy", np.ones((1, K), np.float32))
    out = {"": "", "DIR": str(tmp_path), "missing/y.npy": str(tmp_path / "missing/y.npy")}[output]
    before = set(tmp_path.parent.iterdir()) | set(tmp_path.iterdir())
    calls = served.client().status().weights_loaded  # (a cheap call: the worker is up)
    assert calls == 1
    rc = main(["matmul", "--target", served.target, "--weight", "w", "--input",
               str(tmp_path / "x.npy"), "--output", out])
    assert rc == 2
    line = one_line(capsys.readouterr().err)
    assert "--output" in line, line
    assert set(tmp_path.parent.iterdir()) | set(tmp_path.iterdir()) == before
    assert not Path(".npy").exists()


def test_matmul_writes_the_output_named(served: Any, tmp_path: Path) -> None:
    """An --output without the .npy suffix is written as named (np.save added '.npy')."""
    np.save(tmp_path / "x.npy", np.ones((2, K), np.float32))
    assert main(["matmul", "--target", served.target, "--weight", "w", "--input",
                 str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.bin")]) == 0
    assert np.load(tmp_path / "y.bin").shape == (2, 16)
    assert not (tmp_path / "y.bin.npy").exists()


def test_quantize_never_writes_over_an_input(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`quantize a.npy b.npy` (OUT.gguf forgotten) used to write the GGUF over b.npy, rc 0."""
    x = np.ones((4, 256), np.float32)
    for name in ("a.npy", "b.npy", "c.npz"):
        (np.savez if name.endswith("npz") else np.save)(tmp_path / name, x)
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}
    for argv in ([str(tmp_path / "a.npy:w"), str(tmp_path / "b.npy")],
                 [str(tmp_path / "a.npy:w"), str(tmp_path / "c.npz")],
                 ["--name", "w", str(tmp_path / "a.npy"), str(tmp_path / "a.npy")]):
        assert main(["quantize", *argv]) == 2
        line = one_line(capsys.readouterr().err)
        assert "OUT.gguf" in line, line
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_quantize_refuses_a_matrix_without_rows(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "x.npy", np.ones((0, 256), np.float32))
    assert main(["quantize", "--name", "w", str(tmp_path / "x.npy"),
                 str(tmp_path / "o.gguf")]) == 2
    assert "no rows" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.parametrize("opts,option", [
    (["--shard-index", "-1", "--shard-count", "2"], "--shard-index"),
    (["--shard-index", "2", "--shard-count", "2"], "--shard-index"),
    (["--shard-index", "0", "--shard-count", "0"], "--shard-count"),
    (["--rows", "5:3"], "--rows"),
    (["--rows", "3:3"], "--rows"),
    (["--rows", "99999999999999999999:99999999999999999999999"], "--rows"),
])
def test_load_row_options_are_checked_here(opts: list[str], option: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Used to read 'error: Value out of range: -1' (protobuf's words, no option named), or to
    go to the worker."""
    with pytest.raises(SystemExit) if option == "--rows" else contextlib.nullcontext():
        rc = main(["load", "--target", "127.0.0.1:1", "--timeout", "2", "--gguf", "m.gguf",
                   *opts])
        assert rc == 2
    line = one_line(capsys.readouterr().err)
    assert option in line and "Value out of range" not in line, line


def test_upload_failure_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The upload's progress bar stayed on stderr above the error when stderr is no terminal."""
    np.save(tmp_path / "x.npy", np.ones((4, 256), np.float32))
    assert main(["quantize", "--name", "w", str(tmp_path / "x.npy"),
                 str(tmp_path / "m.gguf")]) == 0
    capsys.readouterr()
    assert main(["upload", "--target", "127.0.0.1:1", "--timeout", "2",
                 str(tmp_path / "m.gguf")]) == 1
    assert "UNAVAILABLE" in one_line(capsys.readouterr().err)


@pytest.mark.parametrize("opts,want", [
    (["--host", "bogus host"], "--host 'bogus host'"),
    (["--host", ""], "--host ''"),
    (["--port", "0", "--metrics-port", "0", "--metrics-host", "no such.host"],
     "--metrics-host 'no such.host'"),
    (["--model-dir", "/nonexistent/models"], "--model-dir /nonexistent/models"),
    (["--model-dir", "/etc/hostname"], "--model-dir /etc/hostname"),
    (["--read-timeout", "nan"], "--read-timeout"),
    (["--read-timeout", "0"], "--read-timeout"),
    (["--reply-timeout", "-1"], "--reply-timeout"),
    (["--reply-timeout", "inf"], "--reply-timeout"),
    (["--grace-period", "-1"], "--grace-period"),
    (["--grace-period", "nan"], "--grace-period"),
    # taken without a word until session 30's second sweep
    (["--frontend-shm-bytes", "1"], "frontend_shm_bytes=1"),
    (["--frontends", "1000"], "frontends=1000"),
    (["--vram-budget", "0"], "--vram-budget '0'"),
    (["--max-request-bytes", "32MiB", "--max-message-bytes", "16MiB"], "max_request_bytes"),
    (["--max-request-bytes", "300MiB"], "max_request_bytes"),
    (["--min-inflight-rpcs-per-connection", "100"], "min_inflight_rpcs_per_connection=100"),
    (["--devices", ""], "--devices ''"),
])
def test_worker_refuses_bad_values_in_one_line(opts: list[str], want: str) -> None:
    """A host that is no address here (with --port 0 it reached gRPC, whose failure was
    reported as 'the port is in use'), a --model-dir that is no directory (the worker started,
    and every LoadWeights failed), timeouts that are no finite seconds (the worker started)."""
    args = ["--port", "0", *opts] if "--port" not in opts else opts
    r = subprocess.run([*CLI, "worker", "--backend", "numpy", *args], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode in (1, 2), r.stderr
    assert "Traceback" not in r.stderr and "listening on" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("q6serve worker: ") and want in last, last
    assert "in use" not in last, last


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_demo_max_weight_mib_is_checked(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """-1 read as 0 (full size: the 7B shapes on NumPy, minutes), nan failed as 'cannot
    convert float NaN to integer' after the worker had started."""
    assert main(["demo", "--backend", "numpy", "--max-weight-mib", value]) == 2
    line = one_line(capsys.readouterr().err)
    assert "--max-weight-mib" in line, line


def test_quantize_refuses_a_name_the_reader_refuses(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A 100,000-byte --name was written; every reader of ours (upload, load, demo) then
    refused the file ('name length 100000 exceeds the limit of 1024 bytes')."""
    from q6serve.kernels.gguf_io import MAX_TENSOR_NAME_BYTES

    np.save(tmp_path / "x.npy", np.ones((4, 256), np.float32))
    name = "n" * (MAX_TENSOR_NAME_BYTES + 1)
    assert main(["quantize", "--name", name, str(tmp_path / "x.npy"),
                 str(tmp_path / "o.gguf")]) == 2
    assert f"at most {MAX_TENSOR_NAME_BYTES} bytes" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "o.gguf").exists()


def test_empty_or_directory_paths_say_so(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """'error: : no such file' for an empty --input, and 'GGUF file DIR does not exist' for
    a directory given to upload, named the wrong thing."""
    assert main(["matmul", "--target", "127.0.0.1:1", "--weight", "w", "--input", "",
                 "--output", str(tmp_path / "y.npy")]) == 2
    line = one_line(capsys.readouterr().err)
    assert "''" in line and "empty" in line, line
    assert main(["upload", "--target", "127.0.0.1:1", str(tmp_path)]) == 2
    line = one_line(capsys.readouterr().err)
    assert "a directory" in line and "does not exist" not in line, line


@pytest.mark.parametrize("content", [b"", b"not a certificate\n"])
def test_worker_refuses_tls_files_that_are_no_pem(tmp_path: Path, content: bytes) -> None:
    """Empty or garbage Q6SERVE_TLS_CERT/KEY made gRPC fail to bind, reported as a bind
    failure of host and port."""
    bad = tmp_path / "bad.pem"
    bad.write_bytes(content)
    env = {**os.environ, "Q6SERVE_TLS_CERT": str(bad), "Q6SERVE_TLS_KEY": str(bad)}
    r = subprocess.run([*CLI, "worker", "--backend", "numpy", "--port", "0"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "Q6SERVE_TLS_CERT" in last and str(bad) in last and "PEM" in last, last


@pytest.mark.parametrize("assignments,want", [
    (["=1"], "write NAME=0 or NAME=1"),
    (["Q6SERVE_Q6K_SOA=1", "Q6K_SOA=0"], "Q6SERVE_Q6K_SOA given twice"),
])
def test_flags_assignments_are_checked_here(assignments: list[str], want: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """'=1' went to the worker as the flag 'Q6SERVE_' (unknown flag(s) Q6SERVE_); a flag given
    twice was collapsed to its last value without a word (the worker refuses it twice)."""
    with contextlib.suppress(SystemExit):
        assert main(["flags", "--target", "127.0.0.1:1", "--timeout", "2", *assignments]) == 2
    line = one_line(capsys.readouterr().err)
    assert want in line and "UNAVAILABLE" not in line, line
