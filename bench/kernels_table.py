"""Issue 16's table and targets from one ``bench/kernels.py --paths auto --json`` run: a Markdown
table (shape (MB) x N; cell = us · TB/s of Q6_K · speed vs torch f16 in the same run, > 1 is
faster), then each target of issue 16 met or missed with the cells that miss it.

    python3 bench/kernels_table.py KERNELS.json [--dtype f16] [--base OLD.json]

--base: an earlier run of the same cells (e.g. the previous closing check's), for the target "no
N <= 8 cell slower than before by more than 3%". The run's shapes and Ns are the table's, in the
run's order; a target's cells are those of the run that it names.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from q6serve.kernels import q6k

LM_HEADS = {"152064x3584", "128256x4096"}  # the two models' lm-head weights


@dataclass(frozen=True)
class Target:
    """One of issue 16's targets: every run cell of a shape of at least ``min_mb`` MB (lm-heads
    only: ``lm_heads``) at ``ns_lo <= N <= ns_hi`` has ``tbs`` >= ``min_tbs`` TB/s or, with
    ``vs_torch``, is faster than torch f16."""

    text: str
    min_mb: float
    ns_lo: int
    ns_hi: int
    min_tbs: float = 0.0
    vs_torch: bool = False
    lm_heads: bool = False


# issue 16 "Targets (H200, bench/kernels.py, AUTO vs torch f16 in the same run)"
TARGETS = (
    Target("faster than torch f16 at every N <= 64, every shape >= 10 MB", 10, 1, 64,
           vs_torch=True),
    Target(">= 2.5 TB/s at N = 16, every shape >= 48 MB", 48, 16, 16, 2.5),
    Target(">= 2.0 TB/s at N = 64, every shape >= 48 MB", 48, 64, 64, 2.0),
    Target(">= 2.4 TB/s at N <= 8, every shape >= 48 MB", 48, 1, 8, 2.4),
    Target(">= 2.8 TB/s at N <= 8 on both lm-heads", 0, 1, 8, 2.8, lm_heads=True),
)
SLOWER = 1.03  # "no cell slower than today by more than 3%" (N <= 8)


def mb(shape: str) -> float:
    """A shape's Q6_K bytes in MB (the file's, as bench/kernels.py counts them)."""
    rows, k = map(int, shape.split("x"))
    return q6k.aos_nbytes(rows, k) / 1e6


def auto_cells(doc: dict[str, Any], dtype: str) -> dict[tuple[str, int], dict[str, Any]]:
    """(shape, N) -> the AUTO row of that activation dtype, in the run's order; a row that
    failed has "error" and no "us"."""
    return {(r["shape"], r["n"]): r for r in doc["results"]
            if r["path"].startswith("auto=") and r["path"].endswith(f".{dtype}")}


def cell(r: dict[str, Any]) -> str:
    if "us" not in r:
        return "FAILED"
    x = f"{r['x_torch']:.2f}x" if r.get("x_torch") else "-"
    return f"{r['us']:.1f} · {r['tbs']:.2f} · {x}"


def misses(t: Target, cells: dict[tuple[str, int], dict[str, Any]]) -> tuple[int, list[str]]:
    """How many run cells the target names, and those that miss it (shape N: figure)."""
    named = [(key, r) for key, r in cells.items()
             if t.ns_lo <= key[1] <= t.ns_hi
             and (key[0] in LM_HEADS if t.lm_heads else mb(key[0]) >= t.min_mb)]
    bad = []
    for (shape, n), r in named:
        if "us" not in r:
            bad.append(f"{shape} N={n}: failed")
        elif t.vs_torch and not (r.get("x_torch") or 0) > 1:
            bad.append(f"{shape} N={n}: {r.get('x_torch') or 0:.3f}x")
        elif not t.vs_torch and r["tbs"] < t.min_tbs:
            bad.append(f"{shape} N={n}: {r['tbs']:.2f}")
    return len(named), bad


def slower(cells: dict[tuple[str, int], dict[str, Any]],
           base: dict[tuple[str, int], dict[str, Any]]) -> tuple[int, list[str]]:
    """The N <= 8 cells of both runs, and those more than SLOWER times the base's time."""
    both = [(key, r, base[key]) for key, r in cells.items()
            if key[1] <= 8 and key in base and "us" in r and "us" in base[key]]
    return len(both), [f"{s} N={n}: {b['us']:.1f} -> {r['us']:.1f} us ({r['us'] / b['us']:.3f}x)"
                       for (s, n), r, b in both if r["us"] > SLOWER * b["us"]]


def verdict(text: str, named: int, bad: list[str]) -> str:
    if not named:
        return f"- {text}: no such cell in the run"
    head = f"- {text} ({named} cells): " + ("**met**" if not bad else f"**missed** in {len(bad)}")
    return head + ("" if not bad else ": " + "; ".join(bad))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="bench/kernels.py --paths auto --json output")
    ap.add_argument("--dtype", default="f16", help="the activation dtype's rows (f16: the "
                    "service's)")
    ap.add_argument("--base", default=None, help="an earlier run: the no-slower-than-3%% target")
    a = ap.parse_args(argv)
    doc = json.loads(Path(a.json).read_text())
    cells = auto_cells(doc, a.dtype)
    if not cells:
        print(f"no AUTO {a.dtype} rows in {a.json}")
        return 1
    shapes = list(dict.fromkeys(s for s, _ in cells))
    ns = sorted({n for _, n in cells})
    print(f"# {doc.get('device', '?')}; AUTO, {a.dtype} activations; cell = us · TB/s of Q6_K · "
          "speed vs torch f16 (> 1 is faster)\n")
    print("| shape (MB) | " + " | ".join(f"N={n}" for n in ns) + " |")
    print("|---|" + "---|" * len(ns))
    for s in shapes:
        print(f"| {s} ({mb(s):.0f}) | "
              + " | ".join(cell(cells[s, n]) if (s, n) in cells else "–" for n in ns) + " |")
    print()
    for t in TARGETS:
        print(verdict(t.text, *misses(t, cells)))
    if a.base:
        base = auto_cells(json.loads(Path(a.base).read_text()), a.dtype)
        print(verdict(f"no N <= 8 cell more than {SLOWER - 1:.0%} slower than {a.base}",
                      *slower(cells, base)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
