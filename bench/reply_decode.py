"""The caller's decode of one replay reply, CPU only: upb's parse and the arrays (what the
replay's host does with ``host.decode=arrays``, bench/service_load.reply_arrays) against the
q6serve client's own (``core.stream_outcome``: what a session's call returns, every field of
MatmulOutput), per reply shape of the 7B decode replay (bench/service_replay.py) at S = 1, 8.

    python3 bench/reply_decode.py [--seqs 1,8] [--reps 3000]

Prints, per shape, the reply's bytes and the best of 5 means (us) of each decode.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from service_load import reply_arrays

from q6serve.client import core
from q6serve.v1 import q6serve_pb2 as pb

# (role, rows of each weight, top-k) as the replay's calls (multi-weight, top-64 lm-head)
SHAPES = (("q+k+v", (3584, 512, 512), 0), ("o", (3584,), 0), ("gate+up", (18944, 18944), 0),
          ("down", (3584,), 0), ("lm_head", (152064,), 64))


def _timing(t: pb.MatmulTiming, whole: bool = True) -> None:
    """A worker's timing fields (a multi-weight result's own: decode and handler only)."""
    t.decode_seconds, t.handler_seconds = 1e-5, 1e-4
    if whole:
        t.queue_seconds, t.kernel_seconds, t.device_seconds = 1e-5, 2e-5, 5e-5
        t.batch_rows = t.batch_requests = 1


def reply(n: int, rows: tuple[int, ...], topk: int) -> bytes:
    """A MatmulStreamResponse as the worker sends it for one replay call (f16 y)."""
    m = pb.MatmulStreamResponse(request_id="")
    r = m.result
    if topk:
        r.kernel, r.layout, r.precision = "q6k_topk", pb.LAYOUT_SOA, pb.PRECISION_F16
        _timing(r.timing)
        r.topk.rows, r.topk.k = n, topk
        r.topk.values = r.topk.indices = bytes(4 * n * topk)
        r.topk.lse = bytes(4 * n)
    elif len(rows) == 1:
        r.kernel, r.layout, r.precision = "q6k", pb.LAYOUT_SOA, pb.PRECISION_F16
        _timing(r.timing)
        core.fill_tensor(r.y, _zeros(n, rows[0]))
    else:
        _timing(r.timing, whole=False)
        for i, w in enumerate(rows):
            o = r.outputs.add(weight=f"blk.0.w{i}", kernel="q6k", layout=pb.LAYOUT_SOA,
                              precision=pb.PRECISION_F16)
            _timing(o.timing)
            core.fill_tensor(o.y, _zeros(n, w))
    return m.SerializeToString()


def _zeros(n: int, rows: int) -> Any:
    import numpy as np

    return np.zeros((n, rows), np.float16)


def arrays(raw: bytes) -> Any:
    msg = pb.MatmulStreamResponse.FromString(raw)
    if msg.WhichOneof("outcome") != "result":
        raise RuntimeError("an error reply")
    return reply_arrays(msg.result)


def client(raw: bytes) -> Any:
    return core.stream_outcome(raw, {})


def best_us(fn: Callable[[bytes], Any], raw: bytes, reps: int) -> float:
    for _ in range(min(reps, 200)):
        fn(raw)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn(raw)
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="1,8")
    ap.add_argument("--reps", type=int, default=3000)
    a = ap.parse_args(argv)
    print("# S role bytes arrays_us client_us")
    for n in (int(s) for s in a.seqs.split(",") if s):
        for role, rows, k in SHAPES:
            raw = reply(n, rows, k)
            print(f"S={n} {role:8s} {len(raw):8d} {best_us(arrays, raw, a.reps):8.2f} "
                  f"{best_us(client, raw, a.reps):8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
