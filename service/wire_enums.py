"""The wire modules' shared tables: proto enum numbers <-> the core's dtypes, precisions,
layouts and upload formats (each made once, read by dict per request), and the checked lookup
that refuses an unknown number by name. Imported by the wire*.py modules only."""

from __future__ import annotations

import numpy as np

from q6serve.kernels.api import DTYPES, Layout, Precision
from q6serve.kernels.errors import InvalidArgument
from q6serve.v1 import q6serve_pb2 as pb

_DTYPE_FROM_PB = {pb.DTYPE_UNSPECIFIED: "f32", pb.DTYPE_F32: "f32", pb.DTYPE_F16: "f16",
                  pb.DTYPE_BF16: "bf16"}
_DTYPE_TO_PB = {"f32": pb.DTYPE_F32, "f16": pb.DTYPE_F16, "bf16": pb.DTYPE_BF16}
_PREC_FROM_PB = {pb.PRECISION_AUTO: Precision.AUTO, pb.PRECISION_EXACT: Precision.EXACT,
                 pb.PRECISION_F16: Precision.F16, pb.PRECISION_Q8_1: Precision.Q8_1}
_PREC_TO_PB = {v: k for k, v in _PREC_FROM_PB.items()}
_LAYOUT_TO_PB = {Layout.SOA: pb.LAYOUT_SOA, Layout.AOS: pb.LAYOUT_AOS}
_UPLOAD_FROM_PB = {pb.UPLOAD_FORMAT_UNSPECIFIED: "q6_k", pb.UPLOAD_FORMAT_Q6_K: "q6_k",
                   pb.UPLOAD_FORMAT_F32: "f32", pb.UPLOAD_FORMAT_F16: "f16"}
MAX_DIM = 1 << 31
# per request and reply on the event loop, by dict: each wire dtype's little-endian numpy
# dtype (made once) and the Tensor.dtype code of the native ones
_LITTLE = {dt: dt.newbyteorder("<") for dt in DTYPES.values()}
_PB_OF_DTYPE = {dt: _DTYPE_TO_PB[name] for name, dt in DTYPES.items()}
# Tensor.dtype code -> dtype (tensor_spec: one lookup per request for a known code; an unknown
# one goes to dtype_from_pb for its refusal)
_DT_OF_PB = {code: DTYPES[name] for code, name in _DTYPE_FROM_PB.items()}


def _enum(table: dict, value: int, what: str):  # type: ignore[no-untyped-def]
    try:
        return table[value]
    except KeyError:
        raise InvalidArgument(f"unknown {what} enum value {value}") from None


def dtype_from_pb(value: int) -> np.dtype:
    dt = _DT_OF_PB.get(value)  # (one lookup for a known code: per request)
    return dt if dt is not None else DTYPES[_enum(_DTYPE_FROM_PB, value, "dtype")]

