"""Every RPC against an in-process worker on the NumPy backend, results vs the reference."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np
import pytest
from svc_util import (
    RunningWorker,
    assert_close,
    backend_name,
    random_q6k,
    reference,
    write_gguf,
)

from q6serve.client.client import Q6ServeError
from q6serve.kernels.quantize import quantize_q6_k
from q6serve.v1 import q6serve_pb2 as pb
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc

ROWS, K = 48, 512


def _code(exc: pytest.ExceptionInfo[Q6ServeError]) -> grpc.StatusCode:
    return exc.value.code


def test_upload_q6k_matmul_get_list_unload(worker: RunningWorker) -> None:
    c = worker.client()
    blocks = random_q6k(ROWS, K, 1)
    w = c.upload("w", blocks, ROWS, K)
    assert (w.name, w.rows, w.k, w.layout, w.source) == ("w", ROWS, K, "soa", "upload")
    assert w.sha256 == hashlib.sha256(blocks.tobytes()).hexdigest()
    assert c.get("w") == w
    assert [x.name for x in c.list()] == ["w"]
    x = np.random.default_rng(0).standard_normal((5, K)).astype(np.float32)
    out = c.matmul_full("w", x, precision="exact")
    assert out.y.dtype == np.float32 and out.y.shape == (5, ROWS)
    assert out.kernel.startswith(backend_name()) and out.precision == "exact"
    assert out.layout == "soa"
    assert out.batch_rows >= 5 and out.kernel_seconds is not None and out.queue_seconds >= 0
    assert_close(out.y, reference(blocks, ROWS, K, x))
    assert c.unload("w").name == "w"
    assert c.list() == []
    with pytest.raises(Q6ServeError) as e:
        c.get("w")
    assert _code(e) == grpc.StatusCode.NOT_FOUND
    with pytest.raises(Q6ServeError) as e:
        c.matmul("w", x)
    assert _code(e) == grpc.StatusCode.NOT_FOUND
    with pytest.raises(Q6ServeError) as e:
        c.unload("w")
    assert _code(e) == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("fmt", ["f32", "f16"])
def test_upload_float_rows_quantized_server_side(worker: RunningWorker, fmt: str) -> None:
    c = worker.client()
    rows = np.random.default_rng(1).standard_normal((16, 256)).astype(
        np.float32 if fmt == "f32" else np.float16)
    w = c.upload("q", rows, 16, 256, fmt=fmt)
    want_blocks = quantize_q6_k(rows)
    assert w.sha256 == hashlib.sha256(want_blocks.tobytes()).hexdigest()
    x = np.ones((1, 256), np.float32)
    assert_close(c.matmul("q", x), reference(want_blocks, 16, 256, x))


def test_upload_errors(worker: RunningWorker) -> None:
    c = worker.client()
    blocks = random_q6k(4, 256, 2)
    with pytest.raises(Q6ServeError) as e:
        c.upload("bad", blocks, 4, 256, sha256="0" * 64)
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT and "sha256" in e.value.message
    with pytest.raises(Q6ServeError) as e:  # declared shape does not match the bytes
        c.upload("bad", blocks, 5, 256)
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(Q6ServeError) as e:
        c.upload("bad", blocks[:, :100], 4, 100)
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT and "K=100" in e.value.message
    # truncated stream: header promises more bytes than the chunks deliver
    stub = pb_grpc.Q6ServeStub(grpc.insecure_channel(worker.target))
    raw = blocks.tobytes()
    header = pb.UploadHeader(name="trunc", rows=4, k=256, total_bytes=len(raw),
                             sha256=hashlib.sha256(raw).hexdigest())
    msgs = [pb.UploadWeightRequest(header=header), pb.UploadWeightRequest(chunk=raw[:500])]
    with pytest.raises(grpc.RpcError) as re:
        stub.UploadWeight(iter(msgs), timeout=10)
    assert re.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as re:  # no header first
        stub.UploadWeight(iter([pb.UploadWeightRequest(chunk=b"x")]), timeout=10)
    assert re.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    nan = blocks.copy()
    nan[1, 208:210] = np.array([np.nan], np.float16).view(np.uint8)
    with pytest.raises(Q6ServeError) as e:
        c.upload("nan", nan, 4, 256)
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT and "non-finite scale" in e.value.message
    c.upload("ok", blocks, 4, 256)
    with pytest.raises(Q6ServeError) as e:
        c.upload("ok", blocks, 4, 256)
    assert _code(e) == grpc.StatusCode.ALREADY_EXISTS
    assert [w.name for w in c.list()] == ["ok"]


def test_load_gguf_all_chosen_prefix(worker: RunningWorker, model_dir: Path) -> None:
    blocks = write_gguf(model_dir / "m.gguf", {"blk.0.ffn": (32, 512, 3), "out": (16, 256, 4)})
    c = worker.client()
    loaded = c.load("m.gguf")
    assert sorted(w.name for w in loaded) == ["blk.0.ffn", "out"]
    assert all(w.source == "gguf:m.gguf" for w in loaded)
    with pytest.raises(Q6ServeError) as e:
        c.load("m.gguf", ["out"])
    assert _code(e) == grpc.StatusCode.ALREADY_EXISTS
    (w,) = c.load("m.gguf", ["out"], prefix="shard1/")
    assert w.name == "shard1/out"
    assert w.sha256 == hashlib.sha256(blocks["out"].tobytes()).hexdigest()
    x = np.random.default_rng(2).standard_normal((3, 512)).astype(np.float32)
    assert_close(c.matmul("blk.0.ffn", x), reference(blocks["blk.0.ffn"], 32, 512, x))
    with pytest.raises(Q6ServeError) as e:
        c.load("m.gguf", ["nope"], prefix="p/")
    assert _code(e) == grpc.StatusCode.NOT_FOUND
    with pytest.raises(Q6ServeError) as e:
        c.load("missing.gguf")
    assert _code(e) == grpc.StatusCode.NOT_FOUND
    (model_dir / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(Q6ServeError) as e:
        c.load("junk.gguf")
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT


def test_load_confined_to_model_dir(worker: RunningWorker, model_dir: Path,
                                    tmp_path: Path) -> None:
    write_gguf(tmp_path / "outside.gguf", {"t": (4, 256, 5)})
    os.symlink(tmp_path / "outside.gguf", model_dir / "link.gguf")
    c = worker.client()
    for path in ("../outside.gguf", str(tmp_path / "outside.gguf"), "link.gguf"):
        with pytest.raises(Q6ServeError) as e:
            c.load(path)
        assert _code(e) == grpc.StatusCode.PERMISSION_DENIED, path
    os.symlink("loop-b", model_dir / "loop-a")
    os.symlink("loop-a", model_dir / "loop-b")
    for path in ("loop-a", "x" * 5000, "m.gguf\x00"):
        with pytest.raises(Q6ServeError) as e:
            c.load(path)
        assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT and len(e.value.message) < 200
    assert c.list() == []


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("out_dtype", ["f32", "f16", "bf16"])
def test_matmul_dtypes(worker: RunningWorker, dtype: str, out_dtype: str) -> None:
    c = worker.client()
    blocks = random_q6k(32, 256, 6)
    c.upload("w", blocks, 32, 256)
    npdt = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}
    x = np.random.default_rng(3).standard_normal((4, 256)).astype(npdt[dtype])
    y = c.matmul("w", x, out_dtype=out_dtype, precision="exact")
    assert y.dtype == np.dtype(npdt[out_dtype])
    rtol = {"f32": 1e-5, "f16": 2e-3, "bf16": 1e-2}[out_dtype]
    assert_close(y.astype(np.float32), reference(blocks, 32, 256, x.astype(np.float32)), rtol)


def test_matmul_precisions(worker: RunningWorker) -> None:
    c = worker.client()
    blocks = random_q6k(32, 512, 7)
    c.upload("w", blocks, 32, 512)
    x = np.random.default_rng(4).standard_normal((6, 512)).astype(np.float32)
    want = reference(blocks, 32, 512, x)
    exact = c.matmul_full("w", x, precision="exact")
    assert exact.precision == "exact"
    assert_close(exact.y, want)
    f16 = c.matmul_full("w", x, precision="f16")
    assert f16.precision == "f16"
    assert_close(f16.y, reference(blocks, 32, 512, x.astype(np.float16)))
    q8 = c.matmul_full("w", x, precision="q8_1")
    assert q8.precision == "q8_1"
    assert_close(q8.y, want, rtol=3e-2)  # activations quantized to 8 bits per 32


def test_matmul_bad_input(start_worker) -> None:  # type: ignore[no-untyped-def]
    worker = start_worker(max_request_rows=8)
    c = worker.client()
    c.upload("w", random_q6k(8, 256, 8), 8, 256)
    stub = pb_grpc.Q6ServeStub(grpc.insecure_channel(worker.target))
    x = np.ones((2, 256), np.float32)
    good = pb.Tensor(dtype=pb.DTYPE_F32, shape=[2, 256], data=x.tobytes())
    bad = {
        "bytes mismatch": pb.MatmulRequest(weight="w", x=pb.Tensor(
            dtype=pb.DTYPE_F32, shape=[2, 256], data=x.tobytes()[:-4])),
        "K mismatch": pb.MatmulRequest(weight="w", x=pb.Tensor(
            dtype=pb.DTYPE_F32, shape=[1, 512], data=np.ones(512, np.float32).tobytes())),
        "N=0": pb.MatmulRequest(weight="w", x=pb.Tensor(dtype=pb.DTYPE_F32, shape=[0, 256])),
        "N over limit": pb.MatmulRequest(weight="w", x=pb.Tensor(
            dtype=pb.DTYPE_F32, shape=[9, 256], data=np.ones((9, 256), np.float32).tobytes())),
        "3-D": pb.MatmulRequest(weight="w", x=pb.Tensor(
            dtype=pb.DTYPE_F32, shape=[1, 2, 128], data=x.tobytes())),
        "bad dtype": pb.MatmulRequest(weight="w", x=pb.Tensor(
            dtype=7, shape=[2, 256], data=x.tobytes())),
        "bad precision": pb.MatmulRequest(weight="w", x=good, precision=9),
        "no x": pb.MatmulRequest(weight="w"),
        "no weight": pb.MatmulRequest(x=good),
    }
    for what, req in bad.items():
        with pytest.raises(grpc.RpcError) as e:
            stub.Matmul(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
    nan = np.full((1, 256), np.nan, np.float32)
    assert np.isnan(c.matmul("w", nan)).all()  # IEEE propagation, not an error
    assert c.health()


def test_matmul_stream(worker: RunningWorker) -> None:
    c = worker.client()
    blocks = random_q6k(16, 256, 9)
    c.upload("w", blocks, 16, 256)
    rng = np.random.default_rng(5)
    xs = {f"r{i}": rng.standard_normal((1 + i % 3, 256)).astype(np.float32) for i in range(20)}
    reqs = [(rid, "w", x) for rid, x in xs.items()]
    reqs.insert(7, ("bad", "missing", xs["r0"]))
    got = {}
    for r in c.matmul_stream(reqs):
        got[r.request_id] = r
    assert set(got) == set(xs) | {"bad"}
    assert isinstance(got["bad"], Q6ServeError) and got["bad"].code == grpc.StatusCode.NOT_FOUND
    for rid, x in xs.items():
        assert_close(got[rid].y, reference(blocks, 16, 256, x))


def test_status_and_flags(worker: RunningWorker) -> None:
    c = worker.client()
    s = c.status_dict()
    assert s["backend"] == backend_name() and s["serving"] is True and s["version"]
    assert int(s["vram"]["budget_bytes"]) == 256 << 20
    assert {f["name"]: f["enabled"] for f in s["flags"]} == {
        "Q6SERVE_Q6K_SOA": True, "Q6SERVE_DECODE_MMQ": True, "Q6SERVE_DYNAMIC_BATCHING": True}
    assert c.flags({"Q6SERVE_DECODE_MMQ": False})["Q6SERVE_DECODE_MMQ"] is False
    assert c.flags()["Q6SERVE_DECODE_MMQ"] is False
    with pytest.raises(Q6ServeError) as e:
        c.flags({"Q6SERVE_NOPE": True})
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT
    c.upload("w", random_q6k(8, 256, 10), 8, 256)
    with pytest.raises(Q6ServeError) as e:
        c.matmul("w", np.ones((1, 256), np.float32), precision="q8_1")
    assert _code(e) == grpc.StatusCode.FAILED_PRECONDITION


def test_undecodable_request_is_invalid_argument(worker: RunningWorker) -> None:
    channel = grpc.insecure_channel(worker.target)
    for method in ("Matmul", "GetWeight"):
        raw = channel.unary_unary(f"/q6serve.v1.Q6Serve/{method}")
        with pytest.raises(grpc.RpcError) as e:
            raw(b"\xff" * 16, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cannot be decoded" in e.value.details()


def test_health_and_reflection(worker: RunningWorker) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    assert worker.client().health()
    assert worker.client().health("q6serve.v1.Q6Serve")
    stub = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(worker.target))
    req = reflection_pb2.ServerReflectionRequest(list_services="")
    (resp,) = list(stub.ServerReflectionInfo(iter([req]), timeout=10))
    names = {s.name for s in resp.list_services_response.service}
    assert {"q6serve.v1.Q6Serve", "grpc.health.v1.Health"} <= names


def test_internal_errors_are_generic(worker: RunningWorker, caplog) -> None:  # type: ignore[no-untyped-def]
    c = worker.client()
    c.upload("w", random_q6k(8, 256, 11), 8, 256)

    def boom(*a: object, **kw: object) -> None:
        raise RuntimeError("secret detail")

    worker.engine.backend.matmul = worker.engine.backend.launch = boom  # CUDA: launch
    with pytest.raises(Q6ServeError) as e:
        c.matmul("w", np.ones((1, 256), np.float32))
    assert _code(e) == grpc.StatusCode.INTERNAL and "secret" not in e.value.message
    assert "secret detail" in caplog.text
    assert c.health()
