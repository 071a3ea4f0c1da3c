"""The split-K sum `q6k_sum_parts` as it is against session 19's (one float per thread, the
remainder's slices loaded one at a time), on the (K slices, outputs) of the table's K-split
cells: both kernels on the same partial sums (resident in L2, as after the tile), alternated
``--rounds`` times in one process, device events around each launch, y compared bit for bit.
No PDL here (both kernels' griddepcontrol.wait is a no-op without it).

    python bench/sum_ab.py [--shapes 4096x14336,..] [--ns 8,16,32,64] [--rounds 3] [--json f]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as _bk
from q6serve.kernels.api import KernelFlags, Layout, Precision
from q6serve.kernels.cuda.launch import MATMUL_FILE, SUM_VEC_MIN

# Session 19's q6k_sum_parts (main 5c10af8), verbatim but for the PDL wait written out.
OLD_SRC = r"""
extern "C" __global__ void __launch_bounds__(256) sum_parts_s19(const float* part, float* y,
                                                                 int ks, long long total) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const float* p = part + i;
        float s = 0.f;
        int k = 0;
        for (; k + 4 <= ks; k += 4) {
            const float v0 = p[k * total], v1 = p[(k + 1) * total];
            const float v2 = p[(k + 2) * total], v3 = p[(k + 3) * total];
            s += v0;
            s += v1;
            s += v2;
            s += v3;
        }
        for (; k < ks; ++k) s += p[k * total];
        y[i] = s;
    }
}
"""


def cells(be, shapes: list[tuple[int, int]], ns: list[int]) -> list[tuple[str, int, int, int]]:
    """(shape, N, K slices, outputs) of every AUTO cell whose plan has a split-K sum."""
    jobs = [(rows, k, n, ch.cfg, ch.path, "InF16") for rows, k in shapes for n in ns
            for ch in [be.choose(n, Precision.AUTO, KernelFlags(soa=True), rows, k)]]
    _bk.prefetch_auto(be, jobs, Layout.SOA)  # the plans' tiles compiled in parallel first
    out = []
    for rows, k in shapes:
        for n in ns:
            ch = be.choose(n, Precision.AUTO, KernelFlags(soa=True), rows, k)
            if ch.cfg is None or ch.path != "mma_f16":
                continue
            lp = be.launcher.plan(rows, k, Layout.SOA, "InF16", ch.path, ch.cfg, n,
                                  be.storage.pairs)
            if lp.post is not None:
                out.append((f"{rows}x{k}", n, lp.ks, n * rows))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(f"{r}x{k}" for r, k in _bk.SHAPES))
    ap.add_argument("--ns", default="8,16,32,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import cupy as cp

    from q6serve.kernels.cuda_backend import CudaBackend

    be = CudaBackend(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    ns = [int(v) for v in a.ns.split(",")]
    rng = np.random.default_rng(0)
    res = []
    with be.ctx.dev, be.stream:
        old = cp.RawKernel(OLD_SRC, "sum_parts_s19")
        new = be.ctx.fn(MATMUL_FILE, "q6k_sum_parts")
        print(f"{'shape':>12} {'N':>3} {'ks':>3} {'outputs':>8} {'s19 us':>7} {'now us':>7} "
              f"{'s19/now':>7} bits", flush=True)
        for shape, n, ks, total in cells(be, shapes, ns):
            part = cp.asarray(rng.standard_normal(ks * total, dtype=np.float32))
            ys = {"old": cp.empty(total, np.float32), "new": cp.empty(total, np.float32)}
            grids = {"old": (min(-(-total // 256), 4096),),
                     "new": (min(-(-total // (256 * (4 if total >= SUM_VEC_MIN and total % 4 == 0
                                                     else 1))), 4096),)}
            fns = {"old": old, "new": new}
            args = {k: (part, ys[k], np.int32(ks), np.int64(total)) for k in ys}
            for k in ys:
                ys[k].fill(np.nan)
                fns[k](grids[k], (256,), args[k])
            same = bool(cp.array_equal(ys["old"].view(np.uint32), ys["new"].view(np.uint32)))
            times: dict[str, list[float]] = {"old": [], "new": []}
            for _ in range(a.rounds):
                for k in ("old", "new"):
                    def call(i: int, f=fns[k], g=grids[k], ar=args[k]) -> None:
                        f(g, (256,), ar)

                    times[k].append(_bk.time_calls(cp, call, 1, iters=a.iters))
            to, tn = min(times["old"]), min(times["new"])
            print(f"{shape:>12} {n:>3} {ks:>3} {total:>8} {to:7.2f} {tn:7.2f} {to / tn:7.3f} "
                  f"{'same' if same else 'DIFFER'}", flush=True)
            res.append({"shape": shape, "n": n, "ks": ks, "total": total, "old_us": to,
                        "new_us": tn, "same_bits": same, "runs": times})
            del part
    be.close()
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0 if res and all(r["same_bits"] for r in res) else 1


if __name__ == "__main__":
    sys.exit(main())
