"""One GPU vs two: the multi-device worker core in-process on the lm-head shape (152064 x 3584).

For each device set (default ``0`` and ``0,1``) and placement (``shard``: rows split over the
devices, every request runs on all of them; ``replicate``: each device holds the whole weight
and requests spread), a random Q6_K lm-head is uploaded, then ``--concurrency`` callers issue
matmuls of N rows (N = 1, 8, 64) for ``--seconds`` each through the same engine the gRPC
worker runs (batching included, no network). Reported per row: wall latency p50/p99 of one
matmul (enqueue to result on the host), device kernel time p50 (CUDA events; the slowest
part for a sharded weight), requests/s, activation rows/s, and the speed-up against the
first device set at the same N, placement-independent.

Run on a two-GPU machine:  python bench/scaleout.py --backend cuda --devices 0 0,1 --json out.json
Smoke test without a GPU: python bench/scaleout.py --backend numpy --rows 4096 --seconds 0.5
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import platform
import subprocess
import time
from collections.abc import AsyncIterator

import numpy as np

from q6serve.kernels import q6k
from q6serve.kernels.backends import make_backend
from q6serve.service.config import Budget, WorkerConfig
from q6serve.service.devices import MultiDeviceEngine, parse_devices
from q6serve.service.engine_types import MatmulCall, UploadSpec

LM_HEAD = (152064, 3584)


@dataclasses.dataclass
class Row:
    devices: str
    placement: str
    n: int
    concurrency: int
    requests: int
    p50_ms: float
    p99_ms: float
    kernel_p50_ms: float | None
    req_per_s: float
    rows_per_s: float
    speedup: float | None = None


def random_weight(rows: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = rows * k // q6k.QK_K
    blocks = rng.integers(0, 256, (n, q6k.BLOCK_BYTES), dtype=np.uint8)
    blocks[:, 208:210] = rng.uniform(1e-4, 4e-4, n).astype(np.float16).view(
        np.uint8).reshape(n, 2)
    return blocks


async def _chunks(data: memoryview, size: int = 64 << 20) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield bytes(data[i : i + size])


async def run_set(args: argparse.Namespace, devices: tuple[int, ...], placement: str,
                  blocks: np.ndarray, digest: str, probe: np.ndarray,
                  probes: list[np.ndarray]) -> list[Row]:
    rows, k = args.rows, args.k
    cfg = WorkerConfig(model_dir=None, vram_budget=Budget.parse(args.vram_budget),
                       max_batch_rows=max(64, max(args.n)),
                       max_batch_delay_us=args.max_batch_delay_us,
                       max_upload_bytes=blocks.nbytes + 1)
    backends = [make_backend(args.backend, d) for d in devices]
    eng = MultiDeviceEngine(backends, cfg, None, placement, ordinals=devices)
    out: list[Row] = []
    try:
        spec = UploadSpec("lm_head", rows, k, "q6_k", blocks.nbytes, digest)
        t0 = time.perf_counter()
        await eng.upload(spec, _chunks(memoryview(blocks).cast("B")))
        print(f"# devices {','.join(map(str, devices))} {placement}: loaded "
              f"{blocks.nbytes / 1e6:.0f} MB in {time.perf_counter() - t0:.1f} s; "
              f"{eng.describe()}", flush=True)
        # the same probe on every device set: sharded/replicated must match one device
        probes.append((await eng.matmul(MatmulCall("lm_head", probe,
                                                   precision=args.precision))).y)
        rng = np.random.default_rng(1)
        for n in args.n:
            x = rng.standard_normal((n, k)).astype(np.float32)
            call = MatmulCall("lm_head", x, precision=args.precision)
            for _ in range(args.warmup):
                await eng.matmul(call)
            for conc in args.concurrency:
                lat: list[float] = []
                kern: list[float] = []
                t_start = time.perf_counter()
                stop = t_start + args.seconds
                await asyncio.gather(*(_caller(eng, call, stop, lat, kern) for _ in range(conc)))
                wall = time.perf_counter() - t_start
                ms = np.array(lat) * 1e3
                out.append(Row(",".join(map(str, devices)), placement, n, conc, len(lat),
                               float(np.percentile(ms, 50)), float(np.percentile(ms, 99)),
                               float(np.median(kern)) * 1e3 if kern else None,
                               len(lat) / wall, len(lat) * n / wall))
                print(_fmt(out[-1]), flush=True)
    finally:
        await eng.close()
    return out


async def _caller(eng: MultiDeviceEngine, call: MatmulCall, stop: float, lat: list[float],
                  kern: list[float]) -> None:
    """Issue matmuls back to back until ``stop``; record wall and kernel seconds."""
    while time.perf_counter() < stop:
        t = time.perf_counter()
        r = await eng.matmul(call)
        lat.append(time.perf_counter() - t)
        if r.kernel_seconds is not None:
            kern.append(r.kernel_seconds)


def _fmt(r: Row) -> str:
    kp = f"{r.kernel_p50_ms:9.3f}" if r.kernel_p50_ms is not None else f"{'n/a':>9}"
    sp = f"{r.speedup:6.2f}x" if r.speedup is not None else ""
    return (f"{r.devices:>7} {r.placement:>9} {r.n:>4} {r.concurrency:>4} {r.requests:>6} "
            f"{r.p50_ms:9.3f} {r.p99_ms:9.3f} {kp} {r.req_per_s:9.1f} {r.rows_per_s:10.1f} {sp}")


HEADER = (f"{'devices':>7} {'placement':>9} {'N':>4} {'conc':>4} {'reqs':>6} {'p50 ms':>9} "
          f"{'p99 ms':>9} {'kern ms':>9} {'req/s':>9} {'rows/s':>10} speedup")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cuda", choices=("cuda", "numpy", "auto"))
    ap.add_argument("--devices", nargs="+", default=["0", "0,1"],
                    help="device sets to compare, e.g. 0 0,1 (the first is the baseline)")
    ap.add_argument("--placements", nargs="+", default=["shard", "replicate"],
                    choices=("shard", "replicate"))
    ap.add_argument("--rows", type=int, default=LM_HEAD[0])
    ap.add_argument("--k", type=int, default=LM_HEAD[1])
    ap.add_argument("--n", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8],
                    help="concurrent callers (1: latency; more: throughput with batching)")
    ap.add_argument("--seconds", type=float, default=3.0, help="per (devices, N, concurrency)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--precision", default="auto", choices=("auto", "exact", "f16", "q8_1"))
    ap.add_argument("--vram-budget", default="0.9")
    ap.add_argument("--max-batch-delay-us", type=int, default=200)
    ap.add_argument("--json", metavar="FILE", help="also write the rows and the machine as JSON")
    args = ap.parse_args()
    from q6serve.kernels.api import Precision

    args.precision = Precision(args.precision)
    sets = [parse_devices(d) for d in args.devices]
    blocks = random_weight(args.rows, args.k)
    digest = hashlib.sha256(blocks).hexdigest()
    print(f"# weight {args.rows}x{args.k} Q6_K ({blocks.nbytes / 1e6:.0f} MB), backend "
          f"{args.backend}, N {args.n}, concurrency {args.concurrency}, {args.seconds} s each")
    print(HEADER)
    rows: list[Row] = []
    probe = np.random.default_rng(2).standard_normal((4, args.k)).astype(np.float32)
    probes: list[np.ndarray] = []
    for devices in sets:
        for placement in (args.placements if len(devices) > 1 else ["shard"]):
            rows += asyncio.run(run_set(args, devices, placement, blocks, digest, probe,
                                        probes))
    scale = float(np.abs(probes[0]).max()) or 1.0
    diffs = [float(np.abs(p.astype(np.float64) - probes[0]).max()) / scale for p in probes]
    print(f"# check: max |y - y(first set)| / max |y| per run: "
          f"{', '.join(f'{d:.2e}' for d in diffs)} (same kernels: expect 0 or rounding)")
    base = {(r.n, r.concurrency): r.rows_per_s for r in rows
            if r.devices == ",".join(map(str, sets[0]))}
    print("\n# summary (speed-up: rows/s against devices " + ",".join(map(str, sets[0])) + ")")
    print(HEADER)
    for r in rows:
        b = base.get((r.n, r.concurrency))
        r.speedup = r.rows_per_s / b if b else None
        print(_fmt(r))
    if args.json:
        meta = {"machine": platform.node(), "backend": args.backend, "shape": [args.rows, args.k],
                "commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                "gpus": _gpus()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=2)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _gpus() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "none"


if __name__ == "__main__":
    main()
