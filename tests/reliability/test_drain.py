"""Drain is bounded by --grace-period whatever a thread is doing (issue 18, item 7).

A `q6serve worker` subprocess: SIGTERM while idle exits 0; SIGTERM while an upload is still
running exits within grace + 5 s with a non-zero code and a log line naming what was
abandoned. Threads abandon at their next check: quantizing (below), GGUF parsing
(test_gguf_cost.py) and loads poll the engine's abandon flag.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from q6serve.v1 import q6serve_pb2 as pb
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc

GRACE = 0.5


class Proc:
    def __init__(self, tmp_path: Path) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.p = subprocess.Popen(
            [sys.executable, "-m", "q6serve.client.cli", "worker", "--host", "127.0.0.1",
             "--port", "0", "--backend", "numpy", "--vram-budget", "256MiB",
             "--grace-period", str(GRACE)],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.lines: list[str] = []
        self.target = ""
        assert self.p.stderr is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not self.target:
            line = self.p.stderr.readline()
            if not line:
                break
            self.lines.append(line)
            if m := re.search(r"listening on (\S+:\d+)", line):
                self.target = m.group(1)
        assert self.target, f"worker did not start: {''.join(self.lines)[-2000:]}"
        self._reader = threading.Thread(
            target=lambda: [self.lines.append(ln) for ln in self.p.stderr or ()], daemon=True)
        self._reader.start()

    def term(self) -> tuple[int, float, str]:
        """SIGTERM; (exit code, seconds to exit, the log)."""
        t0 = time.monotonic()
        self.p.send_signal(signal.SIGTERM)
        try:
            rc = self.p.wait(GRACE + 5)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(10)
            pytest.fail(f"the worker outlived SIGTERM by grace + 5 s: {self.log()[-2000:]}")
        took = time.monotonic() - t0
        self._reader.join(5)
        return rc, took, self.log()

    def log(self) -> str:
        return "".join(self.lines)


@pytest.fixture
def proc(tmp_path: Path) -> Iterator[Proc]:
    p = Proc(tmp_path)
    yield p
    if p.p.poll() is None:
        p.p.kill()
        p.p.wait(10)


def test_an_idle_worker_drains_cleanly(proc):
    rc, _, log = proc.term()
    assert rc == 0, log[-2000:]
    assert "stopped (everything in flight finished)" in log


def test_work_past_the_grace_period_is_abandoned_and_said(proc):
    """An upload whose client stalls mid-stream (deterministic, unlike timing a quantize):
    the grace period ends with it running, the worker abandons it, says so, exits non-zero."""
    rows, k = 1024, 4096
    go = threading.Event()
    sent = threading.Event()
    outcome: list[object] = []

    def stream() -> Iterator[pb.UploadWeightRequest]:
        yield pb.UploadWeightRequest(header=pb.UploadHeader(
            name="big", rows=rows, k=k, format=pb.UPLOAD_FORMAT_F32,
            total_bytes=rows * k * 4, sha256="0" * 64))
        yield pb.UploadWeightRequest(chunk=bytes(1 << 20))
        sent.set()
        go.wait(30)

    def upload() -> None:
        with grpc.insecure_channel(proc.target) as ch:
            try:
                outcome.append(pb_grpc.Q6ServeStub(ch).UploadWeight(stream(), timeout=60))
            except grpc.RpcError as e:
                outcome.append(e)

    t = threading.Thread(target=upload)
    t.start()
    assert sent.wait(30), "the upload was not sent"
    time.sleep(0.2)  # the worker is reading it
    rc, _, log = proc.term()
    go.set()
    t.join(30)
    assert rc != 0, log[-2000:]
    assert re.search(r"grace period of 0\.5 s is over; abandoning .*1 upload\(s\) receiving",
                     log), log[-3000:]
    assert "stopped (work was abandoned)" in log
    assert outcome and isinstance(outcome[0], grpc.RpcError)  # the caller heard of it


def test_a_quantize_in_progress_stops_at_its_next_chunk():
    from q6serve.kernels.errors import Cancelled
    from q6serve.kernels.quantize import quantize_q6_k

    x = np.ones((256, 4096), np.float32)  # 4 chunks of 1024 blocks (64 rows)
    polls = []

    def cancelled() -> bool:
        polls.append(1)
        return len(polls) > 2

    with pytest.raises(Cancelled, match="quantizing abandoned at row 128 of 256"):
        quantize_q6_k(x, "upload 'w'", cancelled)
