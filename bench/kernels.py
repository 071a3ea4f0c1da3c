"""Kernel benchmark of the CUDA backend (run on a GPU; never part of the test suite).

CUDA-event timing of each call after a warm-up, median over many calls; the weight is
rotated over enough resident copies that the 60 MB L2 cannot serve it; activations start as
f32 on the device, so conversion/quantization prepasses are inside the time. Prints the
effective weight bandwidth (Q6_K bytes / time), the ratio to ANCHORS.md's llama.cpp figures
and to torch's f16 linear on an f16 weight of the same shape timed in the same run.

    python bench/kernels.py [--shapes 4096x14336,...] [--ns 1,2,...] [--paths auto,exact,...]
                            [--variants] [--summary] [--only TEXT] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import numpy as np

from q6serve.kernels import q6k
from q6serve.kernels.api import KernelFlags, Layout, Precision, iter_aos_chunks
from q6serve.kernels.cuda_backend import Cfg, CudaBackend

SHAPES = ((4096, 14336), (3584, 18944), (152064, 3584), (512, 3584))
NS = (1, 2, 4, 8, 16, 32, 64)
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
    "nt1.sm": Cfg(nt=1), "nt1.sm.pf": Cfg(nt=1, pf=True), "nt1.sm.w4": Cfg(nt=1, warps=4),
    "nt1.ldg": Cfg(nt=1, src=0),
    "nt2.sm": Cfg(nt=2), "nt2.sm.pf": Cfg(nt=2, pf=True), "nt2.pre": Cfg(nt=2, src=1),
    "nt2.cpa": Cfg(nt=2, src=3), "nt2.cpa.pf": Cfg(nt=2, src=3, pf=True),
    "nt4.pre": Cfg(nt=4, src=1), "nt4.cpa.pf": Cfg(nt=4, src=3, pf=True),
    "nt8.pre": Cfg(nt=8, src=1), "nt8.cpa.pf": Cfg(nt=8, src=3, pf=True),
    "nt8.cpa": Cfg(nt=8, src=3), "nt8.cpa.pf.w4": Cfg(nt=8, src=3, pf=True, warps=4),
    # 32 rows per warp (mt=2): each activation fragment feeds two m-tiles
    "nt1.sm.m2": Cfg(nt=1, mt=2), "nt1.sm.m2.w4": Cfg(nt=1, mt=2, warps=4),
    "nt2.pre.m2": Cfg(nt=2, mt=2, src=1), "nt2.cpa.m2.w4": Cfg(nt=2, mt=2, src=3, warps=4),
    "nt4.cpa.m2": Cfg(nt=4, mt=2, src=3), "nt4.cpa.m2.w4": Cfg(nt=4, mt=2, src=3, warps=4),
    "nt8.cpa.m2": Cfg(nt=8, mt=2, src=3), "nt8.cpa.m2.w4": Cfg(nt=8, mt=2, src=3, warps=4),
}
VARIANT_NS = {"nt1": (1, 2, 4, 8), "nt2": (16, 32), "nt4": (32, 64), "nt8": (64,)}
EXACT_VARIANTS = {"exact.sm.pf": Cfg(nt=1, pf=True), "exact.sm": Cfg(nt=1),
                  "exact.ldg.pf": Cfg(nt=1, src=0, pf=True)}
SPIN_SRC = r"""extern "C" __global__ void spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}"""


def random_blocks(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    n = rows * (k // 256)
    blocks = rng.integers(0, 256, size=(n, 210), dtype=np.uint8)
    blocks[:, 208:210] = (rng.standard_normal(n) * 1e-3).astype(np.float16).view(
        np.uint8).reshape(n, 2)
    return blocks


def time_calls(cp, fn, copies: int, warmup: int = 3, iters: int = 40) -> float:
    """Median µs of ``fn(i)`` over ``iters`` calls, each timed alone with device events."""
    stream = cp.cuda.get_current_stream()
    for i in range(warmup):
        fn(i % copies)
    stream.synchronize()
    evs = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(iters)]
    # Keep the GPU busy while the host enqueues, so the events time the GPU, not Python.
    cp.RawKernel(SPIN_SRC, "spin")((1,), (1,), (np.int64(30_000_000),))
    for i, (a, b) in enumerate(evs):
        a.record(stream)
        fn(i % copies)
        b.record(stream)
    stream.synchronize()
    return statistics.median(cp.cuda.get_elapsed_time(a, b) * 1e3 for a, b in evs)


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
    keys = sorted({(r["shape"], r["n"]) for r in results}, key=lambda t: (t[0], t[1]))
    for shape, n in keys:
        rows = [r for r in results if r["shape"] == shape and r["n"] == n and "us" in r]
        auto = next((r for r in rows if r["path"].startswith("auto=")), None)
        best = min(rows, key=lambda r: r["us"], default=None)
        if auto is None or best is None:
            continue
        print(f"{shape:>14} {n:>3} {auto['us']:8.1f} ({auto['tbs']:.2f}) "
              f"{best['path'] + ' ' + format(best['us'], '.1f'):>29} ({best['tbs']:.2f}) "
              f"{best['us'] / auto['us']:9.2f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(f"{r}x{k}" for r, k in SHAPES))
    ap.add_argument("--ns", default=",".join(map(str, NS)))
    ap.add_argument("--paths", default="auto,exact,mma_f16,mmq_q8_1,cublas_f16")
    ap.add_argument("--layout", default="soa", choices=["soa", "aos"])
    ap.add_argument("--variants", action="store_true", help="compare mma_f16 launch shapes")
    ap.add_argument("--summary", action="store_true",
                    help="end with one line per shape and N: AUTO vs the fastest row")
    ap.add_argument("--only", default=None,
                    help="time only the rows whose label contains this text (for profilers)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import cupy as cp

    be = CudaBackend(0)
    layout = Layout(a.layout)
    flags = KernelFlags(soa=layout is Layout.SOA)
    rng = np.random.default_rng(0)
    results: list[dict] = []
    print(f"# device: {be.device_name()}  date: {time.strftime('%Y-%m-%d')}  layout: {a.layout}")
    hdr = f"{'shape':>14} {'N':>3} {'path':>22} {'us':>8} {'TB/s':>6} {'xllama':>7} {'xtorch':>7}"
    for shape_s in a.shapes.split(","):
        rows, k = map(int, shape_s.split("x"))
        wbytes = q6k.aos_nbytes(rows, k)
        copies = max(2, min(64, math.ceil(3 * L2_BYTES / wbytes)))
        blocks = random_blocks(rng, rows, k)
        ws = [be.load(iter_aos_chunks(blocks, rows, k, 64 << 20), rows, k, layout, 64 << 20)
              for _ in range(copies)]
        del blocks
        print(f"\n{shape_s}: {wbytes / 1e6:.1f} MB Q6_K, {copies} rotated copies\n{hdr}")
        for n in map(int, a.ns.split(",")):
            x = cp.asarray(rng.standard_normal((n, k)).astype(np.float32))
            t_torch = None if a.no_torch else torch_linear_us(rows, k, n, max(2, min(
                16, math.ceil(3 * L2_BYTES / (2 * rows * k)))))
            runs: list[tuple[str, str, Cfg | None]] = []
            for p in a.paths.split(","):
                if p == "auto":
                    c = be.choose(n, Precision.AUTO, flags, rows, k)
                    runs.append(("auto=" + c.path, c.path, c.cfg))
                elif not (p == "cublas_f16" and rows * k > 2e8 and n < 16):
                    runs.append((p, p, None))
            if a.variants:
                for name, cfg in VARIANTS.items():
                    if n in VARIANT_NS[name.split(".")[0]]:
                        runs.append(("mma_f16." + name, "mma_f16", cfg))
                if n == 1:
                    runs += [(name, "exact", cfg) for name, cfg in EXACT_VARIANTS.items()]
            if a.only:
                runs = [r for r in runs if a.only in r[0]]
            for label, path, cfg in runs:
                def call(i: int, path=path, c=cfg, ws=ws, x=x) -> None:
                    be.run(ws[i], x, np.dtype(np.float32), path, c)  # None: the default

                try:
                    with be.ctx.dev, be.stream:
                        us = time_calls(cp, call, copies)
                except Exception as e:  # a new variant that fails must not end the run
                    print(f"{shape_s:>14} {n:>3} {label:>22} FAILED: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}", flush=True)
                    results.append({"shape": shape_s, "n": n, "path": label, "error": str(e)})
                    continue
                tbs = wbytes / us / 1e6
                llama = LLAMA_US.get((rows, k), {}).get(n)
                row = {"shape": shape_s, "n": n, "path": label, "us": us, "tbs": tbs,
                       "x_llama": llama / us if llama else None,
                       "x_torch": t_torch / us if t_torch else None, "torch_us": t_torch}
                results.append(row)
                xl = f"{llama / us:7.2f}" if llama else "      -"
                xt = f"{t_torch / us:7.2f}" if t_torch else "      -"
                print(f"{shape_s:>14} {n:>3} {label:>22} {us:8.1f} {tbs:6.2f} {xl} {xt}",
                      flush=True)
            if t_torch:
                print(f"{shape_s:>14} {n:>3} {'torch f16 linear':>22} {t_torch:8.1f} "
                      f"{2 * rows * k / t_torch / 1e6:6.2f}", flush=True)
        for w in ws:
            be.free(w)
        ws.clear()
        cp.get_default_memory_pool().free_all_blocks()
    if a.summary:
        print_summary(results)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": be.device_name(), "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
