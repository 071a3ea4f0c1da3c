"""Malformed requests against a running NumPy worker: each gets the right status code and a
message with the numbers, and afterwards the worker is SERVING with unchanged VRAM accounting.

Requests are built as raw protobuf messages (the Client would refuse most of them), sent over
one channel. NaN/Inf activations are not errors: they propagate per IEEE 754 into the rows
that contain them, and never into other callers' rows of the same batch.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from q6serve.kernels.errors import InvalidArgument
from q6serve.service import wire, wire_requests
from q6serve.service.config import Budget, WorkerConfig
from q6serve.v1 import q6serve_pb2 as pb
from tests.reliability.gguf_corpus import File, Tensor, q6k_blocks
from tests.reliability.harness import RunningWorker, health, random_q6k, reference, vram_figures
from tests.service.svc_util import assert_close, wait_until

FUZZ_EXAMPLES = int(os.environ.get("Q6SERVE_FUZZ_EXAMPLES", "300"))
ROWS, K = 8, 256
MAX_ROWS = 64  # --max-request-rows of the corpus worker
MAX_MESSAGE = 2 << 20
MAX_UPLOAD = 1 << 20
SVC = "/q6serve.v1.Q6Serve/"
C = grpc.StatusCode


def f32(n: int, k: int = K, fill: float = 0.5) -> bytes:
    return np.full((n, k), fill, np.float32).tobytes()


def x_msg(n: int = 1, k: int = K, dtype: int = pb.DTYPE_F32, data: bytes | None = None,
          shape: list[int] | None = None) -> pb.Tensor:
    item = {pb.DTYPE_F16: 2, pb.DTYPE_BF16: 2}.get(dtype, 4)
    return pb.Tensor(dtype=dtype, shape=[n, k] if shape is None else shape,
                     data=bytes(n * k * item) if data is None else data)


def mm(weight: str = "w", **kw: Any) -> pb.MatmulRequest:
    kw.setdefault("x", x_msg())
    return pb.MatmulRequest(weight=weight, **kw)


def header(name: str = "u", rows: int = 2, k: int = K, fmt: int = pb.UPLOAD_FORMAT_Q6_K,
           data: bytes | None = None, total: int | None = None, sha: str | None = None,
           ) -> pb.UploadWeightRequest:
    data = q6k_blocks(rows, k, 9) if data is None else data
    return pb.UploadWeightRequest(header=pb.UploadHeader(
        name=name, rows=rows, k=k, format=fmt, total_bytes=len(data) if total is None else total,
        sha256=hashlib.sha256(data).hexdigest() if sha is None else sha))


def upload(*msgs: pb.UploadWeightRequest) -> list[pb.UploadWeightRequest]:
    return list(msgs)


def chunk(b: bytes) -> pb.UploadWeightRequest:
    return pb.UploadWeightRequest(chunk=b)


def good_upload(name: str = "u", rows: int = 2, data: bytes | None = None,
                **kw: Any) -> list[pb.UploadWeightRequest]:
    data = q6k_blocks(rows, K, 9) if data is None else data
    return [header(name, rows, data=data, **kw), chunk(data)]


def nan_blocks(rows: int) -> bytes:
    raw = bytearray(q6k_blocks(rows, K, 3))
    raw[208:210] = np.array([np.nan], "<f2").tobytes()
    return bytes(raw)


@dataclass(frozen=True)
class Req:
    id: str
    method: str  # RPC name
    request: Any  # a message, or a list of messages for client-streaming RPCs
    code: grpc.StatusCode
    match: str


CORPUS: tuple[Req, ...] = (
    # -- Matmul: names --------------------------------------------------------------------------
    Req("mm-empty-weight", "Matmul", mm(""), C.INVALID_ARGUMENT, r"weight is empty"),
    Req("mm-unknown-weight", "Matmul", mm("nope"), C.NOT_FOUND, r"no weight named 'nope'"),
    Req("mm-huge-name", "Matmul", mm("n" * 100_000), C.NOT_FOUND, r"no weight named 'nnn"),
    Req("mm-nul-name", "Matmul", mm("w\x00"), C.NOT_FOUND, r"no weight named 'w\\x00'"),
    Req("mm-missing-x", "Matmul", pb.MatmulRequest(weight="w"), C.INVALID_ARGUMENT,
        r"x is missing"),
    # -- Matmul: dtype / shape / bytes ----------------------------------------------------------
    Req("mm-dtype-99", "Matmul", mm(x=x_msg(dtype=99)), C.INVALID_ARGUMENT,
        r"unknown dtype enum value 99"),
    Req("mm-dtype-negative", "Matmul", mm(x=x_msg(dtype=-5)), C.INVALID_ARGUMENT,
        r"unknown dtype enum value -5"),
    Req("mm-shape-empty", "Matmul", mm(x=x_msg(shape=[], data=b"")), C.INVALID_ARGUMENT,
        r"x must be 2-D \[N, K\], got shape \[\]"),
    Req("mm-shape-1d", "Matmul", mm(x=x_msg(shape=[K], data=f32(1))), C.INVALID_ARGUMENT,
        r"got shape \[256\]"),
    Req("mm-shape-3d", "Matmul", mm(x=x_msg(shape=[1, 1, K], data=f32(1))), C.INVALID_ARGUMENT,
        r"got shape \[1, 1, 256\]"),
    Req("mm-n-0", "Matmul", mm(x=x_msg(0)), C.INVALID_ARGUMENT, r"N >= 1, got \(0, 256\)"),
    Req("mm-n-over-limit", "Matmul", mm(x=x_msg(MAX_ROWS + 1)), C.INVALID_ARGUMENT,
        r"N=65 exceeds the per-request limit of 64 rows"),
    Req("mm-k-0", "Matmul", mm(x=x_msg(1, 0)), C.INVALID_ARGUMENT,
        r"activations have K=0, weight 'w' has K=256"),
    Req("mm-k-mismatch", "Matmul", mm(x=x_msg(1, 512)), C.INVALID_ARGUMENT,
        r"K=512, weight 'w' has K=256"),
    Req("mm-k-mismatch-small", "Matmul", mm(x=x_msg(2, 255)), C.INVALID_ARGUMENT,
        r"K=255, weight 'w' has K=256"),
    Req("mm-bytes-short", "Matmul", mm(x=x_msg(data=f32(1)[:-1])), C.INVALID_ARGUMENT,
        r"x \[1, 256\] f32 needs 1024 bytes, got 1023"),
    Req("mm-bytes-long", "Matmul", mm(x=x_msg(data=f32(1) + b"\0")), C.INVALID_ARGUMENT,
        r"needs 1024 bytes, got 1025"),
    Req("mm-bytes-empty", "Matmul", mm(x=x_msg(data=b"")), C.INVALID_ARGUMENT,
        r"needs 1024 bytes, got 0"),
    Req("mm-f16-shape-f32-bytes", "Matmul", mm(x=x_msg(dtype=pb.DTYPE_F16, data=f32(1))),
        C.INVALID_ARGUMENT, r"x \[1, 256\] f16 needs 512 bytes, got 1024"),
    Req("mm-bf16-odd-bytes", "Matmul", mm(x=x_msg(dtype=pb.DTYPE_BF16, data=b"\0" * 511)),
        C.INVALID_ARGUMENT, r"bf16 needs 512 bytes, got 511"),
    Req("mm-dims-2^31", "Matmul", mm(x=x_msg(shape=[1 << 31, K], data=b"")),
        C.INVALID_ARGUMENT, r"shape \[2147483648, 256\] is too large"),
    Req("mm-dims-2^64-1", "Matmul", mm(x=x_msg(shape=[(1 << 64) - 1, K], data=b"")),
        C.INVALID_ARGUMENT, r"is too large"),
    Req("mm-dims-product-overflow", "Matmul", mm(x=x_msg(shape=[(1 << 31) - 1] * 2, data=b"")),
        C.INVALID_ARGUMENT, r"needs \d+ bytes, got 0"),
    Req("mm-precision-99", "Matmul", mm(precision=99), C.INVALID_ARGUMENT,
        r"unknown precision enum value 99"),
    Req("mm-precision-negative", "Matmul", mm(precision=-1), C.INVALID_ARGUMENT,
        r"unknown precision enum value -1"),
    Req("mm-out-dtype-99", "Matmul", mm(out_dtype=99), C.INVALID_ARGUMENT,
        r"unknown dtype enum value 99"),
    Req("mm-oversize-message", "Matmul", mm(x=x_msg(MAX_MESSAGE // (4 * K) + 1)),
        C.RESOURCE_EXHAUSTED, r"larger than max"),
    # -- UploadWeight ---------------------------------------------------------------------------
    Req("up-no-messages", "UploadWeight", upload(), C.INVALID_ARGUMENT,
        r"must start with an UploadHeader"),
    Req("up-chunk-first", "UploadWeight", upload(chunk(b"x")), C.INVALID_ARGUMENT,
        r"must start with an UploadHeader"),
    Req("up-header-twice", "UploadWeight", upload(header(), header()), C.INVALID_ARGUMENT,
        r"only data chunks may follow the header"),
    Req("up-empty-name", "UploadWeight", good_upload(""), C.INVALID_ARGUMENT,
        r"weight name '' must be 1\.\.256 printable characters \(got 0\)"),
    Req("up-long-name", "UploadWeight", good_upload("n" * 300), C.INVALID_ARGUMENT,
        r"must be 1\.\.256 printable characters \(got 300\)"),
    Req("up-nonprintable-name", "UploadWeight", good_upload("a\nb"), C.INVALID_ARGUMENT,
        r"printable characters"),
    Req("up-rows-0", "UploadWeight", upload(header(rows=0, data=b"")), C.INVALID_ARGUMENT,
        r"has rows=0"),
    Req("up-k-300", "UploadWeight", upload(header(k=300, data=b"")), C.INVALID_ARGUMENT,
        r"K=300 is not a positive multiple of 256"),
    Req("up-k-0", "UploadWeight", upload(header(k=0, data=b"")), C.INVALID_ARGUMENT,
        r"K=0 is not a positive multiple"),
    Req("up-total-mismatch", "UploadWeight", upload(header(total=421)), C.INVALID_ARGUMENT,
        r"2x256 q6_k must be 420 bytes, header says 421"),
    Req("up-format-99", "UploadWeight", upload(header(fmt=99)), C.INVALID_ARGUMENT,
        r"unknown upload format enum value 99"),
    Req("up-no-sha", "UploadWeight", good_upload(sha=""), C.INVALID_ARGUMENT,
        r"needs the hex sha256 of the data \(64 digits\)"),
    Req("up-short-sha", "UploadWeight", good_upload(sha="ab" * 16), C.INVALID_ARGUMENT,
        r"64 digits"),
    Req("up-mis-hashed", "UploadWeight", good_upload(sha="0" * 64), C.INVALID_ARGUMENT,
        r"sha256 mismatch \(got [0-9a-f]{64}, header says 0{64}\)"),
    Req("up-truncated", "UploadWeight", [header(), chunk(q6k_blocks(2, K, 9)[:400])],
        C.INVALID_ARGUMENT, r"ended after 400 of 420 bytes"),
    Req("up-no-chunks", "UploadWeight", [header()], C.INVALID_ARGUMENT,
        r"ended after 0 of 420 bytes"),
    Req("up-too-many-bytes", "UploadWeight", [header(), chunk(q6k_blocks(2, K, 9) + b"x")],
        C.INVALID_ARGUMENT, r"sent more than the declared 420 bytes"),
    Req("up-over-upload-limit", "UploadWeight",
        upload(header(rows=MAX_UPLOAD // 210 + 1, data=b"", total=(MAX_UPLOAD // 210 + 1) * 210)),
        C.RESOURCE_EXHAUSTED, r"upload of \d+ bytes exceeds the limit of 1048576"),
    Req("up-rows-2^40", "UploadWeight", upload(header(rows=1 << 40, data=b"")),
        C.INVALID_ARGUMENT, r"must be 230897441832960 bytes, header says 0"),
    Req("up-exists", "UploadWeight", good_upload("w"), C.ALREADY_EXISTS,
        r"already loaded or loading: w"),
    Req("up-nan-scale", "UploadWeight", good_upload("nan-q6k", data=nan_blocks(2)),
        C.INVALID_ARGUMENT,
        r"Q6_K block 0 \(row 0\) has a non-finite scale d=nan"),
    Req("up-f32-nan-rows", "UploadWeight", good_upload(
        "nan-f32", fmt=pb.UPLOAD_FORMAT_F32, data=np.full((2, K), np.nan, np.float32).tobytes()),
        C.INVALID_ARGUMENT, r"'nan-f32' input has 512 non-finite values \(first at row 0, col"),
    Req("up-over-budget", "UploadWeight", good_upload("big", rows=4900),
        C.RESOURCE_EXHAUSTED, r"VRAM budget exceeded: need \d+ bytes"),
    # -- LoadWeights ----------------------------------------------------------------------------
    Req("load-empty-path", "LoadWeights", pb.LoadWeightsRequest(), C.INVALID_ARGUMENT,
        r"gguf path is empty"),
    Req("load-dotdot", "LoadWeights", pb.LoadWeightsRequest(gguf_path="../outside.gguf"),
        C.PERMISSION_DENIED, r"'\.\./outside\.gguf' must be relative to the model dir"),
    Req("load-dotdot-inner", "LoadWeights", pb.LoadWeightsRequest(gguf_path="a/../../x.gguf"),
        C.PERMISSION_DENIED, r"without '\.\.'"),
    Req("load-absolute", "LoadWeights", pb.LoadWeightsRequest(gguf_path="/etc/passwd"),
        C.PERMISSION_DENIED, r"'/etc/passwd' must be relative"),
    Req("load-symlink-escape", "LoadWeights", pb.LoadWeightsRequest(gguf_path="escape.gguf"),
        C.PERMISSION_DENIED, r"'escape\.gguf' leaves the model dir"),
    Req("load-symlink-dir-escape", "LoadWeights",
        pb.LoadWeightsRequest(gguf_path="outdir/m.gguf"), C.PERMISSION_DENIED,
        r"leaves the model dir"),
    Req("load-nul", "LoadWeights", pb.LoadWeightsRequest(gguf_path="m.gguf\x00x"),
        C.INVALID_ARGUMENT, r"gguf path"),
    Req("load-missing-file", "LoadWeights", pb.LoadWeightsRequest(gguf_path="absent.gguf"),
        C.NOT_FOUND, r"absent\.gguf' does not exist"),
    Req("load-directory", "LoadWeights", pb.LoadWeightsRequest(gguf_path="sub"), C.NOT_FOUND,
        r"does not exist"),
    Req("load-missing-tensor", "LoadWeights",
        pb.LoadWeightsRequest(gguf_path="m.gguf", tensors=["nope"]), C.NOT_FOUND,
        r"no tensor named 'nope' \(file has 2 tensors\)"),
    Req("load-duplicate-tensors", "LoadWeights",
        pb.LoadWeightsRequest(gguf_path="m.gguf", tensors=["a", "a"]), C.INVALID_ARGUMENT,
        r"names repeated in one load: \['a'\]"),
    Req("load-exists", "LoadWeights",
        pb.LoadWeightsRequest(gguf_path="m.gguf", tensors=["a"], prefix="pre."),
        C.ALREADY_EXISTS, r"already loaded or loading: pre\.a"),
    Req("load-prefix-too-long", "LoadWeights",
        pb.LoadWeightsRequest(gguf_path="m.gguf", prefix="p" * 300), C.INVALID_ARGUMENT,
        r"printable characters \(got 301\)"),
    Req("load-prefix-nonprintable", "LoadWeights",
        pb.LoadWeightsRequest(gguf_path="m.gguf", prefix="\x1b["), C.INVALID_ARGUMENT,
        r"printable characters"),
    Req("load-not-gguf", "LoadWeights", pb.LoadWeightsRequest(gguf_path="notes.txt"),
        C.INVALID_ARGUMENT, r"magic b'hell', expected b'GGUF'"),
    Req("load-rows-reversed", "LoadWeights", pb.LoadWeightsRequest(
        gguf_path="m.gguf", tensors=["b"], row_range=pb.RowRange(begin=2, end=1)),
        C.INVALID_ARGUMENT, r"row range \[2, 1\) of tensor 'b' is not a non-empty range "
        r"within its 2 rows"),
    Req("load-rows-past-end", "LoadWeights", pb.LoadWeightsRequest(
        gguf_path="m.gguf", tensors=["b"], row_range=pb.RowRange(begin=1 << 63,
                                                                 end=(1 << 64) - 1)),
        C.INVALID_ARGUMENT, r"row range \[9223372036854775808, 18446744073709551615\)"),
    Req("load-shard-count-0", "LoadWeights", pb.LoadWeightsRequest(
        gguf_path="m.gguf", shard=pb.ShardSpec(index=0, count=0)), C.INVALID_ARGUMENT,
        r"shard count 0 must be >= 1"),
    Req("load-shard-index-out", "LoadWeights", pb.LoadWeightsRequest(
        gguf_path="m.gguf", tensors=["b"], shard=pb.ShardSpec(index=3, count=3)),
        C.INVALID_ARGUMENT, r"shard index 3 is not in \[0, 3\)"),
    Req("load-more-shards-than-rows", "LoadWeights", pb.LoadWeightsRequest(
        gguf_path="m.gguf", tensors=["b"], shard=pb.ShardSpec(index=0, count=5)),
        C.INVALID_ARGUMENT, r"cannot split 2 rows into 5 non-empty shards"),
    # -- other RPCs -----------------------------------------------------------------------------
    Req("get-unknown", "GetWeight", pb.GetWeightRequest(name="nope"), C.NOT_FOUND,
        r"no weight named 'nope'"),
    Req("get-empty", "GetWeight", pb.GetWeightRequest(), C.NOT_FOUND, r"no weight named ''"),
    Req("unload-unknown", "UnloadWeight", pb.UnloadWeightRequest(name="nope"), C.NOT_FOUND,
        r"no weight named 'nope'"),
    Req("unload-empty", "UnloadWeight", pb.UnloadWeightRequest(), C.NOT_FOUND,
        r"no weight named ''"),
    Req("flags-unknown", "SetFlags", pb.SetFlagsRequest(flags=[pb.Flag(name="NOPE")]),
        C.INVALID_ARGUMENT, r"unknown flag\(s\) NOPE"),
    Req("flags-duplicate", "SetFlags", pb.SetFlagsRequest(flags=[
        pb.Flag(name="Q6SERVE_Q6K_SOA", enabled=True)] * 2), C.INVALID_ARGUMENT,
        r"flag Q6SERVE_Q6K_SOA given twice"),
    Req("flags-empty-name", "SetFlags", pb.SetFlagsRequest(flags=[pb.Flag(name="")]),
        C.INVALID_ARGUMENT, r"unknown flag"),
)

_STREAMING = {"UploadWeight"}


@pytest.fixture(scope="module")
def corpus_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningWorker]:
    root = tmp_path_factory.mktemp("reqs")
    models, outside = root / "models", root / "outside"
    models.mkdir()
    outside.mkdir()
    m = File([Tensor("a", [K, 4], data=q6k_blocks(4, K, 1)),
              Tensor("b", [K, 2], data=q6k_blocks(2, K, 2))]).build()
    (models / "m.gguf").write_bytes(m)
    (outside / "m.gguf").write_bytes(m)
    (models / "escape.gguf").symlink_to(outside / "m.gguf")
    (models / "outdir").symlink_to(outside, target_is_directory=True)
    (models / "sub").mkdir()
    (models / "notes.txt").write_text("hello, not a model\n" * 4)
    w = RunningWorker(WorkerConfig(
        host="127.0.0.1", port=0, model_dir=models, vram_budget=Budget(nbytes=2 << 20),
        max_request_rows=MAX_ROWS, max_batch_rows=MAX_ROWS, max_message_bytes=MAX_MESSAGE,
        max_upload_bytes=MAX_UPLOAD))
    c = w.client()
    blocks = random_q6k(ROWS, K, 7)
    c.upload("w", blocks, ROWS, K)
    c.load("m.gguf", ["a"], prefix="pre.")
    w.blocks = blocks  # type: ignore[attr-defined]
    yield w
    w.stop()


@pytest.fixture(scope="module")
def channel(corpus_worker: RunningWorker) -> Iterator[grpc.Channel]:
    opts = [("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(corpus_worker.target, options=opts) as ch:
        yield ch


def invoke(ch: grpc.Channel, method: str, request: Any, timeout: float = 30) -> Any:
    kind = ch.stream_unary if method in _STREAMING else ch.unary_unary
    call = kind(SVC + method, request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=lambda b: b)
    return call(iter(request) if method in _STREAMING else request, timeout=timeout)


def test_corpus_size() -> None:
    assert len(CORPUS) >= 50
    assert len({r.id for r in CORPUS}) == len(CORPUS)


@pytest.mark.parametrize("req", CORPUS, ids=[r.id for r in CORPUS])
def test_malformed_request(req: Req, corpus_worker: RunningWorker,
                           channel: grpc.Channel) -> None:
    c = corpus_worker.client()
    before = vram_figures(c)
    names = sorted(w.name for w in c.list())
    try:
        invoke(channel, req.method, req.request)
    except grpc.RpcError as e:
        err: Any = e
    else:
        if req.method == "UploadWeight":  # accepted by mistake: keep the next cases clean
            c.unload(req.request[0].header.name)
        pytest.fail(f"{req.id} was accepted")
    assert err.code() == req.code, err.details()
    assert re.search(req.match, err.details() or ""), err.details()
    assert len(err.details()) < 1200  # a message, not an echo of the request
    assert vram_figures(c) == before
    assert sorted(w.name for w in c.list()) == names
    assert health(corpus_worker.target) == "SERVING"


def test_garbage_protobuf_is_invalid_argument(corpus_worker: RunningWorker,
                                              channel: grpc.Channel) -> None:
    """Bytes that are not a valid message never reach the servicer: INVALID_ARGUMENT."""
    for method in ("Matmul", "LoadWeights", "GetWeight"):
        raw = channel.unary_unary(SVC + method)
        for junk in (b"\xff" * 64, b"\x12\xff\xff\xff\xff\x0f", b"\x0a\x05ab"):
            with pytest.raises(grpc.RpcError) as info:
                raw(junk, timeout=10)
            err: Any = info.value
            assert err.code() == C.INVALID_ARGUMENT, err.details()
            assert "cannot be decoded" in err.details()


def test_garbage_protobuf_and_unknown_method(corpus_worker: RunningWorker,
                                             channel: grpc.Channel) -> None:
    """Undecodable bytes and unknown RPCs fail cleanly and change nothing."""
    c = corpus_worker.client()
    before = vram_figures(c)
    raw = channel.unary_unary(SVC + "Matmul")
    for junk in (b"\xff" * 64, b"\x12\xff\xff\xff\xff\x0f", b"\x0a\x05ab"):
        with pytest.raises(grpc.RpcError) as info:
            raw(junk, timeout=10)
        assert info.value.code() != C.OK  # type: ignore[attr-defined]
    with pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(SVC + "Nope")(b"", timeout=10)
    assert info.value.code() == C.UNIMPLEMENTED  # type: ignore[attr-defined]
    assert vram_figures(c) == before and health(corpus_worker.target) == "SERVING"


def test_stream_bad_requests_answered_in_band(corpus_worker: RunningWorker,
                                             channel: grpc.Channel) -> None:
    """In MatmulStream a malformed request gets a per-request error; the stream goes on."""
    reqs = [mm(x=x_msg(0)), mm("nope"), mm(precision=42), mm(x=x_msg(2))]
    for i, r in enumerate(reqs):
        r.request_id = f"r{i}"
    call = channel.stream_stream(SVC + "MatmulStream",
                                 request_serializer=lambda m: m.SerializeToString(),
                                 response_deserializer=pb.MatmulStreamResponse.FromString)
    out = {r.request_id: r for r in call(iter(reqs), timeout=30)}
    assert out["r0"].error.code == C.INVALID_ARGUMENT.value[0]
    assert out["r1"].error.code == C.NOT_FOUND.value[0]
    assert "precision enum value 42" in out["r2"].error.message
    assert out["r3"].WhichOneof("outcome") == "result"
    assert list(out["r3"].result.y.shape) == [2, ROWS]


# -- NaN / Inf activations: IEEE propagation, row-local ---------------------------------------
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("precision", ["auto", "exact", "f16", "q8_1"])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_nan_inf_activations_propagate_per_ieee(dtype: str, precision: str,
                                                corpus_worker: RunningWorker) -> None:
    """The same in every precision (q8_1 cannot carry NaN/Inf: such rows run exact)."""
    dt = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}[dtype]
    c = corpus_worker.client()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, K)).astype(dt)
    x[0, 5] = np.nan
    x[1, 7] = np.inf
    x[2, 9] = -np.inf
    y = c.matmul("w", x, precision=precision)
    blocks = corpus_worker.blocks  # type: ignore[attr-defined]
    assert np.isnan(y[0]).all()  # NaN * w is NaN in every output of its row
    w = reference(blocks, ROWS, K, np.eye(K))[:, :].T  # [ROWS, K] dequantized
    for row, col, sign in ((1, 7, 1.0), (2, 9, -1.0)):
        # x*Inf: +-Inf where the weight is non-zero, NaN where it is exactly 0 (0 * Inf)
        want = np.where(w[:, col] == 0, np.nan, sign * np.sign(w[:, col]) * np.inf)
        np.testing.assert_array_equal(y[row], want)
    exact = dtype == "f32" and precision in ("auto", "exact")
    np.testing.assert_allclose(y[3], reference(blocks, ROWS, K, x[3:4].astype(np.float64))[0],
                               rtol=1e-5 if exact else 3e-2, atol=1e-4 if exact else 3e-2)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nan_rows_do_not_leak_into_batch_neighbours(corpus_worker: RunningWorker) -> None:
    """Many callers at once (so batches mix clean and NaN requests): clean rows stay exact."""
    c = corpus_worker.client()
    blocks = corpus_worker.blocks  # type: ignore[attr-defined]
    clean = np.random.default_rng(4).standard_normal((3, K)).astype(np.float32)
    want = reference(blocks, ROWS, K, clean)
    bad = np.full((2, K), np.nan, np.float32)
    errors: list[BaseException] = []
    batch_rows: list[int] = []

    def caller(i: int) -> None:
        try:
            for _ in range(10):
                if i % 2:
                    assert np.isnan(c.matmul("w", bad)).all()
                else:
                    out = c.matmul_full("w", clean)
                    batch_rows.append(out.batch_rows)
                    assert_close(out.y, want, 1e-5)
        except BaseException as e:
            errors.append(e)

    # The device thread is held busy while the callers start, so their first requests queue
    # and batch together (a free device runs short jobs at once, inline on the loop: on a
    # loaded machine they may then never meet).
    gate = threading.Event()
    corpus_worker.run(lambda: corpus_worker.engine.device.submit(gate.wait, 30))
    threads = [threading.Thread(target=caller, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    wait_until(lambda: corpus_worker.run(
        lambda: corpus_worker.engine.in_flight("w")) >= 4, what="queued requests")
    gate.set()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    assert max(batch_rows) > 3  # some clean request really shared a batch


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_f16_output_overflow_is_inf(corpus_worker: RunningWorker) -> None:
    c = corpus_worker.client()
    x = np.full((1, K), 6e4, np.float32)
    y32 = c.matmul("w", x)
    y16 = c.matmul("w", x, out_dtype="f16")
    assert y16.dtype == np.float16
    big = np.abs(y32) > 65504
    assert big.any()
    assert np.isinf(y16[big]).all() and np.isfinite(y16[~big]).all()


# -- fuzzing the request decoding (service/wire.py) -------------------------------------------
_dims = st.one_of(st.integers(0, 4), st.integers(0, (1 << 64) - 1), st.sampled_from(
    [255, 256, 1 << 31, (1 << 31) - 1, 1 << 32, 1 << 63, (1 << 64) - 1]))


@st.composite
def tensors(draw: st.DrawFn) -> pb.Tensor:
    shape = draw(st.lists(_dims, max_size=4))
    size = 1
    for d in shape:
        size *= d
    item = draw(st.sampled_from([1, 2, 4]))
    n = size * item if size * item <= 4096 else 0
    n = max(0, n + draw(st.sampled_from([0, 0, 0, -1, 1, 2])))
    return pb.Tensor(dtype=draw(st.integers(-3, 6)), shape=shape, data=draw(
        st.binary(min_size=n, max_size=n)))


@settings(max_examples=FUZZ_EXAMPLES, deadline=5000)
@given(t=tensors(), precision=st.integers(-2, 6), out=st.integers(-2, 6),
       weight=st.text(max_size=8))
def test_fuzz_matmul_request_decoding(t: pb.Tensor, precision: int, out: int,
                                      weight: str) -> None:
    req = pb.MatmulRequest(weight=weight, x=t, precision=precision, out_dtype=out)
    req = pb.MatmulRequest.FromString(req.SerializeToString())  # the bytes the worker sees
    try:
        call = wire_requests.matmul_call(req, None)
    except InvalidArgument as e:
        assert str(e)
        return
    assert call.x.shape == tuple(t.shape) and call.x.nbytes == len(t.data)
    assert not call.x.flags.writeable  # a view of the request bytes, never copied or mutable


@settings(max_examples=FUZZ_EXAMPLES, deadline=5000)
@given(raw=st.binary(max_size=256))
def test_fuzz_raw_bytes_decoding(raw: bytes) -> None:
    """Arbitrary bytes: protobuf either refuses them or wire refuses/accepts cleanly."""
    from google.protobuf.message import DecodeError

    for cls, convert in ((pb.MatmulRequest, lambda m: wire_requests.matmul_call(m, None)),
                         (pb.UploadHeader, wire.upload_spec),
                         (pb.SetFlagsRequest, wire.flag_changes)):
        try:
            msg = cls.FromString(raw)
        except DecodeError:
            continue
        try:
            convert(msg)
        except InvalidArgument as e:
            assert str(e)


@settings(max_examples=max(20, FUZZ_EXAMPLES // 6), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(t=tensors(), precision=st.integers(-1, 5), out=st.integers(-1, 4),
       weight=st.sampled_from(["w", "pre.a", "", "nope"]))
def test_fuzz_live_matmul(t: pb.Tensor, precision: int, out: int, weight: str,
                          corpus_worker: RunningWorker, channel: grpc.Channel) -> None:
    """Random requests to the live worker: only client-error codes, never INTERNAL/UNKNOWN."""
    req = pb.MatmulRequest(weight=weight, x=t, precision=precision, out_dtype=out)
    try:
        invoke(channel, "Matmul", req, timeout=30)
    except grpc.RpcError as e:
        assert e.code() in (C.INVALID_ARGUMENT, C.NOT_FOUND, C.FAILED_PRECONDITION,  # type: ignore[attr-defined]
                            C.RESOURCE_EXHAUSTED), e.details()  # type: ignore[attr-defined]


def test_worker_unchanged_after_everything(corpus_worker: RunningWorker) -> None:
    c = corpus_worker.client()
    assert sorted(w.name for w in c.list()) == ["pre.a", "w"]
    x = np.ones((1, K), np.float32)
    assert_close(c.matmul("w", x), reference(
        corpus_worker.blocks, ROWS, K, x), 1e-5)  # type: ignore[attr-defined]
    assert health(corpus_worker.target) == "SERVING"

