"""A MatmulStream whose request stream fails (a message that cannot be decoded) behind two
front-end processes: every good request sent before the bad message is answered (a reply or a
status of its own) before the stream ends with INVALID_ARGUMENT. The front end's requests are
open (at the device process) when the bad message arrives, so the stream's end must wait for
them; before, only the replies queued already went out (session 30: t1's repro in
tests/service/test_worker_process_abuse.py, 0 of the earlier requests answered)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import numpy as np

from q6serve.client.core import matmul_request
from q6serve.kernels import q6k
from q6serve.v1 import q6serve_pb2 as pb
from tests.dataplane.test_frontends import Running, start  # noqa: F401  (fixture)
from tests.reliability.harness import health
from tests.service.svc_util import InstrumentedBackend

SVC = "/q6serve.v1.Q6Serve/"


def _raw(b: bytes) -> bytes:
    return b


def test_requests_before_an_undecodable_message_are_answered(
        start: Callable[..., Running]) -> None:  # noqa: F811
    # each matmul takes 50 ms at the device process: the good requests are still open there
    # when the bad message (sent right behind them) ends the request stream
    r = start(InstrumentedBackend(matmul_delay=0.05))
    c = r.client()
    c.upload("w", q6k.random_blocks(16, 256, np.random.default_rng(0)), 16, 256)
    x = np.ones((1, 256), np.float32)
    good = [matmul_request("w", x, request_id=f"r{i}").SerializeToString() for i in range(4)]
    shapes = {
        "garbage": b"\xff\xff\xff\xff",
        # field 5 (request_id, a string) that is not UTF-8
        "bad utf-8": matmul_request("w", x).SerializeToString() + b"\x2a\x02\xff\xfe",
    }
    with grpc.insecure_channel(r.target) as ch:
        stream = ch.stream_stream(SVC + "MatmulStream", request_serializer=_raw,
                                  response_deserializer=_raw)
        for name, bad in shapes.items():
            got: list[str] = []
            try:
                for b in stream(iter([*good, bad, good[0]]), timeout=20):
                    reply = pb.MatmulStreamResponse.FromString(b)
                    assert reply.HasField("result"), (name, reply.error)
                    got.append(reply.request_id)
                raise AssertionError(f"{name}: the stream ended OK")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e)
            # every request before the bad one answered, once; none after it
            assert sorted(got) == ["r0", "r1", "r2", "r3"], (name, got)
    assert health(r.target) == "SERVING"
