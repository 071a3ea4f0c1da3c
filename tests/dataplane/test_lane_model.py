"""bench/device_ipc.py --lane in a tiny configuration: the lane's device process alone over
the modelled GPU answers every record (a failed one exits the bench), and with
``Q6SERVE_JOB_BATCHES=4`` its queued calls run several to a device job. Not a timing test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("jobs", [1, 4])
def test_lane_model_answers_every_record(tmp_path: Path, jobs: int) -> None:
    out = tmp_path / "lane.json"
    cmd = [sys.executable, str(ROOT / "bench/device_ipc.py"), "--lane", "--gpu-us", "300",
           "--stack", "64", "--inflight", "8", "--rows", "32", "--k", "256", "--seconds", "0.5",
           "--warmup", "0.2", "--json", str(out)]
    env = {**os.environ, "Q6SERVE_JOB_BATCHES": str(jobs)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["region"] and r["messages"] > 0 and r["gpu_busy"] > 0
    # every call is a full batch (64 rows = --max-batch-rows): one device job each, or with
    # 4 batches to a job, fewer jobs than calls
    if jobs == 1:
        assert r["messages_per_batch"] <= 1.01
    else:
        assert r["messages_per_batch"] > 1.2
