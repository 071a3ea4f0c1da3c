"""The stream-K wgmma tile (bench/ab/q6k_wgmma_sk.cu, session 29; bench-only) against AUTO's
launch of the same cell, alternated in one process (device events, the weight rotated over
copies as in bench/kernels.py), torch f16 beside.

    python bench/sk_ab.py [--cells 18944x3584:64,...] [--variants sk0,sk1] [--rounds 3]
                          [--iters 30] [--ref-rows 2048] [--json f]

A variant is ``LABEL`` = ``sk`` + XB (0: each unit's activation block staged from x by 4-byte
copies; 1: from a prepacked copy in the B layout, ``q6k_sk_xb`` launched first, 16-byte
copies; both with a barrier of the CTA a unit; 2: the prepacked block by one bulk copy a unit
on an mbarrier ring, no barrier of the CTA a unit; 3: stream-K v2 (session 30,
``q6k_wgsk3_f16``): sk2's ring and partition with nothing divergent between a segment's units,
so two wgmma groups stay in flight across units, and a parallel fix-up), optionally
``.wN`` (warpgroups a CTA, 3 by default), ``.sS`` (ring stages, 4; sk2 and sk3 6), ``.dU``
(d loads a lane and row in registers, 2: 8 blocks; more are read where dmax is taken) and the
probes ``.nofix`` / ``.nomma`` / ``.nodeq`` (timing only, y wrong: no fix-up wait, no wgmma,
no decode; sk3: nofix only). Its grid is one
CTA per SM (``--grid`` to change), each a contiguous run of the (row group, K block) units,
the row groups split between CTAs fixed up by their owner in a fixed order (docs/KERNELS.md
"Session 29").

Each line: us (min over the rounds of each round's median), AUTO's us, AUTO / it (> 1: the
variant faster), y against AUTO's (rel: max |diff| / max |AUTO|), against the float64 NumPy
reference on ``--ref-rows`` rows spread over the weight (rel_fro; the F16 contract is 2e-3),
and ``det``: the same bits on a second call with another epoch and on ``--recheck`` fresh x
(against the variant's own first call on that x: a race in the fix-up would show as a
difference), ``xb=``: the same bits as the first variant of the other staging (same values,
same order)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as _bk
from q6serve.kernels import reference
from q6serve.kernels.api import KernelFlags, Layout, Precision
from q6serve.kernels.cuda import loader
from q6serve.kernels.cuda_backend import weight_data

CELLS = "18944x3584:64,14336x4096:64,18944x3584:48,14336x4096:48,18944x3584:32,14336x4096:32"
SK_FILE = Path(__file__).resolve().parent / "ab" / "q6k_wgmma_sk.cu"
INC = '#include "q6k_wgmma.cu"'


def parse_variant(label: str) -> dict:
    """``sk0`` / ``sk1.w2.s5.d4`` -> its template and #define values."""
    head, *opts = label.split(".")
    if not head.startswith("sk") or head[2:] not in ("0", "1", "2", "3"):
        raise SystemExit(f"variant {label!r}: sk0, sk1, sk2 or sk3, then .wN .sS .dU")
    v = {"label": label, "xb": int(head[2:]), "nwg": 3,
         "stages": 6 if head in ("sk2", "sk3") else 4, "du": 2, "probes": []}
    for o in opts:
        if o in ("nofix", "nomma", "nodeq"):  # Q6SERVE_SK_<PROBE> 1: timing only, wrong y
            v["probes"].append(o.upper())
            continue
        key = {"w": "nwg", "s": "stages", "d": "du"}.get(o[:1])
        if key is None or not o[1:].isdigit():
            raise SystemExit(f"variant {label!r}: bad option {o!r}")
        v[key] = int(o[1:])
    if v["nwg"] not in (1, 2, 3) or v["stages"] < 4 + (v["xb"] >= 2) or not 1 <= v["du"] <= 4:
        raise SystemExit(f"variant {label!r}: 1-3 warpgroups, >= 4 stages (sk2, sk3: 5), "
                         "d loads 1/2/4")
    if v["xb"] == 3 and {"NOMMA", "NODEQ"} & set(v["probes"]):
        raise SystemExit(f"variant {label!r}: sk3 has the nofix probe only")
    return v


def sk_text(v: dict) -> str:
    """The variant's source: its #defines, then the file with q6k_wgmma.cu inlined."""
    text = SK_FILE.read_text()
    if INC not in text:
        raise SystemExit(f"no {INC} in {SK_FILE}")
    head = f"#define Q6SERVE_SK_STAGES {v['stages']}\n#define Q6SERVE_SK_DU {v['du']}\n"
    head += "".join(f"#define Q6SERVE_SK_{p} 1\n" for p in v.get("probes", ()))
    return head + text.replace(INC, loader.source_text("q6k_wgmma.cu"))


_built: dict = {}


def sk_functions(be, v: dict, nt: int, lay: str):
    """(tile, prepass) functions of variant ``v`` at ``nt`` n-tiles, one build per source."""
    text = sk_text(v)
    tile = (f"q6k_wgsk3_f16<{nt}, {lay}, {v['nwg']}>" if v["xb"] == 3
            else f"q6k_wgsk_f16<{nt}, {lay}, {v['nwg']}, {v['xb']}>")
    prep = f"q6k_sk_xb<{nt}>"
    key = (text, tile)
    if key not in _built:
        with be.ctx.dev:
            mod, lowered = loader._compile_arch("q6k_wgmma_sk.cu", text, loader.BASE_OPTIONS,
                                                (tile, prep), "sm_90a")
        _built[key] = (loader.ArchKernel(mod.get_function(lowered[tile])),
                       loader.ArchKernel(mod.get_function(lowered[prep])))
    return _built[key]


class SkCall:
    """One variant's launches on one cell: the workspace (partials, flags, the prepacked x),
    a new epoch every call (read only where the kernel is built with Q6SERVE_SK_RESET 0; by
    default each slot's owner sets its flag back to 0 once read)."""

    epoch = 0

    def __init__(self, cp, be, v: dict, rows: int, k: int, n: int, grid: int) -> None:
        self.cp, self.v, self.rows, self.k, self.n = cp, v, rows, k, n
        self.nt = 8 if n > 32 else 4 if n > 16 else 2 if n > 8 else 1  # m64n64/32/16/8k16
        self.nz = -(-n // (8 * self.nt))
        lay = "2" if be.storage.pairs else "true"
        self.fn, self.prep = sk_functions(be, v, self.nt, lay)
        self.bpr = k // 256
        gtiles = -(-rows // 64)
        units = -(-gtiles // v["nwg"]) * self.bpr
        self.grid = min(grid, units)
        self.threads = 128 * v["nwg"]
        self.smem = v["stages"] * 16 * 64 * self.nt * 4 + (16 * v["stages"] if v["xb"] >= 2 else 0)
        if self.smem > int(self.fn.max_dynamic_shared_size_bytes):
            self.fn.max_dynamic_shared_size_bytes = self.smem
        self.part = cp.zeros(self.nz * self.grid * self.threads * 4 * self.nt, cp.float32)
        self.flags = cp.zeros(self.nz * self.grid + 1, cp.uint32)  # + waits given up
        self.xb = cp.zeros(self.nz * self.bpr * 16 * 64 * self.nt if v["xb"] else 4, cp.uint32)

    def __call__(self, w, xd: int, yd: int) -> None:
        u64, i32 = np.uint64, np.int32
        cw = weight_data(w)
        SkCall.epoch += 1
        if self.v["xb"]:
            total = self.nz * self.bpr * self.nt * 256
            self.prep((min(65535, -(-total // 256)),), (256,),
                      (u64(xd), i32(self.n), i32(self.k), i32(self.nz), u64(self.xb.data.ptr)))
        self.fn((self.grid, 1, self.nz), (self.threads,),
                (u64(cw.table.data.ptr), i32(self.rows), i32(self.bpr), i32(cw.rps), u64(xd),
                 i32(self.k), u64(self.xb.data.ptr), u64(yd), u64(self.part.data.ptr),
                 u64(self.flags.data.ptr), i32(self.n), np.uint32(SkCall.epoch)),
                shared_mem=self.smem)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default=CELLS, help="shape:N,...")
    ap.add_argument("--variants", default="sk0,sk1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--grid", type=int, default=0, help="CTAs (0: the SM count)")
    ap.add_argument("--ref-rows", type=int, default=2048)
    ap.add_argument("--recheck", type=int, default=1)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    variants = [parse_variant(s) for s in a.variants.split(",") if s]
    import cupy as cp

    from q6serve.kernels.cuda_backend import CudaBackend

    be = CudaBackend(0)
    if be.cc != "90":
        print("# the wgmma tile needs compute capability 9.0")
        return 2
    grid = a.grid or be.sm_count
    rng = np.random.default_rng(29)
    flags = KernelFlags(soa=True)
    out = []
    print(f"# {be.device_name()}, grid {grid}, pair streams {be.storage.pairs}")
    print(f"{'shape':>12} {'N':>3} {'variant':>12} {'us':>7} {'auto':>7} {'auto/it':>7} "
          f"{'torch':>6} rel(auto) relfro(ref) det xb")
    for cell in a.cells.split(","):
        shape, n = cell.split(":")
        rows, k = map(int, shape.split("x"))
        n = int(n)
        ch = be.choose(n, Precision.AUTO, flags, rows, k)
        if ch.cfg is None:  # cuBLAS (small weights): the exact tile stands in as "auto"
            ch = be.choose(n, Precision.EXACT, flags, rows, k)
        blocks = _bk.random_blocks(rng, rows, k)
        ws = _bk.load_copies(be, rng, rows, k, Layout.SOA, blocks)
        bpr = k // 256
        sel = np.unique(np.linspace(0, rows - 1, min(rows, a.ref_rows)).astype(np.int64))
        sub = blocks.reshape(rows, bpr, -1)[sel].reshape(len(sel) * bpr, -1)
        with be.ctx.dev, be.stream:
            calls = {}
            lp = be.launcher.plan(rows, k, Layout.SOA, "InF16", ch.path, ch.cfg, n,
                                  be.storage.pairs)

            def auto(i: int, xd: int, yd: int, ws=ws, lp=lp, n=n) -> None:
                for s in be.launcher.steps(lp, ws[i], weight_data(ws[i]), xd, yd, n):
                    s()

            calls["auto"] = auto
            sks = {v["label"]: SkCall(cp, be, v, rows, k, n, grid) for v in variants}
            for lab, sk in sks.items():
                calls[lab] = lambda i, xd, yd, sk=sk, ws=ws: sk(ws[i], xd, yd)
            x16 = rng.standard_normal((n, k)).astype(np.float16)
            x = cp.asarray(x16)
            ys = {lab: cp.full((n, rows), np.nan, cp.float32) for lab in calls}
            for lab, f in calls.items():
                f(0, int(x.data.ptr), int(ys[lab].data.ptr))
            be.stream.synchronize()
            yref = reference.matmul_float64(x16, sub, len(sel))
            ya = ys["auto"]
            rel = {lab: float(cp.abs(ys[lab] - ya).max() / cp.abs(ya).max()) for lab in calls}
            relf = {lab: float(np.linalg.norm(ys[lab].get()[:, sel] - yref) /
                               np.linalg.norm(yref)) for lab in calls}
            det = {}
            for lab in sks:  # a second call (another epoch), then fresh x
                y2 = cp.full((n, rows), np.nan, cp.float32)
                calls[lab](1 % len(ws), int(x.data.ptr), int(y2.data.ptr))
                be.stream.synchronize()
                same = bool((y2.view(cp.uint32) == ys[lab].view(cp.uint32)).all())
                for j in range(a.recheck):
                    xr = cp.asarray(rng.standard_normal((n, k)).astype(np.float16))
                    ya_, yb_ = (cp.full((n, rows), np.nan, cp.float32) for _ in range(2))
                    calls[lab](j % len(ws), int(xr.data.ptr), int(ya_.data.ptr))
                    calls[lab]((j + 1) % len(ws), int(xr.data.ptr), int(yb_.data.ptr))
                    be.stream.synchronize()
                    same = same and bool((ya_.view(cp.uint32) == yb_.view(cp.uint32)).all())
                det[lab] = same and int(sks[lab].flags[-1]) == 0  # no wait given up
            xbsame = {}
            for lab, sk in sks.items():
                other = [o for o, s2 in sks.items() if s2.v["xb"] != sk.v["xb"]
                         and s2.v["nwg"] == sk.v["nwg"]]
                if other:
                    xbsame[lab] = bool((ys[lab].view(cp.uint32) ==
                                        ys[other[0]].view(cp.uint32)).all())
            times = {lab: [] for lab in calls}
            for _ in range(a.rounds):
                for lab, f in calls.items():
                    times[lab].append(_bk.time_calls(
                        cp, lambda i, f=f, y=ys[lab], x=x: f(i, int(x.data.ptr), int(y.data.ptr)),
                        len(ws), iters=a.iters))
        tt = None if a.no_torch else _bk.torch_linear_us(rows, k, n, len(ws))
        ta = min(times["auto"])
        ts = f"{tt:6.1f}" if tt else "     -"
        print(f"{shape:>12} {n:>3} {'auto ' + ch.cfg.label() if ch.cfg else 'auto':>12} "
              f"{ta:7.1f} {ta:7.1f} {1.0:7.3f} {ts} - {relf['auto']:.1e}", flush=True)
        for lab in sks:
            to = min(times[lab])
            print(f"{shape:>12} {n:>3} {lab:>12} {to:7.1f} {ta:7.1f} {ta / to:7.3f} {ts} "
                  f"{rel[lab]:.1e} {relf[lab]:.1e} {'det' if det[lab] else 'NONDET'} "
                  f"{'' if lab not in xbsame else 'xb=' + ('same' if xbsame[lab] else 'DIFFER')}",
                  flush=True)
        out.append({"shape": shape, "n": n, "auto": ch.cfg.label() if ch.cfg else ch.path,
                    "us": {lab: min(t) for lab, t in times.items()}, "runs": times,
                    "torch": tt, "rel_auto": rel, "relfro_ref": relf, "det": det,
                    "xb_same": xbsame, "grid": grid})
        _bk.free_copies(be, ws)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"results": out}, fh, indent=1)
    bad = [r for r in out for lab in r["det"] if not r["det"][lab] or r["relfro_ref"][lab] > 2e-3]
    return 1 if bad or not out else 0


if __name__ == "__main__":
    sys.exit(main())
