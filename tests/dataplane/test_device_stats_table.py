"""bench/device_stats_table.py: the busiest second of a Q6SERVE_DP_STATS file, and with --stages
each stage's time a call and the loop's busy time outside the top-level stages."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _table() -> Any:
    spec = importlib.util.spec_from_file_location("device_stats_table",
                                                  ROOT / "bench/device_stats_table.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _line(t: float, calls: int, select_s: float, **st: float) -> dict[str, Any]:
    return {"t": t, "msg_rm": calls, "cpu_s": t * 0.9, "select_s": select_s,
            "loop_iterations": 3 * calls, "pipelined_batches": calls,
            "pipelined_wait_s": 1e-5 * calls, "threads_cpu_s": {"1:MainThread": t * 0.9}, **st}


def test_stages_per_call_and_the_loop_outside_them(tmp_path: Path, capsys: Any) -> None:
    lines = [_line(0.0, 0, 0.0),
             # 1,000 calls in the second: busy 0.6 s = 600 us a call; read 200, flush_calls 300
             # (of it launch_cuda 100), tick 50: 50 us a call outside them
             _line(1.0, 1000, 0.4, st_read_s=0.2, st_read_n=1000, st_flush_calls_s=0.3,
                   st_flush_calls_n=500, st_launch_cuda_s=0.1, st_launch_cuda_n=1000,
                   st_tick_s=0.05, st_tick_n=250),
             # a quieter second after it: not the busiest
             _line(2.0, 1100, 1.3, st_read_s=0.21, st_read_n=1100, st_flush_calls_s=0.31,
                   st_flush_calls_n=550, st_launch_cuda_s=0.11, st_launch_cuda_n=1100,
                   st_tick_s=0.06, st_tick_n=300)]
    (tmp_path / "dpstats_c1.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert _table().main([str(tmp_path), "--stages"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# c1 ") and "1,000 calls/s" in out[0] and "busy 0.60" in out[0]
    assert out[1] == ("# c1       stages us/call (runs/call): busy 600.0  other 50.0  "
                      "flush_calls 300.0 (0.50)  read 200.0 (1.00)  launch_cuda 100.0 (1.00)  "
                      "tick 50.0 (0.25)")


def test_without_stages_one_line_a_file(tmp_path: Path, capsys: Any) -> None:
    lines = [_line(0.0, 0, 0.0), _line(1.0, 10, 0.5)]
    (tmp_path / "dpstats_s0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert _table().main([str(tmp_path)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_system_region_calls_by_their_plan(tmp_path: Path, capsys: Any) -> None:
    """The ``sys`` cell: of 1,000 calls, 900 launched through the pipeline (800 by their
    region's plan) and 100 queued; a file with none has no such cell."""
    lines = [_line(0.0, 0, 0.0, sys_launched=10, sys_planned=5, sys_queued=1),
             _line(1.0, 1000, 0.4, sys_launched=910, sys_planned=805, sys_queued=101)]
    (tmp_path / "dpstats_s1.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "dpstats_s2.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in [_line(0.0, 0, 0.0), _line(1.0, 10, 0.5)]))
    assert _table().main([str(tmp_path)]) == 0
    s1, s2 = capsys.readouterr().out.splitlines()
    assert "sys 0.90 (planned 0.80, queued 0.10)" in s1, s1
    assert "sys " not in s2, s2


def test_lane_requests_are_calls_and_their_stage_top_level(tmp_path: Path, capsys: Any) -> None:
    """A lane load's second: 2,000 lane requests (and 10 front-end messages) are 2,010 calls;
    lane_request (600 ms) is a top-level stage beside tick (100 ms): of 0.8 s busy, 100 ms
    (~49.8 us a call) outside them."""
    base = {"msg_rm": 0, "lane_requests": 0}
    lines = [{**_line(0.0, 0, 0.0), **base},
             {**_line(1.0, 10, 0.2, st_lane_request_s=0.6, st_lane_request_n=2000,
                      st_tick_s=0.1, st_tick_n=1000), "lane_requests": 2000}]
    (tmp_path / "dpstats_lane.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert _table().main([str(tmp_path), "--stages"]) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert "2,010 calls/s" in first, first
    assert "busy 398.0  other 49.8  lane_request 298.5 (1.00)" in second, second
