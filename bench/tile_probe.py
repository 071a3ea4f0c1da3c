"""Probe of the K-slice tensor-core tiles (mma_f16 src 4/8: q6k_ks_f16 and on sm_90 the wgmma
tile q6k_wg_f16; issue 16; the ring tile it also probed, src 5, left the kernels after session 21).

Per weight shape of Qwen2.5-7B and Llama-3.1-8B and N = 9, 16, 32, 64 (f16 activations, what
the service receives): checks every K-slice launch shape of that N against the NumPy float64
reference on a spread of rows (first, last and random rows; F16 contract: relative Frobenius
error <= 2e-3), SoA/AoS bit-identity and call-to-call bit-identity (split-K partial sums), on
the real model shapes the GPU tests do not load; then times each shape with CUDA events (median
of 40 calls over rotated resident copies past the 60 MB L2, the split-K sum included) beside
the backend's AUTO path and torch's f16 linear. A compact table is printed last. ``--profile``:
one launch each of AUTO, the heuristic f16 tile and the K-slice tiles, for Nsight Compute. GPU
only; never part of the test suite. (The stream-K tile it first probed, measured slower and
never dispatched, is in the history: commit 2f899f3, bench/RESULTS.md.)

    python bench/tile_probe.py [--shapes 4096x14336,...] [--ns 9,16,32,64] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from q6serve.kernels import q6k, reference
from q6serve.kernels.api import KernelFlags, Layout, Precision, ResidentWeight
from q6serve.kernels.cuda import storage
from q6serve.kernels.cuda.dispatch import Cfg, default_cfg
from q6serve.kernels.cuda.launch import kernel_file, kernel_name
from q6serve.kernels.cuda.storage import CudaWeight
from q6serve.kernels.cuda_backend import CudaBackend

_spec = importlib.util.spec_from_file_location("_q6_bench_kernels",
                                               Path(__file__).with_name("kernels.py"))
_bk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bk)

SHAPES = ("3584x3584", "512x3584", "18944x3584", "3584x18944", "152064x3584",
          "4096x4096", "1024x4096", "14336x4096", "4096x14336", "128256x4096")
NS = (9, 16, 32, 64)
CHECK_ROWS = 768  # rows compared with the NumPy reference per shape (plus first and last)
TOL = 2e-3


def device_weight(be: CudaBackend, aos: object, rows: int, k: int,
                  layout: Layout, pairs: bool = False) -> ResidentWeight:
    """A resident weight built on the device from device AoS blocks (the backend's own
    repack into its slabs, as ``load`` does chunk by chunk); ``pairs``: SoA slabs in
    pair-stream order (Q6SERVE_Q6K_PAIRS)."""
    plan = storage.slab_plan(rows, k)
    slabs: list = []
    was, be.storage.pairs = be.storage.pairs, pairs
    try:
        be.storage._scatter(aos, 0, rows, plan, slabs, k, layout)
    finally:
        be.storage.pairs = was
    return ResidentWeight(rows, k, layout, be.weight_nbytes(rows, k, layout),
                          CudaWeight(slabs, be.storage._table(slabs), storage.slab_rows(rows, k),
                                     pairs=pairs and layout is Layout.SOA))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ns", default=",".join(map(str, NS)))
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-wg", action="store_true", help="leave out the wgmma tile (src 8)")
    ap.add_argument("--pdl-ab", action="store_true",
                    help="per shape and N: AUTO with the split-K sum launched plainly and with "
                         "PDL (Launcher.pdl), interleaved off/on/off/on, bits compared; no tiles")
    ap.add_argument("--rp", action="store_true",
                    help="the pair-stream layout (session 11): per shape and N, src 4's and the "
                         "wgmma tile's launch shapes on SoA weights and on pair-stream copies "
                         "(layout 2, the same plans), bits compared, beside AUTO")
    ap.add_argument("--rp-profile", action="store_true",
                    help="with --rp: no checks or timing, one launch of each (Nsight Compute)")
    ap.add_argument("--ks-sweep", default=None, metavar="COUNTS",
                    help="probe only src 4's launch shapes, each at these forced K-slice "
                         "counts (e.g. 2,4,8; 0 = the grid model's) beside AUTO")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="no checks or timing: per shape and N, one call of AUTO, of the f16 "
                         "tile's heuristic shape and of the K-slice tiles (for Nsight Compute)")
    ap.add_argument("--profile-cfgs", default=None, metavar="N:CFG;..",
                    help="with --profile: AUTO, then only these mma_f16 launch shapes at their N "
                         "(bench/kernels.py --cfg-ab's syntax)")
    a = ap.parse_args(argv)
    import cupy as cp

    be = CudaBackend(0)
    global WG, KS_SWEEP
    WG = be.ctx.cc == "90" and not a.no_wg
    KS_SWEEP = tuple(int(v) for v in a.ks_sweep.split(",")) if a.ks_sweep else ()
    ns = [int(v) for v in a.ns.split(",")]
    cfgs = [c for n in ns for c in ks_cfgs(n)]
    if a.rp:
        cfgs = [c for sh in a.shapes.split(",") for n in ns
                for c in rp_list(be, n, *map(int, sh.split("x")))]
    if a.pdl_ab:  # AUTO's launch shapes only (SoA twins compiled too: harmless)
        cfgs = [ch.cfg for sh in a.shapes.split(",") for n in ns
                for ch in [be.choose(n, Precision.AUTO, KernelFlags(),
                                     *map(int, sh.split("x")))]
                if ch.path == "mma_f16" and ch.cfg is not None]
    lays: tuple = (True, False)
    if a.profile_cfgs is not None:  # AUTO and these shapes, on pair-stream weights as resident
        cfgs = [c for n in ns for nn, c in _bk.parse_cands(a.profile_cfgs) if nn == n] + [
            ch.cfg for sh in a.shapes.split(",") for n in ns
            for ch in [be.choose(n, Precision.AUTO, KernelFlags(), *map(int, sh.split("x")))]
            if ch.path == "mma_f16" and ch.cfg is not None]
        lays = (2,) if be.storage.pairs else (True,)
    t0 = time.time()
    with be.ctx.dev:
        for file in dict.fromkeys(kernel_file("mma_f16", c) for c in cfgs):
            be.ctx.prefetch(file, {kernel_name("mma_f16", c, soa, "InF16") for c in cfgs
                                   for soa in lays
                                   if kernel_file("mma_f16", c) == file}, threads=16)
    print(f"# device: {be.device_name()}  date: {time.strftime('%Y-%m-%d %H:%M')}  "
          f"compile {time.time() - t0:.1f} s", flush=True)
    if a.rp:  # the probe kernels, and AUTO's kernels (not compiled one by one in the loop)
        autos = [ch for sh in a.shapes.split(",") for n in ns
                 for ch in [be.choose(n, Precision.AUTO, KernelFlags(), *map(int, sh.split("x")))]
                 if ch.cfg is not None]
        with be.ctx.dev:
            for file in dict.fromkeys(kernel_file("mma_f16", c) for c in cfgs):
                be.ctx.prefetch(file, {kernel_name("mma_f16", c, 2, "InF16") for c in cfgs
                                       if kernel_file("mma_f16", c) == file}, threads=16)
            for file in dict.fromkeys(kernel_file(ch.path, ch.cfg) for ch in autos):
                be.ctx.prefetch(file, {kernel_name(ch.path, ch.cfg, True, "InF16") for ch in autos
                                       if kernel_file(ch.path, ch.cfg) == file}, threads=16)
        for c in dict.fromkeys(cfgs):
            f = be.ctx.fn(kernel_file("mma_f16", c), kernel_name("mma_f16", c, 2, "InF16"))
            print(f"# rp {c.label()}: {f.num_regs} regs", flush=True)
    for c in dict.fromkeys(cfgs):
        f = be.ctx.fn(kernel_file("mma_f16", c), kernel_name("mma_f16", c, lays[0], "InF16"))
        print(f"# {c.label()}{' (pairs)' if lays[0] == 2 else ''}: {f.num_regs} regs", flush=True)

    rng = np.random.default_rng(0)
    results: list[dict] = []
    flags = KernelFlags()
    for shape_s in a.shapes.split(","):
        rows, k = map(int, shape_s.split("x"))
        bpr = k // 256
        wbytes = q6k.aos_nbytes(rows, k)
        copies = max(2, min(32, math.ceil(3 * _bk.L2_BYTES / wbytes)))
        with be.ctx.dev, be.stream:
            nb = rows * bpr
            aos = cp.random.randint(0, 256, size=(nb, 210), dtype=cp.int32).astype(cp.uint8)
            d = (cp.random.standard_normal(nb, dtype=cp.float32) * 1e-3).astype(cp.float16)
            aos[:, 208:210] = d.view(cp.uint8).reshape(nb, 2)
            ws = [device_weight(be, aos, rows, k, Layout.SOA,
                                pairs=a.profile_cfgs is not None and be.storage.pairs)
                  for _ in range(copies)]
            wa = device_weight(be, aos, rows, k, Layout.AOS)
            if a.rp:  # the probe's weights: repacked copies of the same blocks
                wr = [device_weight(be, aos, rows, k, Layout.SOA, pairs=True)
                      for _ in range(copies)]
            pick = np.unique(np.concatenate([
                np.arange(min(rows, 128)), np.arange(max(0, rows - 128), rows),
                rng.integers(0, rows, CHECK_ROWS)]))
            sub = aos.reshape(rows, bpr, 210)[cp.asarray(pick)].get().reshape(-1, 210)
            del aos
            be.stream.synchronize()
        print(f"\n{shape_s}: {wbytes / 1e6:.1f} MB Q6_K, {copies} copies, "
              f"{pick.size} rows checked", flush=True)
        for n in ns:
            x16 = rng.standard_normal((n, k)).astype(np.float16)
            no_ref = a.pdl_ab or a.rp_profile
            y64 = None if no_ref else reference.matmul_float64(x16, sub, pick.size)
            with be.ctx.dev, be.stream:
                xd = cp.asarray(x16)
            if a.profile:
                profile_calls(be, ws, xd, n, rows, k, a.profile_cfgs)
                continue
            if a.rp:
                results.append(rp_probe(cp, be, ws, wr, xd, shape_s, n, pick, y64, copies,
                                        a.rp_profile))
                continue
            t_torch = None if a.no_torch else _bk.torch_linear_us(
                rows, k, n, max(2, min(16, math.ceil(3 * _bk.L2_BYTES / (2 * rows * k)))))
            choice = be.choose(n, Precision.AUTO, flags, rows, k)
            auto = choice.path

            def call_auto(i: int, c=choice, xd=xd, ws=ws) -> None:
                be.run(ws[i], xd, np.dtype(np.float16), c.path, c.cfg)

            if a.pdl_ab:
                results.append(pdl_ab(cp, be, call_auto, choice, ws, xd, shape_s, n, copies))
                continue
            with be.ctx.dev, be.stream:
                t_auto = _bk.time_calls(cp, call_auto, copies)
            row = {"shape": shape_s, "n": n, "mb": wbytes / 1e6, "torch_us": t_torch,
                   "auto": auto, "auto_us": t_auto, "tiles": {}}
            print(f"{shape_s:>12} {n:>3} {'auto=' + auto:>26} {t_auto:8.1f} us "
                  f"{wbytes / t_auto / 1e6:5.2f} TB/s   torch {t_torch or 0:8.1f} us", flush=True)
            for c in ks_cfgs(n):
                try:
                    res = probe_cfg(cp, be, c, ws, wa, xd, n, pick, y64, copies)
                except Exception as e:  # one broken shape must not end the run
                    first = str(e).splitlines()[0] if str(e) else ""
                    res = {"error": f"{type(e).__name__}: {first}"}
                row["tiles"][c.label()] = res
                if "error" in res:
                    print(f"{shape_s:>12} {n:>3} {c.label():>26} FAILED {res['error']}", flush=True)
                    continue
                print(f"{shape_s:>12} {n:>3} {c.label():>26} {res['us']:8.1f} us "
                      f"{wbytes / res['us'] / 1e6:5.2f} TB/s  x{t_auto / res['us']:.2f} auto  "
                      f"err {res['err']:.2e} "
                      f"{'ok' if res['ok'] else 'BAD'}", flush=True)
            results.append(row)
        for w in [*ws, wa, *(wr if a.rp else ())]:
            be.free(w)
        ws.clear()
        cp.get_default_memory_pool().free_all_blocks()
    if a.profile:
        return 0
    if a.rp:
        if a.rp_profile:
            return 0
        print_rp_table(results)
        if a.json:
            with open(a.json, "w") as fh:
                json.dump({"device": be.device_name(), "date": time.strftime("%Y-%m-%d"),
                           "rp": results}, fh, indent=1)
        return 0 if all(v["ok"] for r in results for v in r["rp"].values()) else 1
    if a.pdl_ab:
        print_pdl_table(results)
        if a.json:
            with open(a.json, "w") as fh:
                json.dump({"device": be.device_name(), "date": time.strftime("%Y-%m-%d"),
                           "pdl_ab": results}, fh, indent=1)
        return 0 if all(r["same"] for r in results) else 1
    print_table(results)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": be.device_name(), "date": time.strftime("%Y-%m-%d"),
                       "results": results}, fh, indent=1)
    bad = [r for r in results for v in r["tiles"].values() if not v.get("ok")]
    return 1 if bad else 0


WG = False  # probe the wgmma tile too (sm_90 devices; main() sets it)
KS_SWEEP: tuple[int, ...] = ()  # --ks-sweep: src 4's shapes at these forced slice counts


def ks_cfgs(n: int) -> list[Cfg]:
    """The K-slice launch shapes of an ``n``-token call (the tune's candidates)."""
    nt = 1 if n <= 8 else 1 << (-(-n // 8) - 1).bit_length()
    if KS_SWEEP:
        return [Cfg(nt=nt, mt=mt, src=4, pf=pf, warps=w, ksplit=s)
                for mt, pf, w in _bk.KS_SHAPES[nt] for s in KS_SWEEP]
    wide = [Cfg(nt=nt, mt=mt, src=4, pf=pf, warps=w) for mt, pf, w in _bk.KS_SHAPES[nt]
            if w != 8]
    wide += [Cfg(nt=1, src=4, pf=True)] if nt == 2 else []  # two chunks of the 8-token tile
    return ([Cfg(nt=nt, src=4, pf=True)] + wide
            + ([Cfg(nt=nt, src=8, pf=True, warps=12)]  # (4 and 8 warps lost in every cell)
               if WG and nt == 8 else []))  # (the wgmma tile has 8 n-tiles only)


def profile_calls(be, ws, xd, n, rows, k, only: str | None = None) -> None:
    """One call each of: AUTO (the dispatch's kernel and launch shape), then the f16 tile's
    heuristic shape and the K-slice tiles where AUTO is another (``only``: the launch shapes of
    that --cfg-ab spec at this N instead); each on another resident copy (so a profiler's
    replay reads HBM, not the L2 the previous kernel filled)."""
    choice = be.choose(n, Precision.AUTO, KernelFlags(), rows, k)
    runs = [(choice.path, choice.cfg)]
    nt = ks_cfgs(n)[0].nt
    cands = ([c for nn, c in _bk.parse_cands(only) if nn == n] if only is not None else
             [default_cfg("mma_f16", n, rows, be.sm_count),
              Cfg(nt=nt, src=2 if nt == 1 else 3), *ks_cfgs(n)])
    for cand in cands:
        if ("mma_f16", cand) not in runs:
            runs.append(("mma_f16", cand))
    print(f"# profile {rows}x{k} N={n}: "
          + ", ".join(f"{p} {q.label() if q else ''}" for p, q in runs), flush=True)
    with be.ctx.dev, be.stream:
        for i, (path, cfg) in enumerate(runs):
            be.run(ws[i % len(ws)], xd, np.dtype(np.float16), path, cfg)
        be.stream.synchronize()


def probe_cfg(cp, be, c, ws, wa, xd, n, pick, y64, copies) -> dict:
    """Correctness (reference rows, AoS twin, repeat) and timing of one launch shape."""
    f16 = np.dtype(np.float16)
    with be.ctx.dev, be.stream:
        part = be.launcher.ws.array("part", (1 << 22,), np.float32)
        outs = []
        for w in (ws[0], ws[1], wa):
            part.fill(np.nan)  # a partial sum nothing wrote shows up as NaN
            outs.append(be.run(w, xd, f16, "mma_f16", c).get(stream=be.stream))

        def call(i: int) -> None:
            be.run(ws[i], xd, f16, "mma_f16", c)

        us = _bk.time_calls(cp, call, copies)
    y0 = outs[0]
    err = _bk_rel(y0[:, pick], y64)
    finite = bool(np.isfinite(y0).all())
    repeat = bool(np.array_equal(y0.view(np.uint32), outs[1].view(np.uint32)))
    twin = bool(np.array_equal(y0.view(np.uint32), outs[2].view(np.uint32)))
    ok = finite and repeat and twin and err <= TOL
    return {"us": us, "err": err, "finite": finite, "repeat_identical": repeat,
            "aos_identical": twin, "ok": ok}


def _bk_rel(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a64 - b64) / max(np.linalg.norm(b64), 1e-300))


def print_table(results: list[dict]) -> None:
    print("\n# us (TB/s of Q6_K); tile = fastest correct launch shape; x = speed vs AUTO / torch")
    print(f"{'shape':>12} {'MB':>5} {'N':>3} {'AUTO':>14} {'torch f16':>9} "
          f"{'best tile':>34} {'xAUTO':>6} {'xtorch':>6}")
    for r in results:
        good = [(v["us"], lab) for lab, v in r["tiles"].items() if v.get("ok")]
        mb = r["mb"]

        def tb(us: float, mb: float = mb) -> float:  # MB / us = TB/s
            return mb / us

        t = f"{r['torch_us']:9.1f}" if r["torch_us"] else "        -"
        if not good:
            print(f"{r['shape']:>12} {r['mb']:5.1f} {r['n']:>3} {r['auto_us']:7.1f} "
                  f"({tb(r['auto_us']):.2f}) {t}   no correct tile", flush=True)
            continue
        us, lab = min(good)
        xt = f"{r['torch_us'] / us:6.2f}" if r["torch_us"] else "     -"
        print(f"{r['shape']:>12} {r['mb']:5.1f} {r['n']:>3} {r['auto_us']:7.1f} "
              f"({tb(r['auto_us']):.2f}) {t} {lab:>22} {us:6.1f} ({tb(us):.2f}) "
              f"{r['auto_us'] / us:6.2f} {xt}", flush=True)


def pdl_ab(cp, be, call_auto, choice, ws, xd, shape_s, n, copies) -> dict:
    """AUTO's kernels with the split-K sum launched plainly, then with PDL, twice each in turn
    (same process, same weights); y of both compared bit for bit."""
    f16 = np.dtype(np.float16)
    ys, times = {}, {False: [], True: []}
    for rep in range(2):
        for on in (False, True):
            be.launcher.pdl = on
            with be.ctx.dev, be.stream:
                if rep == 0:
                    ys[on] = be.run(ws[0], xd, f16, choice.path, choice.cfg).get(stream=be.stream)
                times[on].append(_bk.time_calls(cp, call_auto, copies))
    be.launcher.pdl = False
    same = bool(np.array_equal(ys[False].view(np.uint32), ys[True].view(np.uint32)))
    off, on = min(times[False]), min(times[True])
    lab = f"{choice.path} {choice.cfg.label() if choice.cfg else ''}"
    print(f"{shape_s:>12} {n:>3} {lab:>28} off {times[False][0]:7.1f} {times[False][1]:7.1f} "
          f"on {times[True][0]:7.1f} {times[True][1]:7.1f}  x{off / on:.3f} "
          f"{'same bits' if same else 'BITS DIFFER'}", flush=True)
    return {"shape": shape_s, "n": n, "kernel": lab, "off": times[False], "on": times[True],
            "same": same}


def rp_cfgs(n: int) -> list[Cfg]:
    """src 4's register-prefetch launch shapes of an ``n``-token call (one m-tile), which the
    pair-stream weights run beside plain SoA (the session-11 probe q6k_ksp_f16 mirrored them)."""
    nt = 1 if n <= 8 else 1 << (-(-n // 8) - 1).bit_length()
    return [Cfg(nt=nt, src=4, pf=True, warps=w) for mt, pf, w in _bk.KS_SHAPES[nt]
            if mt == 1 and pf]


def rp_list(be, n: int, rows: int, k: int) -> list[Cfg]:
    """The probe's launch shapes of one cell: src 4's (rp_cfgs), AUTO's own if it is a K-slice
    or wgmma shape, and at 8 n-tiles the wgmma tile at 12 warps (on sm_90)."""
    out = rp_cfgs(n)
    ch = be.choose(n, Precision.AUTO, KernelFlags(), rows, k)
    if ch.path == "mma_f16" and ch.cfg.src in (4, 6) and ch.cfg.mt == 1 and ch.cfg.pf and (
            ch.cfg.src == 4 or WG):
        out.append(ch.cfg)
    if WG and out[0].nt == 8:
        out.append(Cfg(nt=8, src=8, pf=True, warps=12))
    return list(dict.fromkeys(out))


def run_tile(be, w: ResidentWeight, xd, c: Cfg):
    """One call of the K-slice/wgmma launch shape ``c`` through the backend (a pair-stream
    weight runs the layout-2 kernels on the SoA twin's plan)."""
    return be.run(w, xd, np.dtype(np.float16), "mma_f16", c)


def rp_probe(cp, be, ws, wr, xd, shape_s, n, pick, y64, copies, profile: bool) -> dict:
    """AUTO, then per launch shape the SoA copies and the pair-stream ones:
    y compared bit for bit (same grid, same operation order), error vs the float64 reference,
    times interleaved s4/rp twice (best of each)."""
    rows, k = map(int, shape_s.split("x"))
    choice = be.choose(n, Precision.AUTO, KernelFlags(), rows, k)
    f16 = np.dtype(np.float16)
    if profile:
        with be.ctx.dev, be.stream:
            be.run(ws[0], xd, f16, choice.path, choice.cfg)
        for i, c in enumerate(rp_list(be, n, rows, k)):
            run_tile(be, ws[(1 + i) % len(ws)], xd, c)
            run_tile(be, wr[(1 + i) % len(wr)], xd, c)
        be.stream.synchronize()
        return {}

    def call_auto(i: int) -> None:
        be.run(ws[i], xd, f16, choice.path, choice.cfg)

    with be.ctx.dev, be.stream:
        t_auto = _bk.time_calls(cp, call_auto, copies)
    lab = f"{choice.path} {choice.cfg.label() if choice.cfg else ''}"
    row = {"shape": shape_s, "n": n, "mb": q6k.aos_nbytes(rows, k) / 1e6, "auto": lab,
           "auto_us": t_auto, "s4": {}, "rp": {}}
    print(f"{shape_s:>12} {n:>3} {'auto=' + lab:>34} {t_auto:8.1f} us", flush=True)
    for c in rp_list(be, n, rows, k):
        try:
            with be.ctx.dev, be.stream:
                y4 = run_tile(be, ws[0], xd, c).get(stream=be.stream)
                yp = run_tile(be, wr[0], xd, c).get(stream=be.stream)
            same = bool(np.array_equal(y4.view(np.uint32), yp.view(np.uint32)))
            err = _bk_rel(yp[:, pick], y64)
            ok = same and bool(np.isfinite(yp).all()) and err <= TOL
            with be.ctx.dev:
                gp = be.launcher.plan(rows, k, Layout.SOA, "InF16", "mma_f16", c, n, True).grid
            times: dict[str, list[float]] = {"s4": [], "rp": []}
            for _ in range(2):
                for key, wl in (("s4", ws), ("rp", wr)):
                    with be.ctx.dev, be.stream:
                        times[key].append(_bk.time_calls(
                            cp, lambda i, wl=wl, c=c: run_tile(be, wl[i], xd, c), copies))
        except Exception as e:  # one broken shape must not end the run
            first = str(e).splitlines()[0] if str(e) else ""
            row["rp"][c.label()] = {"ok": False, "error": f"{type(e).__name__}: {first}"}
            print(f"{shape_s:>12} {n:>3} {c.label():>34} FAILED {type(e).__name__}: {first}",
                  flush=True)
            continue
        t4, tp = min(times["s4"]), min(times["rp"])
        row["s4"][c.label()] = {"us": t4, "runs": times["s4"]}
        row["rp"][c.label()] = {"us": tp, "runs": times["rp"], "err": err, "same_bits": same,
                                "grid": list(gp), "ok": ok}
        print(f"{shape_s:>12} {n:>3} {c.label():>34} grid {gp} s4 {t4:7.1f} rp {tp:7.1f} us "
              f"x{t4 / tp:.3f} vs s4, x{t_auto / tp:.3f} vs auto  err {err:.2e} "
              f"{'same bits' if same else 'BITS DIFFER'} {'ok' if ok else 'BAD'}", flush=True)
    return row


def print_rp_table(results: list[dict]) -> None:
    print("\n# pair-stream weights (layout 2) vs SoA (src 4 / 6, same launch shape and grid) and "
          "AUTO: us, best of two interleaved runs; best shape of each")
    print(f"{'shape':>12} {'N':>3} {'AUTO':>8} {'best plain':>24} {'best rp':>24} {'rp/pl':>6} "
          f"{'xAUTO':>6}")
    for r in results:
        good = [(v["us"], lab) for lab, v in r["rp"].items() if v.get("ok")]
        if not good:
            print(f"{r['shape']:>12} {r['n']:>3} {r['auto_us']:8.1f}  no correct probe")
            continue
        t4, l4 = min((v["us"], lab) for lab, v in r["s4"].items())
        tp, lp = min(good)
        print(f"{r['shape']:>12} {r['n']:>3} {r['auto_us']:8.1f} {l4:>16} {t4:7.1f} "
              f"{lp:>16} {tp:7.1f} {t4 / tp:6.3f} {r['auto_us'] / tp:6.3f}", flush=True)


def print_pdl_table(results: list[dict]) -> None:
    print("\n# PDL split-K sum: AUTO us, best of two runs each (interleaved), x = off / on")
    for r in results:
        off, on = min(r["off"]), min(r["on"])
        print(f"{r['shape']:>12} {r['n']:>3} {r['kernel']:>28} {off:7.1f} {on:7.1f} "
              f"x{off / on:.3f} {'' if r['same'] else 'BITS DIFFER'}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
