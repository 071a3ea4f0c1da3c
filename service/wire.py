"""Protobuf <-> core dataclasses of the admin and region RPCs, the service's method names,
and the servicer's registration (matmul replies' serializers pass ready bytes through; matmul
requests read by wire_requests.read_matmul_request).

The wire modules are the only ones of the service importing *_pb2: this one; matmul requests
read in wire_requests.py; replies written in wire_replies.py; the enum tables they share in
wire_enums.py; health and reflection in wire_standard.py.
"""

from __future__ import annotations

from typing import Any

import grpc

from q6serve.kernels.errors import InvalidArgument
from q6serve.v1 import q6serve_pb2 as pb
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc

from .engine_types import StatusView, UploadSpec, WeightView
from .flags import FlagState
from .regions import CudaIpcSource, RegionView, ShmSource
from .shards import RowRange, RowSelect
from .wire_enums import _LAYOUT_TO_PB, _UPLOAD_FROM_PB, _enum
from .wire_requests import read_matmul_request

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Q6Serve"].full_name
METHODS: tuple[str, ...] = tuple(
    m.name for m in pb.DESCRIPTOR.services_by_name["Q6Serve"].methods)
# Request/reply streams: each request in them is counted on its own (metrics).
BIDI_METHODS: tuple[str, ...] = tuple(
    m.name for m in pb.DESCRIPTOR.services_by_name["Q6Serve"].methods
    if m.client_streaming and m.server_streaming)
ADMIN_METHODS = frozenset({"LoadWeights", "UploadWeight", "UnloadWeight", "SetFlags"})



# -- shared-memory regions (service/regions.py) ----------------------------------------------
_REGION_KIND_TO_PB = {"system": pb.REGION_KIND_SYSTEM, "cuda": pb.REGION_KIND_CUDA}



def open_lane_response(path: str, ticket: bytes) -> pb.OpenLaneResponse:
    return pb.OpenLaneResponse(socket_path=path, ticket=ticket)



def region_source(req: pb.RegisterRegionRequest) -> ShmSource | CudaIpcSource:
    which = req.WhichOneof("source")
    if which == "system":
        s = req.system
        return ShmSource(s.key, int(s.offset), int(s.byte_size))
    if which == "cuda":
        c = req.cuda
        return CudaIpcSource(bytes(c.handle), int(c.device), int(c.byte_size), int(c.offset))
    raise InvalidArgument("RegisterRegionRequest needs a source (system or cuda)")


def region_info(v: RegionView) -> pb.RegionInfo:
    return pb.RegionInfo(name=v.name, kind=_REGION_KIND_TO_PB[v.kind], key=v.key,
                         offset=v.offset, byte_size=v.byte_size, in_use=v.in_use)


def register_region_response(v: RegionView) -> pb.RegisterRegionResponse:
    return pb.RegisterRegionResponse(region=region_info(v))


def unregister_region_response(v: RegionView) -> pb.UnregisterRegionResponse:
    return pb.UnregisterRegionResponse(region=region_info(v))


def list_regions_response(views: list[RegionView]) -> pb.ListRegionsResponse:
    return pb.ListRegionsResponse(regions=[region_info(v) for v in views])


def weight_info(w: WeightView) -> pb.WeightInfo:
    return pb.WeightInfo(name=w.name, rows=w.rows, k=w.k, nbytes=w.nbytes,
                         layout=_LAYOUT_TO_PB[w.layout], sha256=w.sha256, source=w.source,
                         in_flight=w.in_flight,
                         row_range=pb.RowRange(begin=w.row_begin, end=w.row_end),
                         tensor_rows=w.tensor_rows or w.rows)


_PLACEMENT_FROM_PB = {pb.PLACEMENT_UNSPECIFIED: None, pb.PLACEMENT_SHARD: "shard",
                      pb.PLACEMENT_REPLICATE: "replicate"}


def placement(req: pb.LoadWeightsRequest) -> str | None:
    """LoadWeightsRequest.placement (None: the worker's default)."""
    return _enum(_PLACEMENT_FROM_PB, req.placement, "placement")  # type: ignore[no-any-return]


def _vram_info(v: Any) -> pb.VramInfo:
    return pb.VramInfo(budget_bytes=v.budget, weights_bytes=v.weights, scratch_bytes=v.scratch,
                       staging_bytes=v.staging, pool_used_bytes=v.pool_used,
                       pool_total_bytes=v.pool_total, device_free_bytes=v.device_free,
                       device_total_bytes=v.device_total, reserved_bytes=v.reserved)


def row_select(req: pb.LoadWeightsRequest) -> RowSelect | None:
    """LoadWeightsRequest's optional ``rows`` oneof (None: every row)."""
    which = req.WhichOneof("rows")
    if which == "row_range":
        return RowSelect(range=RowRange(int(req.row_range.begin), int(req.row_range.end)))
    if which == "shard":
        if req.shard.count < 1:
            raise InvalidArgument(f"shard count {req.shard.count} must be >= 1")
        return RowSelect(shard=(int(req.shard.index), int(req.shard.count)))
    return None


def upload_spec(h: pb.UploadHeader) -> UploadSpec:
    return UploadSpec(name=h.name, rows=int(h.rows), k=int(h.k),
                      fmt=_enum(_UPLOAD_FROM_PB, h.format, "upload format"),
                      total_bytes=int(h.total_bytes), sha256=h.sha256)


def flags_msg(state: FlagState) -> list[pb.Flag]:
    return [pb.Flag(name=n, enabled=v) for n, v in state.as_dict().items()]


def flag_changes(req: pb.SetFlagsRequest) -> dict[str, bool]:
    out: dict[str, bool] = {}
    for f in req.flags:
        if f.name in out:
            raise InvalidArgument(f"flag {f.name} given twice")
        out[f.name] = f.enabled
    return out


def status_response(s: StatusView) -> pb.GetStatusResponse:
    v = s.vram
    vram = pb.VramInfo(budget_bytes=v.budget, weights_bytes=v.weights, scratch_bytes=v.scratch,
                       staging_bytes=v.staging, pool_used_bytes=v.pool_used,
                       pool_total_bytes=v.pool_total, device_free_bytes=v.device_free,
                       device_total_bytes=v.device_total, reserved_bytes=v.reserved)
    return pb.GetStatusResponse(backend=s.backend, device=s.device, version=s.version,
                                vram=vram, flags=flags_msg(s.flags),
                                weights_loaded=s.weights_loaded, serving=s.serving,
                                max_batch_rows=s.max_batch_rows,
                                max_batch_delay_us=s.max_batch_delay_us,
                                relayout_in_progress=s.relayout_in_progress,
                                max_weights=s.max_weights,
                                host_overhead_bytes=s.host_overhead_bytes,
                                devices=[pb.DeviceStatus(index=d.index, ordinal=d.ordinal,
                                                         device=d.device,
                                                         vram=_vram_info(d.vram),
                                                         weights_loaded=d.weights_loaded)
                                         for d in s.devices])


def load_response(views: list[WeightView]) -> pb.LoadWeightsResponse:
    return pb.LoadWeightsResponse(weights=[weight_info(v) for v in views])


def upload_response(view: WeightView) -> pb.UploadWeightResponse:
    return pb.UploadWeightResponse(weight=weight_info(view))


def list_response(views: list[WeightView]) -> pb.ListWeightsResponse:
    return pb.ListWeightsResponse(weights=[weight_info(v) for v in views])


def get_response(view: WeightView) -> pb.GetWeightResponse:
    return pb.GetWeightResponse(weight=weight_info(view))


def unload_response(view: WeightView) -> pb.UnloadWeightResponse:
    return pb.UnloadWeightResponse(weight=weight_info(view))


def set_flags_response(state: FlagState) -> pb.SetFlagsResponse:
    return pb.SetFlagsResponse(flags=flags_msg(state))


def _bytes_or(serialize: Any) -> Any:
    def ser(msg: Any) -> bytes:
        return msg if isinstance(msg, bytes) else serialize(msg)
    return ser


class _Registration:
    """What the generated add_*_to_server registers, with the matmul replies' serializers
    passing ready-made bytes through (matmul_response_bytes, stream_result_bytes) and their
    requests read by read_matmul_request."""

    def __init__(self, server: Any) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Dropped: the generated code registers the same table next, which is patched there
        and registered both ways."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        table = dict(handlers)
        for name in ("Matmul", "MatmulStream"):
            h = table[name]
            table[name] = h._replace(response_serializer=_bytes_or(h.response_serializer),
                                     request_deserializer=read_matmul_request)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, table),))
        self._server.add_registered_method_handlers(service, table)


def add_to_server(servicer: object, server: object) -> None:
    pb_grpc.add_Q6ServeServicer_to_server(servicer, _Registration(server))

