"""Repeat-determinism and SoA-vs-pair-stream bits of chosen launch shapes (run on a GPU).

Session 12's --pairs-ab found one cell (152064x3584 N=16, AUTO = the K-slice tile nt2.w12)
whose pair-stream output differed from the SoA output in bits while every other cell matched.
This runs each (shape, N, launch shape) three times on a SoA weight and three times on a
pair-stream weight of the same blocks (PDL on, then off for the split-K sum), and prints per
pair of runs how many outputs differ, in which rows, and the largest relative difference: a
SoA run that differs from another SoA run is the kernel's own nondeterminism, not the layout's.

    python bench/pair_bits.py [--cells 152064x3584:16:nt2.w12,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from q6serve.kernels import q6k
from q6serve.kernels.api import Layout, iter_aos_chunks
from q6serve.kernels.cuda.dispatch import Cfg
from q6serve.kernels.cuda_backend import CudaBackend

SHAPES = {"nt2.w12": Cfg(nt=2, src=4, pf=True, warps=12),
          "nt2.w16": Cfg(nt=2, src=4, pf=True, warps=16),
          "nt2.w8": Cfg(nt=2, src=4, pf=True),
          "nt1.w16": Cfg(nt=1, src=4, pf=True, warps=16),
          "wg.nt8.w12": Cfg(nt=8, src=8, pf=True, warps=12)}
CELLS = ("152064x3584:16:nt2.w12,152064x3584:16:nt2.w16,18944x3584:16:nt2.w12,"
         "128256x4096:16:nt2.w12,152064x3584:64:wg.nt8.w12")


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    diff = a.view(np.uint32) != b.view(np.uint32)
    if not diff.any():
        return {"ndiff": 0}
    rows = np.nonzero(diff.any(axis=0))[0]
    rel = np.abs(a - b)[diff] / np.maximum(np.abs(a[diff]), 1e-30)
    return {"ndiff": int(diff.sum()), "rows": int(rows.size), "row_min": int(rows.min()),
            "row_max": int(rows.max()), "max_rel": float(rel.max())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default=CELLS)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import cupy as cp

    be = CudaBackend(0)
    rng = np.random.default_rng(0)
    out = []
    loaded: dict[str, tuple] = {}
    for cell in a.cells.split(","):
        shape, n_s, name = cell.split(":")
        rows, k = map(int, shape.split("x"))
        n, cfg = int(n_s), SHAPES[name]
        if cfg.src == 8 and be.cc != "90":
            continue
        if shape not in loaded:
            for w in (loaded.popitem()[1] if loaded else ()):
                be.free(w)
            blocks = q6k.random_blocks(rows, k, rng)
            be.storage.pairs = False
            ws = be.load(iter_aos_chunks(blocks, rows, k, 64 << 20), rows, k, Layout.SOA,
                         64 << 20)
            be.storage.pairs = True
            try:
                wp = be.load(iter_aos_chunks(blocks, rows, k, 64 << 20), rows, k, Layout.SOA,
                             64 << 20)
            finally:
                be.storage.pairs = False
            loaded[shape] = (ws, wp)
        ws, wp = loaded[shape]
        x = cp.asarray(rng.standard_normal((n, k)).astype(np.float16))
        lp = be.launcher.plan(rows, k, Layout.SOA, "InF16", "mma_f16", cfg, n)
        row = {"cell": cell, "grid": list(lp.grid), "ks": lp.ks}
        for pdl in (True, False):
            be.launcher.pdl = pdl
            with be.ctx.dev, be.stream:
                ys = [be.run(ws, x, np.dtype(np.float16), "mma_f16", cfg).get(stream=be.stream)
                      for _ in range(3)]
                yp = [be.run(wp, x, np.dtype(np.float16), "mma_f16", cfg).get(stream=be.stream)
                      for _ in range(3)]
            tag = "pdl" if pdl else "plain"
            row[tag] = {"soa0-soa1": compare(ys[0], ys[1]), "soa0-soa2": compare(ys[0], ys[2]),
                        "pair0-pair1": compare(yp[0], yp[1]),
                        "pair0-pair2": compare(yp[0], yp[2]),
                        "soa0-pair0": compare(ys[0], yp[0]),
                        "soa1-pair1": compare(ys[1], yp[1])}
        be.launcher.pdl = True
        out.append(row)
        print(f"{cell:>28} grid {tuple(lp.grid)} ks {lp.ks}", flush=True)
        for tag in ("pdl", "plain"):
            print("   " + tag + ": " + "  ".join(f"{kk} {v['ndiff']}" + (
                f" (rows {v['row_min']}..{v['row_max']}, {v['rows']} rows, rel {v['max_rel']:.1e})"
                if v["ndiff"] else "") for kk, v in row[tag].items()), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
