"""Loading, unloading and closing N tiny weights through one Engine (NumPy backend):
wall time and the longest event-loop step (a 5 ms ticker measures how late it runs).

    .venv/bin/python bench/many_weights.py 32768 [--no-gc]

Issue 18: with 65536 tensors the load blocked health checks past 30 s (quadratic name checks
on the loop), each unload cost ~58 ms and a close minutes. Figures: docs/RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from q6serve.kernels.backends import make_backend
from q6serve.service.config import Budget, WorkerConfig
from q6serve.service.engine import Engine
from tests.reliability.gguf_corpus import File, Tensor, q6k_blocks


async def run(path: Path, n: int) -> None:
    loop = asyncio.get_running_loop()
    last, worst = [loop.time()], [0.0]

    async def tick() -> None:
        while True:
            await asyncio.sleep(0.005)
            now = loop.time()
            worst[0] = max(worst[0], now - last[0] - 0.005)
            last[0] = now

    ticker = loop.create_task(tick())
    engine = Engine(make_backend("numpy"), WorkerConfig(
        port=0, model_dir=path.parent, vram_budget=Budget(nbytes=8 << 30)))

    async def phase(name: str, coro: object) -> None:
        worst[0] = 0.0
        t0 = time.perf_counter()
        await coro  # type: ignore[misc]
        print(f"{name:<14} {time.perf_counter() - t0:8.2f} s   longest loop step "
              f"{worst[0] * 1e3:7.1f} ms")

    await phase(f"load {n}", engine.load_gguf(path.name, []))

    async def unload_100() -> None:
        for i in range(0, n, max(1, n // 100)):
            await engine.unload(f"t{i}")

    await phase("unload 100", unload_100())
    await phase("close", engine.close())
    ticker.cancel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int)
    ap.add_argument("--no-gc", action="store_true", help="disable the cyclic collector")
    args = ap.parse_args()
    logging.disable(logging.INFO)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "many.gguf"
        b = q6k_blocks(1, 256, 1)
        path.write_bytes(File(tensors=[Tensor(f"t{i}", [256, 1], data=b)
                                       for i in range(args.n)]).build())
        if args.no_gc:
            gc.disable()
        asyncio.run(run(path, args.n))


if __name__ == "__main__":
    main()
