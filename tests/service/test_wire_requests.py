"""MatmulStream / Matmul requests as the worker reads them: wire_requests.read_matmul_request's
MatmulIn (x.data a view of the bytes gRPC read) and a fully parsed message give the same
engine call (wire_requests.matmul_call) and the same stream cost (Q6ServeServicer._cost), and bad
requests fail with the same messages either way."""

from __future__ import annotations

import numpy as np
import pytest

from q6serve.kernels.api import Precision
from q6serve.kernels.errors import InvalidArgument
from q6serve.service import wire_requests
from q6serve.service.servicer import Q6ServeServicer
from q6serve.v1 import q6serve_pb2 as pb


def _raw(x: np.ndarray, **fields: object) -> bytes:
    req = pb.MatmulRequest(**fields)  # type: ignore[arg-type]
    req.x.dtype = pb.DTYPE_F16 if x.dtype == np.float16 else pb.DTYPE_F32
    req.x.shape.extend(x.shape)
    req.x.data = x.tobytes()
    return req.SerializeToString()


def _both(raw: bytes) -> list[object]:
    """The request as the worker reads it (MatmulIn) and as protobuf parses it whole."""
    read = wire_requests.read_matmul_request(raw, zero_copy_min=0)  # the walker whatever the size
    assert isinstance(read, wire_requests.MatmulIn)
    return [read, pb.MatmulRequest.FromString(raw)]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_matmul_call_same_from_view_and_message(dtype: type) -> None:
    x = np.arange(6, dtype=dtype).reshape(2, 3)
    raw = _raw(x, weight="w", precision=pb.PRECISION_F16, out_dtype=pb.DTYPE_F16)
    for req in _both(raw):
        call = wire_requests.matmul_call(req, 1.5)  # type: ignore[arg-type]
        assert (call.weight, call.weights, call.topk, call.timeout) == ("w", (), 0, 1.5)
        assert call.precision is Precision.F16 and call.out_dtype == np.float16
        assert call.x.dtype == dtype and call.x.dtype.byteorder in "=<|"
        np.testing.assert_array_equal(call.x, x)


def test_matmul_call_multi_weight_and_topk() -> None:
    x = np.ones((1, 4), np.float32)
    raw = _raw(x, weights=["q", "k"], topk=pb.TopKEpilogue(k=3))
    for req in _both(raw):
        call = wire_requests.matmul_call(req, None)  # type: ignore[arg-type]
        assert (call.weight, call.weights, call.topk) == ("", ("q", "k"), 3)


@pytest.mark.parametrize(("fields", "shape", "want"), [
    ({"weight": "w", "weights": ["a"]}, (1, 4), "sets both weight and weights"),
    ({}, (1, 4), "MatmulRequest.weight is empty"),
    ({"weight": "w"}, (4,), "x must be 2-D [N, K], got shape [4]"),
    ({"weight": "w"}, (1, 1 << 31), "is too large"),
    ({"weight": "w", "precision": 99}, (1, 4), "unknown precision enum value 99"),
])
def test_bad_requests_same_messages(fields: dict[str, object], shape: tuple[int, ...],
                                    want: str) -> None:
    req = pb.MatmulRequest(**fields)  # type: ignore[arg-type]
    req.x.dtype = pb.DTYPE_F32
    req.x.shape.extend(shape)
    req.x.data = b"\0" * 16
    raw = req.SerializeToString()
    for r in (wire_requests.read_matmul_request(raw, zero_copy_min=0),
              pb.MatmulRequest.FromString(raw)):
        with pytest.raises(InvalidArgument, match=want.replace("[", r"\[").replace("]", r"\]")):
            wire_requests.matmul_call(r, None)  # type: ignore[arg-type]


def test_x_byte_count_checked() -> None:
    req = pb.MatmulRequest(weight="w")
    req.x.dtype = pb.DTYPE_F16
    req.x.shape.extend((2, 4))
    req.x.data = b"\0" * 15
    for r in _both(req.SerializeToString()):
        with pytest.raises(InvalidArgument, match="needs 16 bytes, got 15"):
            wire_requests.matmul_call(r, None)  # type: ignore[arg-type]


class _Engine:
    def __init__(self) -> None:
        self.rows = {"q": 8, "k": 2}

    def get(self, name: str) -> object:
        if name not in self.rows:
            raise InvalidArgument("no such weight")  # any Q6Error: the request's own size
        return type("View", (), {"rows": self.rows[name]})()


@pytest.mark.parametrize(("fields", "extra"), [
    ({"weight": "q", "out_dtype": pb.DTYPE_F16}, 3 * 8 * 2),
    ({"weights": ["q", "k"]}, 3 * 10 * 4),  # out_dtype unset: f32
    ({"weight": "q", "topk": pb.TopKEpilogue(k=5)}, 3 * (8 * 5 + 4)),
    ({"weight": "missing"}, 0),
])
def test_stream_cost_same_from_view_and_message(fields: dict[str, object], extra: int) -> None:
    servicer = Q6ServeServicer(_Engine())  # type: ignore[arg-type]
    raw = _raw(np.zeros((3, 4), np.float32), **fields)
    for req in _both(raw):
        assert servicer._cost(req) == len(raw) + extra
        # the same from the decoded call (MatmulStream decodes first)
        assert servicer._cost(req, wire_requests.matmul_call(req, None)) == len(raw) + extra


def test_small_requests_are_parsed_whole_big_ones_keep_x_in_place() -> None:
    wire_requests.clear_skeletons()  # (a first request of its kind: upb's)
    small = _raw(np.ones((1, 64), np.float16), weight="w")
    assert isinstance(wire_requests.read_matmul_request(small), pb.MatmulRequest)
    rows = wire_requests.ZERO_COPY_MIN // (2 * 1024) + 1
    big = _raw(np.ones((rows, 1024), np.float16), weight="w")
    read = wire_requests.read_matmul_request(big)
    assert isinstance(read, wire_requests.MatmulIn)
    assert np.shares_memory(wire_requests.matmul_call(read, None).x, np.frombuffer(big, np.uint8))


# -- requests like one seen before, read through its skeleton -----------------------------------
def _fields(call: object) -> tuple[object, ...]:
    c = call
    return (c.weight, c.weights, c.precision, c.out_dtype, c.topk, c.timeout,  # type: ignore[attr-defined]
            c.x.dtype, c.x.shape, c.x.tobytes())  # type: ignore[attr-defined]


@pytest.mark.parametrize("fields", [
    {"weight": "ffn_down", "precision": pb.PRECISION_F16, "out_dtype": pb.DTYPE_F16},
    {"weight": "w"},  # x unaligned in the bytes (a 1-byte name): read as such
    {"weights": ["blk.0.attn_q", "blk.0.attn_k", "blk.0.attn_v"]},
    {"weight": "lm", "topk": pb.TopKEpilogue(k=8)},
])
@pytest.mark.parametrize("rid", ["", "r1", "é" * 40])
def test_a_request_like_one_seen_is_read_through_its_skeleton(fields: dict[str, object],
                                                              rid: str) -> None:
    wire_requests.clear_skeletons()
    rng = np.random.default_rng(0)
    first = _raw(rng.standard_normal((2, 40)).astype(np.float16), request_id="a", **fields)
    # upb's, kept (a multi-weight request's kind is tried on its second request)
    for _ in range(2 if "weights" in fields else 1):
        assert not isinstance(wire_requests.read_matmul_request(first), wire_requests.MatmulSeen)
    x = rng.standard_normal((2, 40)).astype(np.float16)
    raw = _raw(x, request_id=rid, **fields)
    seen = wire_requests.read_matmul_request(raw)
    assert isinstance(seen, wire_requests.MatmulSeen)
    whole = pb.MatmulRequest.FromString(raw)
    assert seen.request_id == whole.request_id == rid
    assert wire_requests.region_io(seen) is None
    assert (_fields(wire_requests.matmul_call(seen, 2.0))
            == _fields(wire_requests.matmul_call(whole, 2.0)))
    assert np.array_equal(wire_requests.matmul_call(seen, None).x, x)
    # any other field from upb's parse of the same bytes
    assert seen.SerializeToString() == raw and seen.ByteSize() == len(raw)
    assert list(seen.weights) == list(whole.weights) and seen.x.data == x.tobytes()


@pytest.mark.parametrize("change", [
    "other weight", "other shape", "other precision", "extra field", "bad utf-8 id",
    "long id", "x region", "two ids",
])
def test_a_request_unlike_its_skeleton_is_parsed_by_upb(change: str) -> None:
    wire_requests.clear_skeletons()
    x = np.ones((1, 32), np.float16)
    wire_requests.read_matmul_request(_raw(x, weight="wa", request_id="1"))  # the skeleton
    assert isinstance(wire_requests.read_matmul_request(_raw(x, weight="wa", request_id="2")),
                      wire_requests.MatmulSeen)
    fields: dict[str, object] = {"weight": "wa", "request_id": "3"}
    tail = b""
    if change == "other weight":
        fields["weight"] = "wb"
    elif change == "other shape":
        x = np.ones((2, 16), np.float16)
    elif change == "other precision":
        fields["precision"] = pb.PRECISION_EXACT
    elif change == "extra field":
        fields["out_dtype"] = pb.DTYPE_F16
    elif change == "bad utf-8 id":
        fields["request_id"] = ""
        tail = b"\x2a\x02\xff\xfe"
    elif change == "long id":
        fields["request_id"] = "i" * 200
    elif change == "x region":
        fields["x_region"] = pb.RegionRef(region="r")
    elif change == "two ids":  # the last one wins (upb's rule)
        tail = pb.MatmulRequest(request_id="4").SerializeToString()
    raw = _raw(x, **fields) + tail
    if change == "bad utf-8 id":
        with pytest.raises(Exception) as upb_err:
            pb.MatmulRequest.FromString(raw)
        with pytest.raises(type(upb_err.value)):
            wire_requests.read_matmul_request(raw)
        return
    read = wire_requests.read_matmul_request(raw)
    assert not isinstance(read, wire_requests.MatmulSeen)
    assert read == pb.MatmulRequest.FromString(raw)


def test_skeletons_are_kept_only_for_requests_that_pass_the_checks() -> None:
    wire_requests.clear_skeletons()
    raw = _raw(np.ones((1, 8), np.float16), weight="w", precision=99)  # an unknown enum
    for _ in range(2):
        read = wire_requests.read_matmul_request(raw)
        assert not isinstance(read, wire_requests.MatmulSeen)
        with pytest.raises(InvalidArgument, match="unknown precision"):
            wire_requests.matmul_call(read, None)
    assert not wire_requests._SKELETONS


def test_a_big_request_like_one_seen_keeps_x_in_place() -> None:
    """The walker's request (from ZERO_COPY_MIN bytes) leaves its skeleton too: the next one
    of its kind is read through it, x still a view of the bytes gRPC read."""
    wire_requests.clear_skeletons()
    rows = wire_requests.ZERO_COPY_MIN // (2 * 1024) + 1
    first = _raw(np.ones((rows, 1024), np.float16), weight="w", request_id="1")
    assert isinstance(wire_requests.read_matmul_request(first), wire_requests.MatmulIn)
    x = np.arange(rows * 1024, dtype=np.float16).reshape(rows, 1024)
    big = _raw(x, weight="w", request_id="2")
    read = wire_requests.read_matmul_request(big)
    assert isinstance(read, wire_requests.MatmulSeen) and read.request_id == "2"
    call = wire_requests.matmul_call(read, None)
    assert np.shares_memory(call.x, np.frombuffer(big, np.uint8))
    assert np.array_equal(call.x, x)


def test_a_kind_is_not_tried_again_for_learn_gap_requests() -> None:
    """After an attempt, a kind's requests that no skeleton reads are parsed by upb for
    LEARN_GAP of them before the next attempt: a caller whose shapes keep changing does not
    pay an attempt a request."""
    wire_requests.clear_skeletons()
    a = _raw(np.ones((1, 32), np.float16), weight="wg", request_id="1")
    b = _raw(np.ones((2, 32), np.float16), weight="wg", request_id="1")
    wire_requests.read_matmul_request(a)  # kept: a's skeleton
    assert isinstance(wire_requests.read_matmul_request(a), wire_requests.MatmulSeen)
    for _ in range(wire_requests.LEARN_GAP):  # b's kind held: not kept
        assert not isinstance(wire_requests.read_matmul_request(b), wire_requests.MatmulSeen)
    # (a hit holds nothing)
    assert isinstance(wire_requests.read_matmul_request(a), wire_requests.MatmulSeen)
    wire_requests.read_matmul_request(b)  # the next attempt: kept
    assert isinstance(wire_requests.read_matmul_request(b), wire_requests.MatmulSeen)
    assert isinstance(wire_requests.read_matmul_request(a), wire_requests.MatmulSeen)


def test_a_skeleton_larger_than_the_limit_is_not_kept() -> None:
    """A request whose bytes besides x's data pass MAX_SKELETON_BYTES (long names: made-up
    names pass the checks) leaves no skeleton: the table stays small whatever is sent."""
    wire_requests.clear_skeletons()
    names = [f"{i}" + "n" * 200 for i in range(6)]
    raw = _raw(np.ones((1, 32), np.float16), weights=names, request_id="1")
    for _ in range(2):
        assert not isinstance(wire_requests.read_matmul_request(raw), wire_requests.MatmulSeen)
    assert not wire_requests._SKELETONS


def test_a_kind_of_short_names_is_not_tried_on_every_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A multi-weight request's kind is its last bytes, which hold x's data or the request id
    when the names are short: such a kind never comes again, and is not tried (an attempt
    costs more than upb's parse); a kind of long names is tried on its second request."""
    wire_requests.clear_skeletons()
    tried = []
    call = wire_requests.matmul_call
    monkeypatch.setattr(wire_requests, "matmul_call",
                        lambda *a, **k: tried.append(1) or call(*a, **k))
    rng = np.random.default_rng(1)
    for i in range(10):
        raw = _raw(rng.standard_normal((1, 8)).astype(np.float16), weights=["q", "k"],
                   request_id=str(i))
        assert not isinstance(wire_requests.read_matmul_request(raw), wire_requests.MatmulSeen)
    assert not tried
    names = ["blk.0.attn_q", "blk.0.attn_k"]
    for i in range(3):
        raw = _raw(rng.standard_normal((1, 8)).astype(np.float16), weights=names,
                   request_id=str(i))
        seen = isinstance(wire_requests.read_matmul_request(raw), wire_requests.MatmulSeen)
        assert seen == (i == 2)
    assert len(tried) == 1
