"""bench/device_ipc.py --lane in a tiny configuration: the lane's device process alone over
the modelled GPU answers every record (a failed one exits the bench), and with
``Q6SERVE_JOB_BATCHES=4`` its queued calls run several to a device job; its full batches go
through the device process's pipeline, as a --frontends worker's lanes do, unless
--no-lane-pipe. Not a timing test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, gpu_us: int, jobs: int, *args: str) -> dict[str, Any]:
    out = tmp_path / "lane.json"
    cmd = [sys.executable, str(ROOT / "bench/device_ipc.py"), "--lane", "--gpu-us", str(gpu_us),
           "--stack", "64", "--inflight", "8", "--rows", "32", "--k", "256", "--seconds", "0.5",
           "--warmup", "0.2", "--json", str(out), *args]
    env = {**os.environ, "Q6SERVE_JOB_BATCHES": str(jobs)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["region"] and r["messages"] > 0 and r["gpu_busy"] > 0
    return r  # type: ignore[no-any-return]


@pytest.mark.parametrize("jobs", [1, 4])
def test_lane_model_answers_every_record(tmp_path: Path, jobs: int) -> None:
    # (a modelled kernel of 300 us is one to defer: the calls are queued, not pipelined)
    r = _run(tmp_path, 300, jobs)
    # every call is a full batch (64 rows = --max-batch-rows): one device job each, or with
    # 4 batches to a job, fewer jobs than calls
    if jobs == 1:
        assert r["messages_per_batch"] <= 1.01
    else:
        assert r["messages_per_batch"] > 1.2


@pytest.mark.parametrize("pipe", [True, False])
def test_lane_model_full_batches_through_the_pipeline(tmp_path: Path, pipe: bool) -> None:
    """A short modelled kernel (50 us): the lanes' full batches launched through the device
    process's pipeline (``FrontendsWorker._pipe``), as a --frontends worker's lanes are by
    default; --no-lane-pipe: none (each lane flush waits for its own)."""
    r = _run(tmp_path, 50, 1, *([] if pipe else ["--no-lane-pipe"]))
    assert (r["pipelined"] > 0) == pipe, r["pipelined"]
