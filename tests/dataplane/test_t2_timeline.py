"""bench/t2_timeline.py (T2's per-call timeline through front ends) and the stamps it reads
(bench/frontend_stamps.py): the parts of a call add up to its round trip from stamps of one
clock, the bands and overlaps are computed as documented, and a small run through a real
two-front-end worker stamps every call with its front end's pid, in order."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def tl():
    sys.path.insert(0, str(BENCH))
    try:
        import t2_timeline
    finally:
        sys.path.pop(0)
    return t2_timeline


def row(tl, caller: int, t0: float, gaps: list[float], pid: int = 7) -> list[float]:
    """A call's row: the stamps START..SEND and the caller's read, ``gaps`` apart from t0."""
    t = np.cumsum([t0, *gaps])
    return [caller, t0, t[-1], 1e-4, 2e-4, 3, pid, *t[1:-1]]


def test_parts_add_up_to_the_round_trip_in_stamp_order(tl) -> None:
    gaps = [1e-3, 2e-4, 3e-4, 4e-3, 5e-5, 6e-5, 7e-4, 8e-4]  # up .. down
    parts = tl.timeline(np.array([row(tl, 1, 10.0, gaps)]))
    assert [parts[p][0] for p in tl.PARTS] == pytest.approx(gaps)
    assert parts["e2e"][0] == pytest.approx(sum(gaps))
    assert parts["batch"][0] == pytest.approx(3e-4)  # queue + device_seconds of the reply


def test_bands_and_stall_overlaps(tl) -> None:
    # 300 calls of 1.0-1.3 ms on front end 7, 2 slow ones of 10 ms on front end 8 (a GC
    # pause of 4 ms inside each, and a loop stall that covers half of one)
    rows = [row(tl, i % 4, i * 0.01, [1e-4] * 7 + [3e-4 + i * 1e-6]) for i in range(300)]
    rows += [row(tl, 9, 5.0 + i, [1e-4] * 7 + [9.3e-3], pid=8) for i in range(2)]
    stalls = {"front": [(8, np.array([[5.001, 0.004, 2, 0.004], [6.001, 0.004, 1, 0.004],
                                      [6.005, 0.010, 0, 0.001]]))], "device": []}
    r = tl.analyse(np.array(rows), stalls)
    assert r["calls"] == r["stamped"] == 302
    # the slowest 1%: the two slow calls and the two slowest others (1.298, 1.299 ms)
    assert r["p99"]["calls"] == 4
    assert r["p99"]["e2e"] == pytest.approx((20000 + 1298 + 1299) / 4)
    assert 1100 < r["p50"]["e2e"] < 1200 and 29 <= r["p50"]["calls"] <= 31
    assert r["p50"]["front_stalls"] == 0
    # slow calls: 4 ms of GC each, + 5 ms of the loop stall in the second
    assert r["p99"]["front_gc"] == pytest.approx(8000 / 4)
    assert r["p99"]["front_stalls"] == pytest.approx(13000 / 4)
    assert r["per_front"][8] == {"callers": 1, "calls": 2, "mean_us": pytest.approx(10000),
                                 "p99_us": pytest.approx(10000), "slow_share": pytest.approx(2 / 4)}
    assert 1290 < r["per_front"][7]["p99_us"] < 1300  # its own slowest 1%, not front end 8's
    assert r["per_front"][7]["callers"] == 4
    assert r["stalls"]["front-8"]["gc2_n"] == 1 and r["stalls"]["front-8"]["gc_n"] == 2
    assert r["stalls"]["front-8"]["loop_cpu_ms"] == pytest.approx(1.0)
    assert tl.overlap(np.array([0.0]), np.array([1.0]), np.zeros((0, 2)))[0] == 0


def test_stamps_parse_only_whole_tags() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import frontend_stamps
    finally:
        sys.path.pop(0)
    assert frontend_stamps.parse("42 1 2 3 4 5 6 7") == (42, [1e-6 * i for i in range(1, 8)])
    assert frontend_stamps.parse("") is None
    assert frontend_stamps.parse("1.5 2.5") is None  # (bench/reply_stamps.py's tag)
    assert frontend_stamps.parse("42 1 2 3 4 5 6 x") is None


def test_a_small_run_stamps_every_call_in_order(tl, tmp_path: Path) -> None:
    out = tmp_path / "t2.json"
    r = subprocess.run([sys.executable, str(BENCH / "t2_timeline.py"), "--frontends", "2",
                        "--hosts", "1", "--callers", "3", "--seconds", "0.6", "--warmup", "0.2",
                        "--json", str(out), "--keep", str(tmp_path / "keep")],
                       capture_output=True, text=True, timeout=240, cwd=BENCH)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["calls"] > 0 and got["stamped"] == got["calls"]
    rows = np.load(tmp_path / "keep" / "calls-0.npy")
    parts = tl.timeline(rows)
    for p in tl.PARTS:  # one clock: every stamp after the one before
        assert (parts[p] >= 0).all(), p
    assert sum(got["p50"][p] for p in tl.PARTS) == pytest.approx(got["p50"]["e2e"])
    pids = set(rows[:, tl.COLS.index("pid")].astype(int).tolist())
    assert 1 <= len(pids) <= 2 and 0 not in pids
    assert list((tmp_path / "keep").glob("stalls-front-*.run0"))  # each front end logs


def test_usage_reads_the_counters_at_the_span_edges(tl) -> None:
    """A process's shares over the timed part: its cumulative counters interpolated at the
    span's start and end (not the samples around them, which add warm-up and idle)."""
    # [when, loop busy, in select, process CPU, loop thread CPU]: busy 0.5 s a second until
    # t=2, then idle; CPU 1.0 core until t=2, then nothing
    use = np.array([[t, 0.5 * min(t, 2.0), 0.0, min(t, 2.0), 0.8 * min(t, 2.0)]
                    for t in (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0)])
    u = tl.usage(use, (0.7, 1.9))
    assert u == pytest.approx({"seconds": 1.2, "loop_busy": 0.5, "cores": 1.0,
                               "loop_thread": 0.8})
    assert tl.usage(use, (0.7, 2.2))["cores"] == pytest.approx(1.3 / 1.5)
    assert tl.usage(use, (0.7, 3.5)) is None and tl.usage(use[:1], (0.0, 0.0)) is None


def test_table_row(tmp_path):
    """bench/t2_table.py: one row per run's JSON, each front end's callers (most first) and the
    lowest and highest front-end p99."""
    sys.path.insert(0, str(BENCH))
    try:
        import t2_table
    finally:
        sys.path.pop(0)
    r = {"calls_per_s": 21000.4, "p50_us": 2700, "p99_us": 6050, "p999_us": 15600,
         "p50": {"up": 740}, "p99": {"up": 5153},
         "usage": {"device-1": {"loop_busy": 0.64, "cores": 0.9},
                   "front-2": {"loop_busy": 0.93, "cores": 1.4},
                   "front-3": {"loop_busy": 0.91, "cores": 1.3}},
         "per_front": {"2": {"callers": 14, "p99_us": 5250}, "3": {"callers": 20, "p99_us": 6500}},
         "load_cores": [0.5, 0.6], "machine_cores": 11.2, "machine_cpus": 16}
    (tmp_path / "t2_f4a.json").write_text(json.dumps(r))
    row = t2_table.row(tmp_path / "t2_f4a.json")
    assert row == ("| f4a | 21,000 | 2.70 / 6.05 / 15.60 | 740 / 5,153 | 0.64 | 2.70 (0.93) | "
                   "20/14 | 5.25-6.50 | 1.10 | 11.2 of 16 |")
