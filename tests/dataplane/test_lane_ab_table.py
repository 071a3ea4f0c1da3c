"""bench/lane_ab_table.py: a bundle's lane runs (lane latency and T3 through the lane) per run
and each variant's medians, p50 - device among them."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _table() -> Any:
    spec = importlib.util.spec_from_file_location("lane_ab_table", ROOT / "bench/lane_ab_table.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _lat(p50: float, device: float) -> dict[str, Any]:
    return {"results": {"lane": {"p50_us": p50, "p99_us": 2 * p50, "kernel_p50_us": 20.0,
                                 "p50_minus_kernel_us": p50 - 20.0,
                                 "p50_minus_device_us": p50 - device}}}


def test_runs_and_medians_by_variant(tmp_path: Path, capsys: Any) -> None:
    runs = {"new_1": _lat(70.0, 40.0), "base_1": _lat(80.0, 42.0), "new_2": _lat(74.0, 41.0),
            "base_2": _lat(76.0, 40.0), "new_3": _lat(90.0, 50.0),
            "lnew_1": {"path": "lane", "rows_per_s": 600_000.0, "kernel_fraction": 0.41,
                       "device_window_cpu_us_per_call": 100.0, "p50_us": 800.0},
            "other": {"not": "a lane run"}}
    for i, (name, d) in enumerate(runs.items()):
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps(d))
        os.utime(f, (1000 + i, 1000 + i))  # (the runs' order: the files' times)
    assert _table().main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[:6]] == ["new_1", "base_1", "new_2", "base_2",
                                                     "new_3", "lnew_1"]
    med = {line.split()[0]: line for line in out if " n=" in line}
    assert "p50-kernel 54.0" in med["new"] and "p50-device 33.0" in med["new"], med["new"]
    assert "p50-kernel 58.0" in med["base"] and "p50-device 37.0" in med["base"], med["base"]
    assert "rows/s 600,000" in med["lnew"] and "fraction 0.410" in med["lnew"], med["lnew"]
    assert "other" not in med


def test_an_empty_folder(tmp_path: Path, capsys: Any) -> None:
    assert _table().main([str(tmp_path)]) == 0
    assert "no lane runs" in capsys.readouterr().out
