"""The short table the GPU data-plane scripts (bench/gpu_dataplane_*.sh) print last: one row per
target of each ``bench/service.py --dataplane --json`` file named ``dp_TAG.json`` in DIR
(rows/s, p99, kernel p50, fraction of the kernel alone, and the mean parts of a call); with
``--lanes``, one row per ``bench/frontend_cpu.py --lane --json`` file named ``lane_TAG.json``
(rows/s, p50, p99, the device process's cores and its CPU a call in the timed window).

    python3 bench/dataplane_table.py DIR
    python3 bench/dataplane_table.py --lanes DIR
"""

from __future__ import annotations

import glob
import json
import sys
from pathlib import Path


def lanes(out: str) -> None:
    print("# T3 lane   rows/s   p50 us   p99 us  device cores  device CPU us/call (window)  "
          "kernel p50 us  of the kernel alone")
    for path in sorted(glob.glob(f"{out}/lane_*.json")):
        r = json.loads(Path(path).read_text())
        r = r[0] if isinstance(r, list) else r
        k = r.get("kernel_p50_us") or float("nan")  # (NaN: not in the replies)
        print(f"# {Path(path).stem[5:]:8} {r['rows_per_s']:>8,.0f} {r['p50_us']:>8,.0f} "
              f"{r['p99_us']:>8,.0f} {r['cpu'].get('device', 0):>6.2f} "
              f"{r.get('device_window_cpu_us_per_call', 0):>10,.0f} {k:>17.1f} "
              f"{r.get('kernel_fraction') or float('nan'):>10.3f}")


def main(argv: list[str] | None = None) -> int:
    args = argv or sys.argv[1:]
    if args[0] == "--lanes":
        lanes(args[1])
        return 0
    out = args[0]
    print("# run               target via     rows/s   p99 us kernel us  frac | mean us: queue "
          "kernel dev_other srv_other transport")
    for path in sorted(glob.glob(f"{out}/dp_*.json")):
        doc = json.loads(Path(path).read_text())
        tag = path.rsplit("dp_", 1)[1][:-5]
        runs = {r["label"]: r for r in doc["runs"]}
        for t in doc["targets"]:
            rps = t.get("rows_per_s", t.get("service_rows_per_s", 0.0))
            r = next((r for lab, r in runs.items() if lab.startswith(t["target"] + " ")
                      and lab.endswith(" " + (t["region"] or "bytes"))), None)
            pm = (r or {}).get("parts_mean_us", {})
            k = (r or {}).get("kernel_p50_us") or 0
            parts = " ".join(f"{pm.get(p, 0):6.0f}" for p in
                             ("queue", "kernel", "device_other", "server_other", "transport"))
            print(f"# {tag:17} {t['target']:6} {t['region']:6} {rps:>9,.0f} "
                  f"{t['p99_us']:>8,.0f} {k:>8.0f} {t.get('fraction', 0):>5.2f} | {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
