"""One caller's Client.matmul of a large y, the client reading the reply's arrays as views of
its bytes (client/reply_bytes.py) against parsing it whole (upb: y copied twice), alternated in
one process on one worker: what a caller fetching full logits pays for its own decoding.

    python3 bench/client_decode.py --backend cuda --rows 152064 --k 3584 --n 64 --calls 12
    a CPU rehearsal: --backend numpy --rows 4096 --k 512 --n 8 --calls 4

Each round runs ``--calls`` calls per variant ("views": the client's default threshold;
"whole": every reply parsed whole), in the order views, whole, whole, views per two rounds; per
variant the p50 of the calls' wall (the first call of each round left out) and of the worker's
handler (reply timing). The difference of the walls is the client's decoding (the same worker,
weight, x, and gRPC path).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from q6serve.client import reply_bytes
from q6serve.client.client import Client
from q6serve.client.worker_process import WorkerProcess
from q6serve.kernels import q6k

NEVER = 1 << 62  # a VIEW_MIN no reply reaches: parsed whole


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--rows", type=int, default=152064)
    ap.add_argument("--k", type=int, default=3584)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--out", default="f32", choices=("f32", "f16"))
    ap.add_argument("--calls", type=int, default=12, help="calls per variant and round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--log", type=Path, default=Path("worker_client_decode.log"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    default_min = reply_bytes.VIEW_MIN
    variants = {"views": default_min, "whole": NEVER}
    order = [("views", "whole") if r % 2 == 0 else ("whole", "views") for r in range(a.rounds)]
    got: dict[str, dict[str, list[float]]] = {v: {"wall": [], "handler": []} for v in variants}
    w = WorkerProcess(["--backend", a.backend], a.log).start()
    try:
        with Client(w.target, timeout=600.0) as c:
            t0 = time.perf_counter()
            c.upload("w", q6k.random_blocks(a.rows, a.k, np.random.default_rng(0)), a.rows, a.k)
            print(f"# uploaded {a.rows}x{a.k} in {time.perf_counter() - t0:.1f} s", flush=True)
            x = np.random.default_rng(1).standard_normal((a.n, a.k)).astype(np.float16)
            c.matmul_full("w", x, out_dtype=a.out)  # kernels built, plans made
            for pair in order:
                for v in pair:
                    reply_bytes.VIEW_MIN = variants[v]
                    for i in range(a.calls):
                        t = time.perf_counter()
                        o = c.matmul_full("w", x, out_dtype=a.out)
                        wall = time.perf_counter() - t
                        if i:  # a variant's first call after the switch left out
                            got[v]["wall"].append(wall)
                            got[v]["handler"].append(o.handler_seconds or float("nan"))
    finally:
        reply_bytes.VIEW_MIN = default_min
        w.stop()
    y_bytes = a.n * a.rows * (4 if a.out == "f32" else 2)
    res: dict[str, Any] = {"argv": sys.argv, "y_bytes": y_bytes, "variants": {}}
    print(f"# Client.matmul_full of {a.rows}x{a.k} at N={a.n}, y {a.out} ({y_bytes / 1e6:.1f} MB); "
          f"{a.rounds} rounds x {a.calls} calls; p50 ms")
    for v, cols in got.items():
        wall, handler = (float(np.nanmedian(cols[f]) * 1e3) for f in ("wall", "handler"))
        res["variants"][v] = {"wall_p50_ms": wall, "handler_p50_ms": handler,
                              "calls": len(cols["wall"])}
        print(f"{v:<6} call p50 {wall:8.3f} ms  worker handler p50 {handler:8.3f} ms  "
              f"calls {len(cols['wall'])}")
    d = res["variants"]["whole"]["wall_p50_ms"] - res["variants"]["views"]["wall_p50_ms"]
    print(f"# whole - views: {d:.3f} ms a call")
    if a.json is not None:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
