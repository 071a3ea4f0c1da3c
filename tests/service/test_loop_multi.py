"""bench/loop_multi.py: a multi-weight call's per-request Python, in process."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("launch", ["0", "1"])
def test_multi_weight_requests_run_on_the_direct_path(monkeypatch: pytest.MonkeyPatch,
                                                      launch: str) -> None:
    monkeypatch.setenv("Q6SERVE_MULTI_LAUNCH", launch)
    sys.path.insert(0, str(BENCH))  # (its imports import bench modules as they run)
    try:
        import loop_multi

        r = asyncio.run(loop_multi.run(["q", "k", "v"], calls=30, warmup=10, k=256))
    finally:
        sys.path.pop(0)
    assert r["p50_us"] > 0 and r["cpu_us"] > 0
    # most requests take the direct path, every part of each (another task woken in the
    # reader's trip sends one through the queue now and then): a device job per part, or
    # one per request (Q6SERVE_MULTI_LAUNCH: one backend call)
    per = 1 if launch == "1" else 3
    assert r["direct_parts"] % per == 0 and r["direct_parts"] >= per * 20
