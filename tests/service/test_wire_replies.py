"""Matmul replies serialized with y spliced in (wire_replies.matmul_reply / stream_reply at or above
SPLICE_MIN_BYTES of y) parse to exactly the message the protobuf path builds."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import empty_pb2
from google.protobuf.unknown_fields import UnknownFieldSet

from q6serve.kernels.api import BFLOAT16, Layout, Precision
from q6serve.kernels.epilogue import TopK
from q6serve.service import wire_replies
from q6serve.service.batcher import MatmulReply
from q6serve.v1 import q6serve_pb2 as pb


@pytest.fixture(autouse=True)
def splice_all(monkeypatch: pytest.MonkeyPatch) -> None:
    # small shapes take the spliced path too
    monkeypatch.setattr(wire_replies, "SPLICE_MIN_BYTES", 0)


def _ser(m: pb.MatmulResponse | pb.MatmulStreamResponse | bytes) -> bytes:
    assert isinstance(m, bytes)
    return m


def _reply(n: int, rows: int, dtype: np.dtype, seed: int = 0, topk: int = 0) -> MatmulReply:
    rng = np.random.default_rng(seed)
    top = None
    y = rng.standard_normal((n, rows)).astype(np.float32).astype(dtype)
    if topk:
        top = TopK(rng.standard_normal((n, topk)).astype(np.float32),
                   rng.integers(0, rows, (n, topk)).astype(np.int32),
                   rng.standard_normal(n).astype(np.float32))
        y = None
    # a row slice of a bigger batch output, as the batcher hands it out
    if y is not None:
        y = np.concatenate([y, y])[n:]
    return MatmulReply(y, "k", Layout.SOA, Precision.EXACT, 1e-5, 2e-5, 2 * n, 2, 3e-5,
                       topk=top)


def _same(a: pb.MatmulResponse, b: pb.MatmulResponse) -> None:
    for m in (a, b):  # handler time is taken at encode time: not comparable
        m.timing.ClearField("handler_seconds")
    assert a == b


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16])
@pytest.mark.parametrize("n,rows", [(1, 3), (3, 200), (17, 1000)])  # 1- and 2-byte varints
def test_single_and_stream_replies_parse_to_the_message(dtype: np.dtype, n: int,
                                                        rows: int) -> None:
    r = _reply(n, rows, np.dtype(dtype))
    took = wire_replies.Took(1.0, 1.5)
    got = pb.MatmulResponse.FromString(_ser(wire_replies.matmul_reply(r, "id-1", took)))
    _same(got, wire_replies.matmul_response(r, "id-1", took))
    assert got.y.data == np.ascontiguousarray(r.y).tobytes()
    s = pb.MatmulStreamResponse.FromString(_ser(wire_replies.stream_reply(r, "id-2", took)))
    want = wire_replies.stream_result(r, "id-2", took)
    assert s.request_id == "id-2" and s.WhichOneof("outcome") == "result"
    _same(s.result, want.result)


def test_multi_weight_and_topk_replies_parse_to_the_message() -> None:
    parts = [("q", _reply(2, 48, np.dtype(np.float16), 1)),
             ("k", _reply(2, 300, np.dtype(np.float32), 2)),
             ("lm", _reply(2, 500, np.dtype(np.float32), 3, topk=5))]
    got = pb.MatmulResponse.FromString(_ser(wire_replies.matmul_reply(parts, "m")))
    _same(got, wire_replies.matmul_response(parts, "m"))
    assert [o.weight for o in got.outputs] == ["q", "k", "lm"]
    assert got.outputs[2].HasField("topk") and not got.outputs[2].HasField("y")
    one = pb.MatmulStreamResponse.FromString(_ser(wire_replies.stream_reply(parts[2][1], "t")))
    _same(one.result, wire_replies.stream_result(parts[2][1], "t").result)
    assert wire_replies.stream_reply_code(wire_replies.stream_reply(parts[0][1], "x")).name == "OK"


def test_small_multi_and_topk_replies_stay_messages() -> None:
    wire_replies.SPLICE_MIN_BYTES = 64 << 10  # (restored by the fixture)
    top = _reply(1, 3584, np.dtype(np.float32), topk=4)
    assert isinstance(wire_replies.stream_reply(top, "s"), pb.MatmulStreamResponse)
    multi = [("q", _reply(1, 300, np.dtype(np.float16)))]
    assert isinstance(wire_replies.matmul_reply(multi, "m"), pb.MatmulResponse)
    # one weight's y: bytes at every size
    assert isinstance(wire_replies.stream_reply(_reply(1, 3584, np.dtype(np.float16)), "s"), bytes)
    assert isinstance(wire_replies.matmul_reply(_reply(1, 16384, np.dtype(np.float32)), "b"), bytes)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16])
@pytest.mark.parametrize("n,rows", [(1, 3584), (2, 70), (200, 1), (1, 40000)])
@pytest.mark.parametrize("timing", [
    (1e-5, 2e-5, 3, 2, 3e-5),  # every timing field set
    (0.0, None, 1, 1, None),  # a zero left out, kernel and device time unknown
    (-0.0, 0.0, 300, 200, 0.0),  # -0.0 kept, zeros with presence kept, 2-byte varints
    (float("nan"), float("inf"), 0, 0, -1.0),
    # wire_replies._TIMING6 (every field but the queue set, counts below 128) at its edges
    (0.0, 0.0, 127, 1, 0.0),
    (float("nan"), float("nan"), 1, 127, float("inf")),
    (2e-6, -0.0, 128, 127, 1e300),  # rows' varint 2 bytes: the field-by-field path
])
@pytest.mark.parametrize(("rid", "took"), [("id-7", wire_replies.Took(1.0, 1.5)), ("", None),
                                           ("é" * 100, wire_replies.Took(2.0, 2.0))])
def test_one_weight_replies_are_upbs_bytes(monkeypatch: pytest.MonkeyPatch, dtype: np.dtype,
                                           n: int, rows: int, timing: tuple, rid: str,
                                           took: wire_replies.Took | None) -> None:
    """A plain reply (one weight's y) is written by wire itself: byte for byte what upb
    serializes for the message the protobuf path builds (handler time on a fixed clock)."""
    monkeypatch.setattr(wire_replies.time, "perf_counter", lambda: 9.25)
    y = np.random.default_rng(n).standard_normal((2 * n, rows)).astype(np.float32)
    y = y.astype(dtype)[n:]  # a row slice of a batch's output
    for kernel, layout, prec in (("cuda.gemv.soa", Layout.SOA, Precision.F16),
                                 ("", Layout.AOS, Precision.AUTO)):
        r = MatmulReply(y, kernel, layout, prec, *timing[:2], *timing[2:4], timing[4])
        got = wire_replies.stream_reply(r, rid, took)
        assert isinstance(got, bytes)
        assert got == wire_replies.stream_result(r, rid, took).SerializeToString()
        assert wire_replies.matmul_reply(r, rid, took) == \
            wire_replies.matmul_response(r, rid, took).SerializeToString()
    wide = np.zeros((1, 4), np.dtype(dtype).newbyteorder(">"))  # big-endian y: written LE
    r = MatmulReply(wide + 1, "k", Layout.SOA, Precision.EXACT, 0.0, None, 1, 1)
    want = wire_replies.stream_result(r, rid, took).SerializeToString()
    assert wire_replies.stream_reply(r, rid, took) == want


def test_spliced_replies_over_grpc(worker) -> None:  # type: ignore[no-untyped-def]
    """Unary, stream and multi-weight replies above the threshold, checked against NumPy."""
    import grpc
    from svc_util import assert_close, random_q6k, reference

    from q6serve.client.client import decode_tensor, fill_tensor
    from q6serve.v1 import q6serve_pb2_grpc as pb_grpc

    rows, k, n = 256, 256, 64  # y: 64 x 256 f32 = 64 KiB
    blocks = {name: random_q6k(rows, k, seed) for seed, name in enumerate(("a", "b"))}
    for name, b in blocks.items():
        worker.client().upload(name, b, rows, k)
    x = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    req = pb.MatmulRequest(weight="a", precision=pb.PRECISION_EXACT)
    fill_tensor(req.x, x)
    ch = grpc.insecure_channel(worker.target)
    worker.clients.append(ch)  # closed by the fixture
    stub = pb_grpc.Q6ServeStub(ch)
    want = reference(blocks["a"], rows, k, x)
    assert_close(decode_tensor(stub.Matmul(req, timeout=30).y), want)
    out = list(stub.MatmulStream(iter([req, req]), timeout=30))
    assert len(out) == 2 and all(o.WhichOneof("outcome") == "result" for o in out)
    assert_close(decode_tensor(out[1].result.y), want)
    multi = pb.MatmulRequest(weights=["b", "a"], precision=pb.PRECISION_EXACT)
    fill_tensor(multi.x, x)
    got = stub.Matmul(multi, timeout=30)
    assert [o.weight for o in got.outputs] == ["b", "a"]
    assert_close(decode_tensor(got.outputs[0].y), reference(blocks["b"], rows, k, x))
    assert_close(decode_tensor(got.outputs[1].y), want)


def _fields(buf: bytes) -> list[tuple[int, bytes | int]]:
    """Top-level (field number, value) records of protobuf wire bytes, in order (parsed as
    an empty message: every record is then an unknown field, kept as it came)."""
    return [(f.field_number, f.data) for f in UnknownFieldSet(empty_pb2.Empty.FromString(buf))]


def test_y_is_one_whole_record_for_last_wins_parsers() -> None:
    """protobuf.js keeps the last occurrence of a singular message field instead of merging
    them: y (and each output's y) must be one record holding dtype, shape and data."""
    y_num = pb.MatmulResponse.DESCRIPTOR.fields_by_name["y"].number
    out_num = pb.MatmulResponse.DESCRIPTOR.fields_by_name["outputs"].number
    out_y = pb.WeightOutput.DESCRIPTOR.fields_by_name["y"].number
    r = _reply(5, 300, np.dtype(np.float32))
    ys = [v for f, v in _fields(_ser(wire_replies.matmul_reply(r, "a"))) if f == y_num]
    assert len(ys) == 1
    t = pb.Tensor.FromString(ys[0])  # the record alone is the whole tensor
    assert list(t.shape) == [5, 300] and t.data == np.ascontiguousarray(r.y).tobytes()
    multi = [("q", r), ("k", _reply(5, 40, np.dtype(np.float16), seed=1))]
    outs = [v for f, v in _fields(_ser(wire_replies.matmul_reply(multi, "b"))) if f == out_num]
    assert len(outs) == 2
    for (_name, part), rec in zip(multi, outs, strict=True):
        ys = [v for f, v in _fields(rec) if f == out_y]
        assert len(ys) == 1 and list(pb.Tensor.FromString(ys[0]).shape) == list(part.y.shape)


@pytest.mark.parametrize("splice", [0, 64 << 10])
@pytest.mark.parametrize("timing", [
    (1e-5, 2e-5, 3, 2, 3e-5),  # every part timing field set (the queue too)
    (0.0, 0.0, 127, 1, 0.0),  # no queue; counts at the one-byte edge
    (-0.0, float("nan"), 1, 127, float("inf")),
    (0.0, None, 1, 1, 1e-5),  # kernel time unknown: upb's path
    (0.0, 1e-5, 128, 1, 1e-5),  # a two-byte count: upb's path
])
@pytest.mark.parametrize(("rid", "took"), [("id-7", wire_replies.Took(1.0, 1.5)), ("", None),
                                           ("é" * 100, wire_replies.Took(2.0, 2.0))])
def test_multi_weight_replies_are_upbs_bytes(monkeypatch: pytest.MonkeyPatch, splice: int,
                                             timing: tuple, rid: str,
                                             took: wire_replies.Took | None) -> None:
    """A multi-weight reply of y parts is written by wire itself (wire_replies._multi_stream_bytes):
    byte for byte what upb serializes for the message the protobuf path builds."""
    monkeypatch.setattr(wire_replies, "SPLICE_MIN_BYTES", splice)
    monkeypatch.setattr(wire_replies.time, "perf_counter", lambda: 9.25)
    rng = np.random.default_rng(len(rid))
    parts = []
    for name, rows, dtype in (("q", 3584, np.float16), ("k", 70, np.float32),
                              ("", 1, BFLOAT16), ("é" * 20, 600, np.float16)):
        y = rng.standard_normal((4, rows)).astype(np.float32).astype(dtype)[2:]
        parts.append((name, MatmulReply(y, "cuda.gemv.soa", Layout.SOA, Precision.F16,
                                        *timing[:2], *timing[2:4], timing[4])))
    parts[1] = ("k", MatmulReply(parts[1][1].y, "", Layout.AOS, Precision.AUTO, *timing[:2],
                                 *timing[2:4], timing[4]))
    got = wire_replies.stream_reply(parts, rid, took)
    want = wire_replies.stream_result(parts, rid, took).SerializeToString()
    if took is not None and timing[1] is not None and timing[2] < 128:  # written here
        assert got == want
    else:  # as before: upb's message, or (spliced) the same message when parsed
        msg = got if isinstance(got, bytes) else got.SerializeToString()
        assert pb.MatmulStreamResponse.FromString(msg) == \
            pb.MatmulStreamResponse.FromString(want)
    top = _reply(2, 500, np.dtype(np.float32), 3, topk=5)  # a top-k part: upb's path
    took = wire_replies.Took(1.0, 1.5)
    assert wire_replies._multi_stream_bytes([("lm", top), *parts], b"t", took) is None


def test_multi_weight_part_records_follow_a_changed_part(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The part records kept per weight name (wire_replies._PART_LAST) are remade when the same name
    comes back with another shape, dtype, kernel, layout or precision: every reply is upb's
    bytes."""
    monkeypatch.setattr(wire_replies.time, "perf_counter", lambda: 9.25)
    took = wire_replies.Took(1.0, 1.5)
    rng = np.random.default_rng(3)
    cases = [(3584, np.float16, "cuda.a", Layout.SOA, Precision.F16),
             (3584, np.float16, "cuda.a", Layout.SOA, Precision.F16),  # kept
             (100, np.float16, "cuda.a", Layout.SOA, Precision.F16),
             (100, np.float32, "cuda.a", Layout.SOA, Precision.F16),
             (100, np.float32, "cuda.b", Layout.SOA, Precision.F16),
             (100, np.float32, "cuda.b", Layout.AOS, Precision.F16),
             (100, np.float32, "cuda.b", Layout.AOS, Precision.AUTO),
             (3584, np.float16, "cuda.a", Layout.SOA, Precision.F16)]
    for rows, dtype, kernel, layout, prec in cases:
        parts = [(name, MatmulReply(rng.standard_normal((2, rows)).astype(dtype), kernel,
                                    layout, prec, 0.0, 1e-5, 2, 1, 2e-5))
                 for name in ("blk.0.q", "blk.0.k")]
        parts.append(("blk.0.v", MatmulReply(np.ones((2, 7), np.float16), "cuda.a",
                                             Layout.SOA, Precision.F16, 0.0, 1e-5, 2, 1,
                                             2e-5)))
        got = wire_replies.stream_reply(parts, "r", took)
        assert got == wire_replies.stream_result(parts, "r", took).SerializeToString()
