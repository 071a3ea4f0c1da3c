"""Variants of the wgmma tile ``q6k_wg_f16`` (src 8) against today's on the same launch plan
(grid, K split, shared memory, split-K sum): each variant is today's kernels/cuda/q6k_wgmma.cu
with a text replacement (``--variant 'LABEL|OLD TEXT|NEW TEXT'``, every occurrence), compiled
for sm_90a as the loader builds that file; the kernels alternated ``--rounds`` times in one
process (device events, the weight rotated over copies as in bench/kernels.py), y compared bit
for bit with today's (a variant may change the bits: the line says so). Since session 22 a cell
may also be a K-slice tile's (src 4): q6k_matmul.cu is inlined into the variant's text, so its
kernels compile from it too (for sm_90a, where the product builds them for sm_90: a variant
with no replacement is the control for that); since session 23 the cluster-sum tile's (src 7)
as well, and since session 27 the f16 tile's with staged activations (src 2, q6k_mma_f16: the
table's N = 1..4 cells; not traced).

    python bench/wg_ab.py --variant 'w3|wg_wait<2>();|wg_wait<3>();' [--cells 4096x14336:64,..]
                          [--rounds 3] [--iters 30] [--auto] [--json f]

(Session 22's weight ring and session 26's cluster-sum wgmma tiles ran as variants of files of
their own, ``LABEL|OLD|NEW|FILE|EXTRA`` with shared memory of their own and clusters of the K
split; all three lost, and the files and that support left in session 28: the ring
bench/ab/q6k_wgmma_ring.cu is at commit e2e693c, the cluster forms q6k_wgmma_cl.cu / _cp.cu at
2e03cbb / e3ccc7c.) ``--auto`` times AUTO's own
launch (the table's kernel and plan, whatever its src) in the same alternation, so a variant
reads against the product's cell too, not only against today's src 8 on the same plan.
``--trace now,LABEL`` (session 22) runs one more call of today's kernel / those variants,
compiled with timestamps (``traced``: lane 0 of every warp writes the SM clock at its start,
after the CTA's activation staging and at each tile's end, and %globaltimer at its start and
end, into a buffer whose device address the source is compiled with), and prints where the
call's time goes: the spread of the warps' starts, the staging, the first tile, each warp's
busy time, the tail.

``--nopost LABELS`` (session 24) runs those variants without the split-K sum launch
(q6k_sum_parts): a variant that adds its partials inside the tile (session 24's
``Q6SERVE_KS_FUSE``, branch ``k-s24-fuse``), or today's kernel so (its y incomplete: DIFFER), whose
time against now is the sum's whole cost; ``--pdl LABELS`` launches their sum with PDL whatever
the tile (the product does so after src 4 only). Variants of one text share one build per kernel.
Session 25's ``Q6SERVE_KS_SPREAD`` (the sum spread over each row group's K-slice CTAs; lost, on
branch ``k-s25``, commit 7b5b692) was run so too, with ``--recheck C``: C more calls per kernel,
each on a fresh x, bits against now's (a variant that keeps state between launches shows there).

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
from q6serve.kernels.cuda.launch import PDL_SRCS, kernel_name
from q6serve.kernels.cuda_backend import weight_data

CELLS = "4096x14336:64,3584x18944:64,152064x3584:64,128256x4096:64"


_built: dict[tuple[str, str], object] = {}


def compile_text(be, file: str, text: str, name: str):
    """A q6k_wgmma.cu text compiled for sm_90a as the loader builds that file (its include of
    q6k_matmul.cu inlined from today's tree); once per (text, name) in a process (variants of
    one text, e.g. a control and the same kernel without the sum launch, share the build)."""
    fn = _built.get((text, name))
    if fn is None:
        src = text.replace('#include "q6k_matmul.cu"', loader.source_text("q6k_matmul.cu"))
        with be.ctx.dev:
            mod, lowered = loader._compile_arch(file, src, loader.BASE_OPTIONS, (name,),
                                                "sm_90a")
        fn = _built[(text, name)] = loader.ArchKernel(mod.get_function(lowered[name]))
    return fn


TRACE_WORDS = 8  # per warp: see traced()
TRACE_WARPS = 1 << 16
# The trace points (anchors present in today's q6k_wgmma.cu).
TRACE_HEAD = r"""
#define WGT_REC ((unsigned long long*)(WG_TRACE_PTR) + 8ull * min(TRACE_WARPS - 1u, \
    ((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * (blockDim.x >> 5) + \
    (threadIdx.x >> 5)))
__device__ __forceinline__ unsigned long long wgt_gtime() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned wgt_smid() {
    unsigned s;
    asm volatile("mov.u32 %0, %smid;" : "=r"(s));
    return s;
}
"""
TRACE_POINTS = (
    ("    const int kb0 = ps.kb0, nblk = ps.nblk;\n",
     "    const long long wgt_c0 = clock64();\n    int wgt_tiles = 0;\n"
     "    if ((threadIdx.x & 31) == 0) { WGT_REC[0] = wgt_gtime(); WGT_REC[1] = nblk; "
     "WGT_REC[6] = wgt_smid(); }\n"),
    ("    fence_async_shared();\n    __syncthreads();\n",
     "    if ((threadIdx.x & 31) == 0) { WGT_REC[2] = WGT_REC[4] = clock64() - wgt_c0; "
     "WGT_REC[7] = wgt_gtime(); }\n"),
    ("        ks_emit<NT, 1>(o, w.rows, wrow, tok0, acc, lane);\n",
     "        ++wgt_tiles;\n        if ((threadIdx.x & 31) == 0) { const unsigned long long c = "
     "clock64() - wgt_c0; if (wgt_tiles == 1) WGT_REC[3] = c; WGT_REC[4] = c; "
     "WGT_REC[5] = wgt_tiles; WGT_REC[7] = wgt_gtime(); }\n"),
)


# The same points in the K-slice tiles' body (ks_body of q6k_matmul.cu: src 4 / 7; session 23):
# its start, the activation staging's barrier, and each warp tile's end (after its partial sums
# are written or put in the cluster's shared memory).
TRACE_POINTS_KS = (
    ("    const int wtiles = (w.rows + 16 * MT - 1) / (16 * MT);\n", TRACE_POINTS[0][1]),
    ("    const int tstride = nblk * 32 + 4;\n", TRACE_POINTS[1][1]),
    ("            ks_cluster_put<NT, MT>(acc, warp, lane, w.bpr);\n", TRACE_POINTS[2][1]),
)


def traced(text: str, ptr: int, ks: bool = False) -> str:
    """``text`` (a q6k_wgmma.cu) with the trace points after their anchors, writing to ``ptr``
    (TRACE_WARPS records of TRACE_WORDS u64: globaltimer at the start, the K slice's blocks,
    clocks since the start at the staging's end, the first and the last tile's end, tiles, SM,
    globaltimer at the end). ``ks``: the K-slice tiles' points instead (q6k_matmul.cu inlined
    here from today's tree, its points put in)."""
    inc = '#include "q6k_matmul.cu"\n'
    head = f"#define WG_TRACE_PTR {ptr}ull\n#define TRACE_WARPS {TRACE_WARPS}u\n" + TRACE_HEAD
    if ks:
        mm = loader.source_text("q6k_matmul.cu") + "\n"
        for anchor, add in TRACE_POINTS_KS:
            if mm.count(anchor) != 1:
                raise SystemExit(f"trace anchor {anchor!r} not once in q6k_matmul.cu")
            mm = mm.replace(anchor, anchor + add)
        if inc not in text:
            raise SystemExit("no q6k_matmul.cu include in the kernel text")
        # the helpers before the K-slice tiles (they follow q6k_matmul.cu's includes)
        at = mm.index("extern __shared__ uint4 smem_x[];")
        return text.replace(inc, mm[:at] + head + mm[at:])
    for anchor, add in TRACE_POINTS:
        if anchor not in text:
            raise SystemExit(f"trace anchor {anchor!r} not in the kernel text")
        text = text.replace(anchor, anchor + add)
    return text.replace(inc, inc + head)


def trace_summary(rec: np.ndarray) -> str:
    """One line from the records of the warps that ran (start stamp set). The SM clock is
    read off the records themselves (clocks over globaltimer ns from each warp's start to its
    end, the median over warps that ran > 1 us), as the device's clock attribute is the boost
    clock at best."""
    r = rec[rec[:, 0] != 0].astype(np.float64)
    if not len(r):
        return "no records"
    ns = r[:, 7] - r[:, 0]
    ghz = float(np.median(r[ns > 1000, 4] / ns[ns > 1000])) if (ns > 1000).any() else 1.98
    us = 1e-3 / ghz  # us per clock
    t0 = r[:, 0].min()
    busy = r[:, 4] * us
    worked = r[:, 5] > 0
    per_blk = (r[worked, 4] - r[worked, 2]) * us / np.maximum(1, r[worked, 5] * r[worked, 1])
    return (f"warps {len(r)} on {len(np.unique(r[:, 6]))} SMs | start spread "
            f"{(r[:, 0].max() - t0) * 1e-3:.2f} us | staging med {np.median(r[:, 2]) * us:.2f} "
            f"max {r[:, 2].max() * us:.2f} | 1st tile med "
            f"{np.median((r[worked, 3] - r[worked, 2]) * us) if worked.any() else 0:.2f} | busy "
            f"med {np.median(busy):.2f} max {busy.max():.2f} | span "
            f"{(r[:, 7].max() - t0) * 1e-3:.2f} us | per block med "
            f"{np.median(per_blk) if worked.any() else 0:.3f} us | tiles "
            f"{int(r[:, 5].min())}-{int(r[:, 5].max())} blocks {int(r[:, 1].min())}-"
            f"{int(r[:, 1].max())} | clock {ghz:.2f} GHz")


def variant_text(spec: str) -> tuple[str, str]:
    """``LABEL|OLD|NEW`` -> (label, today's q6k_wgmma.cu with OLD replaced by NEW (OLD empty:
    as it is))."""
    label, old, new = spec.split("|")
    path = loader.CUDA_DIR / "q6k_wgmma.cu"
    text = path.read_text()
    if old and old not in text:
        raise SystemExit(f"variant {label}: {old!r} is not in {path}")
    return label, text.replace(old, new) if old else text


def plan_for(label: str, lp, nopost: str, pdl: str):
    """``lp`` as the variant ``label`` runs it: without the split-K sum launch when it is in
    ``nopost`` (session 24: a fused sum adds its partials in the tile; the plain tile so
    timed is the sum's whole cost), with the sum launched by PDL when in ``pdl`` (the plan's
    src only picks that: PDL_SRCS)."""
    if label in nopost.split(","):
        lp = replace(lp, post=None)
    if label in pdl.split(","):
        lp = replace(lp, src=PDL_SRCS[0])
    return lp


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default=CELLS, help="shape:N of AUTO cells on src 8, or "
                    "shape:N:LABEL with a src 8 launch shape of its own (nt8.m1.w12.s8.pf.k2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--variant", action="append", default=[],
                    help="LABEL|OLD TEXT|NEW TEXT: today's q6k_wgmma.cu with a replacement")
    ap.add_argument("--trace", default="", metavar="LABELS",
                    help="one traced call per cell of these kernels (now and variant labels)")
    ap.add_argument("--auto", action="store_true",
                    help="also time AUTO's own launch (the table's cell) in the alternation")
    ap.add_argument("--recheck", type=int, default=0, metavar="C",
                    help="after the timed calls, C more calls of each kernel, each on a fresh x "
                    "(and the next weight copy), bits against now's on it (a variant that keeps "
                    "state between launches, e.g. counters, shows here: the timed calls repeat "
                    "one x)")
    ap.add_argument("--nopost", default="", metavar="LABELS",
                    help="these kernels (variant labels) run without the split-K sum launch "
                    "(a variant that adds its partials itself, or the sum's cost read off)")
    ap.add_argument("--pdl", default="", metavar="LABELS",
                    help="these kernels' split-K sum launched with PDL whatever their src")
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
    trbuf = cp.zeros(TRACE_WARPS * TRACE_WORDS, cp.uint64) if a.trace else None
    if a.trace and a.trace.split(",")[0] not in ("now", *(lab for lab, _, _ in variants)):
        raise SystemExit(f"--trace {a.trace}: not now or a variant label")
    texts = {"now": (loader.CUDA_DIR / "q6k_wgmma.cu").read_text()}
    texts.update(dict(variants))
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
        if ch.path != "mma_f16" or ch.cfg is None or ch.cfg.src not in (2, 4, 7, 8):
            print(f"{shape:>12} {n:>3} not a src 2 / 4 / 7 / 8 cell: {ch.path} {ch.cfg}")
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
                vp = replace(lp, fn=fo)
                plans[lab] = plan_for(lab, vp, a.nopost, a.pdl)
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

            traces = {}
            if trbuf is not None:
                for lab in [lb for lb in plans if lb in a.trace.split(",")
                            and ch.cfg.src != 2]:  # (no trace points in src 2's tile)
                    fo = compile_text(be, f"q6k_wgmma_{lab}_trace.cu",
                                      traced(texts[lab], int(trbuf.data.ptr),
                                             ks=ch.cfg.src != 8), name)
                    if plans[lab].smem > int(fo.max_dynamic_shared_size_bytes):
                        fo.max_dynamic_shared_size_bytes = plans[lab].smem
                    traces[lab] = replace(plans[lab], fn=fo)
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
            for j in range(a.recheck):  # a fresh x per call: stale state would show
                xr = cp.asarray(rng.standard_normal((n, k)).astype(np.float16))
                yr = {lab: cp.full((n, rows), np.nan, cp.float32) for lab in plans}
                for lab in plans:
                    for st in be.launcher.steps(plans[lab], ws[j % len(ws)],
                                                weight_data(ws[j % len(ws)]),
                                                int(xr.data.ptr), int(yr[lab].data.ptr), n):
                        st()
                be.stream.synchronize()
                for lab in same:
                    same[lab] = same[lab] and bool(
                        (yr[lab].view(cp.uint32) == yr["now"].view(cp.uint32)).all())
            trace_lines = {}
            for lab, tp in traces.items():  # after the timed calls: warm clocks, a cold copy
                trbuf.fill(0)
                yt = cp.empty_like(ys[lab])
                for s in be.launcher.steps(tp, ws[len(ws) // 2], weight_data(ws[len(ws) // 2]),
                                           int(x.data.ptr), int(yt.data.ptr), n):
                    s()
                be.stream.synchronize()
                trace_lines[lab] = trace_summary(trbuf.get().reshape(-1, TRACE_WORDS))
        tn = min(times["now"])
        ta = min(times["auto"]) if "auto" in times else None
        for lab, line in trace_lines.items():
            print(f"# trace {shape} N={n} {ch.cfg.label()} {lab}: {line}", flush=True)
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
            "runs": times, "trace": trace_lines})
        _bk.free_copies(be, ws)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"results": out}, fh, indent=1)
    return 0 if out else 1


if __name__ == "__main__":
    sys.exit(main())
