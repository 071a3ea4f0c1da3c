"""One caller, N=1, one weight: latency through the fast lane vs gRPC (issue 15 item 3).

Starts ``q6serve worker --allow-shm`` (``--frontends`` as given), uploads a synthetic weight,
then per path runs closed-loop calls for ``--seconds``: gRPC unary with the bytes in the
messages, gRPC unary with x and y in a region, and the fast lane (x and y in the same region).
Prints p50/p99 and p50 minus the worker's device time per call (the stretch target: p50 -
kernel <= 50 us on the H200; on the CPU the kernel is NumPy's, so compare the paths).

    python bench/lane_latency.py --backend numpy --rows 512 --k 3584 --seconds 3
    python bench/lane_latency.py --backend cuda --rows 3584 --k 18944 --json "$OUT/lane.json"
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from service import random_q6k, start_worker  # bench/ is sys.path[0]


def timed(fn: Any, seconds: float, warmup: float) -> tuple[np.ndarray, np.ndarray]:
    """Closed loop: (wall seconds per call, the worker's device seconds per call)."""
    end = time.perf_counter() + warmup
    while time.perf_counter() < end:
        fn()
    walls, dev = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        d = fn()
        walls.append(time.perf_counter() - t0)
        dev.append(np.nan if d is None else d)
    return np.asarray(walls), np.asarray(dev)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numpy", choices=("numpy", "cuda"))
    ap.add_argument("--rows", type=int, default=3584)
    ap.add_argument("--k", type=int, default=18944)
    ap.add_argument("--frontends", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    from q6serve.client.client import Client

    out_dir = a.json.parent if a.json else Path(tempfile.mkdtemp(prefix="q6lane-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    extra = ["--allow-shm"] + (["--frontends", str(a.frontends)] if a.frontends > 1 else [])
    worker = start_worker(a.backend, out_dir / "worker.log", extra)
    results: dict[str, Any] = {}
    try:
        with Client(worker.target) as c:
            c.upload("w", random_q6k(a.rows, a.k, 1), a.rows, a.k)
            x = np.random.default_rng(0).standard_normal((1, a.k)).astype(np.float16)
            with c.register_shm("io", 1 << 22) as region, c.open_lane(region) as lane:
                y_off = 1 << 21

                def rpc() -> float | None:
                    return c.matmul_full("w", x).device_seconds

                def rpc_region() -> float | None:
                    return c.matmul_full("w", x, x_region=region,
                                         y_region=(region, y_off)).device_seconds

                def via_lane() -> float | None:
                    lane.matmul("w", x, y_offset=y_off)
                    return lane.last.device_seconds if lane.last else None

                for name, fn in (("grpc bytes", rpc), ("grpc regions", rpc_region),
                                 ("lane", via_lane)):
                    walls, dev = timed(fn, a.seconds, a.warmup)
                    p50, p99 = (float(np.percentile(walls, q) * 1e6) for q in (50, 99))
                    d50 = float(np.nanmedian(dev) * 1e6) if np.isfinite(dev).any() else 0.0
                    results[name] = {"calls": int(walls.size), "p50_us": p50, "p99_us": p99,
                                     "device_p50_us": d50, "p50_minus_device_us": p50 - d50}
                    print(f"{name:<13} calls {walls.size:>7}  p50 {p50:8.1f} us  p99 {p99:8.1f} "
                          f"us  device p50 {d50:7.1f} us  p50 - device {p50 - d50:7.1f} us",
                          flush=True)
            st = c.status()
            results["device"] = st.device
    finally:
        worker.stop()
    if a.json:
        a.json.write_text(json.dumps({"argv": sys.argv[1:] if argv is None else argv,
                                      "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
