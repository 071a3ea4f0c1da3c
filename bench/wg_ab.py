"""Session 21 (issue 16 item 2): the wgmma tile as session 20 left it (its file kept for this
A/B as bench/ab/q6k_wgmma_s20.cu, the instantiation V = 3 its src 8 pf cells ran) against
today's ``q6k_wg_f16`` (src 6 / 9 and V removed, the dequantize branches merged) on the table's
src 8 cells: the same launch plan (grid, K split, shared memory, split-K sum) with either
kernel, alternated ``--rounds`` times in one process (device events, the weight rotated over
copies as in bench/kernels.py), y compared bit for bit.

    python bench/wg_ab.py [--cells 4096x14336:64,...] [--rounds 3] [--iters 30] [--json f]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as _bk
from q6serve.kernels.api import KernelFlags, Layout, Precision
from q6serve.kernels.cuda import loader
from q6serve.kernels.cuda.launch import kernel_name
from q6serve.kernels.cuda_backend import weight_data

OLD_FILE = Path(__file__).resolve().parent / "ab" / "q6k_wgmma_s20.cu"
CELLS = "4096x14336:64,3584x18944:64,152064x3584:64,128256x4096:64"


def old_kernel(be, name: str):
    """Session 20's file compiled for sm_90a as the loader builds q6k_wgmma.cu (its include of
    q6k_matmul.cu inlined from today's tree: that file did not change)."""
    src = OLD_FILE.read_text().replace('#include "q6k_matmul.cu"',
                                       loader.source_text("q6k_matmul.cu"))
    with be.ctx.dev:
        mod, lowered = loader._compile_arch("q6k_wgmma_s20.cu", src, loader.BASE_OPTIONS,
                                            (name,), "sm_90a")
    return loader.ArchKernel(mod.get_function(lowered[name]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default=CELLS, help="shape:N of AUTO cells on src 8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import cupy as cp

    from q6serve.kernels.cuda_backend import CudaBackend

    be = CudaBackend(0)
    if be.cc != "90":
        print("# the wgmma tile needs compute capability 9.0")
        return 2
    rng = np.random.default_rng(5)
    flags = KernelFlags(soa=True)
    out = []
    print(f"{'shape':>12} {'N':>3} {'cfg':>22} {'s20 us':>8} {'now us':>8} {'s20/now':>8} bits")
    for cell in a.cells.split(","):
        shape, n = cell.split(":")
        rows, k = map(int, shape.split("x"))
        n = int(n)
        ch = be.choose(n, Precision.AUTO, flags, rows, k)
        if ch.path != "mma_f16" or ch.cfg is None or ch.cfg.src != 8:
            print(f"{shape:>12} {n:>3} not a src 8 cell: {ch.path} {ch.cfg}")
            continue
        ws = _bk.load_copies(be, rng, rows, k, Layout.SOA)
        with be.ctx.dev, be.stream:
            lp = be.launcher.plan(rows, k, Layout.SOA, "InF16", "mma_f16", ch.cfg, n,
                                  be.storage.pairs)
            old_name = kernel_name("mma_f16", ch.cfg, 2 if be.storage.pairs else True,
                                   "InF16")[:-1] + ", 3>"
            fo = old_kernel(be, old_name)
            if lp.smem > int(fo.max_dynamic_shared_size_bytes):
                fo.max_dynamic_shared_size_bytes = lp.smem
            plans = {"s20": replace(lp, fn=fo), "now": lp}
            x = cp.asarray(rng.standard_normal((n, k)).astype(np.float16))
            ys = {lab: cp.full((n, rows), np.nan, cp.float32) for lab in plans}

            def call(i: int, lab: str, ws=ws, plans=plans, x=x, ys=ys, n=n) -> None:
                w = ws[i]
                for s in be.launcher.steps(plans[lab], w, weight_data(w), int(x.data.ptr),
                                           int(ys[lab].data.ptr), n):
                    s()

            for lab in plans:
                call(0, lab)
            be.stream.synchronize()
            same = bool((ys["s20"].view(cp.uint32) == ys["now"].view(cp.uint32)).all())
            times: dict[str, list[float]] = {lab: [] for lab in plans}
            for _ in range(a.rounds):
                for lab in plans:
                    times[lab].append(_bk.time_calls(
                        cp, lambda i, lab=lab: call(i, lab), len(ws), iters=a.iters))
        to, tn = min(times["s20"]), min(times["now"])
        print(f"{shape:>12} {n:>3} {ch.cfg.label():>22} {to:8.1f} {tn:8.1f} {to / tn:8.3f} "
              f"{'same' if same else 'DIFFER'}", flush=True)
        out.append({"shape": shape, "n": n, "cfg": ch.cfg.label(), "s20_us": to, "now_us": tn,
                    "same_bits": same, "runs": times, "old_kernel": old_name})
        _bk.free_copies(be, ws)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"results": out}, fh, indent=1)
    return 0 if out and all(r["same_bits"] for r in out) else 1


if __name__ == "__main__":
    sys.exit(main())
