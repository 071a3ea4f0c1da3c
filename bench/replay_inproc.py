"""One decode layer's calls through the worker's MatmulStream handler in this process (issue 14,
ask 1 of session 26): the interceptor, Q6ServeServicer.MatmulStream and the real Engine over a
no-op NumPy backend (bench/batcher_overhead._Noop: y zeros at once, no kernel), one request in
flight, driven as gRPC would drive the handler (bench/stream_overhead.stream_handler) but
without gRPC: the Python the worker spends per call of each role of the 28-layer replay
(bench/service_replay.py: q+k+v, o, gate+up, down; S rows, f16 x and y), a figure far
steadier than a round trip on the shared 2-core VM.

  .venv/bin/python bench/replay_inproc.py --seqs 1 --calls 2000 --rounds 3
  .venv/bin/python bench/replay_inproc.py --profile q+k+v   # cProfile, per call, by cumulative

Prints per role the median over rounds of the per-call p50 (wall, and this thread's CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np

ROLES: dict[str, tuple[tuple[str, int], ...]] = {  # role -> (weight, rows) of K below
    "q+k+v": (("q", 3584), ("k", 512), ("v", 512)),
    "o": (("o", 3584),),
    "gate+up": (("gate", 18944), ("up", 18944)),
    "down": (("down", 3584),),
}
K = {"q+k+v": 3584, "o": 3584, "gate+up": 3584, "down": 18944}


async def _worker(scale: float) -> Any:
    """The worker over a no-op backend, one layer's weights loaded (rows x ``scale``)."""
    import dataclasses

    from batcher_overhead import _Noop, upload_random

    from q6serve.service.config import WorkerConfig
    from q6serve.service.worker import Worker

    worker = Worker(dataclasses.replace(WorkerConfig(), port=0), _Noop())
    await worker.start()
    for role, parts in ROLES.items():
        for name, rows in parts:
            await upload_random(worker.engine, name, max(1, round(rows * scale)), K[role])
    return worker


def _requests(seqs: int) -> dict[str, bytes]:
    from q6serve.client import core

    rng = np.random.default_rng(0)
    out = {}
    for role, parts in ROLES.items():
        x = rng.standard_normal((seqs, K[role])).astype(np.float16)
        names = [n for n, _ in parts]
        out[role] = core.matmul_request_bytes(names[0] if len(names) == 1 else names, x,
                                              "f16", "f16", "r1")
    return out


async def _drive(handler: Any, reqs: list[bytes], calls: int,
                 ) -> tuple[list[float], list[float]]:
    """``calls`` rounds of ``reqs`` in turn, one in flight: per request (wall, CPU) s."""
    from stream_overhead import start_stream

    incoming, ctx, runner = start_stream(handler)
    serialize = handler.response_serializer
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(calls):
        for raw in reqs:
            c0 = time.thread_time()
            t0 = time.perf_counter()
            incoming.put_nowait(raw)
            serialize(await ctx.written.get())
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
    incoming.put_nowait(None)
    await runner
    return wall, cpu


ABLATE = {
    "metrics": "the batch metrics (Engine._on_batch) and the stream request's "
               "(observe_stream_request) not recorded",
    "encode": "every reply the same 64 ready bytes (wire_replies.stream_reply not run)",
    "cost": "the window's cost a constant (Q6ServeServicer._cost not run)",
    "skeletons": "every request parsed by upb, none read through a skeleton "
                 "(wire_requests.SKELETONS off: the worker before session 27)",
}


def _fixed_reply(r: Any, rid: str, took: Any = None) -> bytes:
    return b"\x0a\x02r1" + b"\0" * 60


def ablate(names: list[str]) -> None:
    """Leave out what ``names`` say (ABLATE): an upper bound of what cutting each would save
    (the replies are wrong with ``encode``; the figures only)."""
    from q6serve.service import engine, servicer

    for name in names:
        if name == "metrics":
            engine.Engine._on_batch = lambda self, stats: None  # type: ignore[method-assign]
            servicer.observe_stream_request = lambda code, end=None: None  # type: ignore[assignment]
        elif name == "encode":
            servicer.wire_replies.stream_reply = _fixed_reply  # type: ignore[assignment]
        elif name == "cost":
            servicer.Q6ServeServicer._cost = lambda self, req, call=None: 1 << 16  # type: ignore[method-assign]
        elif name == "skeletons":
            servicer.wire_requests.SKELETONS = False
        else:
            raise SystemExit(f"--ablate: {name!r}: one of {', '.join(ABLATE)}")


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    from stream_overhead import stream_handler

    from q6serve.service.servicer import Q6ServeServicer

    ablate([x for x in a.ablate.split(",") if x])
    worker = await _worker(a.scale)
    try:
        servicer = Q6ServeServicer(worker.engine)
        handler = await stream_handler(servicer)
        reqs = _requests(a.seqs)
        roles = list(ROLES)
        await _drive(handler, [reqs[r] for r in roles], 50)  # warm: plans, costs, caches
        if a.profile:
            import cProfile
            import pstats

            pr = cProfile.Profile()
            pr.enable()
            await _drive(handler, [reqs[a.profile]], a.calls)
            pr.disable()
            st = pstats.Stats(pr)
            rows = []
            for (f, line, fn), (_, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
                if nc >= a.calls * 0.9:
                    rows.append((ct / a.calls * 1e6, tt / a.calls * 1e6, nc / a.calls,
                                 f"{f.split('/')[-1]}:{line}({fn})"))
            for ct, tt, n, name in sorted(rows, reverse=True)[:a.top]:
                print(f"{ct:7.2f} cum {tt:6.2f} own {n:4.1f}x {name}")
            return {}
        got: dict[str, dict[str, list[float]]] = {r: {"wall": [], "cpu": []} for r in roles}
        for _ in range(a.rounds):
            wall, cpu = await _drive(handler, [reqs[r] for r in roles], a.calls)
            for i, r in enumerate(roles):
                got[r]["wall"].append(float(np.median(wall[i::len(roles)])) * 1e6)
                got[r]["cpu"].append(float(np.median(cpu[i::len(roles)])) * 1e6)
        out = {r: {k: statistics.median(v) for k, v in d.items()} | {"rounds": d["wall"]}
               for r, d in got.items()}
        layer = sum(v["wall"] for v in out.values())
        print(f"# replay_inproc S={a.seqs} scale {a.scale} ablate {a.ablate or '-'}: per call "
              f"p50 us (median of {a.rounds} rounds of {a.calls})")
        for r, v in out.items():
            spread = ", ".join(f"{x:.1f}" for x in v["rounds"])
            print(f"{r:8s} wall {v['wall']:6.1f}  cpu {v['cpu']:6.1f}  (rounds {spread})")
        print(f"layer    wall {layer:6.1f}  (x28 + lm-head: the step's worker Python)")
        return out
    finally:
        await worker.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=1, help="rows per call (the host's S)")
    ap.add_argument("--calls", type=int, default=2000, help="layers per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scale", type=float, default=0.01,
                    help="weights' rows x this (the no-op backend's y is rows x S zeros; "
                         "default 0.01: small uploads, y sizes not the real ones)")
    ap.add_argument("--profile", default="", choices=("", *ROLES),
                    help="cProfile this role's calls instead (per call, by cumulative time)")
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--ablate", default="", metavar="WHAT[,WHAT]",
                    help="leave parts out (an upper bound of a cut): "
                         + "; ".join(f"{k}: {v}" for k, v in ABLATE.items()))
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    out = asyncio.run(main_async(a))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
