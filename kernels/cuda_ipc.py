"""CUDA IPC helpers shared by the worker's CUDA regions (service/cuda_regions.py) and the
client's (client/shm.py CudaRegion): one place for the driver query both sides need."""

from __future__ import annotations

import ctypes

from .errors import DeviceError, InvalidArgument


def allocation_range(ptr: int) -> tuple[int, int]:
    """(base address, byte size) of the device allocation holding ``ptr`` in the current
    context (``cuMemGetAddressRange``; the runtime API has no equivalent)."""
    try:
        f = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
    except (OSError, AttributeError) as e:
        raise DeviceError(f"cannot query CUDA allocations: {e}") from None
    f.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                  ctypes.c_uint64]
    f.restype = ctypes.c_int
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = f(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise InvalidArgument(f"address {ptr:#x} is not in a device allocation (CUresult {rc})")
    return int(base.value), int(size.value)
