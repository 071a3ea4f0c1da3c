"""N tiny weights in one worker (NumPy backend, loopback gRPC): what the event loop and
health checks see while they are loaded, used, collected, unloaded and closed.

    .venv/bin/python bench/many_weights.py 65536 [--touch 65536] [--no-gc]

A thread asks grpc.health.v1 Check every 20 ms (latency p50/p99/max per phase); a 5 ms ticker
on the worker's loop measures its longest step; ``gc.callbacks`` times every full (generation
2) collection. Phases: LoadWeights of one GGUF with N 1x256 tensors; one ``gc.collect()`` (the
longest pause a full collection makes with the weights resident); a matmul on ``--touch``
weights (each gets a batcher); 100 unloads; close. Also: GC-tracked objects and RSS per
weight.

Issue 18: with 65536 tensors the load blocked health checks past 30 s (quadratic name checks
on the loop), each unload cost ~58 ms and a close minutes; then full collections over ~27
tracked objects per weight made 0.33 s steps. Figures: docs/RELIABILITY.md ("Many weights").
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from q6serve.service.config import Budget, WorkerConfig
from q6serve.service.engine_types import MatmulCall
from tests.reliability.gguf_corpus import File, Tensor, q6k_blocks
from tests.reliability.harness import RunningWorker


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    return 0


class Probes:
    """Health latency (a thread), loop lateness (a ticker task), full-collection times."""

    def __init__(self, w: RunningWorker) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        self.health: list[float] = []
        self.step = 0.0
        self.gc2: list[float] = []
        self._t_gc = 0.0
        self._stop = threading.Event()
        self._chan = grpc.insecure_channel(w.target)
        stub = health_pb2_grpc.HealthStub(self._chan)
        req = health_pb2.HealthCheckRequest()

        def ask() -> None:
            while not self._stop.wait(0.02):
                t0 = time.perf_counter()
                stub.Check(req, timeout=30)
                self.health.append(time.perf_counter() - t0)

        def on_gc(phase: str, info: dict[str, Any]) -> None:
            if info["generation"] == 2:
                if phase == "start":
                    self._t_gc = time.perf_counter()
                else:
                    self.gc2.append(time.perf_counter() - self._t_gc)

        gc.callbacks.append(on_gc)
        self._thread = threading.Thread(target=ask, daemon=True)
        self._thread.start()

        async def tick() -> None:
            loop = asyncio.get_running_loop()
            last = loop.time()
            while True:
                await asyncio.sleep(0.005)
                now = loop.time()
                self.step = max(self.step, now - last - 0.005)
                last = now

        self._ticker = w.call(self._start(tick))

    @staticmethod
    async def _start(tick: Callable[[], Any]) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(tick())

    def close(self, w: RunningWorker) -> None:
        self._stop.set()
        self._thread.join()
        self._chan.close()
        w.loop.call_soon_threadsafe(self._ticker.cancel)

    def reset(self) -> None:
        self.health.clear()
        self.gc2.clear()
        self.step = 0.0

    def line(self, name: str, seconds: float) -> str:
        h = np.array(self.health or [0.0]) * 1e3
        gcs = (f"{len(self.gc2)} full GC, p50/max {np.median(self.gc2) * 1e3:5.1f}/"
               f"{max(self.gc2) * 1e3:5.1f} ms" if self.gc2 else "no full GC")
        return (f"{name:<16} {seconds:7.2f} s  loop step max {self.step * 1e3:6.1f} ms  "
                f"health p50/p99/max {np.percentile(h, 50):5.1f}/{np.percentile(h, 99):6.1f}/"
                f"{h.max():6.1f} ms ({len(self.health)})  {gcs}")


def tracked() -> int:
    """GC-tracked objects, frozen ones included (gc.freeze moves them out of get_objects)."""
    return len(gc.get_objects()) + gc.get_freeze_count()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int)
    ap.add_argument("--touch", type=int, default=None, help="weights to run a matmul on "
                    "(default: all)")
    ap.add_argument("--no-gc", action="store_true", help="disable the cyclic collector")
    args = ap.parse_args()
    n, touch = args.n, args.n if args.touch is None else min(args.touch, args.n)
    logging.disable(logging.INFO)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "many.gguf"
        b = q6k_blocks(1, 256, 1)
        path.write_bytes(File(tensors=[Tensor(f"t{i}", [256, 1], data=b)
                                       for i in range(n)]).build())
        if args.no_gc:
            gc.disable()
        w = RunningWorker(WorkerConfig(port=0, model_dir=path.parent,
                                       vram_budget=Budget(nbytes=8 << 30)))
        c = w.client(timeout=600)
        p = Probes(w)
        time.sleep(0.2)

        def phase(name: str, fn: Callable[[], object]) -> None:
            p.reset()
            t0 = time.perf_counter()
            fn()
            print(p.line(name, time.perf_counter() - t0), flush=True)

        w.run(gc.collect)
        objs0, rss0 = w.run(tracked), rss()
        phase(f"load {n}", lambda: c.load(path.name))
        phase("gc.collect()", lambda: w.run(gc.collect))
        objs1, rss1 = w.run(tracked), rss()
        print(f"{'resident':<16} {(objs1 - objs0) / n:.2f} GC-tracked objects and "
              f"{(rss1 - rss0) / n:.0f} B RSS per weight ({objs1} tracked in all, "
              f"{w.run(gc.get_freeze_count)} frozen)")

        async def touch_all() -> None:
            x = np.ones((1, 256), np.float32)
            eng = w.engine
            for i in range(0, touch, 16):  # 16 at a time: a burst of 256 is queueing
                await asyncio.gather(*(eng.matmul(MatmulCall(f"t{j}", x))
                                       for j in range(i, min(touch, i + 16))))

        phase(f"matmul on {touch}", lambda: w.call(touch_all(), timeout=600))
        phase("gc.collect()", lambda: w.run(gc.collect))
        objs2 = w.run(tracked)
        print(f"{'after matmuls':<16} {(objs2 - objs0) / n:.2f} GC-tracked objects per weight")

        def unload_100() -> None:
            for i in range(0, n, max(1, n // 100)):
                c.unload(f"t{i}")

        phase("unload 100", unload_100)
        phase("close", lambda: w.call(w.engine.close(), timeout=600))
        p.close(w)
        w.stop()


if __name__ == "__main__":
    main()
