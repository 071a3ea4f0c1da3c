"""The 7B decode replay's service path on the CPU: multi-weight vs single-weight calls (issue 14).

bench/service.py --replay drives a real worker; on the NumPy backend its kernels (a 55 MB
weight dequantized per call) bury the service's own cost, and the weights must be scaled down,
which shrinks the replies too. Here the worker (service/worker.py, in its own process) runs on
a *simulated* backend: every matmul returns a y of the real shape, written in full (as a
download would write it), after ``--kernel-us`` of GIL-free sleep (as a CUDA job waits on its
sync); the weights are real-sized (the replies are) but only their K and rows are kept. The
hosts are bench/service_replay.py's (its plan without the lm-head, whose top-k the simulated
backend does not compute), so the step's parts are the replay's own.

    python bench/replay_sim.py --seqs 64 --layers 4 --seconds 3
    python bench/replay_sim.py --seqs 1,64 --spy /tmp/spy   # py-spy the worker per variant

Prints one line per (S, multi) with the step's p50 and its parts (ms per step, sums over calls).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from service_replay import STEP_FIELDS, ReplaySpec, model_weights, run_replay, step_plan


def _sim_backend(kernel_us: float) -> Any:
    from q6serve.kernels.api import KernelTiming, MatmulResult, Precision, ResidentWeight
    from q6serve.kernels.numpy_backend import NumpyBackend

    class Sim(NumpyBackend):
        """y of the real shape, written; the kernel a GIL-free sleep; weights not kept."""

        def load(self, chunks: Any, rows: int, k: int, layout: Any, chunk_bytes: int,
                 ) -> ResidentWeight:
            for _ in chunks:  # read (and hashed) as a real load would, then dropped
                pass
            return ResidentWeight(rows, k, layout, 0)

        def free(self, w: Any) -> None:
            pass

        def matmul(self, w: Any, x: np.ndarray, **kw: Any) -> MatmulResult:
            if kernel_us:
                time.sleep(kernel_us * 1e-6)
            y = np.empty((x.shape[0], w.rows), kw.get("out_dtype") or np.float32)
            y.fill(1)
            return MatmulResult(y, "sim", w.layout, Precision.EXACT,
                                KernelTiming(host_seconds=kernel_us * 1e-6))

    return Sim(threads=1)


def _worker_main(port_q: Any, kernel_us: float, weights: list[tuple[str, int, int]]) -> None:
    import dataclasses
    import hashlib

    from q6serve.service.config import WorkerConfig
    from q6serve.service.engine_types import UploadSpec
    from q6serve.service.worker import Worker

    async def serve() -> None:
        worker = Worker(dataclasses.replace(WorkerConfig(), port=0), _sim_backend(kernel_us))
        await worker.start()
        blocks: dict[tuple[int, int], tuple[bytes, str]] = {}
        for name, rows, k in weights:
            if (rows, k) not in blocks:
                data = bytes(rows * k // 256 * 210)
                blocks[(rows, k)] = (data, hashlib.sha256(data).hexdigest())
            data, sha = blocks[(rows, k)]

            async def once(d: bytes = data) -> Any:
                yield d

            await worker.engine.upload(UploadSpec(name, rows, k, "q6_k", len(data), sha),
                                       once())
        blocks.clear()
        port_q.put(worker.port)
        await worker.server.wait_for_termination()

    asyncio.run(serve())


def _proc(pid: int) -> tuple[float, int]:
    """CPU seconds (user + system) and minor page faults of process ``pid`` so far."""
    f = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(f[11]) + int(f[12])) / tick, int(f[7])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="64", help="S values (N = S per call)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--multi", default="both", choices=("both", "on", "off"))
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--kernel-us", type=float, default=30.0,
                    help="the simulated kernel's GIL-free wait per matmul")
    ap.add_argument("--spy", default="", help="folder: py-spy record the worker per variant")
    a = ap.parse_args(argv)
    weights = [w for w in model_weights(a.layers, 1.0) if not w[0].startswith("lm_head")]
    rows = {name: r for name, r, _ in weights}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_worker_main, args=(q, a.kernel_us, weights), daemon=True)
    proc.start()
    try:
        port = q.get(timeout=600)
        styles = {"both": [True, False], "on": [True], "off": [False]}[a.multi]
        for s in (int(v) for v in a.seqs.split(",") if v):
            for multi in styles:
                label = f"S={s} {'multi' if multi else 'single'}"
                plan = tuple(c for c in step_plan(a.layers, {**rows, "lm_head": 1}, multi, 0)
                             if c.weights != ("lm_head",))
                spec = ReplaySpec(f"127.0.0.1:{port}", plan, s, a.seconds, a.warmup, 3,
                                  "stream", "f16", 2, "f16")
                spy = None
                if a.spy:
                    Path(a.spy).mkdir(parents=True, exist_ok=True)
                    out = Path(a.spy) / f"{label.replace(' ', '_').replace('=', '')}.txt"
                    spy = subprocess.Popen(
                        ["py-spy", "record", "-p", str(proc.pid), "-r", "500", "-f", "raw",
                         "-d", str(int(a.seconds + a.warmup + 2)), "-o", str(out), "--nonblocking"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                cpu0, flt0 = _proc(proc.pid)
                st, _, _ = run_replay(spec, 1)
                cpu1, flt1 = _proc(proc.pid)  # (the warm-up steps counted too)
                if spy is not None:
                    spy.wait()
                p = {f: float(np.median(st[f])) * 1e3 for f in STEP_FIELDS}
                steps = len(st["e2e"]) + spec.warm_steps
                print(f"{label:<12} calls/step {len(plan):>3} steps {len(st['e2e']):>4}  "
                      f"step p50 {p['e2e']:8.2f} ms  transport {p['transport']:7.2f}  "
                      f"worker {p['handler']:7.2f} (device {p['device']:6.2f}, queue "
                      f"{p['queue']:5.2f})  client {p['client']:6.2f}  worker CPU/step "
                      f"~{(cpu1 - cpu0) / steps * 1e3:.1f} ms, page faults/step "
                      f"~{(flt1 - flt0) / steps:.0f}", flush=True)
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
