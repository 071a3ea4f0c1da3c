"""bench/loop_split.py: T1's worker-side parts in process, from each reply's own timing."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_split_reads_each_parts_from_the_replies() -> None:
    sys.path.insert(0, str(BENCH))  # (its imports import bench modules as they run)
    try:
        import loop_split

        r = asyncio.run(loop_split.split(calls=40, warmup=20, k=256, rows=16))
    finally:
        sys.path.pop(0)
    assert set(r) == {"e2e", "decode", "device", "other", "handler", "outside"}
    # every reply ran the direct path's job and carried its decode, device and handler times
    assert r["decode"] > 0 and r["device"] > 0 and r["other"] > 0
    assert r["handler"] < r["e2e"] and r["outside"] > 0
