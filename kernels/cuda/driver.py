"""The CUDA driver entry points the launch path calls through ctypes, where CuPy has no wrapper:
``cuLaunchKernelEx`` with programmatic stream serialization (:func:`launch_pdl`, the split-K
sum's PDL launch), ``cuOccupancyMaxActiveClusters`` (:func:`clusters_fit`, the cluster-sum
tile's one-wave plan), ``cuEventRecordWithFlags`` (:func:`_external_record`, the timing events
a captured graph keeps as nodes) and ``cuMemHostGetDevicePointer_v2`` (:func:`_host_device_ptr`,
a pinned region's device address for the copy kernel), with the driver structs they take.

Called by kernels/cuda/launch.py (``Launcher``, ``Step``); each lookup returns None where the
driver lacks the entry point (a device-less host, an old driver), and its caller falls back.
launch.py imports these names, so a test that replaces one there (``_external_record``,
``_driver_launch_ex``) replaces it for the launcher."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ..errors import DeviceError

_H2D, _D2H, _D2D = 1, 2, 3  # cudaMemcpyKind
_CUDA_R_16F, _CUDA_R_32F, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT = 2, 0, 68, -1  # cuBLAS

class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_ubyte * 4),
                ("value", ctypes.c_ubyte * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("nattrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
_CTYPES = {("u", 8): ctypes.c_uint64, ("i", 8): ctypes.c_int64, ("i", 4): ctypes.c_int32,
           ("u", 4): ctypes.c_uint32}


def _driver_fn(name: str, *argtypes: Any) -> Any:
    """The driver's entry point ``name`` (ctypes: these ``argtypes``, a CUresult back), or
    None where there is no driver or it has no such entry point."""
    try:
        f = getattr(ctypes.CDLL("libcuda.so.1"), name)
    except (OSError, AttributeError):
        return None
    f.argtypes = list(argtypes)
    f.restype = ctypes.c_int
    return f


def _host_device_ptr() -> Any:
    """``cuMemHostGetDevicePointer_v2``: the device address of page-locked host memory (a
    region registered by ``HostIO``), or None where the driver has none."""
    return _driver_fn("cuMemHostGetDevicePointer_v2", ctypes.POINTER(ctypes.c_uint64),
                      ctypes.c_void_p, ctypes.c_uint)


def _driver_launch_ex() -> Any:
    """The driver's ``cuLaunchKernelEx`` (ctypes), or None where it has none."""
    return _driver_fn("cuLaunchKernelEx", ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                      ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)


def _driver_max_clusters() -> Any:
    """The driver's ``cuOccupancyMaxActiveClusters`` (ctypes), or None where it has none."""
    return _driver_fn("cuOccupancyMaxActiveClusters", ctypes.POINTER(ctypes.c_int),
                      ctypes.c_void_p, ctypes.POINTER(_LaunchConfig))


def clusters_fit(fn: Any, grid: tuple[int, int, int], block: int, smem: int,
                 clusters: int) -> bool:
    """Whether ``clusters`` clusters of ``fn``'s compile-time size run at once on the device
    (``cuOccupancyMaxActiveClusters``: the GPCs' SMs bound how many co-reside; the cluster-sum
    tile's grid is planned as one wave, and a second wave of clusters cost it 0.58-0.76x on
    the H200). True without a device (a device-less launcher's stand-in functions), False
    where the driver cannot answer."""
    kern = getattr(fn, "kernel", None)
    if kern is None:
        return True
    f = _driver_max_clusters()
    if f is None:
        return False
    cfg = _LaunchConfig()
    for i, v in enumerate(grid):
        cfg.grid[i] = v
    cfg.block[0], cfg.block[1], cfg.block[2] = block, 1, 1
    cfg.smem = smem
    got = ctypes.c_int(0)
    try:
        rc = f(ctypes.byref(got), ctypes.c_void_p(kern.ptr), ctypes.byref(cfg))
    except (ctypes.ArgumentError, AttributeError, TypeError):
        return False
    return rc == 0 and got.value >= clusters


def launch_pdl(launch_ex: Any, fn: Any, grid: tuple[int, ...], block: int, args: tuple,
               smem: int) -> None:
    """``fn<<<grid, block, smem>>>(args)`` on the current stream through ``cuLaunchKernelEx``
    with programmatic stream serialization (PDL, sm_90): the launch before it on the stream
    lets it start once all its CTAs ran ``griddepcontrol.launch_dependents`` (or exited), so
    this kernel's launch and CTA start overlap that kernel's tail; ``fn`` must begin with
    ``griddepcontrol.wait`` before it reads what that kernel wrote. ``args``: NumPy scalars.
    Under stream capture the driver records it as a programmatic graph edge."""
    import cupy

    vals = [_CTYPES[(np.dtype(type(a)).kind, np.dtype(type(a)).itemsize)](int(a)) for a in args]
    params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
    attr = _LaunchAttr(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1  # .programmaticStreamSerializationAllowed (an int at offset 0)
    cfg = _LaunchConfig()
    for i, v in enumerate(tuple(grid) + (1,) * (3 - len(grid))):
        cfg.grid[i] = v
    cfg.block[0], cfg.block[1], cfg.block[2] = block, 1, 1
    cfg.smem = smem
    cfg.stream = cupy.cuda.get_current_stream().ptr or None
    cfg.attrs = ctypes.pointer(attr)
    cfg.nattrs = 1
    # a cupy.RawKernel (its Function for the current device) or a loader.ArchKernel
    func = fn.kernel.ptr
    rc = launch_ex(ctypes.byref(cfg), ctypes.c_void_p(func), params, None)
    if rc != 0:
        raise DeviceError(f"cuLaunchKernelEx (programmatic dependent launch) failed: {rc}")


def _external_record() -> Any:
    """``cuEventRecordWithFlags(.., CU_EVENT_RECORD_EXTERNAL)``: an event record that stream
    capture keeps as a graph node (a plain record inside a capture is only a dependency).
    None where the driver has no such entry point (then no graphs)."""
    return _driver_fn("cuEventRecordWithFlags", ctypes.c_void_p, ctypes.c_void_p,
                      ctypes.c_uint)
