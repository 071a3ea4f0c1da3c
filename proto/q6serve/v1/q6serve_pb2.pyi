from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_F32: _ClassVar[DType]
    DTYPE_F16: _ClassVar[DType]
    DTYPE_BF16: _ClassVar[DType]

class Precision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRECISION_AUTO: _ClassVar[Precision]
    PRECISION_EXACT: _ClassVar[Precision]
    PRECISION_F16: _ClassVar[Precision]
    PRECISION_Q8_1: _ClassVar[Precision]

class Layout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LAYOUT_UNSPECIFIED: _ClassVar[Layout]
    LAYOUT_SOA: _ClassVar[Layout]
    LAYOUT_AOS: _ClassVar[Layout]

class Placement(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLACEMENT_UNSPECIFIED: _ClassVar[Placement]
    PLACEMENT_SHARD: _ClassVar[Placement]
    PLACEMENT_REPLICATE: _ClassVar[Placement]

class UploadFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPLOAD_FORMAT_UNSPECIFIED: _ClassVar[UploadFormat]
    UPLOAD_FORMAT_Q6_K: _ClassVar[UploadFormat]
    UPLOAD_FORMAT_F32: _ClassVar[UploadFormat]
    UPLOAD_FORMAT_F16: _ClassVar[UploadFormat]

class RegionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REGION_KIND_UNSPECIFIED: _ClassVar[RegionKind]
    REGION_KIND_SYSTEM: _ClassVar[RegionKind]
    REGION_KIND_CUDA: _ClassVar[RegionKind]
DTYPE_UNSPECIFIED: DType
DTYPE_F32: DType
DTYPE_F16: DType
DTYPE_BF16: DType
PRECISION_AUTO: Precision
PRECISION_EXACT: Precision
PRECISION_F16: Precision
PRECISION_Q8_1: Precision
LAYOUT_UNSPECIFIED: Layout
LAYOUT_SOA: Layout
LAYOUT_AOS: Layout
PLACEMENT_UNSPECIFIED: Placement
PLACEMENT_SHARD: Placement
PLACEMENT_REPLICATE: Placement
UPLOAD_FORMAT_UNSPECIFIED: UploadFormat
UPLOAD_FORMAT_Q6_K: UploadFormat
UPLOAD_FORMAT_F32: UploadFormat
UPLOAD_FORMAT_F16: UploadFormat
REGION_KIND_UNSPECIFIED: RegionKind
REGION_KIND_SYSTEM: RegionKind
REGION_KIND_CUDA: RegionKind

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class WeightInfo(_message.Message):
    __slots__ = ("name", "rows", "k", "nbytes", "layout", "sha256", "source", "in_flight", "row_range", "tensor_rows")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ROW_RANGE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ROWS_FIELD_NUMBER: _ClassVar[int]
    name: str
    rows: int
    k: int
    nbytes: int
    layout: Layout
    sha256: str
    source: str
    in_flight: int
    row_range: RowRange
    tensor_rows: int
    def __init__(self, name: _Optional[str] = ..., rows: _Optional[int] = ..., k: _Optional[int] = ..., nbytes: _Optional[int] = ..., layout: _Optional[_Union[Layout, str]] = ..., sha256: _Optional[str] = ..., source: _Optional[str] = ..., in_flight: _Optional[int] = ..., row_range: _Optional[_Union[RowRange, _Mapping]] = ..., tensor_rows: _Optional[int] = ...) -> None: ...

class RowRange(_message.Message):
    __slots__ = ("begin", "end")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    begin: int
    end: int
    def __init__(self, begin: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class ShardSpec(_message.Message):
    __slots__ = ("index", "count")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    index: int
    count: int
    def __init__(self, index: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("gguf_path", "tensors", "prefix", "row_range", "shard", "placement")
    GGUF_PATH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    ROW_RANGE_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    gguf_path: str
    tensors: _containers.RepeatedScalarFieldContainer[str]
    prefix: str
    row_range: RowRange
    shard: ShardSpec
    placement: Placement
    def __init__(self, gguf_path: _Optional[str] = ..., tensors: _Optional[_Iterable[str]] = ..., prefix: _Optional[str] = ..., row_range: _Optional[_Union[RowRange, _Mapping]] = ..., shard: _Optional[_Union[ShardSpec, _Mapping]] = ..., placement: _Optional[_Union[Placement, str]] = ...) -> None: ...

class LoadWeightsResponse(_message.Message):
    __slots__ = ("weights",)
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    weights: _containers.RepeatedCompositeFieldContainer[WeightInfo]
    def __init__(self, weights: _Optional[_Iterable[_Union[WeightInfo, _Mapping]]] = ...) -> None: ...

class UploadHeader(_message.Message):
    __slots__ = ("name", "rows", "k", "format", "total_bytes", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    rows: int
    k: int
    format: UploadFormat
    total_bytes: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., rows: _Optional[int] = ..., k: _Optional[int] = ..., format: _Optional[_Union[UploadFormat, str]] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class UploadWeightRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UploadHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[UploadHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class UploadWeightResponse(_message.Message):
    __slots__ = ("weight",)
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    weight: WeightInfo
    def __init__(self, weight: _Optional[_Union[WeightInfo, _Mapping]] = ...) -> None: ...

class ListWeightsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWeightsResponse(_message.Message):
    __slots__ = ("weights",)
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    weights: _containers.RepeatedCompositeFieldContainer[WeightInfo]
    def __init__(self, weights: _Optional[_Iterable[_Union[WeightInfo, _Mapping]]] = ...) -> None: ...

class GetWeightRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetWeightResponse(_message.Message):
    __slots__ = ("weight",)
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    weight: WeightInfo
    def __init__(self, weight: _Optional[_Union[WeightInfo, _Mapping]] = ...) -> None: ...

class UnloadWeightRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadWeightResponse(_message.Message):
    __slots__ = ("weight",)
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    weight: WeightInfo
    def __init__(self, weight: _Optional[_Union[WeightInfo, _Mapping]] = ...) -> None: ...

class MatmulRequest(_message.Message):
    __slots__ = ("weight", "x", "out_dtype", "precision", "request_id", "x_region", "y_region", "weights", "topk")
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    X_FIELD_NUMBER: _ClassVar[int]
    OUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    X_REGION_FIELD_NUMBER: _ClassVar[int]
    Y_REGION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    weight: str
    x: Tensor
    out_dtype: DType
    precision: Precision
    request_id: str
    x_region: RegionRef
    y_region: RegionRef
    weights: _containers.RepeatedScalarFieldContainer[str]
    topk: TopKEpilogue
    def __init__(self, weight: _Optional[str] = ..., x: _Optional[_Union[Tensor, _Mapping]] = ..., out_dtype: _Optional[_Union[DType, str]] = ..., precision: _Optional[_Union[Precision, str]] = ..., request_id: _Optional[str] = ..., x_region: _Optional[_Union[RegionRef, _Mapping]] = ..., y_region: _Optional[_Union[RegionRef, _Mapping]] = ..., weights: _Optional[_Iterable[str]] = ..., topk: _Optional[_Union[TopKEpilogue, _Mapping]] = ...) -> None: ...

class MatmulTiming(_message.Message):
    __slots__ = ("queue_seconds", "kernel_seconds", "batch_rows", "batch_requests", "decode_seconds", "device_seconds", "handler_seconds")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    BATCH_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HANDLER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    kernel_seconds: float
    batch_rows: int
    batch_requests: int
    decode_seconds: float
    device_seconds: float
    handler_seconds: float
    def __init__(self, queue_seconds: _Optional[float] = ..., kernel_seconds: _Optional[float] = ..., batch_rows: _Optional[int] = ..., batch_requests: _Optional[int] = ..., decode_seconds: _Optional[float] = ..., device_seconds: _Optional[float] = ..., handler_seconds: _Optional[float] = ...) -> None: ...

class MatmulResponse(_message.Message):
    __slots__ = ("y", "kernel", "layout", "precision", "timing", "request_id", "topk", "outputs")
    Y_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    y: Tensor
    kernel: str
    layout: Layout
    precision: Precision
    timing: MatmulTiming
    request_id: str
    topk: TopKResult
    outputs: _containers.RepeatedCompositeFieldContainer[WeightOutput]
    def __init__(self, y: _Optional[_Union[Tensor, _Mapping]] = ..., kernel: _Optional[str] = ..., layout: _Optional[_Union[Layout, str]] = ..., precision: _Optional[_Union[Precision, str]] = ..., timing: _Optional[_Union[MatmulTiming, _Mapping]] = ..., request_id: _Optional[str] = ..., topk: _Optional[_Union[TopKResult, _Mapping]] = ..., outputs: _Optional[_Iterable[_Union[WeightOutput, _Mapping]]] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class MatmulStreamResponse(_message.Message):
    __slots__ = ("request_id", "result", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    result: MatmulResponse
    error: StreamError
    def __init__(self, request_id: _Optional[str] = ..., result: _Optional[_Union[MatmulResponse, _Mapping]] = ..., error: _Optional[_Union[StreamError, _Mapping]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VramInfo(_message.Message):
    __slots__ = ("budget_bytes", "weights_bytes", "scratch_bytes", "staging_bytes", "pool_used_bytes", "pool_total_bytes", "device_free_bytes", "device_total_bytes", "reserved_bytes")
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCRATCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    budget_bytes: int
    weights_bytes: int
    scratch_bytes: int
    staging_bytes: int
    pool_used_bytes: int
    pool_total_bytes: int
    device_free_bytes: int
    device_total_bytes: int
    reserved_bytes: int
    def __init__(self, budget_bytes: _Optional[int] = ..., weights_bytes: _Optional[int] = ..., scratch_bytes: _Optional[int] = ..., staging_bytes: _Optional[int] = ..., pool_used_bytes: _Optional[int] = ..., pool_total_bytes: _Optional[int] = ..., device_free_bytes: _Optional[int] = ..., device_total_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ...) -> None: ...

class Flag(_message.Message):
    __slots__ = ("name", "enabled")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    name: str
    enabled: bool
    def __init__(self, name: _Optional[str] = ..., enabled: _Optional[bool] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("backend", "device", "version", "vram", "flags", "weights_loaded", "serving", "max_batch_rows", "max_batch_delay_us", "relayout_in_progress", "devices", "max_weights", "host_overhead_bytes")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    VRAM_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_LOADED_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_DELAY_US_FIELD_NUMBER: _ClassVar[int]
    RELAYOUT_IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    MAX_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    HOST_OVERHEAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    backend: str
    device: str
    version: str
    vram: VramInfo
    flags: _containers.RepeatedCompositeFieldContainer[Flag]
    weights_loaded: int
    serving: bool
    max_batch_rows: int
    max_batch_delay_us: int
    relayout_in_progress: bool
    devices: _containers.RepeatedCompositeFieldContainer[DeviceStatus]
    max_weights: int
    host_overhead_bytes: int
    def __init__(self, backend: _Optional[str] = ..., device: _Optional[str] = ..., version: _Optional[str] = ..., vram: _Optional[_Union[VramInfo, _Mapping]] = ..., flags: _Optional[_Iterable[_Union[Flag, _Mapping]]] = ..., weights_loaded: _Optional[int] = ..., serving: _Optional[bool] = ..., max_batch_rows: _Optional[int] = ..., max_batch_delay_us: _Optional[int] = ..., relayout_in_progress: _Optional[bool] = ..., devices: _Optional[_Iterable[_Union[DeviceStatus, _Mapping]]] = ..., max_weights: _Optional[int] = ..., host_overhead_bytes: _Optional[int] = ...) -> None: ...

class DeviceStatus(_message.Message):
    __slots__ = ("index", "ordinal", "device", "vram", "weights_loaded")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VRAM_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_LOADED_FIELD_NUMBER: _ClassVar[int]
    index: int
    ordinal: int
    device: str
    vram: VramInfo
    weights_loaded: int
    def __init__(self, index: _Optional[int] = ..., ordinal: _Optional[int] = ..., device: _Optional[str] = ..., vram: _Optional[_Union[VramInfo, _Mapping]] = ..., weights_loaded: _Optional[int] = ...) -> None: ...

class SetFlagsRequest(_message.Message):
    __slots__ = ("flags",)
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    flags: _containers.RepeatedCompositeFieldContainer[Flag]
    def __init__(self, flags: _Optional[_Iterable[_Union[Flag, _Mapping]]] = ...) -> None: ...

class SetFlagsResponse(_message.Message):
    __slots__ = ("flags",)
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    flags: _containers.RepeatedCompositeFieldContainer[Flag]
    def __init__(self, flags: _Optional[_Iterable[_Union[Flag, _Mapping]]] = ...) -> None: ...

class SystemShm(_message.Message):
    __slots__ = ("key", "offset", "byte_size")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    byte_size: int
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class CudaIpcBuffer(_message.Message):
    __slots__ = ("handle", "device", "byte_size", "offset")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    device: int
    byte_size: int
    offset: int
    def __init__(self, handle: _Optional[bytes] = ..., device: _Optional[int] = ..., byte_size: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class RegisterRegionRequest(_message.Message):
    __slots__ = ("name", "system", "cuda")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    name: str
    system: SystemShm
    cuda: CudaIpcBuffer
    def __init__(self, name: _Optional[str] = ..., system: _Optional[_Union[SystemShm, _Mapping]] = ..., cuda: _Optional[_Union[CudaIpcBuffer, _Mapping]] = ...) -> None: ...

class RegionInfo(_message.Message):
    __slots__ = ("name", "kind", "key", "offset", "byte_size", "in_use")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    IN_USE_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: RegionKind
    key: str
    offset: int
    byte_size: int
    in_use: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[RegionKind, str]] = ..., key: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ..., in_use: _Optional[int] = ...) -> None: ...

class RegisterRegionResponse(_message.Message):
    __slots__ = ("region",)
    REGION_FIELD_NUMBER: _ClassVar[int]
    region: RegionInfo
    def __init__(self, region: _Optional[_Union[RegionInfo, _Mapping]] = ...) -> None: ...

class UnregisterRegionRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnregisterRegionResponse(_message.Message):
    __slots__ = ("region",)
    REGION_FIELD_NUMBER: _ClassVar[int]
    region: RegionInfo
    def __init__(self, region: _Optional[_Union[RegionInfo, _Mapping]] = ...) -> None: ...

class ListRegionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRegionsResponse(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[RegionInfo]
    def __init__(self, regions: _Optional[_Iterable[_Union[RegionInfo, _Mapping]]] = ...) -> None: ...

class RegionRef(_message.Message):
    __slots__ = ("region", "offset")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    region: str
    offset: int
    def __init__(self, region: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class OpenLaneRequest(_message.Message):
    __slots__ = ("region",)
    REGION_FIELD_NUMBER: _ClassVar[int]
    region: str
    def __init__(self, region: _Optional[str] = ...) -> None: ...

class OpenLaneResponse(_message.Message):
    __slots__ = ("socket_path", "ticket")
    SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    socket_path: str
    ticket: bytes
    def __init__(self, socket_path: _Optional[str] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class TopKEpilogue(_message.Message):
    __slots__ = ("k",)
    K_FIELD_NUMBER: _ClassVar[int]
    k: int
    def __init__(self, k: _Optional[int] = ...) -> None: ...

class TopKResult(_message.Message):
    __slots__ = ("rows", "k", "values", "indices", "lse")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    LSE_FIELD_NUMBER: _ClassVar[int]
    rows: int
    k: int
    values: bytes
    indices: bytes
    lse: bytes
    def __init__(self, rows: _Optional[int] = ..., k: _Optional[int] = ..., values: _Optional[bytes] = ..., indices: _Optional[bytes] = ..., lse: _Optional[bytes] = ...) -> None: ...

class WeightOutput(_message.Message):
    __slots__ = ("weight", "y", "topk", "kernel", "layout", "precision", "timing")
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    Y_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    weight: str
    y: Tensor
    topk: TopKResult
    kernel: str
    layout: Layout
    precision: Precision
    timing: MatmulTiming
    def __init__(self, weight: _Optional[str] = ..., y: _Optional[_Union[Tensor, _Mapping]] = ..., topk: _Optional[_Union[TopKResult, _Mapping]] = ..., kernel: _Optional[str] = ..., layout: _Optional[_Union[Layout, str]] = ..., precision: _Optional[_Union[Precision, str]] = ..., timing: _Optional[_Union[MatmulTiming, _Mapping]] = ...) -> None: ...
