"""T3's alternated runs as a table: per ``t3_NAME_I.json`` in DIR (``bench/service.py --json``
of one T3 run, as the data-plane bundle scripts name them) one row (regions, front ends,
rows/s, p99, the run's kernel p50, the fraction of the kernel alone), then per ``--pair A:B:LABEL``
the median rows/s of A's runs and B's and their ratio B / A.

    python3 bench/t3_ab_table.py DIR --pair coff:con:"cuda, lean 0 / 1" ...
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
from pathlib import Path


def rows(out: str) -> dict[str, list[float]]:
    """Print one row per run; return each variant's rows/s (the name before ``_I``)."""
    got: dict[str, list[float]] = {}
    for path in sorted(glob.glob(f"{out}/t3_*.json")):
        doc = json.loads(Path(path).read_text())
        name = Path(path).stem[3:]
        kernel = min([r["kernel_p50_us"] for r in doc["runs"]] or [0.0])
        for t in doc["targets"]:
            print(f"# {name:8} {t['region']:6} {t['frontends']:2} {t['service_rows_per_s']:>10,.0f}"
                  f" {t['p99_us']:>8,.0f} {kernel:>6.1f} {t['fraction']:6.3f}")
            got.setdefault(name.split("_")[0], []).append(t["service_rows_per_s"])
    return got


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the folder of t3_*.json")
    p.add_argument("--pair", action="append", default=[], metavar="A:B:LABEL",
                   help="variants A and B (names before _I) compared as B / A")
    args = p.parse_args(argv)
    print("# T3: run, regions, front ends, rows/s, p99 us, kernel p50 us, fraction")
    got = rows(args.out)
    for pair in args.pair:
        a, b, label = pair.split(":", 2)
        if a in got and b in got:
            x, y = statistics.median(got[a]), statistics.median(got[b])
            print(f"# median {label}: {x:,.0f} ({len(got[a])}) / {y:,.0f} ({len(got[b])}) = "
                  f"{y / x:.3f}")


if __name__ == "__main__":
    main()
