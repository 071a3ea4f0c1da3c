"""Every client call against a real in-process NumPy worker, for Client and AsyncClient."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from svc_util import random_q6k, reference, write_gguf

from q6serve.client.client import DTYPES, Q6ServeError
from q6serve.kernels import reference as ref
from q6serve.kernels.quantize import quantize_q6_k

ROWS, K = 96, 512


def rel_err(y: np.ndarray, want: np.ndarray) -> float:
    y64 = np.asarray(y, dtype=np.float64)
    return float(np.linalg.norm(y64 - want) / np.linalg.norm(want))


@pytest.fixture
def uploaded(client: Any) -> np.ndarray:
    """A random Q6_K weight ``w`` (ROWS x K) uploaded as AoS bytes; returns its blocks."""
    blocks = random_q6k(ROWS, K, seed=3)
    client.upload("w", blocks, ROWS, K)
    return blocks


def test_upload_get_list_unload(client: Any, uploaded: np.ndarray) -> None:
    digest = hashlib.sha256(uploaded.tobytes()).hexdigest()
    w = client.get("w")
    assert (w.name, w.rows, w.k, w.sha256, w.source) == ("w", ROWS, K, digest, "upload")
    assert w.nbytes >= uploaded.nbytes and w.layout in ("soa", "aos")
    assert [x.name for x in client.list()] == ["w"]
    gone = client.unload("w")
    assert gone.name == "w" and gone.sha256 == digest
    assert client.list() == []
    with pytest.raises(Q6ServeError) as e:
        client.get("w")
    assert e.value.code.name == "NOT_FOUND"


def test_upload_reports_progress(client: Any) -> None:
    from q6serve.client.client import UPLOAD_CHUNK

    rows, k = 1024, 2048  # 1.6 MiB of Q6_K: two chunks
    blocks = random_q6k(rows, k, seed=4)
    assert blocks.nbytes > UPLOAD_CHUNK
    seen: list[int] = []
    client.upload("big", blocks, rows, k, progress=seen.append)
    assert sum(seen) == blocks.nbytes and len(seen) == -(-blocks.nbytes // UPLOAD_CHUNK)


@pytest.mark.parametrize("fmt", ["f32", "f16"])
def test_upload_rows_quantized_by_the_worker(client: Any, fmt: str) -> None:
    w = np.random.default_rng(5).standard_normal((64, K)).astype(DTYPES[fmt]) * 0.05
    info = client.upload("q", w, 64, K, fmt=fmt)
    want = quantize_q6_k(w.astype(np.float32))  # ggml-exact quantizer: same bytes expected
    assert info.sha256 == hashlib.sha256(want.tobytes()).hexdigest()


def test_load_from_model_dir(client: Any, model_dir: Path) -> None:
    blocks = write_gguf(model_dir / "m.gguf", {"a.weight": (64, K, 1), "b.weight": (128, K, 2)})
    loaded = client.load("m.gguf", ["b.weight"], prefix="L0.")
    assert [(w.name, w.rows, w.source) for w in loaded] == [("L0.b.weight", 128, "gguf:m.gguf")]
    part = client.load("m.gguf", ["a.weight"], rows=(16, 48))
    assert (part[0].rows, part[0].row_begin, part[0].row_end) == (32, 16, 48)
    x = np.random.default_rng(0).standard_normal((3, K)).astype(np.float32)
    want = reference(blocks["a.weight"], 64, K, x)[:, 16:48]
    assert rel_err(client.matmul("a.weight", x), want) < 1e-5
    assert {w.name for w in client.list()} == {"L0.b.weight", "a.weight"}


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("out_dtype", ["f32", "f16", "bf16"])
def test_matmul_dtypes(client: Any, uploaded: np.ndarray, dtype: str, out_dtype: str) -> None:
    x = np.random.default_rng(6).standard_normal((5, K)).astype(DTYPES[dtype])
    y = client.matmul("w", x, out_dtype=out_dtype)
    assert y.shape == (5, ROWS) and y.dtype == DTYPES[out_dtype]
    # the reference sees the same (already rounded) activations; only the output rounds
    tol = {"f32": 1e-5, "f16": 1e-3, "bf16": 8e-3}[out_dtype]
    assert rel_err(y, reference(uploaded, ROWS, K, x)) < tol


@pytest.mark.parametrize(("precision", "fn", "tol"), [
    ("exact", ref.matmul_exact, 1e-5), ("f16", ref.matmul_f16, 1e-5),
    ("q8_1", ref.matmul_q8_1, 1e-5)])
def test_matmul_precisions(client: Any, uploaded: np.ndarray, precision: str, fn: Any,
                           tol: float) -> None:
    x = np.random.default_rng(7).standard_normal((4, K)).astype(np.float32)
    out = client.matmul_full("w", x, precision=precision)
    assert out.precision == precision and precision in out.kernel
    assert rel_err(out.y, fn(x, uploaded, ROWS).astype(np.float64)) < tol


def test_matmul_full_reports_kernel_and_timing(client: Any, uploaded: np.ndarray) -> None:
    x = np.ones((2, K), dtype=np.float16)
    out = client.matmul_full("w", x)
    assert out.kernel and out.precision == "exact" and out.layout in ("soa", "aos")
    assert out.batch_rows >= 2 and out.batch_requests >= 1 and out.queue_seconds >= 0
    assert out.kernel_seconds is not None and out.kernel_seconds > 0
    # the worker's split of its own time: decode <= handler, device job >= kernel
    assert out.decode_seconds is not None and out.handler_seconds is not None
    assert 0 < out.decode_seconds <= out.handler_seconds
    assert out.device_seconds is not None and out.device_seconds >= out.kernel_seconds


def test_matmul_stream_mixes_results_and_errors(client: Any, uploaded: np.ndarray) -> None:
    rng = np.random.default_rng(8)
    xs = {f"r{i}": rng.standard_normal((i + 1, K)).astype(np.float32) for i in range(4)}
    reqs = [(rid, "w", x) for rid, x in xs.items()] + [("bad", "missing", xs["r0"])]
    items = list(client.matmul_stream(reqs))
    assert len(items) == 5
    errors = [i for i in items if isinstance(i, Q6ServeError)]
    assert [(e.request_id, e.code.name) for e in errors] == [("bad", "NOT_FOUND")]
    outs = {i.request_id: i for i in items if not isinstance(i, Q6ServeError)}
    assert set(outs) == set(xs)
    for rid, x in xs.items():
        assert rel_err(outs[rid].y, reference(uploaded, ROWS, K, x)) < 1e-5


def test_status_flags_health(client: Any, uploaded: np.ndarray) -> None:
    st = client.status()
    assert st.backend == "numpy" and st.serving and st.weights_loaded == 1
    assert st.vram.weights_bytes >= uploaded.nbytes
    d = client.status_dict()
    assert d["backend"] == "numpy" and int(d["vram"]["weights_bytes"]) == st.vram.weights_bytes
    flags = client.flags()
    assert flags["Q6SERVE_DYNAMIC_BATCHING"] is True and len(flags) == 3
    after = client.flags({"Q6SERVE_DYNAMIC_BATCHING": False})
    assert after["Q6SERVE_DYNAMIC_BATCHING"] is False
    assert client.flags()["Q6SERVE_DYNAMIC_BATCHING"] is False
    client.flags({"Q6SERVE_DYNAMIC_BATCHING": True})
    assert client.health() is True


def test_local_dtype_error_before_the_wire(client: Any, uploaded: np.ndarray) -> None:
    with pytest.raises(ValueError, match="float64"):
        client.matmul("w", np.zeros((1, K)))


def test_replies_larger_than_grpc_default_limit(client: Any) -> None:
    """A 5 MiB reply (gRPC's default cap is 4 MiB): the channel options are sized for it."""
    rows = 8192
    blocks = random_q6k(rows, K, seed=9)
    client.upload("wide", blocks, rows, K)
    x = np.random.default_rng(10).standard_normal((160, K)).astype(np.float32)
    y = client.matmul("wide", x)
    assert y.nbytes > 4 << 20
    assert rel_err(y, reference(blocks, rows, K, x)) < 1e-5
