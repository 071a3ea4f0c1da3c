"""Multi-weight calls and the top-k epilogue through Client, AsyncClient, ShardedClient and the
CLI, against real in-process NumPy workers (the wire contract itself: tests/service)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from svc_util import assert_close, random_q6k, reference, write_gguf

from q6serve.client import cli
from q6serve.client.client import Q6ServeError
from q6serve.client.sharded import ShardedClient
from q6serve.kernels.epilogue import LSE_RTOL, TopK, topk_reference

K = 512
SHAPES = {"q": (48, 1), "k": (32, 2), "v": (16, 3)}


@pytest.fixture
def loaded(client: Any) -> dict[str, np.ndarray]:
    blocks = {}
    for name, (rows, seed) in SHAPES.items():
        blocks[name] = random_q6k(rows, K, seed)
        client.upload(name, blocks[name], rows, K)
    return blocks


def _x(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, K)).astype(np.float32)


def check_topk(top: TopK, y: np.ndarray, k: int) -> None:
    """Against the reference top-k of ``y`` (the exact float64 result: within 1e-5 of scale;
    indices equal wherever the reference values are well separated)."""
    ref = topk_reference(y.astype(np.float32), k)
    tol = 1e-5 * max(1.0, float(np.abs(y).max()))
    assert top.values.shape == top.indices.shape == (y.shape[0], k)
    assert top.values.dtype == np.float32 and top.indices.dtype == np.int32
    assert np.all(np.abs(top.values - ref.values) <= tol)
    gap = np.full(ref.values.shape, np.inf)
    d = np.abs(np.diff(ref.values.astype(np.float64), axis=1))
    gap[:, 1:], gap[:, :-1] = d, np.minimum(gap[:, :-1], d)
    clear = gap > 2 * tol
    np.testing.assert_array_equal(top.indices[clear], ref.indices[clear])
    lse = np.log(np.exp(y.astype(np.float64)).sum(axis=1))
    assert np.all(np.abs(top.lse - lse) <= LSE_RTOL * np.maximum(1, np.abs(lse)) + tol)


def test_matmul_multi_and_full(client: Any, loaded: dict[str, np.ndarray]) -> None:
    x = _x(3)
    ys = client.matmul_multi(["v", "q"], x, precision="exact")
    assert [y.shape for y in ys] == [(3, 16), (3, 48)]
    for name, y in zip(("v", "q"), ys, strict=True):
        assert_close(y, reference(loaded[name], SHAPES[name][0], K, x))
    out = client.matmul_full(("q", "k", "v"), x, precision="exact")
    assert out.y is None and out.topk is None and out.handler_seconds is not None
    assert [o.weight for o in out.outputs] == ["q", "k", "v"]
    assert all(o.batch_rows >= 3 and o.kernel and o.precision == "exact" for o in out.outputs)


def test_matmul_topk_and_with_several_weights(client: Any,
                                              loaded: dict[str, np.ndarray]) -> None:
    x = _x(4, seed=1)
    want = reference(loaded["q"], 48, K, x)
    top = client.matmul_topk("q", x, 7, precision="exact")
    check_topk(top, want, 7)
    out = client.matmul_full(["k", "q"], x, precision="exact", topk=16)
    for o in out.outputs:
        assert o.y is None
        check_topk(o.topk, reference(loaded[o.weight], SHAPES[o.weight][0], K, x), 16)


def test_stream_mixes_single_multi_and_errors(client: Any,
                                              loaded: dict[str, np.ndarray]) -> None:
    x = _x(2, seed=2)
    got = {o.request_id: o for o in client.matmul_stream(
        [("a", ["q", "v"], x), ("b", "k", x), ("c", ["q", "gone"], x)], precision="exact",
        topk=5)}
    assert [o.weight for o in got["a"].outputs] == ["q", "v"]
    check_topk(got["a"].outputs[1].topk, reference(loaded["v"], 16, K, x), 5)
    check_topk(got["b"].topk, reference(loaded["k"], 32, K, x), 5)
    err = got["c"]
    assert isinstance(err, Q6ServeError) and err.code.name == "NOT_FOUND"
    assert "weights[1] 'gone'" in err.message


def test_bad_arguments(client: Any, loaded: dict[str, np.ndarray]) -> None:
    x = _x(1)
    with pytest.raises(ValueError, match="use matmul_multi"):
        client.matmul(["q"], x)
    with pytest.raises(ValueError, match="a list of weight names"):
        client.matmul_multi("q", x)
    with pytest.raises(ValueError, match="must be names"):
        client.matmul_multi(["q", 3], x)
    for bad in ("3", 2.0, -1, True, 1 << 32):
        with pytest.raises(ValueError, match="topk="):
            client.matmul_topk("q", x, bad)
    for k, fragment in ((0, "out of range"), (257, "out of range"),
                        (17, "exceeds the 16 rows of weight 'v'")):
        with pytest.raises(Q6ServeError) as e:
            client.matmul_topk("v", x, k)
        assert e.value.code.name == "INVALID_ARGUMENT" and fragment in e.value.message
    with pytest.raises(Q6ServeError) as e:
        client.matmul_multi([], x)
    assert e.value.code.name == "INVALID_ARGUMENT"
    with pytest.raises(Q6ServeError) as e:
        client.matmul_multi(["q", "nope"], x)
    assert e.value.code.name == "NOT_FOUND" and e.value.message.startswith("weights[1] 'nope'")
    assert client.get("q").in_flight == 0


# -- the CLI ------------------------------------------------------------------------------------
def test_cli_matmul_several_weights_and_topk(worker: Any, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from q6serve.client.client import Client

    with Client(worker.target) as c:
        blocks = {n: random_q6k(r, K, s) for n, (r, s) in SHAPES.items()}
        for n, b in blocks.items():
            c.upload(n, b, SHAPES[n][0], K)
    x = _x(3, seed=4)
    np.save(tmp_path / "x.npy", x)
    base = ["matmul", "--target", worker.target, "--input", str(tmp_path / "x.npy"),
            "--precision", "exact"]
    assert cli.main([*base, "--weight", "q", "--weight", "v", "--output",
                     str(tmp_path / "q.npy"), "--output", str(tmp_path / "v.npy")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("q: y [3, 48] f32 -> ") and lines[1].startswith("v: y [3, 16]")
    for n in ("q", "v"):
        assert_close(np.load(tmp_path / f"{n}.npy"),
                     reference(blocks[n], SHAPES[n][0], K, x))
    assert cli.main([*base, "--weight", "q", "--topk", "6", "--output",
                     str(tmp_path / "t.npz")]) == 0
    assert "top-6 values/indices/lse of 3 rows" in capsys.readouterr().out
    with np.load(tmp_path / "t.npz") as z:
        check_topk(TopK(z["values"], z["indices"], z["lse"]), reference(blocks["q"], 48, K, x),
                   6)
    # user errors: one line, exit 2 (usage) or 1 (the worker refused)
    assert cli.main([*base, "--weight", "q", "--weight", "v", "--output", "a.npy"]) == 2
    assert "one --output per --weight" in capsys.readouterr().err
    assert cli.main([*base, "--weight", "q", "--topk", "3", "--output", "a.npy"]) == 2
    assert "FILE.npz" in capsys.readouterr().err
    assert cli.main([*base, "--weight", "q", "--topk", "999", "--output",
                     str(tmp_path / "b.npz")]) == 1
    err = capsys.readouterr().err
    assert "INVALID_ARGUMENT" in err and "topk.k=999" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "b.npz").exists()


# -- row-sharded over two workers -----------------------------------------------------------------
def test_sharded_multi_and_topk_equal_one_worker(start_worker: Any, model_dir: Path) -> None:
    blocks = write_gguf(model_dir / "m.gguf", {"q": (48, K, 1), "v": (16, K, 3)})
    a, b = start_worker(), start_worker()
    x = _x(3, seed=5)
    with ShardedClient([a.target, b.target], timeout=30) as sc:
        sc.load("m.gguf", ["q", "v"])  # q: 24 + 24 rows, v: 8 + 8
        ys = sc.matmul_multi(["q", "v"], x, precision="exact")
        for n, y in zip(("q", "v"), ys, strict=True):
            assert_close(y, reference(blocks[n], y.shape[1], K, x))
        want_q = reference(blocks["q"], 48, K, x)
        for k in (1, 24, 40):  # 40: more than one shard holds, so each sends all of its own
            check_topk(sc.matmul_topk("q", x, k, precision="exact"), want_q, k)
        out = sc.matmul_full(["q", "v"], x, precision="exact", topk=12)  # v's shards: 8 < 12
        assert [o.weight for o in out.outputs] == ["q", "v"]
        check_topk(out.outputs[1].topk, reference(blocks["v"], 16, K, x), 12)
        out = sc.matmul_full(["q", "v"], x, precision="exact", topk=8)  # one request per shard
        check_topk(out.outputs[0].topk, want_q, 8)
        with pytest.raises(Q6ServeError) as e:
            sc.matmul_topk("v", x, 17)
        assert e.value.code.name == "INVALID_ARGUMENT" and "16 rows of weight 'v'" in \
            e.value.message
