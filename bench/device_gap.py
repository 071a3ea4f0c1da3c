"""The replay's device jobs without the service: where a call's time outside its kernel goes.

The service's decode replay (bench/service.py --replay, single-weight calls) spent ~88 us per
call outside the kernel at S=1 and ~153 at S=8 (session 9's closing check), while
``CudaBackend.matmul`` on one weight in a tight loop spends 26-34 us (bench/backend_wall.py).
This runs the replay's calls in-process - the 197 weights of a 28-layer 7B-class model in step
order, f16 x from host memory, f16 y, ``launch_ieee`` as the engine calls it - and times each
call (perf_counter around launch + wait, minus the call's own kernel seconds), under:

- ``order``: ``step`` (every weight in turn, as the replay) or ``same`` (one 18944x3584 weight
  repeated: what backend_wall measures);
- ``gap``: between calls nothing (``0``), a busy spin of G us (``spinG``: the host stays hot,
  the GPU idles) or a sleep of G us (``sleepG``: the host idles too, as the worker between two
  requests of a closed-loop client).

- ``y16``: ``Launcher.y16_graph`` off (0: a larger f16 y, > 64 KiB, converted by a CuPy launch
  per call) or on (1: converted inside the bound sequence's graph).

Per (N, y16, order, gap) it prints the median and p90 of wall - kernel per call, and per role.
GPU only.

    python bench/device_gap.py [--ns 1,8] [--gaps 0,spin300,sleep300] [--y16 0,1] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from tile_probe import device_weight

from q6serve.kernels.api import KernelFlags, Layout, Precision, launch_ieee
from q6serve.kernels.cuda.launch import MATMUL_FILE, kernel_file, kernel_name
from q6serve.kernels.cuda_backend import CudaBackend

LAYER = (("q", 3584, 3584), ("k", 512, 3584), ("v", 512, 3584), ("o", 3584, 3584),
         ("gate", 18944, 3584), ("up", 18944, 3584), ("down", 3584, 18944))
LM_HEAD = ("lm_head", 152064, 3584)


def wait_gap(gap: str) -> None:
    if gap == "0":
        return
    us = float(gap[5:] if gap.startswith("sleep") else gap[4:])
    if gap.startswith("sleep"):
        time.sleep(us * 1e-6)
        return
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="1,8")
    ap.add_argument("--gaps", default="0,spin300,sleep300")
    ap.add_argument("--orders", default="step,same")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--y16", default="0,1")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import cupy as cp

    be = CudaBackend(0)
    t0 = time.time()
    plan = [(f"blk.{i}.{r}", rows, k) for i in range(a.layers) for r, rows, k in LAYER]
    plan.append(LM_HEAD)
    weights = {}
    with be.ctx.dev, be.stream:
        for rows, k in sorted({(r, k) for _, r, k in plan}):
            nb = rows * (k // 256)
            aos = cp.random.randint(0, 256, size=(nb, 210), dtype=cp.int32).astype(cp.uint8)
            d = (cp.random.standard_normal(nb, dtype=cp.float32) * 1e-3).astype(cp.float16)
            aos[:, 208:210] = d.view(cp.uint8).reshape(nb, 2)
            for name, r2, k2 in plan:
                if (r2, k2) == (rows, k):
                    weights[name] = device_weight(be, aos, rows, k, Layout.SOA)
            del aos
        be.stream.synchronize()
    print(f"# device: {be.device_name()}  {len(plan)} weights built in {time.time() - t0:.1f} s",
          flush=True)
    # compile AUTO's kernels up front, on parallel threads (one by one on first use would be
    # a whole NVRTC pass each), and the split-K sum beside them
    t0 = time.time()
    names = {}
    for _, rows, k in plan:
        for n in (int(v) for v in a.ns.split(",")):
            c = be.choose(n, Precision.AUTO, KernelFlags(), rows, k)
            if c.cfg is not None:
                names.setdefault(kernel_file(c.path, c.cfg), set()).add(
                    kernel_name(c.path, c.cfg, True, "InF16"))
    with be.ctx.dev, ThreadPoolExecutor(4) as ex:
        jobs = [ex.submit(be.ctx.prefetch, f, ns, 8) for f, ns in names.items()]
        jobs.append(ex.submit(be.ctx.fn, MATMUL_FILE, "q6k_sum_parts"))
        for j in jobs:
            j.result()
    print(f"# compiled {sum(map(len, names.values()))} kernels in {time.time() - t0:.1f} s",
          flush=True)
    rng = np.random.default_rng(0)
    f16 = np.dtype(np.float16)
    flags = KernelFlags()
    results = []
    print(f"{'N':>3} {'y16':>3} {'order':>5} {'gap':>9} {'calls':>6} {'host p50':>9} "
          f"{'host p90':>9} {'kernel/step':>11} {'host/step':>10}   host p50 per role (us)",
          flush=True)
    for n in (int(v) for v in a.ns.split(",")):
        xs = {k: rng.standard_normal((n, k)).astype(np.float16) for k in (3584, 18944)}
        for y16, order in [(y, o) for y in a.y16.split(",") for o in a.orders.split(",")]:
            if bool(int(y16)) != be.launcher.y16_graph:  # bound calls are keyed without it
                be.launcher.y16_graph = bool(int(y16))
                for w in weights.values():
                    w.data.plans.clear()
            seq = plan if order == "step" else [p for p in plan if p[0] == "blk.0.gate"] * len(plan)
            for gap in a.gaps.split(","):
                rec: list[tuple[str, float, float]] = []
                for s in range(a.steps + 1):
                    for name, _, k in seq:
                        w = weights[name]
                        t = time.perf_counter()
                        r = launch_ieee(be, w, xs[k], precision=Precision.AUTO, flags=flags,
                                        out_dtype=f16).wait()
                        wall = time.perf_counter() - t
                        if s:  # step 0: warm-up (compiles, binds, captures)
                            rec.append((name.split(".")[-1], wall, r.timing.seconds() or 0.0))
                        wait_gap(gap)
                host = [(wl - kn) * 1e6 for _, wl, kn in rec]
                roles = {}
                for role, wl, kn in rec:
                    roles.setdefault(role, []).append((wl - kn) * 1e6)
                steps = a.steps
                row = {"n": n, "y16": int(y16), "order": order, "gap": gap, "calls": len(rec),
                       "host_p50": statistics.median(host),
                       "host_p90": float(np.percentile(host, 90)),
                       "kernel_step_ms": sum(kn for _, _, kn in rec) / steps * 1e3,
                       "host_step_ms": sum(host) / steps / 1e3,
                       "roles": {r: statistics.median(v) for r, v in roles.items()}}
                results.append(row)
                per_role = " ".join(f"{r} {v:.0f}" for r, v in row["roles"].items())
                print(f"{n:>3} {y16:>3} {order:>5} {gap:>9} {len(rec):>6} {row['host_p50']:9.1f} "
                      f"{row['host_p90']:9.1f} {row['kernel_step_ms']:9.2f}ms "
                      f"{row['host_step_ms']:8.2f}ms   {per_role}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"device": be.device_name(), "results": results},
                                           indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
