"""ShardedClient over NumPy workers on loopback: same results as one worker and the reference,
uneven splits, explicit ranges in any order, round_robin replicas, a shard going away."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from scaleout_util import LoopWorker, assert_close, reference, write_gguf

from q6serve.client.client import Client, Q6ServeError
from q6serve.client.sharded import ShardedClient

ROWS, K = 37, 512  # 37 rows over 3 shards: 13 + 12 + 12


@pytest.fixture
def gguf(model_dir: Path) -> np.ndarray:
    return write_gguf(model_dir / "m.gguf", {"w": (ROWS, K, 7)})["w"]


def _x(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, K)).astype(np.float32)


def test_sharded_equals_single_worker_and_reference(
        start_worker: Callable[..., LoopWorker], gguf: np.ndarray) -> None:
    single, *shards = (start_worker() for _ in range(4))
    with Client(single.target, timeout=10) as one, \
            ShardedClient([s.target for s in shards], timeout=10) as many:
        one.load("m.gguf", ["w"])
        (merged,) = many.load("m.gguf", ["w"])
        assert (merged.name, merged.rows, merged.k, merged.row_begin, merged.row_end) == \
            ("w", ROWS, K, 0, ROWS)
        parts = [(w.row_begin, w.row_end) for ws in many.list_shards() for w in ws]
        assert parts == [(0, 13), (13, 25), (25, 37)]
        for n in (1, 5):
            x = _x(n, n)
            y = many.matmul("w", x)
            assert y.shape == (n, ROWS) and y.dtype == np.float32
            np.testing.assert_allclose(y, one.matmul("w", x), rtol=1e-6, atol=1e-6)
            assert_close(y, reference(gguf, ROWS, K, x))
        out = many.matmul_full("w", _x(2).astype(np.float16), out_dtype="f16")
        assert out.y.dtype == np.float16 and out.kernel and out.batch_rows >= 2
        assert [w.name for w in many.list()] == ["w"] and many.get("w").rows == ROWS
        assert many.health()
        assert many.unload("w").rows == ROWS
        assert many.list() == [] and all(ws == [] for ws in many.list_shards())


def test_explicit_uneven_ranges_in_any_target_order(
        start_worker: Callable[..., LoopWorker], gguf: np.ndarray) -> None:
    shards = [start_worker() for _ in range(3)]
    x = _x(3)
    with ShardedClient([s.target for s in shards], timeout=10) as c:
        c.load("m.gguf", ["w"], ranges=[(30, 37), (0, 1), (1, 30)])
        assert_close(c.matmul("w", x), reference(gguf, ROWS, K, x))
    with ShardedClient([s.target for s in shards[:2]], timeout=10) as gap:
        with pytest.raises(Q6ServeError) as e:
            gap.matmul("w", x)  # rows [1, 30) are on no shard of this client
        assert e.value.code.name == "FAILED_PRECONDITION" and "tile" in e.value.message


def test_missing_weight_names_the_shard(start_worker: Callable[..., LoopWorker],
                                        gguf: np.ndarray) -> None:
    a, b = start_worker(), start_worker()
    with Client(a.target, timeout=10) as c:
        c.load("m.gguf", ["w"], rows=(0, 20))
    with ShardedClient([a.target, b.target], timeout=10) as c, pytest.raises(Q6ServeError) as e:
        c.matmul("w", _x(1))
    assert e.value.code.name == "NOT_FOUND"
    assert f"shard 1 of 2 ({b.target})" in e.value.message


def test_shard_going_away_is_unavailable_without_hanging(
        start_worker: Callable[..., LoopWorker], gguf: np.ndarray) -> None:
    shards = [start_worker() for _ in range(3)]
    with ShardedClient([s.target for s in shards], timeout=20) as c:
        c.load("m.gguf", ["w"])
        c.matmul("w", _x(1))
        shards[1].stop()
        t0 = time.monotonic()
        with pytest.raises(Q6ServeError) as e:
            c.matmul("w", _x(1))
        assert time.monotonic() - t0 < 5.0  # far below the 20 s deadline: no hang
    assert e.value.code.name == "UNAVAILABLE"
    assert f"shard 1 of 3 ({shards[1].target})" in e.value.message


def test_replicas_share_calls_through_round_robin(start_worker: Callable[..., LoopWorker],
                                                   gguf: np.ndarray) -> None:
    """One shard, two replicas behind one target: gRPC's round_robin spreads the matmuls.
    (In Kubernetes the target is a headless Service: dns:///q6serve-shard-0.q6serve:50051.)"""
    reps = [start_worker(), start_worker()]
    for r in reps:  # loads go to each replica directly
        with Client(r.target, timeout=10) as c:
            c.load("m.gguf", ["w"])
    both = "ipv4:" + ",".join(r.target for r in reps)
    x = _x(2)
    want = reference(gguf, ROWS, K, x)

    def served(r: LoopWorker) -> float:
        return r.worker.registry.get_sample_value(
            "q6serve_requests_total",
            {"service": "q6serve.v1.Q6Serve", "method": "Matmul", "code": "OK"}) or 0.0

    with ShardedClient([both], timeout=10) as c:
        deadline = time.monotonic() + 10
        while not all(served(r) for r in reps) and time.monotonic() < deadline:
            assert_close(c.matmul("w", x), want)
    assert all(served(r) > 0 for r in reps), [served(r) for r in reps]


def test_cli_load_and_matmul_take_several_targets(
        start_worker: Callable[..., LoopWorker], gguf: np.ndarray, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from q6serve.client.cli import main

    a, b = start_worker(), start_worker()
    targets = f"{a.target},{b.target}"
    assert main(["load", "--target", targets, "--gguf", "m.gguf", "--tensor", "w"]) == 0
    assert "w" in capsys.readouterr().out
    x = _x(4)
    np.save(tmp_path / "x.npy", x)
    assert main(["matmul", "--target", targets, "--weight", "w", "--input",
                 str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npy")]) == 0
    assert_close(np.load(tmp_path / "y.npy"), reference(gguf, ROWS, K, x))
    with Client(b.target, timeout=10) as c:
        (w,) = c.list()
    assert (w.row_begin, w.row_end) == (19, 37)
    assert main(["load", "--target", targets, "--gguf", "m.gguf", "--tensor", "w",
                 "--prefix", "r/", "--rows", "0:30,30:37"]) == 0
    with Client(b.target, timeout=10) as c:
        assert c.get("r/w").row_begin == 30


def test_frozen_shard_hits_the_deadline_not_a_hang(start_worker: Callable[..., LoopWorker],
                                                   gguf: np.ndarray) -> None:
    """A shard that accepts connections but never answers (a frozen process): the call ends
    at its deadline with DEADLINE_EXCEEDED naming that shard."""
    import socket

    a = start_worker()
    with Client(a.target, timeout=10) as c:
        c.load("m.gguf", ["w"], rows=(0, 19))
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        frozen = f"127.0.0.1:{mute.getsockname()[1]}"
        with ShardedClient([a.target, frozen], timeout=1.0) as c:
            t0 = time.monotonic()
            with pytest.raises(Q6ServeError) as e:
                c.matmul("w", _x(1))
            assert time.monotonic() - t0 < 4.0
    assert e.value.code.name in ("DEADLINE_EXCEEDED", "UNAVAILABLE"), e.value
    assert f"shard 1 of 2 ({frozen})" in e.value.message
