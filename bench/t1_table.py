"""The table of T1 runs a bench/gpu_t1_*.sh session wrote: for each ``LABEL<i>.log`` in DIR
(bench/service.py --target-report output) of the labels given, p50 - kernel, the run's bare
gRPC floors (plain, spinning, with the caller's encode/decode) and its mean parts; then each
label's median over its runs.

    python3 bench/t1_table.py "$OUT" base now
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    out, labels = Path(argv[0]), argv[1:]
    rows: dict[str, list[float]] = {label: [] for label in labels}
    for log in sorted(out.glob("*.log")):
        label = log.stem.rstrip("0123456789")
        if label not in rows:
            continue
        lines = log.read_text().splitlines()
        fig = [json.loads(line[2:]) for line in lines if line.startswith('# {"target"')]
        means = [line.strip() for line in lines if line.strip().startswith("mean us:")]
        if fig:
            f = fig[-1]
            rows[label].append(f["p50_minus_kernel_us"])
            print(f"{log.stem:7s} p50-kernel {f['p50_minus_kernel_us']:6.0f}  bare "
                  f"{f['bare_grpc_p50_us']:5.0f}  spin {f['bare_grpc_spin_p50_us']:5.0f}  client "
                  f"work {f['bare_grpc_client_work_p50_us']:5.0f}  | {means[-1] if means else ''}")
    for label, got in rows.items():
        if got:
            print(f"{label}: p50 - kernel median {statistics.median(got):.0f} us over {len(got)} "
                  f"runs ({', '.join(f'{g:.0f}' for g in got)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
