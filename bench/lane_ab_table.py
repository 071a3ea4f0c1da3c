"""The lane's alternated runs of a bench/gpu_dp_s*.sh bundle, as a table: per run and per
variant (its medians), from the JSONs in one folder.

A lane latency run (bench/lane_latency.py --json: results.lane) gives p50, p99, the kernel's
p50, p50 - kernel (issue 15's stretch, <= 50 us) and p50 - device (without the device job, whose
length moves from worker to worker: session 28's bundle B resolved the lane's cuts there); a
T3-through-the-lane run (bench/frontend_cpu.py --lane --json) gives rows/s, its fraction of the
kernel alone (0.5 asked) and the device process's CPU a call in the timed window. A run is
NAME_I.json (ab_runs' names); the variant is NAME.

    python bench/lane_ab_table.py OUT_DIR
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def rows_of(folder: Path) -> list[tuple[str, str, dict[str, float]]]:
    """(run, variant, figures) per JSON of ``folder`` this table knows, in the runs' order
    (the file's time)."""
    got = []
    for f in sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime):
        try:
            d: Any = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        run = f.stem
        variant = run.rsplit("_", 1)[0] if run.rsplit("_", 1)[-1].isdigit() else run
        lane = d.get("results", {}).get("lane") if isinstance(d, dict) else None
        if lane:
            got.append((run, variant, {"p50": lane["p50_us"], "p99": lane["p99_us"],
                                       "kernel": lane.get("kernel_p50_us", float("nan")),
                                       "p50-kernel": lane.get("p50_minus_kernel_us",
                                                              float("nan")),
                                       "p50-device": lane.get("p50_minus_device_us",
                                                              float("nan"))}))
        elif isinstance(d, dict) and d.get("path") == "lane" and "rows_per_s" in d:
            got.append((run, variant, {"rows/s": d["rows_per_s"],
                                       "fraction": d.get("kernel_fraction", float("nan")),
                                       "cpu/call": d.get("device_window_cpu_us_per_call",
                                                         float("nan")),
                                       "p50": d.get("p50_us", float("nan"))}))
    return got


def fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3f}" if abs(v) < 1 else f"{v:.1f}"


def main(argv: list[str]) -> int:
    folder = Path(argv[0] if argv else ".")
    rows = rows_of(folder)
    if not rows:
        print(f"# no lane runs in {folder}")
        return 0
    by: dict[str, list[dict[str, float]]] = {}
    for run, variant, fig in rows:
        print(f"{run:14s} " + "  ".join(f"{k} {fmt(v)}" for k, v in fig.items()))
        by.setdefault(variant, []).append(fig)
    print("# medians a variant")
    for variant, figs in by.items():
        keys = figs[0].keys()
        print(f"{variant:14s} n={len(figs)} " + "  ".join(
            f"{k} {fmt(statistics.median(f[k] for f in figs))}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
