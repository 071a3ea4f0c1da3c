"""Kernel benchmark and dispatch tuner of the CUDA backend (run on a GPU; never in the tests).

CUDA-event timing of each call after a warm-up, median over many calls; the weight is
rotated over enough resident copies that the 60 MB L2 cannot serve it; activations start on
the device as f16 (what the service receives) or f32, so conversion/quantization prepasses are
inside the time. Prints the effective weight bandwidth (Q6_K bytes / time), the ratio to
ANCHORS.md's llama.cpp figures and to torch's f16 linear on an f16 weight of the same shape
timed in the same run.

    python bench/kernels.py [--shapes 4096x14336,...] [--ns 1,2,...] [--paths auto,exact,...]
                            [--dtypes f16,f32] [--variants] [--summary] [--only TEXT]
                            [--json out.json]
    python bench/kernels.py --tune [--table-out kernels/cuda/dispatch_h200.json] [--json ..]
    python bench/kernels.py --pairs-ab [--shapes ..] [--ns ..] [--precision q8_1] [--nts 1,2]
    python bench/kernels.py --table-ab OLD.json [--shapes ..] [--ns ..] [--columns auto,..]

``--tune`` times every candidate (kernel path x launch shape, ``tune_candidates``) of every
shape and N bucket with f16 activations, writes the dispatch table (per shape, bucket and
precision column: the fastest candidate; the heuristic choice is kept unless another is more
than ``KEEP`` faster) and prints, per shape and N, the table's AUTO choice with f16 and f32
activations beside torch's f16 linear.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace

import numpy as np

from q6serve.kernels import q6k
from q6serve.kernels.api import KernelFlags, Layout, Precision, iter_aos_chunks
from q6serve.kernels.cuda.dispatch import (
    BUCKETS,
    COLUMNS,
    KERNELS,
    Dispatch,
    DispatchTable,
    Entry,
    default_cfg,
    heuristic_path,
)
from q6serve.kernels.cuda.launch import IN_TYPES, MATMUL_FILE, WG_FILE, Launcher, kernel_name
from q6serve.kernels.cuda_backend import Cfg, CudaBackend
from q6serve.kernels.errors import DeviceError

# The weight shapes of Qwen2.5-7B and Llama-3.1-8B (rows x K): q/o, k/v, gate/up, down, lm-head.
QWEN = ((3584, 3584), (512, 3584), (18944, 3584), (3584, 18944), (152064, 3584))
LLAMA = ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096))
SHAPES = QWEN + LLAMA
NS = BUCKETS
DTYPES = {"f16": np.float16, "f32": np.float32}
KEEP = 0.02  # --tune keeps the heuristic choice unless a candidate is more than this faster
CONFIRM = 0.01  # --confirm: a changed cell's tuned pick must re-time this much faster to stay
L2_BYTES = 60e6
# ANCHORS.md: llama.cpp test-backend-ops MUL_MAT q6_K on the H200, µs per call.
LLAMA_US = {
    (4096, 14336): {1: 28.8, 2: 30.8, 4: 40.5, 8: 62.6, 16: 54.1, 32: 66.3, 64: 91.6},
    (3584, 18944): {1: 34.1, 2: 35.4, 4: 46.6, 8: 70.8, 16: 64.5, 32: 75.6, 64: 102.6},
    (152064, 3584): {1: 278.8, 2: 267.8, 4: 366.7, 8: 532.4, 16: 387.7, 32: 471.4, 64: 654.9},
}
PATHS = {"exact": Precision.EXACT, "mma_f16": Precision.F16, "mmq_q8_1": Precision.Q8_1,
         "cublas_f16": Precision.F16}
VARIANTS = {  # mma_f16 launch shapes compared with --variants
    # (the f16 tile's register prefetch, `.pf` at src 2/3, left the kernels in session 15)
    "nt1.sm": Cfg(nt=1), "nt1.sm.w4": Cfg(nt=1, warps=4), "nt2.sm": Cfg(nt=2),
    "nt2.cpa": Cfg(nt=2, src=3), "nt4.cpa": Cfg(nt=4, src=3),
    "nt8.cpa": Cfg(nt=8, src=3), "nt8.cpa.w4": Cfg(nt=8, src=3, warps=4),
    # 32 rows per warp (mt=2): each activation fragment feeds two m-tiles
    "nt1.sm.m2": Cfg(nt=1, mt=2), "nt1.sm.m2.w4": Cfg(nt=1, mt=2, warps=4),
    "nt2.cpa.m2.w4": Cfg(nt=2, mt=2, src=3, warps=4),
    "nt4.cpa.m2": Cfg(nt=4, mt=2, src=3), "nt4.cpa.m2.w4": Cfg(nt=4, mt=2, src=3, warps=4),
    "nt8.cpa.m2": Cfg(nt=8, mt=2, src=3), "nt8.cpa.m2.w4": Cfg(nt=8, mt=2, src=3, warps=4),
    # the K-slice tile at 12 / 16 warps: weights one block ahead in registers (src 4; the ring
    # tile src 5 beside it left the kernels after session 21)
    "nt2.ks.w16": Cfg(nt=2, src=4, pf=True, warps=16),
    "nt2.ks.w12": Cfg(nt=2, src=4, pf=True, warps=12),
    "nt4.ks.w12": Cfg(nt=4, src=4, pf=True, warps=12),
}
# K-slice tile shapes (mt, prefetch, warps per CTA) per n-tiles, as instantiated in
# q6k_matmul.cu; mt=2 spilled
# and lost everywhere (bench/RESULTS.md); 12 warps (<= 168 registers: q6k_ks_f16<2> spills at
# 8 warps x 2 CTAs) and 16 (one activation slice per SM) at nt <= 4 / 2
KS_SHAPES = {1: ((1, True, 8), (1, True, 12), (1, True, 16)),
             2: ((1, True, 8), (1, True, 12), (1, True, 16)),
             4: ((1, True, 8), (1, True, 12)), 8: ((1, True, 8),)}
# The ring tile (src 5: weights through a warp-private cp.async ring in shared memory) left the
# kernels after session 21: session 8 offered it at nt 1, 2, 4 (bench/RESULTS.md), session 13
# again on pair-stream weights; its last cell, 152064x3584 N=32, went to the wgmma tile src 8
# nt 4 in session 21 (184.7 -> 171.3 us).
VARIANT_NS = {"nt1": (1, 2, 4, 8), "nt2": (16, 32), "nt4": (32, 64), "nt8": (64,)}
EXACT_VARIANTS = {"exact.sm.pf": Cfg(nt=1, pf=True), "exact.sm": Cfg(nt=1)}
SPIN_SRC = r"""extern "C" __global__ void spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}"""


def random_blocks(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    return q6k.random_blocks(rows, k, rng)


# The last time_calls' details (bench/kernels.py --samples prints them): every call's us, the
# host's enqueue time per call, and whether the spin kernel still ran when the last call was
# enqueued (if not, the GPU waited on Python between calls and an event pair can hold host time:
# session 20's closing check read 14336x4096 N=8 at 69.9 us against 21.2 the session before)
TIMING: dict = {}
SPIN_CYCLES = 400_000  # per queued call: ~200 us at the H200's clock (--spin-cycles)


def time_calls(cp, fn, copies: int, warmup: int = 3, iters: int = 40) -> float:
    """Median µs of ``fn(i)`` over ``iters`` calls, each timed alone with device events. The
    GPU spins while the host enqueues; where the spin ended before the last call was enqueued
    (a slow or preempted host) the calls are timed again once behind a spin 8x longer
    (``TIMING['covered']`` says how the returned figure was taken)."""
    stream = cp.cuda.get_current_stream()
    for i in range(warmup):
        fn(i % copies)
    stream.synchronize()
    spin = cp.RawKernel(SPIN_SRC, "spin")
    for scale in (1, 8) if SPIN_CYCLES else (1,):
        evs = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(iters)]
        # Keep the GPU busy while the host enqueues, so the events time the GPU, not Python.
        # (~200 us per queued call: more than Python needs to enqueue one; 16 ms at 40 calls)
        spin((1,), (1,), (np.int64(SPIN_CYCLES * scale * iters),))
        spun = cp.cuda.Event(disable_timing=True)
        spun.record(stream)
        t0 = time.perf_counter()
        for i, (a, b) in enumerate(evs):
            a.record(stream)
            fn(i % copies)
            b.record(stream)
        host_us = (time.perf_counter() - t0) / iters * 1e6
        covered = not spun.done  # the GPU was still spinning: every call was queued ahead
        stream.synchronize()
        us = [cp.cuda.get_elapsed_time(a, b) * 1e3 for a, b in evs]
        first = TIMING.get("samples") if scale > 1 else None
        TIMING.clear()
        TIMING.update(samples=us, host_us=host_us, covered=covered, spin_scale=scale)
        if first:  # the uncovered attempt's median, for the record
            TIMING["uncovered_p50"] = statistics.median(first)
        if covered:
            break
    return statistics.median(TIMING["samples"])


def timing_note() -> str:
    """The last time_calls' spread and host side, one line: min / p10 / p50 / p90 / max us,
    the host's enqueue us per call, and whether the spin covered the enqueue."""
    us = sorted(TIMING.get("samples", ()))
    if not us:
        return ""
    q = [us[min(len(us) - 1, int(f * len(us)))] for f in (0.1, 0.5, 0.9)]
    cov = "covered" if TIMING["covered"] else "NOT covered"
    if "uncovered_p50" in TIMING:
        cov += f" (the first try, spin x1 not covered: p50 {TIMING['uncovered_p50']:.1f})"
    return (f"min {us[0]:.1f} p10 {q[0]:.1f} p50 {q[1]:.1f} p90 {q[2]:.1f} max {us[-1]:.1f}; "
            f"host {TIMING['host_us']:.1f} us/call; spin x{TIMING['spin_scale']} {cov}")


def torch_linear_us(rows: int, k: int, n: int, copies: int) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    ws = [torch.randn(rows, k, device="cuda", dtype=torch.float16) * 0.02 for _ in range(copies)]
    x = torch.randn(n, k, device="cuda", dtype=torch.float16)
    f = torch.nn.functional.linear
    for i in range(3):
        f(x, ws[i % copies])
    torch.cuda.synchronize()
    torch.cuda._sleep(30_000_000)  # GPU busy while the host enqueues (as for our kernels)
    ts = []
    for i in range(40):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f(x, ws[i % copies])
        b.record()
        ts.append((a, b))
    torch.cuda.synchronize()
    out = statistics.median(a.elapsed_time(b) * 1e3 for a, b in ts)
    del ws
    torch.cuda.empty_cache()
    return out


def print_summary(results: list[dict]) -> None:
    """Per shape and N: AUTO against the fastest row timed (any path or launch variant)."""
    print("\n# summary: us (TB/s); best = the fastest row of this run")
    print(f"{'shape':>14} {'N':>3} {'AUTO':>15} {'best':>36} {'AUTO/best':>9}")
    keys = sorted({(r["shape"], r["n"], r.get("dtype")) for r in results},
                  key=lambda t: (t[0], t[1], str(t[2])))
    for shape, n, dt in keys:
        rows = [r for r in results if r["shape"] == shape and r["n"] == n and "us" in r
                and r.get("dtype") == dt]
        auto = next((r for r in rows if r["path"].startswith("auto=")), None)
        best = min(rows, key=lambda r: r["us"], default=None)
        if auto is None or best is None:
            continue
        print(f"{shape:>14} {n:>3} {auto['us']:8.1f} ({auto['tbs']:.2f}) "
              f"{best['path'] + ' ' + format(best['us'], '.1f'):>29} ({best['tbs']:.2f}) "
              f"{best['us'] / auto['us']:9.2f}", flush=True)


def tune_candidates(n: int, rows: int, k: int, sm_count: int,
                    wg: bool = False) -> list[tuple[str, Cfg | None]]:
    """Every (path, launch shape) --tune times for bucket ``n``: the heuristic's choice of each
    path and the launch-shape variants measured competitive before (bench/RESULTS.md);
    ``wg`` (sm_90 devices): the wgmma tile too (N=32 / 64)."""
    exact = {1: [Cfg(nt=1, pf=True), Cfg(nt=1)], 2: [Cfg(nt=2, pf=True), Cfg(nt=2),
                                                     Cfg(nt=1, pf=True)]}.get(
        n, [Cfg(nt=4), Cfg(nt=2)])
    mma = {16: [Cfg(nt=2, src=3), Cfg(nt=2, mt=2, src=3, warps=4)],
           32: [Cfg(nt=4, src=3), Cfg(nt=4, mt=2, src=3, warps=4)],
           64: [Cfg(nt=8, mt=2, src=3, warps=4), Cfg(nt=8, src=3), Cfg(nt=4, src=3)]}.get(
        n, [Cfg(nt=1), Cfg(nt=1, mt=2), Cfg(nt=1, warps=4)])
    q8 = default_cfg("mmq_q8_1", n)
    mmq = [q8, Cfg(nt=max(1, q8.nt // 2)) if q8.nt > 1 else Cfg(nt=2)]
    # the f16 tile's heuristic shape with a fixed K split: the occupancy model's split is a
    # guess (14336x4096 and 128256x4096 ran N=1 slower than N=2..8 in run 1)
    base = default_cfg("mma_f16", n, rows, sm_count)
    mma = mma + [replace(base, ksplit=s) for s in (1, 2, 4) if s <= k // 256]
    # the K-slice tile (src 4: activations staged once per CTA, warps stream many row tiles)
    nt = 1 if n <= 8 else n // 8
    mma += [Cfg(nt=nt, mt=mt, src=4, pf=pf, warps=w) for mt, pf, w in KS_SHAPES[nt]]
    # two token chunks of the half-width tile (each weight decoded twice; the chunks' CTAs of
    # one wave read the same rows together, so the second read may come from L2)
    mma += {16: [Cfg(nt=1, src=4, pf=True, warps=w) for w in (8, 16)],
            32: [Cfg(nt=2, src=4, pf=True, warps=w) for w in (12, 16)],
            64: [Cfg(nt=4, src=4, pf=True, warps=12)]}.get(n, [])
    # (session 14's 8 n-tiles at 12 warps and 4 at 16 without the prefetch left in session 30:
    # no tune since picked them, bench/kernels_reach.py)
    # the wgmma tile (src 8, sm_90; src 6 until session 21): 8 n-tiles, and 4 again since
    # session 21 (src 6's 2/4 n-tile widths lost every cell of the session 13/14 tunes);
    # 12 warps won, 8 sometimes; the grid model's K split can leave SMs idle with 12 warps, so
    # a few fixed splits too
    if wg and nt in (4, 8):
        mma += [Cfg(nt=nt, src=8, pf=True, warps=w) for w in (12, 8)]
        mma += [Cfg(nt=nt, src=8, pf=True, warps=12, ksplit=s) for s in (2, 3, 4)
                if s <= k // 256]
    out: list[tuple[str, Cfg | None]] = []
    for path, cfgs in (("exact", exact), ("mma_f16", mma), ("mmq_q8_1", mmq)):
        for cfg in [default_cfg(path, n, rows, sm_count), *cfgs]:
            if (path, cfg) not in out:
                out.append((path, cfg))
    if n >= 16 or (n >= 8 and rows * k <= 1 << 23):  # cuBLAS's dequant pass never wins below
        out.append(("cublas_f16", None))
    return out


def prefetch_auto(be: CudaBackend, jobs: list[tuple[int, int, int, Cfg | None, str, str]],
                  layout: Layout) -> int:
    """Compile up front, in parallel NVRTC programs of two names, what the timed calls' launch
    plans ask for (``jobs``: rows, k, N, cfg, path, activation type), as the weights are held
    (layout, ``be.storage.pairs``): each planned on a device-less launcher that records the
    names (tile, its SoA twin, x prep, split-K sum). Lazily each name is a program of its own,
    one after another: ~2 s each, most of a short A/B's device time."""
    from types import SimpleNamespace

    asked: set[tuple[str, str]] = set()

    def fn(file: str, name: str) -> SimpleNamespace:
        asked.add((file, name))
        return SimpleNamespace(num_regs=128, max_dynamic_shared_size_bytes=48 << 10)

    lc = Launcher(SimpleNamespace(sm_count=be.sm_count, smem_sm=be.ctx.smem_sm, cc=be.cc, fn=fn))
    for rows, k, n, cfg, path, in_t in jobs:
        if cfg is not None and path in ("exact", "mma_f16", "mmq_q8_1"):
            try:
                lc.plan(rows, k, layout, in_t, path, cfg, n, be.storage.pairs)
            except DeviceError:  # (a tune candidate that fits no K split: reported when timed)
                continue
    with be.ctx.dev:
        return sum(be.ctx.prefetch(f, {nm for fl, nm in asked if fl == f}, threads=16, group=2)
                   for f in (MATMUL_FILE, WG_FILE) if f != WG_FILE or be.cc == "90")


def load_copies(be: CudaBackend, rng: np.random.Generator, rows: int, k: int,
                layout: Layout, blocks: np.ndarray | None = None) -> list:
    wbytes = q6k.aos_nbytes(rows, k)
    copies = max(2, min(64, math.ceil(3 * L2_BYTES / wbytes)))
    blocks = random_blocks(rng, rows, k) if blocks is None else blocks
    return [be.load(iter_aos_chunks(blocks, rows, k, 64 << 20), rows, k, layout, 64 << 20)
            for _ in range(copies)]


def pairs_ab(a: argparse.Namespace, be: CudaBackend) -> list[dict]:
    """AUTO (the committed table; ``--precision``: that column) on SoA weights and on
    pair-stream weights of the same blocks (``Storage.pairs``), f16 activations, in one
    process: per cell SoA, pairs, SoA, pairs (the best median of each), the outputs compared
    bit for bit, torch's f16 linear beside."""
    import cupy as cp

    flags = KernelFlags(soa=True)
    prec = Precision(a.precision)
    rng = np.random.default_rng(0)
    shapes = [tuple(map(int, s.split("x"))) for s in a.shapes.split(",")]
    ns = list(map(int, a.ns.split(",")))
    t0 = time.perf_counter()

    def picks(n: int, r: int, k: int) -> list[tuple[str, Cfg | None]]:
        """The column's pick, or (--nts) its path at each of those n-tile counts."""
        c = be.choose(n, prec, flags, r, k)
        if not a.nts or c.cfg is None:
            return [(c.path, c.cfg)]
        return [(c.path, replace(c.cfg, nt=int(x))) for x in a.nts.split(",")]

    jobs = [(r, k, n, cfg, path, "InF16") for r, k in shapes for n in ns
            for path, cfg in picks(n, r, k)]
    got = 0
    for pairs in (False, True):
        be.storage.pairs = pairs
        got += prefetch_auto(be, jobs, Layout.SOA)
    be.storage.pairs = False
    print(f"# compiled {got} instantiations for AUTO (SoA and pair streams) in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    print(f"{'shape':>12} {'N':>3} {'AUTO':>26} {'SoA us':>7} {'TB/s':>5} {'pairs us':>8} "
          f"{'TB/s':>5} {'x':>6} {'bits':>5} {'torch':>7} {'xtorch':>6}", flush=True)
    out: list[dict] = []
    for rows, k in shapes:
        wbytes = q6k.aos_nbytes(rows, k)
        blocks = random_blocks(rng, rows, k)
        ws = load_copies(be, rng, rows, k, Layout.SOA, blocks)
        be.storage.pairs = True
        try:
            wp = load_copies(be, rng, rows, k, Layout.SOA, blocks)
        finally:
            be.storage.pairs = False
        for n, (path, cfg) in [(nn, pc) for nn in ns for pc in picks(nn, rows, k)]:
            f16 = np.dtype(np.float16)
            times: dict[str, list[float]] = {"soa": [], "pairs": []}
            with be.ctx.dev, be.stream:
                # x on the backend's (non-blocking) stream: uploaded on the null stream, the
                # first kernel could read it half-written (session 12's one unrepeatable DIFF)
                x = cp.asarray(rng.standard_normal((n, k)).astype(np.float16))
                ys, yp = (be.run(w[0], x, f16, path, cfg) for w in (ws, wp))
                same = bool((ys.view(cp.uint32) == yp.view(cp.uint32)).all())
                for _ in range(2):
                    for key, wl in (("soa", ws), ("pairs", wp)):
                        def call(i: int, wl=wl, x=x, dt=f16, p=path, c=cfg) -> None:
                            be.run(wl[i], x, dt, p, c)

                        times[key].append(time_calls(cp, call, len(wl), iters=a.iters))
            t_s, t_p = min(times["soa"]), min(times["pairs"])
            t_torch = None if a.no_torch else torch_linear_us(rows, k, n, max(2, min(
                16, math.ceil(3 * L2_BYTES / (2 * rows * k)))))
            label = f"{path}.{cfg.label() if cfg else ''}"
            xt = f"{t_torch / t_p:6.2f}" if t_torch else "     -"
            tt = f"{t_torch:7.1f}" if t_torch else "      -"
            print(f"{rows}x{k:<6} {n:>3} {label:>26} {t_s:7.1f} {wbytes / t_s / 1e6:5.2f} "
                  f"{t_p:8.1f} {wbytes / t_p / 1e6:5.2f} {t_s / t_p:6.3f} "
                  f"{'same' if same else 'DIFF':>5} {tt} {xt}", flush=True)
            out.append({"shape": f"{rows}x{k}", "n": n, "path": label, "soa_us": t_s,
                        "pairs_us": t_p, "runs": times, "same_bits": same, "torch_us": t_torch,
                        "mb": wbytes / 1e6})
        free_copies(be, ws)
        free_copies(be, wp)
    return out


def table_ab(a: argparse.Namespace, be: CudaBackend) -> list[dict]:
    """The committed table against ``--table-ab OLD`` (another table file) on the weights as
    the storage holds them (pair streams by default), f16 activations, in one process: every
    (shape, N, column) whose pick differs between the two is timed old, new, old, new (the
    best median of each); the others are the same kernel. Prints one line per changed cell."""
    import cupy as cp

    old = Dispatch(DispatchTable.load(a.table_ab), be.sm_count)
    flags = KernelFlags(soa=True)
    rng = np.random.default_rng(2)
    shapes = [tuple(map(int, s.split("x"))) for s in a.shapes.split(",")]
    ns = list(map(int, a.ns.split(",")))
    cols = [Precision(c) for c in a.columns.split(",")]
    cells = [(r, k, n, p, old.choose(n, p, flags, r, k), be.choose(n, p, flags, r, k))
             for r, k in shapes for n in ns for p in cols]
    cells = [c for c in cells if (c[4].path, c[4].cfg) != (c[5].path, c[5].cfg)]
    t0 = time.perf_counter()
    got = prefetch_auto(be, [(r, k, n, ch.cfg, ch.path, "InF16") for r, k, n, _, co, cn in cells
                             for ch in (co, cn)], Layout.SOA)
    print(f"# compiled {got} instantiations in {time.perf_counter() - t0:.1f} s; "
          f"{len(cells)} changed cells of {len(shapes) * len(ns) * len(cols)}", flush=True)
    print(f"{'shape':>12} {'N':>3} {'column':>6} {'old pick':>28} {'us':>7} {'new pick':>28} "
          f"{'us':>7} {'TB/s':>5} {'old/new':>7}", flush=True)
    out: list[dict] = []
    f16 = np.dtype(np.float16)
    for rows, k in shapes:
        mine = [c for c in cells if c[:2] == (rows, k)]
        if not mine:
            continue
        wbytes = q6k.aos_nbytes(rows, k)
        ws = load_copies(be, rng, rows, k, Layout.SOA)
        for _, _, n, p, co, cn in mine:
            times: dict[str, list[float]] = {"old": [], "new": []}
            with be.ctx.dev, be.stream:
                x = cp.asarray(rng.standard_normal((n, k)).astype(np.float16))
                for _ in range(2):
                    for key, ch in (("old", co), ("new", cn)):
                        def call(i: int, ch=ch, x=x, ws=ws) -> None:
                            be.run(ws[i], x, f16, ch.path, ch.cfg)

                        times[key].append(time_calls(cp, call, len(ws), iters=a.iters))
            t_o, t_n = min(times["old"]), min(times["new"])
            lo = f"{co.path}.{co.cfg.label() if co.cfg else ''}"
            ln = f"{cn.path}.{cn.cfg.label() if cn.cfg else ''}"
            print(f"{rows}x{k:<6} {n:>3} {p.value:>6} {lo:>28} {t_o:7.1f} {ln:>28} {t_n:7.1f} "
                  f"{wbytes / t_n / 1e6:5.2f} {t_o / t_n:7.3f}", flush=True)
            out.append({"shape": f"{rows}x{k}", "n": n, "column": p.value, "old": lo, "new": ln,
                        "old_us": t_o, "new_us": t_n, "runs": times})
        free_copies(be, ws)
    return out


def parse_cands(spec: str) -> list[tuple[int, Cfg]]:
    """``--cfg-ab``'s candidates: ``N:field=v,field=v;N:...`` (Cfg fields; pf as 0/1)."""
    out: list[tuple[int, Cfg]] = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        n_s, _, fields = item.partition(":")
        kv = {f: int(v) for f, v in (x.split("=") for x in fields.split(",") if x)}
        cfg = Cfg(**{f: bool(v) if f == "pf" else v for f, v in kv.items()})
        cfg.check("mma_f16")
        out.append((int(n_s), cfg))
    return out


def cfg_ab(a: argparse.Namespace, be: CudaBackend) -> list[dict]:
    """AUTO (the committed table) against the mma_f16 launch shapes of ``--cfg-ab`` at their
    N, on the weights as the storage holds them (pair streams by default), f16 activations, in
    one process: per cell AUTO, each candidate, AUTO, each candidate, ... (``--rounds``; the
    best median of each). Each candidate's y (partial-sum scratch poisoned with NaN first) is
    compared with AUTO's: rel = |y - y_auto| / |y_auto| (the same F16 numerics, only the K
    split's order of the sums differs: ~1e-7; a broken shape shows up as NaN or ~1). torch's
    f16 linear once per cell unless --no-torch."""
    import cupy as cp

    flags = KernelFlags(soa=True)
    rng = np.random.default_rng(3)
    cands = parse_cands(a.cfg_ab)
    shapes = [tuple(map(int, s.split("x"))) for s in a.shapes.split(",")]
    ns = sorted({n for n, _ in cands})
    t0 = time.perf_counter()
    got = prefetch_auto(be, [(r, k, n, ch.cfg, ch.path, "InF16") for r, k in shapes for n in ns
                             for ch in [be.choose(n, Precision.AUTO, flags, r, k)]]
                        + [(r, k, n, c, "mma_f16", "InF16") for r, k in shapes
                           for n, c in cands], Layout.SOA)
    print(f"# compiled {got} instantiations in {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"{'shape':>12} {'N':>3} {'AUTO':>26} {'us':>7} {'candidate':>22} {'us':>7} "
          f"{'AUTO/cand':>9} {'rel':>8} {'torch':>7}", flush=True)
    out: list[dict] = []
    f16 = np.dtype(np.float16)
    for rows, k in shapes:
        wbytes = q6k.aos_nbytes(rows, k)
        ws = load_copies(be, rng, rows, k, Layout.SOA)
        for n in ns:
            ch = be.choose(n, Precision.AUTO, flags, rows, k)
            runs = [("auto", ch.path, ch.cfg)] + [(c.label(), "mma_f16", c)
                                                   for nn, c in cands if nn == n]
            times: dict[str, list[float]] = {r[0]: [] for r in runs}
            rel: dict[str, float] = {}
            with be.ctx.dev, be.stream:
                x = cp.asarray(rng.standard_normal((n, k)).astype(np.float16))
                ys = {}
                for label, path, cfg in runs:
                    try:
                        part = be.launcher.ws.array("part", (1 << 22,), np.float32)
                        part.fill(np.nan)  # a partial sum nothing wrote shows up as NaN
                    except Exception:  # (no such workspace buffer: nothing to poison)
                        pass
                    try:
                        ys[label] = be.run(ws[0], x, f16, path, cfg).get(stream=be.stream)
                    except Exception as e:  # a candidate that fails must not end the run
                        print(f"{rows}x{k:<6} {n:>3} {label}: FAILED {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}", flush=True)
                        times.pop(label)
                y0 = ys.get("auto")
                for label in times:
                    if label != "auto" and y0 is not None:
                        d = np.linalg.norm((ys[label] - y0).astype(np.float64))
                        rel[label] = float(d / max(np.linalg.norm(y0.astype(np.float64)),
                                                   1e-300))
                for _ in range(a.rounds):
                    for label, path, cfg in runs:
                        if label not in times:
                            continue

                        def call(i: int, path=path, cfg=cfg, x=x, ws=ws) -> None:
                            be.run(ws[i], x, f16, path, cfg)

                        times[label].append(time_calls(cp, call, len(ws), iters=a.iters))
            t_torch = None if a.no_torch else torch_linear_us(rows, k, n, max(2, min(
                16, math.ceil(3 * L2_BYTES / (2 * rows * k)))))
            ta = min(times["auto"])
            la = f"{ch.path}.{ch.cfg.label() if ch.cfg else ''}"
            for label in times:
                if label == "auto":
                    continue
                tc = min(times[label])
                tt = f"{t_torch:7.1f}" if t_torch else "      -"
                print(f"{rows}x{k:<6} {n:>3} {la:>26} {ta:7.1f} {label:>22} {tc:7.1f} "
                      f"{ta / tc:9.3f} {rel.get(label, float('nan')):8.1e} {tt}", flush=True)
                out.append({"shape": f"{rows}x{k}", "n": n, "auto": la, "auto_us": ta,
                            "cand": label, "cand_us": tc, "rel": rel.get(label),
                            "torch_us": t_torch, "runs": times, "mb": wbytes / 1e6})
        free_copies(be, ws)
    return out


def free_copies(be: CudaBackend, ws: list) -> None:
    import cupy as cp

    for w in ws:
        be.free(w)
    ws.clear()
    cp.get_default_memory_pool().free_all_blocks()


def pick(rows: int, k: int, n: int, column: str, timed: dict, sm_count: int) -> Entry | None:
    """The fastest timed candidate of ``column``; the heuristic's own choice stays unless
    another is more than KEEP faster (run-to-run noise is ~2-4%: no flapping tables)."""
    ok = [(us, path, cfg) for (path, cfg), us in timed.items()
          if path in COLUMNS[column] and us is not None]
    if not ok:
        return None
    us, path, cfg = min(ok, key=lambda t: t[0])
    hp, _ = heuristic_path(n, Precision(column), KernelFlags(), rows, k)
    hc = default_cfg(hp, n, rows, sm_count) if hp != "cublas_f16" else None
    h_us = timed.get((hp, hc))
    if h_us is not None and us > h_us * (1 - KEEP):
        us, path, cfg = h_us, hp, hc
    return Entry(rows, k, n, column, path, cfg, us)


def tune(a: argparse.Namespace, be: CudaBackend) -> list[dict]:
    """Time every candidate per (shape, bucket) with f16 activations, write the table, print
    the AUTO choice (f16 and f32 activations) beside torch's f16 linear. The buckets are
    ``--ns`` (all of BUCKETS by default; fewer write a partial table: for re-checks)."""
    import cupy as cp

    rng = np.random.default_rng(0)
    sm = be.sm_count
    wg = be.cc == "90"  # the wgmma tile builds for sm_90a only
    pairs = be.storage.pairs
    shapes = [tuple(map(int, s.split("x"))) for s in a.shapes.split(",")]
    buckets = [n for n in map(int, a.ns.split(",")) if n in BUCKETS]
    columns = [c for c in COLUMNS if c in a.tune_columns.split(",")]
    paths = {p for c in columns for p in COLUMNS[c]}

    def cands(n: int, rows: int, k: int) -> list[tuple[str, Cfg | None]]:
        """tune_candidates of the paths of the columns tuned (--tune-columns)."""
        return [(p, c) for p, c in tune_candidates(n, rows, k, sm, wg) if p in paths]

    names = set()  # compile every candidate up front: parallel NVRTC programs
    for rows, k in shapes:
        for n in buckets:
            for path, cfg in cands(n, rows, k):
                if cfg is None:
                    continue
                for in_t in (IN_TYPES[np.dtype(np.float16)], IN_TYPES[np.dtype(np.float32)]):
                    names.add(kernel_name(path, cfg, True, in_t))
                    if path == "mma_f16" and cfg.src == 3:
                        names.add(f"q6k_prep_f16<{cfg.nt}, {in_t}>")
                    if path == "mmq_q8_1":
                        names.add(f"q6k_prep_q8_1<{cfg.nt}, {in_t}>")
    t0 = time.perf_counter()
    if be.storage.pairs:  # pair-stream weights (--pairs): what plan asks for on them
        got = prefetch_auto(be, [(rows, k, n, cfg, path, in_t) for rows, k in shapes
                                 for n in buckets
                                 for path, cfg in cands(n, rows, k)
                                 for in_t in ("InF16",)], Layout.SOA)
    else:
        with be.ctx.dev:
            got = sum(be.ctx.prefetch(f, {nm for nm in names if nm.startswith("q6k_wg_") == (
                f == WG_FILE)}, threads=16) for f in (MATMUL_FILE, WG_FILE) if f != WG_FILE or wg)
    print(f"# compiled {got} instantiations in {time.perf_counter() - t0:.1f} s"
          f"{' (pair streams)' if be.storage.pairs else ''}", flush=True)
    entries: list[Entry] = []
    rows_out: list[dict] = []
    meta = {"device": be.device_name(), "sm_count": sm, "cc": str(be.cc),
            "date": time.strftime("%Y-%m-%d"), "commit": a.commit,
            "command": "python bench/kernels.py --tune " + " ".join(a.tune_args),
            "activations": "f16", "iters": a.iters, "keep": KEEP,
            "weights": "pair streams" if pairs else "plain SoA",
            "note": "written by bench/kernels.py --tune; read by kernels/cuda/dispatch.py" + (
                f"; --confirm {a.confirm}: a cell whose tuned pick differs from the previous "
                f"table's keeps it only if an alternated re-timing finds it > {CONFIRM:.0%} "
                "faster, else the previous pick" if a.confirm else "")}
    hdr = (f"{'shape':>12} {'N':>3} {'AUTO (table)':>28} {'f16 us':>7} {'TB/s':>5} "
           f"{'f32 us':>7} {'torch':>7} {'xtorch':>6}  runner-up")
    for rows, k in shapes:
        shape_s = f"{rows}x{k}"
        wbytes = q6k.aos_nbytes(rows, k)
        ws = load_copies(be, rng, rows, k, Layout.SOA)
        print(f"\n{shape_s}: {wbytes / 1e6:.1f} MB Q6_K, {len(ws)} rotated copies\n{hdr}",
              flush=True)
        for n in buckets:
            xs = {d: cp.asarray(rng.standard_normal((n, k)).astype(t)) for d, t in DTYPES.items()}
            timed: dict[tuple[str, Cfg | None], float | None] = {}
            for path, cfg in cands(n, rows, k):
                def call(i: int, path=path, cfg=cfg, ws=ws, x=xs["f16"]) -> None:
                    be.run(ws[i], x, np.dtype(np.float16), path, cfg)

                try:
                    with be.ctx.dev, be.stream:
                        timed[(path, cfg)] = time_calls(cp, call, len(ws), 2, a.iters)
                except Exception as e:  # a candidate that fails is reported, never picked
                    print(f"{shape_s:>12} {n:>3} {path} {cfg} FAILED: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}", flush=True)
                    timed[(path, cfg)] = None
                rows_out.append({"shape": shape_s, "n": n, "path": path, "dtype": "f16",
                                 "cfg": cfg.label() if cfg else None, "us": timed[(path, cfg)]})
            cells = {c: pick(rows, k, n, c, timed, sm) for c in columns}
            entries += [e for e in cells.values() if e is not None]
            auto = cells.get("auto")
            if auto is None:
                continue
            if be.storage.pairs:  # the committed table's pick on these weights vs the best
                now = be.choose(n, Precision.AUTO, KernelFlags(), rows, k)
                if (now.path, now.cfg) not in timed:
                    def call_now(i: int, c=now, ws=ws, x=xs["f16"]) -> None:
                        be.run(ws[i], x, np.dtype(np.float16), c.path, c.cfg)

                    with be.ctx.dev, be.stream:
                        timed[(now.path, now.cfg)] = time_calls(cp, call_now, len(ws), 2, a.iters)
                t_now = timed[(now.path, now.cfg)]
                print(f"{shape_s:>12} {n:>3} table {now.path}.{now.cfg.label() if now.cfg else ''}"
                      f" {t_now:.1f} us on pairs; tuned {auto.path}."
                      f"{auto.cfg.label() if auto.cfg else ''} {auto.us:.1f}: "
                      f"x{t_now / auto.us:.3f}", flush=True)
                rows_out.append({"shape": shape_s, "n": n, "table_pick": f"{now.path}."
                                 f"{now.cfg.label() if now.cfg else ''}", "table_us": t_now,
                                 "tuned_us": auto.us})

            def call32(i: int, e=auto, ws=ws, x=xs["f32"]) -> None:
                be.run(ws[i], x, np.dtype(np.float32), e.path, e.cfg)

            us32 = float("nan")  # (--pairs: f16 only, the cells' picks are what it checks)
            if not be.storage.pairs:
                with be.ctx.dev, be.stream:
                    us32 = time_calls(cp, call32, len(ws), 2, a.iters)
            t_torch = None if a.no_torch else torch_linear_us(rows, k, n, max(2, min(
                16, math.ceil(3 * L2_BYTES / (2 * rows * k)))))
            ranked = sorted(((us, p, c) for (p, c), us in timed.items()
                             if us is not None and p in COLUMNS["auto"]), key=lambda t: t[0])
            runner = next((f"{p}.{c.label() if c else ''} {us:.1f}" for us, p, c in ranked
                           if (p, c) != (auto.path, auto.cfg)), "-")
            label = f"{auto.path}.{auto.cfg.label() if auto.cfg else ''}"
            xt = f"{t_torch / auto.us:6.2f}" if t_torch else "     -"
            tt = f"{t_torch:7.1f}" if t_torch else "      -"
            print(f"{shape_s:>12} {n:>3} {label:>28} {auto.us:7.1f} {wbytes / auto.us / 1e6:5.2f} "
                  f"{us32:7.1f} {tt} {xt}  {runner}", flush=True)
            rows_out.append({"shape": shape_s, "n": n, "path": "auto=" + label, "dtype": "f16",
                             "us": auto.us, "us_f32": us32, "torch_us": t_torch,
                             "tbs": wbytes / auto.us / 1e6})
        if a.confirm:  # each changed cell: committed vs tuned pick again, alternated
            entries = confirm_shape(a, be, ws, rows, k, buckets, entries, rows_out)
        free_copies(be, ws)
        # after every shape: a run cut short still leaves the shapes it finished, and the
        # committed table's cells not tuned (other shapes, other --ns) stay as they are
        tuned = {(e.rows, e.k, e.n, e.column) for e in entries}
        kept = [e for cells in (be.dispatch.table.cells.values() if be.dispatch.table else ())
                for e in cells.values() if (e.rows, e.k, e.n, e.column) not in tuned]
        DispatchTable(entries + kept, meta).dump(a.table_out)
    print(f"\n# wrote {len(entries)} tuned entries for {len(shapes)} shapes (+ the committed "
          f"table's other cells) to {a.table_out}")
    return rows_out


def confirm_shape(a: argparse.Namespace, be: CudaBackend, ws: list, rows: int, k: int,
                  buckets: list[int], entries: list[Entry], rows_out: list[dict]) -> list[Entry]:
    """--confirm R: every (bucket, column) of this shape whose tuned pick differs from the
    committed table's is timed again, committed and tuned alternated R times each (the best
    median of each; the tune's own figure is the minimum over many candidates, so it favours
    the tuned pick by its noise). The tuned entry stays only if this re-timing finds it more
    than CONFIRM faster; else the committed pick is written back (with its re-timed us).
    Prints one ``confirm`` line per changed cell; returns the entries."""
    import cupy as cp

    rng = np.random.default_rng(1)
    shape_s = f"{rows}x{k}"
    out = []
    for e in entries:
        if (e.rows, e.k) != (rows, k) or e.n not in buckets:
            out.append(e)
            continue
        now = be.choose(e.n, Precision(e.column), KernelFlags(), rows, k)
        if (now.path, now.cfg) == (e.path, e.cfg):
            out.append(e)
            continue
        x = cp.asarray(rng.standard_normal((e.n, k)).astype(np.float16))
        times: dict[str, list[float]] = {"table": [], "tuned": []}
        for _ in range(a.confirm):
            for key, (path, cfg) in (("table", (now.path, now.cfg)), ("tuned", (e.path, e.cfg))):
                def call(i: int, path=path, cfg=cfg, x=x) -> None:
                    be.run(ws[i], x, np.dtype(np.float16), path, cfg)

                with be.ctx.dev, be.stream:
                    times[key].append(time_calls(cp, call, len(ws), 2, a.iters))
        t_old, t_new = min(times["table"]), min(times["tuned"])
        keep_new = t_new < t_old * (1 - CONFIRM)
        lab = f"{now.path}.{now.cfg.label() if now.cfg else ''}"
        lab_new = f"{e.path}.{e.cfg.label() if e.cfg else ''}"
        print(f"{shape_s:>12} {e.n:>3} confirm {e.column:>5}: table {lab} {t_old:.1f} / tuned "
              f"{lab_new} {t_new:.1f} us: x{t_old / t_new:.3f} -> "
              f"{'tuned' if keep_new else 'table'}", flush=True)
        rows_out.append({"shape": shape_s, "n": e.n, "column": e.column, "confirm": True,
                         "table_pick": lab, "tuned_pick": lab_new, "table_us": t_old,
                         "tuned_us": t_new, "runs": times, "kept": "tuned" if keep_new
                         else "table"})
        out.append(e if keep_new else Entry(rows, k, e.n, e.column, now.path, now.cfg, t_old))
    return out


def cfg_from_label(label: str) -> Cfg:
    """The launch shape of a ``Cfg.label()`` (``nt4.m1.w12.s4.pf.k2``; --cfg-ab's JSON)."""
    kv: dict = {}
    for part in label.split("."):
        if part == "pf":
            kv["pf"] = True
            continue
        key = {"nt": "nt", "m": "mt", "w": "warps", "s": "src", "k": "ksplit"}
        name = next((n for n in sorted(key, key=len, reverse=True) if part.startswith(n)
                     and part[len(n):].isdigit()), None)
        if name is None:
            raise ValueError(f"not a launch-shape label: {label!r}")
        kv[key[name]] = int(part[len(name):])
    return Cfg(**kv)


def ab_cells(files: list[str], table: DispatchTable, gain: float,
             columns: tuple[str, ...] = ("auto", "f16"),
             max_rel: float = 1e-4) -> tuple[DispatchTable, list[str]]:
    """--ab-cells: the table with each (shape, N bucket) cell of ``files`` (--cfg-ab JSON of one
    or more runs; a candidate's time is its best over the runs) whose fastest candidate beat
    AUTO by more than ``gain`` (AUTO / candidate) with AUTO's numerics (rel < ``max_rel``, 1e-4:
    the same sums up to the order; session 20's src 8 rounds A differently, ~1e-4 to 1e-3 from
    AUTO within the F16 contract, and enters only with a larger ``max_rel``) set to that
    candidate, in ``columns`` where the cell held AUTO's pick (the launch shape the A/B ran).
    Returns the table and one line per cell (kept or changed)."""
    best: dict[tuple[str, int], dict[str, list[float]]] = {}
    auto: dict[tuple[str, int], tuple[str, list[float]]] = {}
    for f in files:
        with open(f) as fh:
            results = json.load(fh)["cfg_ab"]
        for r in results:
            key = (r["shape"], int(r["n"]))
            if r.get("rel") is None or not r["rel"] < max_rel or r["n"] not in BUCKETS:
                continue
            best.setdefault(key, {}).setdefault(r["cand"], []).append(r["cand_us"])
            auto.setdefault(key, (r["auto"], []))[1].append(r["auto_us"])
    entries = {(e.rows, e.k, e.n, e.column): e for cells in table.cells.values()
               for e in cells.values()}
    lines = []
    for (shape, n), cands in sorted(best.items()):
        rows, k = map(int, shape.split("x"))
        lab, ts = auto[(shape, n)]
        t_auto = min(ts)
        cand, t = min(((c, min(v)) for c, v in cands.items()), key=lambda cv: cv[1])
        cfg = cfg_from_label(cand)
        if t_auto / t <= gain:
            lines.append(f"{shape} N={n}: kept {lab} {t_auto:.2f} us (best {cand} {t:.2f}, "
                         f"x{t_auto / t:.3f})")
            continue
        for col in columns:
            e = entries.get((rows, k, n, col))
            if e is None or f"{e.path}.{e.cfg.label() if e.cfg else ''}" != lab:
                continue
            cfg.check(e.path)
            entries[(rows, k, n, col)] = Entry(rows, k, n, col, e.path, cfg, t)
            lines.append(f"{shape} N={n} {col}: {lab} {t_auto:.2f} -> mma_f16.{cand} {t:.2f} us "
                         f"(x{t_auto / t:.3f})")
    return DispatchTable(entries.values(), table.meta), lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(f"{r}x{k}" for r, k in SHAPES))
    ap.add_argument("--ns", default=",".join(map(str, NS)))
    ap.add_argument("--paths", default="auto,exact,mma_f16,mmq_q8_1,cublas_f16")
    ap.add_argument("--dtypes", default="f16,f32", help="activation dtypes timed per row")
    ap.add_argument("--layout", default="soa", choices=["soa", "aos"])
    ap.add_argument("--variants", action="store_true", help="compare mma_f16 launch shapes")
    ap.add_argument("--summary", action="store_true",
                    help="end with one line per shape and N: AUTO vs the fastest row")
    ap.add_argument("--samples", action="store_true",
                    help="after each row its calls' spread and the host's enqueue time")
    ap.add_argument("--spin-cycles", type=int, default=None,
                    help="GPU cycles the spin kernel buys per queued call (0: no spin, so the "
                    "GPU waits on the host between calls: what a slow host does to the figure; "
                    f"default {SPIN_CYCLES})")
    ap.add_argument("--repeat", type=int, default=1,
                    help="time each row this many times in a row (each printed)")
    ap.add_argument("--only", default=None,
                    help="time only the rows whose label contains this text (or any of a "
                    "comma-separated list; for profilers and A/Bs)")
    ap.add_argument("--iters", type=int, default=40, help="timed calls per row (median)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tune", action="store_true",
                    help="time every candidate per shape and N bucket, write the dispatch table")
    ap.add_argument("--table-out", default="kernels/cuda/dispatch_h200.json")
    ap.add_argument("--commit", default="", help="recorded in the table (the tuned tree)")
    ap.add_argument("--tune-columns", default=",".join(COLUMNS),
                    help="with --tune: the table columns tuned (their paths' candidates "
                    "only); the committed table's other columns stay")
    ap.add_argument("--confirm", type=int, default=0, metavar="R",
                    help="with --tune: time each cell whose pick changed again, committed and "
                    "tuned alternated R times each; keep the tuned pick only if it is more than "
                    "CONFIRM faster (confirm_shape)")
    ap.add_argument("--pairs", action="store_true",
                    help="load the weights as pair streams (Storage.pairs; the default unless "
                    "Q6SERVE_Q6K_PAIRS=0; with --tune: each cell's committed pick timed beside "
                    "the tuned one)")
    ap.add_argument("--precision", default="auto", choices=[p.value for p in Precision],
                    help="--pairs-ab: the table column timed (default auto)")
    ap.add_argument("--nts", default=None,
                    help="--pairs-ab: the column's path at each of these n-tile counts (e.g. "
                    "1,2,8) instead of the table's launch shape")
    ap.add_argument("--cfg-ab", default=None, metavar="N:CFG;..",
                    help="AUTO vs these mma_f16 launch shapes (N:nt=8,warps=12,src=4,pf=1;..), "
                         "alternated --rounds times, outputs compared with AUTO's")
    ap.add_argument("--rounds", type=int, default=2, help="--cfg-ab's alternations")
    ap.add_argument("--table-ab", default=None, metavar="OLD.json",
                    help="the committed table against this one: every changed cell timed "
                    "old/new alternated (table_ab)")
    ap.add_argument("--columns", default="auto,f16,exact,q8_1", help="--table-ab's columns")
    ap.add_argument("--pairs-ab", action="store_true",
                    help="AUTO on SoA and on pair-stream weights of the same blocks, f16 "
                    "activations, alternated in one process, bits compared (pairs_ab)")
    ap.add_argument("--ab-cells", default=None, metavar="AB.json[,..]",
                    help="no device: set the table cells (auto, f16) of these --cfg-ab results "
                    "whose best candidate beat AUTO by more than --gain, into --table-out")
    ap.add_argument("--gain", type=float, default=1.01, help="--ab-cells: AUTO/candidate above")
    ap.add_argument("--ab-rel", type=float, default=1e-4,
                    help="--ab-cells: a candidate's |y - y_AUTO| / |y_AUTO| below this")
    ap.add_argument("--note", default="", help="--ab-cells: appended to the table's note")
    a = ap.parse_args(argv)
    if a.spin_cycles is not None:
        globals()["SPIN_CYCLES"] = a.spin_cycles  # time_calls reads the module's value
    if a.ab_cells:
        from q6serve.kernels.cuda.dispatch import DEFAULT_TABLE

        table, lines = ab_cells(a.ab_cells.split(","), DispatchTable.load(DEFAULT_TABLE), a.gain,
                                max_rel=a.ab_rel)
        if a.note:
            table.meta["note"] = table.meta.get("note", "") + "; " + a.note
        table.dump(a.table_out)
        print("\n".join(lines))
        return 0
    # the command recorded in the table: the arguments that shape it (no output paths)
    all_shapes = ",".join(f"{r}x{k}" for r, k in SHAPES)
    a.tune_args = [f"--iters {a.iters}"] + (["--pairs"] if a.pairs else []) + (
        [f"--confirm {a.confirm}"] if a.confirm else []) + (
        [f"--tune-columns {a.tune_columns}"] if a.tune_columns != ",".join(COLUMNS) else []) + (
        [f"--shapes {a.shapes}"] if a.shapes != all_shapes else [])
    import cupy as cp

    be = CudaBackend(0)
    be.storage.pairs = a.pairs or be.storage.pairs
    print(f"# device: {be.device_name()}  date: {time.strftime('%Y-%m-%d')}  layout: {a.layout}"
          f"  table: {be.dispatch.table.meta.get('date', '?') if be.dispatch.table else 'none'}")

    def dump(key: str, results: list[dict]) -> None:
        if a.json:
            with open(a.json, "w") as fh:
                json.dump({"device": be.device_name(), key: results}, fh, indent=1)

    if a.table_ab:
        dump("table_ab", table_ab(a, be))
        return 0
    if a.cfg_ab:
        results = cfg_ab(a, be)
        dump("cfg_ab", results)
        return 0 if all(r["rel"] is not None and r["rel"] < 1e-4 for r in results) else 1
    if a.pairs_ab:
        results = pairs_ab(a, be)
        dump("pairs_ab", results)
        return 0 if all(r["same_bits"] for r in results) else 1
    if a.tune:
        dump("results", tune(a, be))
        return 0
    layout = Layout(a.layout)
    flags = KernelFlags(soa=layout is Layout.SOA)
    rng = np.random.default_rng(0)
    results: list[dict] = []
    hdr = f"{'shape':>14} {'N':>3} {'path':>26} {'us':>8} {'TB/s':>6} {'xllama':>7} {'xtorch':>7}"
    if "auto" in a.paths.split(","):  # AUTO's shapes compiled before the first weight loads
        t0 = time.perf_counter()
        jobs = [(r, k, n, c.cfg, c.path, IN_TYPES[np.dtype(DTYPES[d])])
                for r, k in (map(int, s.split("x")) for s in a.shapes.split(","))
                for n in map(int, a.ns.split(",")) for d in a.dtypes.split(",")
                for c in [be.choose(n, Precision.AUTO, flags, r, k)]]
        got = prefetch_auto(be, jobs, layout)
        print(f"# compiled {got} instantiations for AUTO in {time.perf_counter() - t0:.1f} s"
              f"{' (pair streams)' if be.storage.pairs else ''}", flush=True)
    for shape_s in a.shapes.split(","):
        rows, k = map(int, shape_s.split("x"))
        wbytes = q6k.aos_nbytes(rows, k)
        ws = load_copies(be, rng, rows, k, layout)
        copies = len(ws)
        print(f"\n{shape_s}: {wbytes / 1e6:.1f} MB Q6_K, {copies} rotated copies\n{hdr}")
        for n in map(int, a.ns.split(",")):
            t_torch = None if a.no_torch else torch_linear_us(rows, k, n, max(2, min(
                16, math.ceil(3 * L2_BYTES / (2 * rows * k)))))
            runs: list[tuple[str, str, Cfg | None]] = []
            for p in a.paths.split(","):
                if p == "auto":
                    c = be.choose(n, Precision.AUTO, flags, rows, k)
                    runs.append(("auto=" + c.path, c.path, c.cfg))
                elif p not in KERNELS:
                    raise SystemExit(f"unknown path {p!r}; use auto or one of {', '.join(KERNELS)}")
                elif not (p == "cublas_f16" and rows * k > 2e8 and n < 16):
                    runs.append((p, p, None))
            if a.variants:
                for name, cfg in VARIANTS.items():
                    if n in VARIANT_NS[name.split(".")[0]]:
                        runs.append(("mma_f16." + name, "mma_f16", cfg))
                if n == 1:
                    runs += [(name, "exact", cfg) for name, cfg in EXACT_VARIANTS.items()]
            if a.only:  # comma-separated: rows whose label contains any of them
                runs = [r for r in runs if any(o in r[0] for o in a.only.split(","))]
            for dname in a.dtypes.split(","):
                dt = np.dtype(DTYPES[dname])
                x = cp.asarray(rng.standard_normal((n, k)).astype(dt))
                for label0, path, cfg in runs:
                    label = f"{label0}.{dname}"

                    def call(i: int, path=path, c=cfg, ws=ws, x=x, dt=dt) -> None:
                        be.run(ws[i], x, dt, path, c)  # None: the dispatch's shape

                    for _rep in range(a.repeat):
                        try:
                            with be.ctx.dev, be.stream:
                                us = time_calls(cp, call, copies, iters=a.iters)
                        except Exception as e:  # a new variant that fails must not end the run
                            print(f"{shape_s:>14} {n:>3} {label:>26} FAILED: "
                                  f"{type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}", flush=True)
                            results.append({"shape": shape_s, "n": n, "path": label,
                                            "error": str(e)})
                            break
                        tbs = wbytes / us / 1e6
                        llama = LLAMA_US.get((rows, k), {}).get(n)
                        row = {"shape": shape_s, "n": n, "path": label, "dtype": dname,
                               "us": us, "tbs": tbs, "x_llama": llama / us if llama else None,
                               "x_torch": t_torch / us if t_torch else None,
                               "torch_us": t_torch, "host_us": TIMING["host_us"],
                               "covered": TIMING["covered"]}
                        if "uncovered_p50" in TIMING:
                            row["uncovered_p50"] = TIMING["uncovered_p50"]
                        if a.samples:
                            row["samples"] = TIMING["samples"]
                        results.append(row)
                        xl = f"{llama / us:7.2f}" if llama else "      -"
                        xt = f"{t_torch / us:7.2f}" if t_torch else "      -"
                        print(f"{shape_s:>14} {n:>3} {label:>26} {us:8.1f} {tbs:6.2f} {xl} {xt}",
                              flush=True)
                        if a.samples or "uncovered_p50" in TIMING:
                            print(f"{'':>14} {'':>3} {'#':>26} {timing_note()}", flush=True)
            if t_torch:
                print(f"{shape_s:>14} {n:>3} {'torch f16 linear':>26} {t_torch:8.1f} "
                      f"{2 * rows * k / t_torch / 1e6:6.2f}", flush=True)
        free_copies(be, ws)
    if a.summary:
        print_summary(results)
    dump("results", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
