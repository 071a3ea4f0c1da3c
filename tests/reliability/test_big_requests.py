"""Big requests cost the event loop little (issue 18: health within 100 ms under every attack).

Two rules hold it (docs/RELIABILITY.md, "Big requests"): gRPC's core refuses a request message
over the receive limit (``--max-request-bytes``, default 32 MiB) before it is read into Python,
so the worker's handler never runs and nothing of it is held; and a Matmul request under the
limit is read without copying ``x.data`` (service/rawmsg.py), with protobuf's exact semantics:
checked here against upb on generated and mutated messages.
"""

from __future__ import annotations

import functools
import os
import tracemalloc
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from q6serve.client.client import matmul_request
from q6serve.service import rawmsg, wire_requests
from q6serve.service.config import Budget, WorkerConfig
from q6serve.v1 import q6serve_pb2 as pb
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc
from tests.reliability.harness import RunningWorker, health, random_q6k, vram_figures

K = 256
LIMIT = 1 << 20  # the worker's receive limit in these tests
EXAMPLES = int(os.environ.get("Q6SERVE_FUZZ_EXAMPLES", "300"))


def fields_of(m: pb.MatmulRequest | wire_requests.MatmulIn) -> tuple[bytes, bytes]:
    """(the message without x.data, x.data) of a request read either way."""
    if isinstance(m, wire_requests.MatmulIn):
        return m.msg.SerializeToString(deterministic=True), bytes(m.x_data)
    rest = pb.MatmulRequest()
    rest.CopyFrom(m)
    data = rest.x.data
    if rest.HasField("x"):
        rest.x.data = b""
    return rest.SerializeToString(deterministic=True), data


def read_both(raw: bytes) -> tuple[object, object]:
    """What read_matmul_request and upb's whole parse make of ``raw``: (fields, fields), or
    the DecodeError class when it is refused."""
    out = []
    # the walker, then upb
    for parse in (functools.partial(wire_requests.read_matmul_request, zero_copy_min=0),
                  pb.MatmulRequest.FromString):
        try:
            out.append(fields_of(parse(raw)))
        except DecodeError:
            out.append(DecodeError)
    return out[0], out[1]


tensors = st.builds(
    lambda dt, shape, data: pb.Tensor(dtype=dt, shape=shape, data=data),
    st.integers(0, 4), st.lists(st.integers(0, 2**64 - 1), max_size=4),
    st.binary(max_size=64))
requests = st.builds(
    lambda w, xs, rid, ws, prec, unknown: b"".join(
        [pb.MatmulRequest(weight=w, request_id=rid, weights=ws, precision=prec,
                          x_region=pb.RegionRef(region="r") if unknown % 3 == 0 else None)
         .SerializeToString()]
        # x repeated: protobuf merges the occurrences (the last data wins)
        + [pb.MatmulRequest(x=x).SerializeToString() for x in xs]
        # an unknown field, then more of x
        + [b"\xf8\x07" + rawmsg.encode_varint(unknown)]
        + [pb.MatmulRequest(x=x).SerializeToString() for x in xs[:1]]),
    st.text(max_size=8), st.lists(tensors, max_size=3), st.text(max_size=8),
    st.lists(st.text(max_size=4), max_size=2), st.integers(0, 5), st.integers(0, 2**40))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests, st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3),
       st.integers(0, 8))
def test_fuzz_reading_without_the_copy_is_protobufs_parse(raw, flips, cut):
    """Generated requests (x repeated, unknown fields), then bytes flipped and the end cut:
    read_matmul_request gives exactly upb's fields and x.data, or both refuse."""
    assert read_both(raw)[0] == read_both(raw)[1]
    mutated = bytearray(raw)
    for pos, value in flips:
        if mutated:
            mutated[pos % len(mutated)] = value
    mutated = mutated[: max(0, len(mutated) - cut)]
    ours, upb = read_both(bytes(mutated))
    assert ours == upb


def test_what_the_walker_does_not_take_is_parsed_whole():
    x = pb.Tensor(dtype=pb.DTYPE_F32, shape=[1, K], data=b"\1" * 4 * K)
    many = pb.MatmulRequest(weight="w", x=x).SerializeToString() + b"".join(
        b"\xf8\x07\x01" for _ in range(rawmsg.MAX_FIELDS))  # unknown fields past the cap
    group = pb.MatmulRequest(weight="w", x=x).SerializeToString() + b"\xfb\x07\xfc\x07"
    for raw in (many, group):
        with pytest.raises(rawmsg.Unusual):
            rawmsg.take_bytes_field(raw, 2, 3)
        m = wire_requests.read_matmul_request(raw, zero_copy_min=0)
        assert isinstance(m, pb.MatmulRequest) and m.x.data == x.data
        ours, upb = read_both(raw)
        assert ours == upb


def test_x_is_a_view_of_the_bytes_grpc_read():
    x = np.arange(64 * 4096, dtype=np.float32).reshape(64, 4096)  # 1 MiB
    raw = matmul_request("w", x).SerializeToString()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        req = wire_requests.read_matmul_request(raw)
        call = wire_requests.matmul_call(req, None)
        grew = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert grew < 64 << 10, f"reading the request allocated {grew} bytes"
    assert np.shares_memory(call.x, np.frombuffer(raw, np.uint8))
    np.testing.assert_array_equal(call.x, x)
    assert not call.x.flags.writeable
    assert req.ByteSize() == len(raw) and req.SerializeToString() is raw


@pytest.fixture(scope="module")
def worker() -> Iterator[RunningWorker]:
    rw = RunningWorker(WorkerConfig(port=0, vram_budget=Budget(nbytes=16 << 20),
                                    max_request_bytes=LIMIT))
    rw.client().upload("w", random_q6k(8, K, 1), 8, K)
    yield rw
    rw.stop()


def requests_counted(rw: RunningWorker, method: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in rw.registry.collect():
        for s in metric.samples:
            if (s.name == "q6serve_requests_total" and s.labels.get("method") == method):
                out[s.labels["code"]] = s.value
    return out


@pytest.mark.parametrize("method", ["Matmul", "MatmulStream"])
def test_a_request_over_the_receive_limit_never_reaches_the_worker(worker, method):
    c = worker.client()
    before = vram_figures(c)
    counted = requests_counted(worker, method).get("RESOURCE_EXHAUSTED", 0)
    # 2 MiB: over the limit, and refused whatever its content (K does not even match)
    req = matmul_request("w", np.ones((2, LIMIT // 4), np.float32))
    opts = [("grpc.max_send_message_length", 8 * LIMIT)]
    with grpc.insecure_channel(worker.target, options=opts) as ch:
        stub = pb_grpc.Q6ServeStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            if method == "Matmul":
                stub.Matmul(req, timeout=30)
            else:
                list(stub.MatmulStream(iter([req]), timeout=30))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"vs. {LIMIT}" in info.value.details(), info.value.details()
    if method == "Matmul":  # counted as what the caller saw, not as a request the handler ran
        assert requests_counted(worker, method).get("RESOURCE_EXHAUSTED", 0) == counted + 1
        assert "INVALID_ARGUMENT" not in requests_counted(worker, method)
    # the worker serves on, exactly, with its figures where they were
    x = np.ones((4, K), np.float32)
    assert c.matmul("w", x).shape == (4, 8)
    assert health(worker.target) == "SERVING"
    assert vram_figures(c) == before


def test_a_request_under_the_limit_is_served_from_its_own_bytes(worker):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((LIMIT // 4 // K - 8, K)).astype(np.float32)  # ~1 MiB - 8 rows
    c = worker.client()
    np.testing.assert_allclose(c.matmul("w", x[:256]), c.matmul("w", x[:256].copy()))
    with grpc.insecure_channel(worker.target) as ch:
        reply = pb_grpc.Q6ServeStub(ch).Matmul(matmul_request("w", x[:256]), timeout=30)
    assert tuple(reply.y.shape) == (256, 8)
