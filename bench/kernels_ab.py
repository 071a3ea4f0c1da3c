"""Side by side: the AUTO rows of two ``bench/kernels.py --json`` runs (e.g. a baseline tree
and this one, timed on the same GPU in one device call), one line per shape and N.

    python bench/kernels_ab.py OLD.json NEW.json [--label-old main --label-new new] [--match TEXT]
"""

from __future__ import annotations

import argparse
import json
import sys


def auto_rows(path: str, match: str = "") -> dict[tuple[str, int, str], dict]:
    """The AUTO rows of a run, or with ``match`` every row whose label contains it (keyed by
    label too)."""
    with open(path) as fh:
        res = json.load(fh)["results"]
    if match:
        return {(r["shape"], r["n"], r["path"]): r for r in res
                if match in r.get("path", "") and "us" in r}
    return {(r["shape"], r["n"], r.get("dtype", "")): r for r in res
            if r.get("path", "").startswith("auto=") and "us" in r}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--label-old", default="old")
    ap.add_argument("--label-new", default="new")
    ap.add_argument("--match", default="", help="compare the rows whose label contains this "
                    "(e.g. mma_f16.: the --variants rows) instead of AUTO's")
    a = ap.parse_args(argv)
    old, new = auto_rows(a.old, a.match), auto_rows(a.new, a.match)
    print(f"# AUTO us (TB/s): {a.label_old} vs {a.label_new}; x = {a.label_old} / {a.label_new}")
    print(f"{'shape':>12} {'N':>3} {'dtype':>5} {a.label_old:>15} {a.label_new:>15} {'x':>6}"
          "  kernel")
    for key in sorted(set(old) & set(new), key=lambda t: (t[0], t[2], t[1])):
        o, n = old[key], new[key]
        print(f"{key[0]:>12} {key[1]:>3} {key[2]:>5} {o['us']:8.1f} ({o['tbs']:.2f}) "
              f"{n['us']:8.1f} ({n['tbs']:.2f}) {o['us'] / n['us']:6.3f}  {n['path']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
