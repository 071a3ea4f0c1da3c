"""grpc.health.v1 and server reflection on a worker behave as grpcio's own servicers do on a bare
grpcio server (the reference here), through q6serve's interceptor, auth and metrics."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from q6serve.service.config import Budget, WorkerConfig
from tests.service.svc_util import RunningWorker

Q6 = "q6serve.v1.Q6Serve"
REFLECTION = {v: f"/grpc.reflection.{v}.ServerReflection/ServerReflectionInfo"
              for v in ("v1", "v1alpha")}


def _config(**kw: Any) -> WorkerConfig:
    return WorkerConfig(host="127.0.0.1", port=0, vram_budget=Budget(nbytes=16 << 20),
                        grace_period_s=2.0, **kw)


@pytest.fixture
def worker() -> Iterator[RunningWorker]:
    w = RunningWorker(_config())
    yield w
    w.stop()


class BareServer:
    """grpcio's asyncio health servicer alone on a grpcio server: the reference behaviour."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.health: Any = None
        self.server: Any = None
        self.target = self._call(self._start())

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def _start(self) -> str:
        self.server = grpc.aio.server()
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        await self.health.set(Q6, health_pb2.HealthCheckResponse.SERVING)
        return f"127.0.0.1:{port}"

    def close(self) -> None:
        self._call(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _outcomes(target: str) -> dict[str, Any]:
    """What a health client sees: (code, reply) of Check/List and the first Watch reply."""
    out: dict[str, Any] = {}
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", Q6, "no.such.Service"):
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                out[f"check {service}"] = ("OK", r.status)
            except grpc.RpcError as e:
                out[f"check {service}"] = (e.code().name, None)
        try:
            out["list"] = ("OK", dict(stub.List(health_pb2.HealthListRequest(), timeout=10)
                                      .statuses))
        except grpc.RpcError as e:
            out["list"] = (e.code().name, None)
        for service in (Q6, "no.such.Service"):
            call = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=10)
            out[f"watch {service}"] = next(call).status
            call.cancel()
    return out


def test_health_matches_grpcio_without_q6serve(worker: RunningWorker,
                                                caplog: pytest.LogCaptureFixture) -> None:
    bare = BareServer()
    try:
        want = _outcomes(bare.target)
    finally:
        bare.close()
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        got = _outcomes(worker.target)
    assert got == want
    # List: whatever grpcio-health-checking does (1.8x: UNIMPLEMENTED); Watch: streams
    assert got["list"][0] in ("UNIMPLEMENTED", "OK")
    assert got[f"watch {Q6}"] == health_pb2.HealthCheckResponse.SERVING
    assert got["watch no.such.Service"] == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    # an unimplemented method is not a worker failure: no error, no traceback in the log
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info], \
        caplog.text


def test_watch_streams_not_serving_on_drain(worker: RunningWorker) -> None:
    with grpc.insecure_channel(worker.target) as ch:
        call = health_pb2_grpc.HealthStub(ch).Watch(
            health_pb2.HealthCheckRequest(service=Q6), timeout=20)
        assert next(call).status == health_pb2.HealthCheckResponse.SERVING
        stopper = threading.Thread(target=worker.stop, kwargs={"grace": 2.0})
        stopper.start()
        try:
            assert next(call).status == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            call.cancel()
            stopper.join(30)


def _reflect(target: str, version: str, requests: list[reflection_pb2.ServerReflectionRequest],
             metadata: tuple[tuple[str, str], ...] = ()) -> list[Any]:
    # v1 and v1alpha messages are wire-identical, so the v1alpha classes speak both.
    with grpc.insecure_channel(target) as ch:
        info = ch.stream_stream(
            REFLECTION[version],
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        return list(info(iter(requests), timeout=10, metadata=metadata))


def _files(resp: Any) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    assert resp.WhichOneof("message_response") == "file_descriptor_response", resp
    out = {}
    for raw in resp.file_descriptor_response.file_descriptor_proto:
        fdp = descriptor_pb2.FileDescriptorProto.FromString(raw)
        out[fdp.name] = fdp
    return out


def _pool_of(files: dict[str, descriptor_pb2.FileDescriptorProto]) -> Any:
    """A fresh descriptor pool built from reflection's files alone (imports first)."""
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(name: str) -> None:
        if name not in added:
            for dep in files[name].dependency:
                add(dep)
            pool.Add(files[name])
            added.add(name)

    for name in files:
        add(name)
    return pool


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_and_resolves(worker: RunningWorker, version: str) -> None:
    R = reflection_pb2.ServerReflectionRequest
    symbols = [Q6, f"{Q6}.Matmul", f"{Q6}.MatmulStream", "q6serve.v1.MatmulRequest",
               "q6serve.v1.MatmulRequest.x", "q6serve.v1.DType", "grpc.health.v1.Health",
               "grpc.health.v1.Health.Watch", "grpc.reflection.v1.ServerReflection",
               "grpc.reflection.v1.ServerReflection.ServerReflectionInfo"]
    missing = ["q6serve.v1.Nope", f"{Q6}.Nope", "no.such.Service.Method"]
    resps = _reflect(worker.target, version, [
        R(list_services=""), R(file_by_filename="q6serve/v1/q6serve.proto"),
        *(R(file_containing_symbol=s) for s in symbols + missing)])
    names = {s.name for s in resps[0].list_services_response.service}
    assert names == {Q6, "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                     "grpc.reflection.v1alpha.ServerReflection"}
    assert "q6serve/v1/q6serve.proto" in _files(resps[1])
    for sym, resp in zip(symbols, resps[2:], strict=False):
        first = next(iter(_files(resp).values()))  # the containing file, then its imports
        assert sym.startswith(first.package + "."), (sym, first.name)
    for sym, resp in zip(missing, resps[2 + len(symbols):], strict=True):
        assert resp.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0], sym
    # every service listed resolves (what `grpcurl describe` does), and the worker's own file
    # set builds in a fresh pool, so a client can make calls from reflection alone
    for name in names:
        (resp,) = _reflect(worker.target, version, [R(file_containing_symbol=name)])
        pool = _pool_of(_files(resp))
        assert pool.FindServiceByName(name).methods, name
    (resp,) = _reflect(worker.target, version,
                       [R(file_containing_symbol="grpc.reflection.v1.ServerReflection")])
    (fdp,) = _files(resp).values()
    assert (fdp.name, fdp.package) == ("grpc/reflection/v1/reflection.proto",
                                       "grpc.reflection.v1")
    method = fdp.service[0].method[0]
    assert (method.input_type, method.output_type) == (
        ".grpc.reflection.v1.ServerReflectionRequest",
        ".grpc.reflection.v1.ServerReflectionResponse")


def test_health_open_reflection_needs_the_token() -> None:
    """With tokens set, health stays open (probes, load balancers) and reflection, which
    describes the API, needs the user token on both versions like every other RPC."""
    w = RunningWorker(_config(token="user-token"))
    try:
        with grpc.insecure_channel(w.target) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        req = [reflection_pb2.ServerReflectionRequest(list_services="")]
        for version in REFLECTION:
            with pytest.raises(grpc.RpcError) as e:
                _reflect(w.target, version, req)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            (resp,) = _reflect(w.target, version, req,
                               metadata=(("authorization", "Bearer user-token"),))
            assert Q6 in {s.name for s in resp.list_services_response.service}
    finally:
        w.stop()


def test_open_watch_does_not_hold_the_drain() -> None:
    """A load balancer's Watch stays open as long as the connection: the drain sends it
    NOT_SERVING and stops once the other calls are done, not at the end of the grace period
    (here 120 s: the stop below would time out long before)."""
    w = RunningWorker(_config())
    with grpc.insecure_channel(w.target) as ch:
        call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=Q6))
        assert next(call).status == health_pb2.HealthCheckResponse.SERVING
        w.call(w.worker.stop(120.0), timeout=30)
        statuses = []
        with pytest.raises(grpc.RpcError):
            for r in call:
                statuses.append(r.status)
        assert statuses == [health_pb2.HealthCheckResponse.NOT_SERVING]
    w.stop()
