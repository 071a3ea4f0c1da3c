"""client/reply_bytes.py: a reply read with its arrays as views of its bytes gives what upb's
whole parse gives (every field the client returns), for every shape of reply the worker sends,
and falls back to the whole parse for what its walk does not read."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from q6serve.client import core, reply_bytes
from q6serve.v1 import q6serve_pb2 as pb


@pytest.fixture(autouse=True)
def _views_always(monkeypatch: pytest.MonkeyPatch) -> None:
    """Views for every reply here (the real threshold keeps small ones whole)."""
    monkeypatch.setattr(reply_bytes, "VIEW_MIN", 0)


def _tensor(rng: np.random.Generator, n: int, rows: int, dtype: Any = np.float16) -> pb.Tensor:
    return core.encode_tensor(rng.standard_normal((n, rows)).astype(dtype))


def _topk(n: int, k: int) -> pb.TopKResult:
    return pb.TopKResult(rows=n, k=k, values=np.arange(n * k, dtype="<f4").tobytes(),
                         indices=np.arange(n * k, dtype="<i4")[::-1].copy().tobytes(),
                         lse=np.linspace(1, 2, n, dtype="<f4").tobytes())


def _timing(i: int) -> pb.MatmulTiming:
    return pb.MatmulTiming(queue_seconds=1e-6 * i, kernel_seconds=2e-5 * (i + 1), batch_rows=i,
                           batch_requests=1, device_seconds=3e-5, handler_seconds=1e-4 + i)


def _responses() -> dict[str, pb.MatmulResponse]:
    rng = np.random.default_rng(0)
    multi = pb.MatmulResponse(kernel="", request_id="r2", timing=_timing(9))
    for i, rows in enumerate((3584, 512, 512)):
        multi.outputs.add(weight=f"blk.0.{'qkv'[i]}", y=_tensor(rng, 8, rows), kernel="k",
                          layout=pb.LAYOUT_SOA, precision=pb.PRECISION_F16, timing=_timing(i))
    multi_topk = pb.MatmulResponse(timing=_timing(3))
    for i in range(2):
        multi_topk.outputs.add(weight=f"h{i}", topk=_topk(4, 8 + i), timing=_timing(i))
    return {
        "y f16": pb.MatmulResponse(y=_tensor(rng, 8, 3584), kernel="q6k", layout=pb.LAYOUT_SOA,
                                   precision=pb.PRECISION_F16, timing=_timing(1),
                                   request_id="r1"),
        "y f32": pb.MatmulResponse(y=_tensor(rng, 3, 1000, np.float32), timing=_timing(2)),
        "y of no rows": pb.MatmulResponse(y=_tensor(rng, 0, 64), timing=_timing(0)),
        "topk": pb.MatmulResponse(topk=_topk(8, 64), kernel="q6k", timing=_timing(4)),
        "multi": multi,
        "multi topk": multi_topk,
    }


def _same(a: core.MatmulOutput, b: core.MatmulOutput) -> None:
    for f in ("kernel", "layout", "precision", "queue_seconds", "kernel_seconds", "batch_rows",
              "batch_requests", "request_id", "decode_seconds", "device_seconds",
              "handler_seconds", "weight"):
        assert getattr(a, f) == getattr(b, f), f
    if a.y is None:
        assert b.y is None
    else:
        assert b.y is not None and b.y.dtype == a.y.dtype and b.y.shape == a.y.shape
        assert np.array_equal(a.y, b.y) and not b.y.flags.writeable
    if a.topk is None:
        assert b.topk is None
    else:
        assert b.topk is not None
        for x, y in ((a.topk.values, b.topk.values), (a.topk.indices, b.topk.indices),
                     (a.topk.lse, b.topk.lse)):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
    assert len(a.outputs) == len(b.outputs)
    for x, y in zip(a.outputs, b.outputs, strict=True):
        _same(x, y)


@pytest.mark.parametrize("name", list(_responses()))
def test_views_give_what_the_whole_parse_gives(name: str) -> None:
    r = _responses()[name]
    raw = r.SerializeToString()
    _same(core.output_of(pb.MatmulResponse.FromString(raw)), core.parse_response(raw))
    stream = pb.MatmulStreamResponse(request_id="s", result=r).SerializeToString()
    _same(core.output_of(pb.MatmulStreamResponse.FromString(stream).result),
          core.stream_outcome(stream, {}))  # type: ignore[arg-type]
    if r.HasField("y"):
        y = core.response_y_bytes(raw)
        assert np.array_equal(y, core.response_y(pb.MatmulResponse.FromString(raw)))


def test_arrays_are_views_of_the_reply() -> None:
    raw = _responses()["multi"].SerializeToString()
    _, views = reply_bytes.parse(pb.MatmulResponse, raw, reply_bytes.RESPONSE)
    assert views is not None and len(views) == 3
    y = core.parse_response(raw).outputs[1].y
    assert y is not None and np.shares_memory(y, np.frombuffer(raw, np.uint8))


def test_below_the_threshold_the_reply_is_parsed_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = _responses()["y f16"].SerializeToString()
    monkeypatch.setattr(reply_bytes, "VIEW_MIN", len(raw) + 1)
    assert reply_bytes.parse(pb.MatmulResponse, raw, reply_bytes.RESPONSE)[1] is None
    monkeypatch.setattr(reply_bytes, "VIEW_MIN", len(raw))
    assert reply_bytes.parse(pb.MatmulResponse, raw, reply_bytes.RESPONSE)[1] is not None


def test_an_error_reply() -> None:
    raw = pb.MatmulStreamResponse(request_id="e", error=pb.StreamError(
        code=5, message="no weight named 'x'")).SerializeToString()
    got = core.stream_outcome(raw, {})
    assert isinstance(got, core.Q6ServeError) and got.request_id == "e"
    assert "no weight named 'x'" in str(got)


def test_what_the_walk_does_not_read_is_parsed_whole() -> None:
    """y twice (upb merges the two messages of a field that is not repeated) and a field
    order upb never writes: the whole parse's answer; a truncated reply: upb's error."""
    rng = np.random.default_rng(1)
    y = _tensor(rng, 2, 256)
    first = pb.MatmulResponse(y=pb.Tensor(dtype=y.dtype, shape=y.shape)).SerializeToString()
    second = pb.MatmulResponse(y=pb.Tensor(data=y.data), kernel="k").SerializeToString()
    raw = first + second  # upb merges the two y: the shape of one, the data of the other
    assert reply_bytes.parse(pb.MatmulResponse, raw, reply_bytes.RESPONSE)[1] is None
    _same(core.output_of(pb.MatmulResponse.FromString(raw)), core.parse_response(raw))
    reordered = (pb.MatmulResponse(kernel="k", timing=_timing(1)).SerializeToString()
                 + pb.MatmulResponse(y=_tensor(rng, 2, 256)).SerializeToString())
    _same(core.output_of(pb.MatmulResponse.FromString(reordered)),
          core.parse_response(reordered))
    with pytest.raises(DecodeError):
        core.parse_response(second[:-10])


@pytest.mark.parametrize("views", [False, True])
def test_each_output_has_its_own_fields(monkeypatch: pytest.MonkeyPatch, views: bool) -> None:
    """What output_of reads per message type: a response's request id and timing on the
    whole result, each entry of a multi-weight reply its weight, kernel and timing (and no
    request id), a one-weight result no weight; the same parsed whole or walked."""
    if not views:
        monkeypatch.setattr(reply_bytes, "VIEW_MIN", 1 << 62)
    got = core.parse_response(_responses()["multi"].SerializeToString())
    assert (got.request_id, got.weight, got.y, got.handler_seconds) == ("r2", "", None, 9 + 1e-4)
    assert [o.weight for o in got.outputs] == ["blk.0.q", "blk.0.k", "blk.0.v"]
    assert [o.request_id for o in got.outputs] == ["", "", ""]
    assert [o.batch_rows for o in got.outputs] == [0, 1, 2]
    assert [o.y.shape for o in got.outputs if o.y is not None] == [(8, 3584), (8, 512), (8, 512)]
    assert {(o.kernel, o.layout, o.precision) for o in got.outputs} == {("k", "soa", "f16")}
    one = core.parse_response(_responses()["y f16"].SerializeToString())
    assert (one.request_id, one.weight, one.kernel, one.outputs) == ("r1", "", "q6k", ())
    assert one.y is not None and one.y.shape == (8, 3584)
