"""What one asyncio event-loop trip costs on this machine (issue 14: a MatmulStream round trip
takes ~6 trips where gRPC's bare echo takes 4; this says what each extra trip is worth).

  chain      a callback that call_soon()s the next: one trip each (select(0) + run_once)
  batch      100 callbacks scheduled at once: one trip runs them all (the per-callback part)
  select0    the selector's poll with timeout 0 alone (the syscall each trip makes)
  threadwake another thread's call_soon_threadsafe -> the loop runs it -> it answers the
             thread (a round trip through the loop's self-pipe, as gRPC's poller thread wakes
             the loop for each completion)

  python3 bench/loop_cost.py [--n 200000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import selectors
import sys
import threading
import time


def chain(n: int) -> float:
    async def go() -> float:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        left = [n]

        def step() -> None:
            left[0] -= 1
            if left[0]:
                loop.call_soon(step)
            else:
                done.set_result(None)

        t0 = time.perf_counter()
        loop.call_soon(step)
        await done
        return (time.perf_counter() - t0) / n

    return asyncio.run(go())


def batch(n: int) -> float:
    async def go() -> float:
        loop = asyncio.get_running_loop()
        rounds = n // 100
        t0 = time.perf_counter()
        for _ in range(rounds):
            for _ in range(100):
                loop.call_soon(int)
            await asyncio.sleep(0)
        return (time.perf_counter() - t0) / (rounds * 100)

    return asyncio.run(go())


def select0(n: int) -> float:
    sel = selectors.DefaultSelector()
    r, w = __import__("socket").socketpair()
    sel.register(r, selectors.EVENT_READ)
    t0 = time.perf_counter()
    for _ in range(n):
        sel.select(0)
    out = (time.perf_counter() - t0) / n
    sel.close()
    r.close()
    w.close()
    return out


def threadwake(n: int) -> float:
    async def go() -> float:
        loop = asyncio.get_running_loop()
        answers: queue.SimpleQueue[None] = queue.SimpleQueue()
        took: list[float] = []

        def other() -> None:
            for _ in range(n):
                t0 = time.perf_counter()
                loop.call_soon_threadsafe(answers.put, None)
                answers.get()
                took.append(time.perf_counter() - t0)

        t = threading.Thread(target=other)
        t.start()
        await asyncio.to_thread(t.join)
        took.sort()
        return took[len(took) // 2]

    return asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    got = {"chain_us": chain(a.n) * 1e6, "batch_us": batch(a.n) * 1e6,
           "select0_us": select0(a.n) * 1e6, "threadwake_p50_us": threadwake(a.n // 20) * 1e6}
    print("loop costs (us): " + "  ".join(f"{k} {v:.2f}" for k, v in got.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(got, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
