"""The table of bench/lane_latency.py runs: one row per lane variant of every ``--json`` file in
a folder (the gpu_t1_lane*.sh scripts' summary).   python bench/lane_table.py DIR"""

from __future__ import annotations

import json
import pathlib
import sys

STAGES = ("client_pre", "up", "pre_job", "job", "post_job", "down", "client_post")


def main(folder: str) -> None:
    print("| run | variant | p50 | p99 | device | kernel | p50-kernel | spun/slept | y ok | "
          + " ".join(STAGES) + " (p50 us) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in sorted(pathlib.Path(folder).glob("*.json")):
        d = json.loads(p.read_text())
        if not isinstance(d, dict):
            continue
        for name, r in d.get("results", {}).items():  # (lane_stamps_*.json: no results)
            if not name.startswith("lane"):
                continue
            parts = r.get("parts_p50_us", {})
            stages = " ".join(f"{parts[k]:.0f}" for k in STAGES) if parts else ""
            print(f"| {p.stem} | {name} | {r['p50_us']:.0f} | {r['p99_us']:.0f} | "
                  f"{r['device_p50_us']:.0f} | {r['kernel_p50_us']:.0f} | "
                  f"{r['p50_minus_kernel_us']:.0f} | {r.get('spun')}/{r.get('slept')} | "
                  f"{r.get('check', {}).get('ok')} | {stages} |")


if __name__ == "__main__":
    main(sys.argv[1])
