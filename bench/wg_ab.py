"""Variants of the wgmma tile ``q6k_wg_f16`` (src 8) against today's on the same launch plan
(grid, K split, shared memory, split-K sum): each variant is today's kernels/cuda/q6k_wgmma.cu
with a text replacement (``--variant 'LABEL|OLD TEXT|NEW TEXT'``, every occurrence), compiled
for sm_90a as the loader builds that file; the kernels alternated ``--rounds`` times in one
process (device events, the weight rotated over copies as in bench/kernels.py), y compared bit
for bit with today's (a variant may change the bits: the line says so).

    python bench/wg_ab.py --variant 'w3|wg_wait<2>();|wg_wait<3>();' [--cells 4096x14336:64,..]
                          [--rounds 3] [--iters 30] [--json f]

Session 21 (H200, bundle A, tree 7a7eded) ran it with session 20's file as a further kernel
(the same bits and 0.98-1.02x in the seven src 8 cells after src 6 / 9 left the file; that copy
is in git history, bench/ab/q6k_wgmma_s20.cu at 7a7eded) and with w3 (three wgmma groups in
flight: 1.000-1.015x, the same bits).
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

CELLS = "4096x14336:64,3584x18944:64,152064x3584:64,128256x4096:64"


_built: dict[tuple[str, str], object] = {}


def compile_text(be, file: str, text: str, name: str):
    """A q6k_wgmma.cu text compiled for sm_90a as the loader builds that file (its include of
    q6k_matmul.cu inlined from today's tree); once per (file, name) in a process."""
    fn = _built.get((file, name))
    if fn is None:
        src = text.replace('#include "q6k_matmul.cu"', loader.source_text("q6k_matmul.cu"))
        with be.ctx.dev:
            mod, lowered = loader._compile_arch(file, src, loader.BASE_OPTIONS, (name,),
                                                "sm_90a")
        fn = _built[(file, name)] = loader.ArchKernel(mod.get_function(lowered[name]))
    return fn


def variant_text(spec: str) -> tuple[str, str]:
    """``LABEL|OLD|NEW`` -> (label, today's q6k_wgmma.cu with OLD replaced by NEW)."""
    label, old, new = spec.split("|")
    text = (loader.CUDA_DIR / "q6k_wgmma.cu").read_text()
    if old not in text:
        raise SystemExit(f"variant {label}: {old!r} is not in q6k_wgmma.cu")
    return label, text.replace(old, new)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default=CELLS, help="shape:N of AUTO cells on src 8, or "
                    "shape:N:LABEL with a src 8 launch shape of its own (nt8.m1.w12.s8.pf.k2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--variant", action="append", default=[],
                    help="LABEL|OLD TEXT|NEW TEXT: today's file with a replacement")
    a = ap.parse_args()
    variants = [variant_text(v) for v in a.variant]
    if not variants:
        raise SystemExit("no --variant given")
    import cupy as cp

    from q6serve.kernels.cuda_backend import CudaBackend

    be = CudaBackend(0)
    if be.cc != "90":
        print("# the wgmma tile needs compute capability 9.0")
        return 2
    rng = np.random.default_rng(5)
    flags = KernelFlags(soa=True)
    out = []
    print(f"{'shape':>12} {'N':>3} {'cfg':>22} {'kernel':>10} {'us':>8} {'now us':>8} "
          f"{'now/it':>7} bits against now")
    for cell in a.cells.split(","):
        shape, n, *own = cell.split(":")
        rows, k = map(int, shape.split("x"))
        n = int(n)
        ch = be.choose(n, Precision.AUTO, flags, rows, k)
        if own:
            ch = replace(ch, path="mma_f16", cfg=_bk.cfg_from_label(own[0]))
        if ch.path != "mma_f16" or ch.cfg is None or ch.cfg.src != 8:
            print(f"{shape:>12} {n:>3} not a src 8 cell: {ch.path} {ch.cfg}")
            continue
        ws = _bk.load_copies(be, rng, rows, k, Layout.SOA)
        with be.ctx.dev, be.stream:
            lp = be.launcher.plan(rows, k, Layout.SOA, "InF16", "mma_f16", ch.cfg, n,
                                  be.storage.pairs)
            name = kernel_name("mma_f16", ch.cfg, 2 if be.storage.pairs else True, "InF16")
            plans = {"now": lp}
            for lab, text in variants:
                fo = compile_text(be, f"q6k_wgmma_{lab}.cu", text, name)
                if lp.smem > int(fo.max_dynamic_shared_size_bytes):
                    fo.max_dynamic_shared_size_bytes = lp.smem
                plans[lab] = replace(lp, fn=fo)
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
            same = {lab: bool((ys[lab].view(cp.uint32) == ys["now"].view(cp.uint32)).all())
                    for lab in plans if lab != "now"}
            times: dict[str, list[float]] = {lab: [] for lab in plans}
            for _ in range(a.rounds):
                for lab in plans:
                    times[lab].append(_bk.time_calls(
                        cp, lambda i, lab=lab: call(i, lab), len(ws), iters=a.iters))
        tn = min(times["now"])
        for lab in same:
            to = min(times[lab])
            print(f"{shape:>12} {n:>3} {ch.cfg.label():>22} {lab:>10} {to:8.1f} {tn:8.1f} "
                  f"{tn / to:7.3f} {'same' if same[lab] else 'DIFFER'}", flush=True)
        out.append({"shape": shape, "n": n, "cfg": ch.cfg.label(), "us": {
            lab: min(t) for lab, t in times.items()}, "same_bits": same, "runs": times})
        _bk.free_copies(be, ws)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"results": out}, fh, indent=1)
    return 0 if out else 1


if __name__ == "__main__":
    sys.exit(main())
