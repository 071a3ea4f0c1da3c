"""bench/loop_lmhead.py: the lm-head target's per-call Python on the loop, in process."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_the_lm_head_calls_run_as_deferred_batches() -> None:
    sys.path.insert(0, str(BENCH))  # (its imports import bench modules as they run)
    try:
        import loop_lmhead

        a = argparse.Namespace(streams=3, n=4, topk=8, rows=256, gpu_us=300.0, calls=40,
                               warmup=10, profile=False, top=5)
        r = asyncio.run(loop_lmhead._run(a))
    finally:
        sys.path.pop(0)
    assert r["calls"] >= 40
    assert r["loop_cpu_us_per_call"] > 0 and r["wall_us_per_call"] > 0
    # the stub's kernel (300 us, over DEFER_KERNEL_US) makes the batches deferred: launched on
    # the loop and waited for on the device thread, as the CUDA lm-head's are
    assert r["deferred_jobs"] >= 30


def test_the_grpc_mode_reports_the_workers_threads() -> None:
    """--grpc: the same worker served over real gRPC in a child process, the callers here."""
    sys.path.insert(0, str(BENCH))
    try:
        import loop_lmhead

        a = argparse.Namespace(streams=2, n=4, topk=8, rows=256, gpu_us=300.0, seconds=0.4,
                               warmup_s=0.3)
        r = loop_lmhead._grpc_round(a, None)
    finally:
        sys.path.pop(0)
    assert r["calls_s"] > 0 and r["p50_ms"] > 0 and r["loop_us"] > 0
