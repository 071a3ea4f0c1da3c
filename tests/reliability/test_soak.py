"""A bounded soak: 64 concurrent callers against a `q6serve worker` subprocess (NumPy backend).

Zero errors (every reply is checked against the float64 reference), resident memory of the
worker process (VmRSS from /proc/PID/status) grows by at most 10% after the warm-up, and the
VRAM accounting never moves. Runs in CI for Q6SERVE_SOAK_SECONDS (default 120); set it higher
for a long soak and Q6SERVE_SOAK_REPORT=FILE to get the figures as JSON. On a GPU machine:
Q6SERVE_SOAK_BACKEND=cuda (and Q6SERVE_SOAK_PRECISION=auto to soak the fastest path, checked
to a looser tolerance).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pytest

from q6serve.client.client import Client, Q6ServeError
from tests.reliability.harness import random_q6k, reference

SOAK_SECONDS = float(os.environ.get("Q6SERVE_SOAK_SECONDS", "120"))
BACKEND = os.environ.get("Q6SERVE_SOAK_BACKEND", "numpy")
PRECISION = os.environ.get("Q6SERVE_SOAK_PRECISION", "exact")
# relative to max |y|: exact is f32 on exact weights; f16/q8_1 round the activations
TOLERANCE = {"exact": 1e-5}.get(PRECISION, 3e-2)
CALLERS = 64
CHANNELS = 8  # callers share channels, as threads of one inference host would
ROWS, K = 1024, 1024
RSS_GROWTH = 1.10


def rss_bytes(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE)
    assert m, "no VmRSS in /proc status"
    return int(m.group(1)) * 1024


@dataclass
class Figures:
    seconds: float = 0.0
    backend: str = BACKEND
    precision: str = PRECISION
    callers: int = CALLERS
    requests: int = 0
    rows: int = 0
    errors: int = 0
    first_errors: list[str] = field(default_factory=list)
    rss_start: int = 0
    rss_warm: int = 0
    rss_max_after_warm: int = 0
    rss_end: int = 0
    latency_p50_ms: float = 0.0
    latency_p99_ms: float = 0.0
    max_batch_rows: int = 0
    vram_samples: int = 0
    vram_distinct: int = 0
    pool_warm: int = 0
    pool_max_after_warm: int = 0
    reserved: int = 0


@pytest.fixture
def worker_proc(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "q6serve.client.cli", "worker", "--host", "127.0.0.1",
         "--port", "0", "--backend", BACKEND, "--vram-budget", "256MiB"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    assert proc.stderr is not None
    # The first log line is `listening on H:P`.
    lines: list[str] = []
    target = ""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"listening on (\S+:\d+)", line)
        if m:
            target = m.group(1)
            break
    assert target, f"worker did not start: {''.join(lines)[-2000:]}"
    # Keep draining stderr so the worker never blocks on a full pipe.
    threading.Thread(target=lambda: [lines.append(ln) for ln in proc.stderr or ()],
                     daemon=True).start()
    yield proc, target
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(SOAK_SECONDS + 180)
def test_soak_64_callers(worker_proc: tuple[subprocess.Popen[str], str]) -> None:
    proc, target = worker_proc
    blocks = random_q6k(ROWS, K, 77)
    rng = np.random.default_rng(78)
    inputs = [rng.standard_normal((n, K)).astype(np.float32) for n in (1, 2, 3, 4, 8) * 3]
    wants = [reference(blocks, ROWS, K, x) for x in inputs]
    tol = [TOLERANCE * max(1.0, float(np.abs(w).max())) for w in wants]
    admin = Client(target, timeout=60)
    admin.upload("soak.w", blocks, ROWS, K)
    vram0 = admin.status().vram
    fig = Figures(rss_start=rss_bytes(proc.pid))
    stop = threading.Event()
    lock = threading.Lock()
    latencies: list[float] = []
    channels = [Client(target, timeout=30) for _ in range(CHANNELS)]

    def fail(msg: str) -> None:
        with lock:
            fig.errors += 1
            if len(fig.first_errors) < 5:
                fig.first_errors.append(msg)

    def caller(i: int) -> None:
        c = channels[i % CHANNELS]
        r = np.random.default_rng(i)
        lat: list[float] = []
        n_req = n_rows = top = 0
        while not stop.is_set():
            j = int(r.integers(len(inputs)))
            t0 = time.perf_counter()
            try:
                if i % 16 == 0:  # a few callers use the bidirectional stream
                    outs = list(c.matmul_stream([(f"{i}-{k}", "soak.w", inputs[j])
                                                 for k in range(4)], precision=PRECISION))
                else:
                    outs = [c.matmul_full("soak.w", inputs[j], precision=PRECISION)]
            except Q6ServeError as e:
                fail(f"{e.code.name}: {e.message}")
                continue
            lat.append(time.perf_counter() - t0)
            for out in outs:
                if isinstance(out, Q6ServeError):
                    fail(f"{out.code.name}: {out.message}")
                    continue
                err = float(np.abs(out.y - wants[j]).max())
                if err > tol[j]:
                    fail(f"wrong result: error {err} > {tol[j]}")
                n_req += 1
                n_rows += inputs[j].shape[0]
                top = max(top, out.batch_rows)
        with lock:
            latencies.extend(lat)
            fig.requests += n_req
            fig.rows += n_rows
            fig.max_batch_rows = max(fig.max_batch_rows, top)

    vram_seen: set[tuple[int, ...]] = set()
    pools: list[int] = []

    def vram_key() -> tuple[int, ...]:
        """The accounting (what counts against the budget); the allocator pool aside."""
        v = admin.status().vram
        pools.append(v.pool_used_bytes)
        return (v.weights_bytes, v.scratch_bytes, v.staging_bytes, v.reserved_bytes)

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(CALLERS)]
    t_start = time.monotonic()
    for t in threads:
        t.start()
    warm_at = t_start + max(10.0, SOAK_SECONDS * 0.2)
    rss_after: list[int] = []
    while (now := time.monotonic()) < t_start + SOAK_SECONDS:
        time.sleep(1.0)
        vram_seen.add(vram_key())
        fig.vram_samples += 1
        if now >= warm_at:
            rss = rss_bytes(proc.pid)
            if not fig.rss_warm:
                fig.rss_warm, fig.pool_warm = rss, pools[-1]
            rss_after.append(rss)
            fig.pool_max_after_warm = max(fig.pool_max_after_warm, pools[-1])
    stop.set()
    for t in threads:
        t.join(60)
    fig.seconds = round(time.monotonic() - t_start, 1)
    fig.rss_end = rss_bytes(proc.pid)
    fig.rss_max_after_warm = max(rss_after)
    fig.vram_distinct = len(vram_seen)
    lat_ms = np.array(latencies) * 1e3
    fig.latency_p50_ms = round(float(np.percentile(lat_ms, 50)), 2)
    fig.latency_p99_ms = round(float(np.percentile(lat_ms, 99)), 2)
    vram1 = admin.status().vram
    fig.reserved = vram1.reserved_bytes
    print(f"\nsoak: {json.dumps(asdict(fig))}")
    report = os.environ.get("Q6SERVE_SOAK_REPORT")
    if report:
        Path(report).write_text(json.dumps(asdict(fig), indent=2) + "\n")
    for c in (*channels, admin):
        c.close()

    assert fig.errors == 0, fig.first_errors
    assert fig.requests > CALLERS * 10  # the callers really ran
    assert fig.max_batch_rows > 8  # concurrent callers were coalesced
    assert fig.rss_max_after_warm <= RSS_GROWTH * fig.rss_warm, asdict(fig)
    assert fig.vram_distinct == 1, vram_seen
    # The allocator's pool (CuPy's on CUDA) may grow to its high-water mark, but never past
    # what the accountant reserved for weights + scratch + staging.
    assert max(pools) <= vram1.reserved_bytes, (max(pools), vram1.reserved_bytes)
    assert (vram1.weights_bytes, vram1.scratch_bytes, vram1.staging_bytes) == \
        (vram0.weights_bytes, vram0.scratch_bytes, vram0.staging_bytes)
    assert proc.poll() is None  # the worker is alive
