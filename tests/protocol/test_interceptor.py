"""The one interceptor wraps every handler shape, keeps a status the handler set itself, and
counts what callers see: one series per RPC and per request inside a MatmulStream, with the
service that served it."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from q6serve.kernels.errors import NotFound
from q6serve.service.config import Budget, WorkerConfig
from q6serve.service.interceptor import ErrorInterceptor
from q6serve.service.metrics import Metrics
from q6serve.v1 import q6serve_pb2 as pb
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc
from tests.service.svc_util import RunningWorker, random_q6k, reference

SVC = "test.Shapes"


def _decode(raw: bytes) -> bytes:
    if raw == b"junk":
        raise ValueError("not a message")
    return raw.upper()


# -- every handler shape, as grpcio lets a servicer write it ----------------------------------
async def unary_async(req: bytes, ctx: Any) -> bytes:
    return req + b"!"


def unary_sync(req: bytes, ctx: Any) -> bytes:
    return req + b"?"


async def stream_yield(req: bytes, ctx: Any) -> AsyncIterator[bytes]:
    for i in range(3):
        yield req + bytes([48 + i])


async def stream_write(req: bytes, ctx: Any) -> None:  # health Watch's shape
    for i in range(2):
        await ctx.write(req + bytes([48 + i]))


async def client_stream_iter(reqs: AsyncIterator[bytes], ctx: Any) -> bytes:
    return b"+".join([r async for r in reqs])


async def client_stream_read(reqs: Any, ctx: Any) -> bytes:  # the reader API
    got = []
    while (r := await ctx.read()) is not grpc.aio.EOF:
        got.append(r)
    return b"+".join(got)


async def bidi_iter(reqs: AsyncIterator[bytes], ctx: Any) -> AsyncIterator[bytes]:
    async for r in reqs:
        yield r + b"."


async def bidi_read_write(reqs: Any, ctx: Any) -> None:
    while (r := await ctx.read()) is not grpc.aio.EOF:
        await ctx.write(r + b",")


async def set_code_raise(req: bytes, ctx: Any) -> bytes:
    # what grpcio's generated base servicer does for a method a servicer does not implement
    ctx.set_code(grpc.StatusCode.UNIMPLEMENTED)
    ctx.set_details("Method not implemented!")
    raise NotImplementedError("Method not implemented!")


async def set_code_return(req: bytes, ctx: Any) -> bytes:
    ctx.set_code(grpc.StatusCode.FAILED_PRECONDITION)
    ctx.set_details("chose to fail")
    return b""


async def write_then_set_code_raise(req: bytes, ctx: Any) -> None:
    await ctx.write(b"first")
    ctx.set_code(grpc.StatusCode.OUT_OF_RANGE)
    ctx.set_details("ran out")
    raise RuntimeError("after the status was chosen")


async def aborts(req: bytes, ctx: Any) -> bytes:
    await ctx.abort(grpc.StatusCode.PERMISSION_DENIED, "handler said no")
    return b""


async def raises_q6(req: bytes, ctx: Any) -> bytes:
    raise NotFound("weight 'x' is not loaded")


async def raises_bug(req: bytes, ctx: Any) -> bytes:
    raise RuntimeError("secret detail")


HANDLERS = {
    "UnaryAsync": grpc.unary_unary_rpc_method_handler(unary_async, _decode),
    "UnarySync": grpc.unary_unary_rpc_method_handler(unary_sync, _decode),
    "StreamYield": grpc.unary_stream_rpc_method_handler(stream_yield, _decode),
    "StreamWrite": grpc.unary_stream_rpc_method_handler(stream_write, _decode),
    "ClientIter": grpc.stream_unary_rpc_method_handler(client_stream_iter, _decode),
    "ClientRead": grpc.stream_unary_rpc_method_handler(client_stream_read, _decode),
    "BidiIter": grpc.stream_stream_rpc_method_handler(bidi_iter, _decode),
    "BidiReadWrite": grpc.stream_stream_rpc_method_handler(bidi_read_write, _decode),
    "SetCodeRaise": grpc.unary_unary_rpc_method_handler(set_code_raise),
    "SetCodeReturn": grpc.unary_unary_rpc_method_handler(set_code_return),
    "WriteSetCodeRaise": grpc.unary_stream_rpc_method_handler(write_then_set_code_raise),
    "Aborts": grpc.unary_unary_rpc_method_handler(aborts),
    "RaisesQ6": grpc.unary_unary_rpc_method_handler(raises_q6),
    "RaisesBug": grpc.unary_unary_rpc_method_handler(raises_bug),
}


async def _run_shapes() -> tuple[dict[str, Any], Metrics]:
    metrics = Metrics(CollectorRegistry(), version="t", backend="numpy", device="cpu")
    server = grpc.aio.server(interceptors=[ErrorInterceptor(metrics)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SVC, HANDLERS),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out: dict[str, Any] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            def m(kind: str, name: str) -> Any:
                return getattr(ch, kind)(f"/{SVC}/{name}")

            async def outcome(coro: Any) -> Any:
                try:
                    return await coro
                except grpc.aio.AioRpcError as e:
                    return (e.code(), e.details())

            async def collect(call: Any) -> Any:
                got = []
                try:
                    async for r in call:
                        got.append(r)
                except grpc.aio.AioRpcError as e:
                    return got, (e.code(), e.details())
                return got

            out["UnaryAsync"] = await m("unary_unary", "UnaryAsync")(b"a")
            out["UnarySync"] = await m("unary_unary", "UnarySync")(b"a")
            out["junk"] = await outcome(m("unary_unary", "UnaryAsync")(b"junk"))
            out["StreamYield"] = await collect(m("unary_stream", "StreamYield")(b"s"))
            out["StreamWrite"] = await collect(m("unary_stream", "StreamWrite")(b"w"))
            out["ClientIter"] = await m("stream_unary", "ClientIter")(iter([b"a", b"b"]))
            out["ClientRead"] = await m("stream_unary", "ClientRead")(iter([b"c", b"d"]))
            out["ClientReadJunk"] = await outcome(
                m("stream_unary", "ClientRead")(iter([b"c", b"junk"])))
            out["BidiIter"] = await collect(m("stream_stream", "BidiIter")(iter([b"x", b"y"])))
            out["BidiReadWrite"] = await collect(
                m("stream_stream", "BidiReadWrite")(iter([b"x", b"y"])))
            for name in ("SetCodeRaise", "SetCodeReturn", "Aborts", "RaisesQ6", "RaisesBug"):
                out[name] = await outcome(m("unary_unary", name)(b""))
            out["WriteSetCodeRaise"] = await collect(
                m("unary_stream", "WriteSetCodeRaise")(b""))
    finally:
        await server.stop(0)
    return out, metrics


def test_every_handler_shape_and_handler_set_statuses(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        out, metrics = asyncio.run(_run_shapes())
    C = grpc.StatusCode
    assert out["UnaryAsync"] == b"A!" and out["UnarySync"] == b"A?"
    assert out["junk"] == (C.INVALID_ARGUMENT,
                           "UnaryAsync request cannot be decoded: ValueError")
    assert out["StreamYield"] == [b"S0", b"S1", b"S2"]
    assert out["StreamWrite"] == [b"W0", b"W1"]
    assert out["ClientIter"] == b"A+B" and out["ClientRead"] == b"C+D"
    assert out["ClientReadJunk"][0] == C.INVALID_ARGUMENT
    assert out["BidiIter"] == [b"X.", b"Y."] and out["BidiReadWrite"] == [b"X,", b"Y,"]
    # a status the handler chose is kept, whether it then returned, raised or aborted
    assert out["SetCodeRaise"] == (C.UNIMPLEMENTED, "Method not implemented!")
    assert out["SetCodeReturn"] == (C.FAILED_PRECONDITION, "chose to fail")
    assert out["WriteSetCodeRaise"] == ([b"first"], (C.OUT_OF_RANGE, "ran out"))
    assert out["Aborts"] == (C.PERMISSION_DENIED, "handler said no")
    assert out["RaisesQ6"] == (C.NOT_FOUND, "weight 'x' is not loaded")
    assert out["RaisesBug"] == (C.INTERNAL, "internal error (logged by the worker)")
    # only the bug is logged as an error, with its traceback
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in errors] == ["RaisesBug failed"], caplog.text
    assert errors[0].exc_info is not None

    def count(method: str, code: str) -> float:
        return metrics.registry.get_sample_value(
            "q6serve_requests_total", {"service": SVC, "method": method, "code": code}) or 0.0

    for name in ("UnaryAsync", "UnarySync", "StreamYield", "StreamWrite", "ClientIter",
                 "BidiIter", "BidiReadWrite"):
        assert count(name, "OK") == 1, name
    assert count("ClientRead", "OK") == 1 and count("ClientRead", "INVALID_ARGUMENT") == 1
    for name, code in (("SetCodeRaise", "UNIMPLEMENTED"), ("SetCodeReturn", "FAILED_PRECONDITION"),
                       ("WriteSetCodeRaise", "OUT_OF_RANGE"), ("Aborts", "PERMISSION_DENIED"),
                       ("RaisesQ6", "NOT_FOUND"), ("RaisesBug", "INTERNAL")):
        assert count(name, code) == 1, (name, code)
        assert count(name, "OK") == 0, name


# -- MatmulStream: one series per request, as its caller sees it --------------------------------
@pytest.fixture
def worker() -> Iterator[RunningWorker]:
    w = RunningWorker(WorkerConfig(host="127.0.0.1", port=0, vram_budget=Budget(nbytes=16 << 20),
                                   grace_period_s=2.0))
    yield w
    w.stop()


def _count(w: RunningWorker, service: str, method: str, code: str) -> float:
    return w.registry.get_sample_value(
        "q6serve_requests_total", {"service": service, "method": method, "code": code}) or 0.0


def test_stream_requests_are_counted_each(worker: RunningWorker) -> None:
    q6 = "q6serve.v1.Q6Serve"
    assert worker.registry.get_sample_value(  # pre-created, so dashboards see a zero
        "q6serve_requests_total",
        {"service": q6, "method": "MatmulStream/request", "code": "OK"}) == 0.0
    blocks = random_q6k(8, 256, 3)
    x = np.ones((2, 256), np.float32)

    def req(rid: str, weight: str, x: np.ndarray) -> pb.MatmulRequest:
        return pb.MatmulRequest(weight=weight, request_id=rid, x=pb.Tensor(
            dtype=pb.DTYPE_F32, shape=list(x.shape), data=x.tobytes()))

    with grpc.insecure_channel(worker.target) as ch:
        stub = pb_grpc.Q6ServeStub(ch)
        raw = blocks.tobytes()
        stub.UploadWeight(iter([
            pb.UploadWeightRequest(header=pb.UploadHeader(
                name="w", rows=8, k=256, format=pb.UPLOAD_FORMAT_Q6_K, total_bytes=len(raw),
                sha256=hashlib.sha256(raw).hexdigest())),
            pb.UploadWeightRequest(chunk=raw)]), timeout=10)
        replies = list(stub.MatmulStream(iter([
            req("a", "w", x), req("b", "missing", x), req("c", "w", x[:, :128]),
            req("d", "w", x)]), timeout=10))
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    by_id = {r.request_id: r for r in replies}
    assert by_id["b"].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert by_id["c"].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    y = np.frombuffer(by_id["a"].result.y.data, np.float32).reshape(2, 8)
    np.testing.assert_allclose(y, reference(blocks, 8, 256, x), rtol=1e-5, atol=1e-6)

    deadline = time.monotonic() + 10  # the stream's own series lands as its handler returns
    while _count(worker, q6, "MatmulStream", "OK") < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _count(worker, q6, "MatmulStream", "OK") == 1
    assert _count(worker, q6, "MatmulStream/request", "OK") == 2
    assert _count(worker, q6, "MatmulStream/request", "NOT_FOUND") == 1
    assert _count(worker, q6, "MatmulStream/request", "INVALID_ARGUMENT") == 1
    per_request = worker.registry.get_sample_value(
        "q6serve_request_duration_seconds_count",
        {"service": q6, "method": "MatmulStream/request", "code": "OK"})
    assert per_request == 2
    # standard services are told apart by their service label
    assert _count(worker, "grpc.health.v1.Health", "Check", "OK") == 1
    assert _count(worker, q6, "Check", "OK") == 0
