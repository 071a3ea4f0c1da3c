"""Variants of the wgmma tile ``q6k_wg_f16`` (src 8) against today's on the same launch plan
(grid, K split, shared memory, split-K sum): each variant is today's kernels/cuda/q6k_wgmma.cu
with a text replacement (``--variant 'LABEL|OLD TEXT|NEW TEXT'``, every occurrence), compiled
for sm_90a as the loader builds that file; the kernels alternated ``--rounds`` times in one
process (device events, the weight rotated over copies as in bench/kernels.py), y compared bit
for bit with today's (a variant may change the bits: the line says so).

    python bench/wg_ab.py --variant 'w3|wg_wait<2>();|wg_wait<3>();' [--cells 4096x14336:64,..]
                          [--rounds 3] [--iters 30] [--auto] [--json f]

A variant may name another base file and shared memory of its own (session 22's weight ring,
bench/ab/q6k_wgmma_ring.cu): ``LABEL|OLD|NEW|FILE|EXTRA`` compiles FILE (OLD -> NEW; OLD empty:
no replacement) and launches it with the plan's shared memory plus EXTRA bytes per warp (a
cell whose plan leaves too little is skipped for that variant). ``--auto`` times AUTO's own
launch (the table's kernel and plan, whatever its src) in the same alternation, so a variant
reads against the product's cell too, not only against today's src 8 on the same plan.

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


SMEM_MAX = 232448  # dynamic shared memory a CTA may opt into on sm_90 (227 KB)


def variant_text(spec: str) -> tuple[str, str, int]:
    """``LABEL|OLD|NEW[|FILE[|EXTRA]]`` -> (label, FILE's text (default today's q6k_wgmma.cu)
    with OLD replaced by NEW (OLD empty: as it is), EXTRA shared-memory bytes per warp)."""
    label, old, new, *rest = spec.split("|")
    path = Path(rest[0]) if rest and rest[0] else loader.CUDA_DIR / "q6k_wgmma.cu"
    extra = int(rest[1]) if len(rest) > 1 else 0
    text = path.read_text()
    if old and old not in text:
        raise SystemExit(f"variant {label}: {old!r} is not in {path}")
    return label, text.replace(old, new) if old else text, extra


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default=CELLS, help="shape:N of AUTO cells on src 8, or "
                    "shape:N:LABEL with a src 8 launch shape of its own (nt8.m1.w12.s8.pf.k2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--variant", action="append", default=[],
                    help="LABEL|OLD TEXT|NEW TEXT[|FILE[|EXTRA SMEM PER WARP]]: today's file "
                    "(or FILE) with a replacement")
    ap.add_argument("--auto", action="store_true",
                    help="also time AUTO's own launch (the table's cell) in the alternation")
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
          f"{'now/it':>7} bits against now  (auto: AUTO's us, auto/it)")
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
            for lab, text, extra in variants:
                smem = lp.smem + extra * ch.cfg.warps
                if smem > SMEM_MAX:
                    print(f"{shape:>12} {n:>3} {ch.cfg.label():>22} {lab:>10} skipped: plan "
                          f"{lp.smem} + ring {extra * ch.cfg.warps} B > {SMEM_MAX}", flush=True)
                    continue
                fo = compile_text(be, f"q6k_wgmma_{lab}.cu", text, name)
                if smem > int(fo.max_dynamic_shared_size_bytes):
                    fo.max_dynamic_shared_size_bytes = smem
                plans[lab] = replace(lp, fn=fo, smem=smem)
            if a.auto:  # the table's own cell (its kernel's module, as the backend loads it)
                au = be.choose(n, Precision.AUTO, flags, rows, k)
                if au.path == "mma_f16" and au.cfg is not None:
                    plans["auto"] = be.launcher.plan(rows, k, Layout.SOA, "InF16", "mma_f16",
                                                     au.cfg, n, be.storage.pairs)
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
                    for lab in plans if lab not in ("now", "auto")}
            ref = ys["auto" if "auto" in ys else "now"]
            rel = {lab: float(cp.abs(ys[lab] - ref).max() / cp.abs(ref).max()) for lab in plans}
            times: dict[str, list[float]] = {lab: [] for lab in plans}
            for _ in range(a.rounds):
                for lab in plans:
                    times[lab].append(_bk.time_calls(
                        cp, lambda i, lab=lab: call(i, lab), len(ws), iters=a.iters))
        tn = min(times["now"])
        ta = min(times["auto"]) if "auto" in times else None
        for lab in same:
            to = min(times[lab])
            au_s = f"  auto {ta:.1f} {ta / to:.3f}" if ta else ""
            print(f"{shape:>12} {n:>3} {ch.cfg.label():>22} {lab:>10} {to:8.1f} {tn:8.1f} "
                  f"{tn / to:7.3f} {'same' if same[lab] else 'DIFFER'} rel {rel[lab]:.1e}{au_s}",
                  flush=True)
        if not same and ta:
            print(f"{shape:>12} {n:>3} {ch.cfg.label():>22} {'(no var)':>10} {tn:8.1f} "
                  f"  auto {ta:.1f} {ta / tn:.3f}", flush=True)
        out.append({"shape": shape, "n": n, "cfg": ch.cfg.label(), "us": {
            lab: min(t) for lab, t in times.items()}, "same_bits": same, "rel": rel,
            "runs": times})
        _bk.free_copies(be, ws)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"results": out}, fh, indent=1)
    return 0 if out else 1


if __name__ == "__main__":
    sys.exit(main())
