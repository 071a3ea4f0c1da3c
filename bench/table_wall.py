"""The host wall of dispatch-table cells under two tables, alternated in one process (on a GPU).

For each (shape, N): ``CudaBackend.launch`` with x built in ``CudaBackend.staging`` (the
``staged`` mode of bench/backend_wall.py, whose ``measure`` times it: wall = launch .. the
result, kernel = the call's own events, host = wall - kernel, the GPU's span of the call with
its ``pre`` / ``tail`` around the kernels, and when the y copy stream's copies are done), under
each variant in turn, the variants alternated over ``--rounds`` (forward, then backward: a b b a).
A variant is a dispatch table and constants of kernels/cuda/launch.py:

- ``new``: the committed table (kernels/cuda/dispatch_h200.json) and launch.py as it is;
- ``old``: the committed table with the ``--old`` cells replaced (``SHAPE:N:LABEL,...``, a
  ``Cfg.label()`` each, in the auto and f16 columns of N's bucket): what the table was;
- ``--variant 'LABEL:TABLE[:NAME=V,...]'`` (TABLE ``new`` or ``old``; NAME a constant of
  launch.py, V an int or ints joined by ``/`` for a tuple, e.g. ``Y_CHUNKS=0,X_SPLIT_Y_MIN=0``:
  the call whole; ``X_SPLIT_Y_SRCS=4/8``: token halves on every tile; or ``SLAB_ROWS=R``: the
  variant's own copy of the weight in slabs of R rows, -P: P slabs (backend_wall.py's ``load``;
  such a weight has no row chunks of its own: give ``Y_CHUNKS=C``)).

At every switch the cached calls (``BoundCall``: keyed without the table's pick) are dropped
and the bound sequences rebound (a split's binding follows the constants), inside the
measurement's 5 warm-up calls.
Printed per row: the pick, the split its call took (``rows 7168/7168``, ``tokens 32/32 x rows
...``), and y (a call on the first x after the timed ones) against the first variant's: ``same``
bit for bit, else the max |difference| / max |y|. Two variants of the same pick must agree bit
for bit (a split never changes a value): one that does not is marked DIFFER and the exit status
is 1. Then per (shape, N) the median over rounds of each variant's wall / kernel / host p50 and
wall ratios against ``old``.

    python bench/table_wall.py --shapes 14336x4096,18944x3584 --ns 64 \\
        --old 14336x4096:64:nt8.m1.w8.s4.pf,18944x3584:64:nt4.m1.w12.s4.pf \\
        --variant 'whole:new:Y_CHUNKS=0,X_SPLIT_Y_MIN=0' --rounds 2 --calls 200

Session 25 (k): the two-slab weights' N=64 cells moved from the K-slice tile (token halves x
row chunks, 4 parts) to the wgmma tile (its 2 row chunks; launch.X_SPLIT_Y_SRCS).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import backend_wall as _bw

from q6serve.kernels.api import KernelFlags, Precision
from q6serve.kernels.cuda.dispatch import Cfg, Dispatch, DispatchTable, bucket, load_default_table


def cfg_from_label(label: str) -> Cfg:
    """The launch shape of a ``Cfg.label()`` (``nt8.m1.w12.s8.pf.k6``)."""
    names = {"nt": "nt", "m": "mt", "w": "warps", "s": "src", "k": "ksplit"}
    kv: dict[str, Any] = {}
    for part in label.split("."):
        if part == "pf":
            kv["pf"] = True
            continue
        name = next(
            (
                n
                for n in sorted(names, key=len, reverse=True)
                if part.startswith(n) and part[len(n) :].isdigit()
            ),
            None,
        )
        if name is None:
            raise ValueError(f"not a launch-shape label: {label!r}")
        kv[names[name]] = int(part[len(name) :])
    return Cfg(**kv)


def old_table(table: DispatchTable, spec: str) -> DispatchTable:
    """``table`` with the cells of ``spec`` (``SHAPE:N:LABEL,...``) replaced in its auto and f16
    columns (mma_f16, that launch shape)."""
    want: dict[tuple[int, int, int], Cfg] = {}
    for item in filter(None, spec.split(",")):
        shape, n, label = item.split(":")
        rows, k = map(int, shape.split("x"))
        cfg = cfg_from_label(label)
        cfg.check("mma_f16")
        want[rows, k, bucket(int(n))] = cfg
    cells, seen = [], set()
    for cell in table.cells.values():
        for e in cell.values():
            key = (e.rows, e.k, e.n)
            if key in want and e.column in ("auto", "f16"):
                e = replace(e, path="mma_f16", cfg=want[key])
                seen.add(key)
            cells.append(e)
    missing = set(want) - seen
    if missing:
        raise SystemExit(f"--old: no table cell {sorted(missing)}")
    return DispatchTable(cells, table.meta)


def parse_sets(text: str) -> dict[str, Any]:
    """``NAME=V,...`` (V an int, or ints joined by ``/``: a tuple)."""
    out: dict[str, Any] = {}
    for kv in filter(None, text.split(",")):
        name, _, v = kv.partition("=")
        out[name] = tuple(int(p) for p in v.split("/")) if "/" in v else int(v)
    return out


def split_of(w: Any, n: int) -> str:
    """The split of ``w``'s bound sequence at N = ``n`` that its last cached call uses."""
    from q6serve.kernels.cuda.launch import BoundCall

    for b in w.data.plans.values():
        if isinstance(b, BoundCall) and b.n == n:
            ex = b.b.extra
            if ex.get("chunks"):
                return "rows " + "/".join(str(r1 - r0) for r0, r1, _ in ex["chunks"])
            if ex.get("tokens"):
                s = "tokens " + "/".join(str(t1 - t0) for t0, t1 in ex["tokens"])
                rows = ex.get("token_rows") or []
                return s + (
                    " x rows " + "/".join(str(r1 - r0) for _, _, r0, r1 in rows) if rows else ""
                )
            return "whole"
    return "?"


def drop_calls(w: Any) -> None:
    """Forget ``w``'s cached calls (``BoundCall``), whose key does not hold the table's pick."""
    from q6serve.kernels.cuda.launch import BoundCall

    for key in [k for k, b in w.data.plans.items() if isinstance(b, BoundCall)]:
        del w.data.plans[key]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="14336x4096,18944x3584")
    ap.add_argument("--ns", default="64")
    ap.add_argument(
        "--old",
        required=True,
        metavar="SHAPE:N:LABEL,...",
        help="the old table's cells (the committed table's otherwise)",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL:TABLE[:NAME=V,...]",
        help="a further variant (TABLE new/old)",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--write-old",
        default=None,
        metavar="FILE",
        help="only write the old table to FILE (for bench/kernels.py --table-ab) and exit",
    )
    a = ap.parse_args(argv)
    if a.write_old:
        committed = load_default_table()
        if committed is None:
            raise SystemExit("no committed dispatch table")
        old_table(committed, a.old).dump(a.write_old)
        return 0
    from q6serve.kernels.cuda import launch
    from q6serve.kernels.cuda_backend import CudaBackend

    be = CudaBackend(0)
    new = load_default_table()
    if new is None:
        raise SystemExit("no committed dispatch table")
    tables = {
        "new": Dispatch(new, be.sm_count),
        "old": Dispatch(old_table(new, a.old), be.sm_count),
    }
    variants: list[tuple[str, str, dict[str, Any]]] = [("old", "old", {}), ("new", "new", {})]
    for spec in a.variant:
        label, table, *rest = spec.split(":")
        if table not in tables:
            raise SystemExit(f"--variant {spec!r}: table {table!r} is not new or old")
        variants.append((label, table, parse_sets(rest[0] if rest else "")))
    unknown = {k for _, _, s in variants for k in s if k != "SLAB_ROWS" and not hasattr(launch, k)}
    if unknown:
        raise SystemExit(f"--variant: no constant {', '.join(sorted(unknown))} in launch.py")
    defaults = {k: getattr(launch, k) for _, _, s in variants for k in s if k != "SLAB_ROWS"}
    slab_sets = sorted({s.get("SLAB_ROWS", 0) for _, _, s in variants})
    flags = KernelFlags()
    rng = np.random.default_rng(0)
    out: list[dict] = []
    bad = False
    print(
        f"# device: {be.device_name()}  staged calls, f16 x, f32 y, {a.calls} calls per row, "
        f"{a.rounds} rounds alternated (us)"
    )
    print(
        f"{'shape':>12} {'N':>3} {'variant':>8} {'pick':>22} {'wall':>7} {'kernel':>7} "
        f"{'host':>7} {'span':>7} {'pre':>6} {'tail':>6} {'y1':>6}  split, y"
    )
    for shape in a.shapes.split(","):
        rows, k = map(int, shape.split("x"))
        blocks = _bw.random_blocks(rng, rows, k)
        # the weight as storage keeps it (0), and in the variants' own slabs (SLAB_ROWS)
        ws = {sr: _bw.load(be, blocks, rows, k, sr) for sr in slab_sets}
        del blocks
        for n in map(int, a.ns.split(",")):
            xs = [rng.standard_normal((n, k)).astype(np.float16) for _ in range(4)]
            ys: dict[str, np.ndarray] = {}
            picks: dict[str, str] = {}
            order = [
                v for r in range(a.rounds) for v in (variants if r % 2 == 0 else variants[::-1])
            ]
            for rnd, (label, table, sets) in enumerate(order):
                be.dispatch = tables[table]
                for name, v in {**defaults, **sets}.items():
                    if name != "SLAB_ROWS":
                        setattr(launch, name, v)
                w = ws[sets.get("SLAB_ROWS", 0)]
                drop_calls(w)
                be.launcher.ws.gen += 1  # (a split's binding follows the constants: rebind)
                c = be.choose(n, Precision.AUTO, flags, rows, k)
                pick = c.cfg.label() if c.cfg else c.path
                r = _bw.measure(be, w, xs, a.calls, "staged", parts=True)
                y = be.matmul(w, xs[0]).y
                split = split_of(w, n)
                first = next(iter(ys), None)
                if first is None:
                    note = "ref"
                elif np.array_equal(y, ys[first]):
                    note = "same"
                else:
                    ref = ys[first]
                    note = f"rel {float(np.abs(y - ref).max() / np.abs(ref).max()):.1e}"
                twin = next((lb for lb, p in picks.items() if p == pick and lb != label), None)
                if twin is not None and not np.array_equal(y, ys[twin]):
                    note += f" DIFFER from {twin} (same pick)"
                    bad = True
                ys.setdefault(label, y)
                picks[label] = pick
                r.update(
                    shape=shape,
                    n=n,
                    variant=label,
                    pick=pick,
                    split=split,
                    round=rnd // len(variants),
                    y=note,
                )
                out.append(r)
                y1 = r.get("y1_p50")
                print(
                    f"{shape:>12} {n:>3} {label:>8} {pick:>22} {r['wall_p50']:7.1f} "
                    f"{r['kernel_p50']:7.1f} {r['host_p50']:7.1f} {r['span_p50']:7.1f} "
                    f"{r['pre_p50'] or 0:6.1f} {r['tail_p50'] or 0:6.1f} "
                    f"{y1 if y1 is not None else float('nan'):6.1f}  {split}, y {note}",
                    flush=True,
                )
            for name, v in defaults.items():
                setattr(launch, name, v)
            be.dispatch = tables["new"]
            for w in ws.values():
                drop_calls(w)
        for w in ws.values():
            be.free(w)
    print("# per (shape, N): median over rounds of wall / kernel / host p50 (us); wall old/it")
    for shape, n in dict.fromkeys((r["shape"], r["n"]) for r in out):
        med = {}
        for label, _, _ in variants:
            rs = [r for r in out if (r["shape"], r["n"], r["variant"]) == (shape, n, label)]
            med[label] = tuple(
                statistics.median(r[f] for r in rs) for f in ("wall_p50", "kernel_p50", "host_p50")
            )
        cells = "  ".join(
            f"{lb} {m[0]:.1f} / {m[1]:.1f} / {m[2]:.1f} ({med['old'][0] / m[0]:.3f})"
            for lb, m in med.items()
        )
        print(f"{shape:>12} {n:>3}  {cells}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": be.device_name(), "results": out}, fh, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
