"""The standard services beside Q6Serve: grpc.health.v1 (grpcio's own asyncio servicer)
and server reflection as v1alpha and v1. Called by service/worker.py and the front ends."""

from __future__ import annotations

from typing import Any

import grpc

from .wire import SERVICE_NAME

# -- standard services: grpc.health.v1 and server reflection (v1 and v1alpha) ----------------

def health_servicer() -> Any:
    """grpcio's own asyncio health servicer, unchanged (Check, Watch; List as grpcio has it)."""
    from grpc_health.v1 import health

    return health.aio.HealthServicer()


def health_status(serving: bool) -> Any:
    from grpc_health.v1 import health_pb2

    return (health_pb2.HealthCheckResponse.SERVING if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING)


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


class _MethodLookupPool:
    """The default descriptor pool for reflection, plus method symbols: the reflection protocol
    lets file_containing_symbol name a method (``q6serve.v1.Q6Serve.Matmul``, what
    ``grpcurl describe`` sends), which protobuf's upb pool does not resolve by itself."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def FindFileContainingSymbol(self, name: str) -> Any:  # the pool API
        try:
            return self._pool.FindFileContainingSymbol(name)
        except KeyError:
            service, _, method = name.rpartition(".")
            try:
                found = self._pool.FindServiceByName(service)
            except KeyError:
                found = None
            if found is None or method not in found.methods_by_name:
                raise
            return found.file

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


def _add_reflection_v1_descriptor(pool: Any) -> None:
    """Put grpc/reflection/v1/reflection.proto into ``pool`` so reflection describes itself.

    grpcio-reflection ships only v1alpha. v1 is the same file under another package (same
    messages, fields and numbers), so its descriptor is v1alpha's with the package renamed."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2

    name = "grpc/reflection/v1/reflection.proto"
    try:
        pool.FindFileByName(name)
        return  # added by an earlier worker of this process
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    old, new = f".{fdp.package}.", ".grpc.reflection.v1."
    fdp.name, fdp.package = name, "grpc.reflection.v1"
    fdp.options.Clear()
    fdp.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    fdp.options.java_package = "io.grpc.reflection.v1"
    fdp.options.java_outer_classname = "ServerReflectionProto"
    fdp.options.java_multiple_files = True
    for msg in fdp.message_type:
        for f in msg.field:
            if f.HasField("type_name"):
                f.type_name = f.type_name.replace(old, new)
    for svc in fdp.service:
        for m in svc.method:
            m.input_type = m.input_type.replace(old, new)
            m.output_type = m.output_type.replace(old, new)
    pool.Add(fdp)


def add_health_and_reflection(server: Any, health_servicer: Any) -> None:
    """Health, and reflection as v1alpha (grpcio's servicer) and v1 (the same servicer: the
    two protocols' messages are wire-identical, so v1 bytes parse as v1alpha messages)."""
    from google.protobuf import descriptor_pool
    from grpc_health.v1 import health, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection, reflection_pb2

    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    pool = descriptor_pool.Default()
    _add_reflection_v1_descriptor(pool)
    names = (SERVICE_NAME, health.SERVICE_NAME, REFLECTION_V1, reflection.SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names, pool=_MethodLookupPool(pool))
    for service in (REFLECTION_V1, reflection.SERVICE_NAME):
        handler = grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {"ServerReflectionInfo": handler}),))

