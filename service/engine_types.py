"""The plain values the engine's callers pass in and get back (no gRPC, no backend): a matmul
call, an upload's header and its checks, a weight's view and the worker's status. Made by the
wire modules and the servicer, the front ends and the multi-device engine; read by the engine."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from q6serve.kernels import q6k
from q6serve.kernels.api import DTYPES, Layout, Precision
from q6serve.kernels.errors import InvalidArgument, ResourceExhausted

from .flags import FlagState
from .registry import check_name
from .vram import VramStats

UPLOAD_FORMATS = ("q6_k", "f32", "f16")



@dataclass(frozen=True)
class WeightView:
    name: str
    rows: int
    k: int
    nbytes: int
    layout: Layout
    sha256: str
    source: str
    in_flight: int
    row_begin: int = 0  # global rows [row_begin, row_begin + rows) of the source tensor
    tensor_rows: int = 0  # rows of the whole source tensor

    @property
    def row_end(self) -> int:
        return self.row_begin + self.rows


@dataclass(slots=True, eq=False)  # made per request on the loop: a frozen init costs 2x
class MatmulCall:
    weight: str
    x: np.ndarray  # [N, K] f32/f16/bf16 (may be a read-only view of the request bytes)
    precision: Precision = Precision.AUTO
    out_dtype: np.dtype = DTYPES["f32"]
    timeout: float | None = None  # seconds left of the caller's deadline
    topk: int = 0  # > 0: the top-k epilogue (kernels/epilogue.py) replaces y
    weights: tuple[str, ...] = ()  # a multi-weight request (service/multi.py): not ``weight``


@dataclass(frozen=True)
class UploadSpec:
    name: str
    rows: int
    k: int
    fmt: str  # one of UPLOAD_FORMATS
    total_bytes: int
    sha256: str


def check_upload_spec(spec: UploadSpec, max_upload_bytes: int) -> int:
    """Validate an upload header before any data is read; return the byte count it promises."""
    check_name(spec.name)
    if spec.fmt not in UPLOAD_FORMATS:
        raise InvalidArgument(f"upload format {spec.fmt!r}; use one of {UPLOAD_FORMATS}")
    if spec.rows < 1:
        raise InvalidArgument(f"upload of {spec.name!r} has rows={spec.rows}")
    q6k.check_k(spec.k)
    itemsize = {"q6_k": None, "f32": 4, "f16": 2}[spec.fmt]
    want = (q6k.aos_nbytes(spec.rows, spec.k) if itemsize is None
            else spec.rows * spec.k * itemsize)
    if spec.total_bytes != want:
        raise InvalidArgument(f"upload {spec.name!r} {spec.rows}x{spec.k} {spec.fmt} must "
                              f"be {want} bytes, header says {spec.total_bytes}")
    if want > max_upload_bytes:
        raise ResourceExhausted(f"upload of {want} bytes exceeds the limit of "
                                f"{max_upload_bytes}")
    if len(spec.sha256) != 64:
        raise InvalidArgument("upload header needs the hex sha256 of the data (64 digits)")
    return want


@dataclass(frozen=True)
class StatusView:
    backend: str
    device: str
    version: str
    vram: VramStats
    flags: FlagState
    weights_loaded: int
    serving: bool
    max_batch_rows: int
    max_batch_delay_us: int
    relayout_in_progress: bool
    devices: tuple[object, ...] = ()  # multi-device workers: service.devices.DeviceStatus
    max_weights: int = 0
    host_overhead_bytes: int = 0  # weights' bookkeeping outside the VRAM budget (fixed costs)

