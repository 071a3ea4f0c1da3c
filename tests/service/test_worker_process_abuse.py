"""The gRPC surface's newest features abused against a real `q6serve worker --backend numpy`
process, alone (--frontends 1) and behind two front-end processes (--frontends 2): multi-weight
requests with top-k in MatmulStream and unary (duplicate names, none, mixed K, 10,000 names,
k=0/257/k > rows, NaN/Inf x, N=0/65/257), streams cancelled mid-way, flags toggled mid-stream.
Each bad request gets its status and a message naming the culprit, inside a stream too (the
stream goes on); afterwards the worker serves, holds no request, and its processes hold no more
file descriptors or threads than after a first round of the same abuse (a leak per request or
per cancelled stream would show)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from svc_util import matmul_request, process_tree

from q6serve.client.client import Client
from q6serve.client.worker_process import WorkerProcess
from q6serve.kernels import q6k
from q6serve.v1 import q6serve_pb2 as pb
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc

K = 512
SHAPES = {"q": (48, K), "k": (32, K), "v": (16, K), "other_k": (16, 256), "lm": (300, K)}
C = grpc.StatusCode
FLAGS = ("Q6SERVE_Q6K_SOA", "Q6SERVE_DECODE_MMQ", "Q6SERVE_DYNAMIC_BATCHING")


def _x(n: int, k: int = K, seed: int = 0, fill: float | None = None) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    if fill is not None:
        x[:] = fill
    return x


def _req(weights: str | list[str], x: np.ndarray, topk: int | None = None,
         rid: str = "") -> pb.MatmulRequest:
    return matmul_request(weights, x, topk, request_id=rid)  # type: ignore[no-any-return]


# (id, weights, x, k, code, message fragment)
BAD = [
    ("duplicate", ["q", "k", "q"], _x(1), 4, C.INVALID_ARGUMENT, "lists 'q' twice"),
    ("none", [], _x(1), 4, C.INVALID_ARGUMENT, "MatmulRequest.weight is empty"),
    ("mixed-k", ["other_k", "q"], _x(1, 256), 4, C.INVALID_ARGUMENT,
     "weights[1] 'q': activations have K=256, the weight has K=512"),
    ("10000-names", [f"w{i}" for i in range(10000)], _x(1), 4, C.INVALID_ARGUMENT,
     "lists 10000 weights; at most 16"),
    ("k-0", ["q", "k"], _x(1), 0, C.INVALID_ARGUMENT, "topk.k=0 is out of range"),
    ("k-257", ["q", "k"], _x(1), 257, C.INVALID_ARGUMENT, "topk.k=257 is out of range"),
    ("k-over-rows", ["q", "v"], _x(1), 17, C.INVALID_ARGUMENT,
     "weights[1] 'v': topk k=17 exceeds the 16 rows"),
    ("n-0", ["q", "k"], _x(0), 4, C.INVALID_ARGUMENT, "N >= 1, got (0, 512)"),
    ("n-257", ["q", "k", "v"], _x(257), 4, C.INVALID_ARGUMENT,
     "N=257 exceeds the per-request limit of 256"),
    ("unknown", ["q", "nope"], _x(1), 4, C.NOT_FOUND, "weights[1] 'nope'"),
]


def _held(pid: int) -> tuple[int, int]:
    """File descriptors and threads of the worker's processes (spinners have none of note)."""
    fds = threads = 0
    for p in [pid, *process_tree(pid)]:
        try:
            fds += len(os.listdir(f"/proc/{p}/fd"))
            threads += len(os.listdir(f"/proc/{p}/task"))
        except FileNotFoundError:
            pass
    return fds, threads


def _abuse(stub: Any) -> None:
    """One round: every bad request unary and in a stream, the good edge cases, cancelled
    streams, flags toggled under a stream."""
    for name, weights, x, k, code, fragment in BAD:
        with pytest.raises(grpc.RpcError) as e:
            stub.Matmul(_req(weights, x, k), timeout=30)
        assert e.value.code() == code and fragment in e.value.details(), (name, e.value.details())
        out = list(stub.MatmulStream(iter([_req(weights, x, k, rid="bad"),
                                           _req("v", _x(1), rid="ok")]), timeout=30))
        got = {r.request_id: r for r in out}
        assert got["bad"].error.code == code.value[0], name
        assert fragment in got["bad"].error.message, (name, got["bad"].error.message)
        assert got["ok"].WhichOneof("outcome") == "result", name
    # the edges that are no errors: k = rows, N = 65 (past one batch), non-finite x
    r = stub.Matmul(_req(["q", "v"], _x(1), 16), timeout=30)
    assert [(o.weight, o.topk.rows, o.topk.k) for o in r.outputs] == [("q", 1, 16), ("v", 1, 16)]
    r = stub.Matmul(_req(["q", "k", "v"], _x(65), 4), timeout=30)
    assert [o.topk.rows for o in r.outputs] == [65, 65, 65]
    for fill in (np.nan, np.inf, -np.inf):
        r = stub.Matmul(_req(["q", "k"], _x(2, fill=fill), 4), timeout=30)
        lse = np.frombuffer(r.outputs[0].topk.lse, "<f4")
        assert lse.shape == (2,) and not np.isfinite(lse).all(), (fill, lse)
    # streams cancelled mid-way: after some replies, and with many requests in flight unread
    for trial in range(4):
        def slow(trial: int = trial) -> Iterator[pb.MatmulRequest]:
            for i in range(1000):
                yield _req(["q", "k", "v"], _x(8, seed=i), 4, rid=str(i))
                time.sleep(0.002)
        call = stub.MatmulStream(slow(), timeout=30)
        for n, _ in enumerate(call):
            if n == 5 + 3 * trial:
                call.cancel()
                break
        burst = stub.MatmulStream((_req(["q", "lm"], _x(64, seed=i), 8, rid=str(i))
                                   for i in range(100)), timeout=30)
        time.sleep(0.02 * (trial + 1))
        burst.cancel()
    # flags toggled while a stream of multi-weight, top-k and single calls runs
    stop = threading.Event()
    refused: list[str] = []

    def toggle() -> None:
        i = 0
        while not stop.is_set():
            flag = pb.Flag(name=FLAGS[i % 3], enabled=bool((i // 3) % 2))
            try:
                stub.SetFlags(pb.SetFlagsRequest(flags=[flag]), timeout=10)
            except grpc.RpcError as e:
                refused.append(f"{e.code().name}: {e.details()}")
            i += 1
            time.sleep(0.005)

    def mixed() -> Iterator[pb.MatmulRequest]:
        for i in range(150):
            yield (_req(["q", "k", "v"], _x(4, seed=i), 4, rid=f"m{i}") if i % 3 == 0 else
                   _req("lm", _x(2, seed=i), 16, rid=f"t{i}") if i % 3 == 1 else
                   _req(["q", "k"], _x(3, seed=i), rid=f"y{i}"))

    t = threading.Thread(target=toggle)
    t.start()
    try:
        out = list(stub.MatmulStream(mixed(), timeout=60))
    finally:
        stop.set()
        t.join()
    assert not refused, refused[:3]
    errors = [r.error.message for r in out if r.WhichOneof("outcome") == "error"]
    assert len(out) == 150 and not errors, errors[:3]
    stub.SetFlags(pb.SetFlagsRequest(flags=[pb.Flag(name=f, enabled=True) for f in FLAGS]),
                  timeout=10)


def _idle(stub: Any, deadline_s: float = 10.0) -> None:
    """The worker serves and holds no request (a cancelled stream's work drains first)."""
    end = time.monotonic() + deadline_s
    while True:
        busy = {w.name: w.in_flight for w in stub.ListWeights(pb.ListWeightsRequest(),
                                                              timeout=10).weights
                if w.in_flight}
        if not busy or time.monotonic() > end:
            break
        time.sleep(0.05)
    assert not busy, busy
    assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).serving


@pytest.mark.parametrize("frontends", [1, 2])
def test_the_newest_features_abused_leave_nothing_behind(tmp_path: Path, frontends: int) -> None:
    w = WorkerProcess(["--backend", "numpy", "--frontends", str(frontends)],
                      tmp_path / "worker.log").start()
    assert w.proc is not None
    try:
        with Client(w.target) as c:
            for i, (name, (rows, k)) in enumerate(SHAPES.items()):
                c.upload(name, q6k.random_blocks(rows, k, np.random.default_rng(i)), rows, k)
        ch = grpc.insecure_channel(w.target)
        try:
            stub = pb_grpc.Q6ServeStub(ch)
            _abuse(stub)  # the first round warms every path (threads, arenas, channels)
            _idle(stub)
            time.sleep(0.5)
            base = _held(w.proc.pid)
            _abuse(stub)
            _idle(stub)
            time.sleep(0.5)
            after = _held(w.proc.pid)
        finally:
            ch.close()
        # (a leak per request, per cancelled stream or per flag change: dozens to hundreds)
        assert after[0] <= base[0] + 2 and after[1] <= base[1] + 2, (base, after)
        assert w.proc.poll() is None, w.log()[-2000:]
        assert "Traceback" not in w.log(), w.log()[-3000:]
    finally:
        assert w.stop() == 0, w.log()[-2000:]
