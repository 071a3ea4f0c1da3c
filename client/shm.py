"""Shared-memory regions on the client side: create, map, name in requests (issue 15).

A co-located caller (same machine and user as the worker, which runs with ``--allow-shm``)
registers a region once and then passes activations and results through it instead of gRPC
bytes::

    with Client(target) as c, c.register_shm("io0", 1 << 20) as region:
        x = region.ndarray(0, np.float16, (n, k)); x[...] = activations   # or matmul copies it
        out = c.matmul_full("blk.0.ffn_down.weight", x, x_region=region,
                            y_region=(region, x.nbytes))
        out.y  # a view of the region: valid until the region's next use

``ShmRegion.close()`` unlinks the object this process created (the worker keeps its own
mapping until the region is unregistered, so unregister first: ``Client.unregister_region``,
which ``with c.register_shm(...)`` does on exit).

On a CUDA worker a caller on the same GPU can do the same with device memory
(``Client.register_cuda_ipc``, a :class:`CudaRegion`; needs CuPy): x is read from and y
written to the caller's buffer on the device, and ``out.y`` is a CuPy view of it.
"""

from __future__ import annotations

import os
import secrets
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

from q6serve.v1 import q6serve_pb2 as pb

ALIGN = 64  # offsets the helpers pick are multiples of this (any element size divides it)


class ShmRegion:
    """A POSIX shared-memory object mapped in this process, registered under ``name``."""

    def __init__(self, name: str, shm: shared_memory.SharedMemory, owned: bool) -> None:
        self.name = name
        self.shm = shm
        self.owned = owned  # created here: close() unlinks it
        self.on_close: Any = None  # set by Client.register_shm: unregisters first

    @classmethod
    def create(cls, name: str, size: int, key: str | None = None) -> ShmRegion:
        """A fresh object of ``size`` bytes (key: a random ``q6r_...`` unless given)."""
        shm = shared_memory.SharedMemory(name=key or f"q6r_{secrets.token_hex(8)}",
                                         create=True, size=size)
        return cls(name, shm, owned=True)

    @classmethod
    def attach(cls, name: str, key: str) -> ShmRegion:
        """Map an object another process created (this one will not unlink it)."""
        shm = shared_memory.SharedMemory(name=key, create=False)
        # Python < 3.13 tracks attached objects too and unlinks them at exit: untrack
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        return cls(name, shm, owned=False)

    @property
    def key(self) -> str:
        return self.shm.name

    @property
    def size(self) -> int:
        return self.shm.size

    def ndarray(self, offset: int, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        """A writable view of the region's bytes at ``offset`` (little-endian ``dtype``)."""
        dt = np.dtype(dtype).newbyteorder("<")
        nbytes = _check_span(self, offset, dt, shape)
        return np.frombuffer(self.shm.buf, dtype=dt, count=nbytes // dt.itemsize,
                             offset=offset).reshape(shape)

    def put(self, offset: int, x: np.ndarray) -> None:
        """x's bytes at ``offset`` (no copy when x already is the region's view there)."""
        dst = self.ndarray(offset, x.dtype, x.shape)
        if dst.__array_interface__["data"][0] != x.__array_interface__["data"][0]:
            dst[...] = x

    def register_request(self) -> pb.RegisterRegionRequest:
        return pb.RegisterRegionRequest(
            name=self.name, system=pb.SystemShm(key=self.key, offset=0, byte_size=self.size))

    def close(self) -> None:
        """Unregister (when registered through a Client), unmap, and unlink if created
        here. Arrays from ``ndarray`` that are still alive keep the mapping (not the name)
        until they are freed."""
        if self.on_close is not None:
            fn, self.on_close = self.on_close, None
            fn()
        try:
            self.shm.close()
        except BufferError:
            # arrays still view the mapping: close the descriptor now and leave the mmap to
            # its exports (it unmaps when the last one goes); SharedMemory has no API for it
            if self.shm._fd >= 0:  # type: ignore[attr-defined]
                os.close(self.shm._fd)  # type: ignore[attr-defined]
                self.shm._fd = -1  # type: ignore[attr-defined]
            self.shm._mmap = None  # type: ignore[attr-defined]
        if self.owned:
            self.owned = False
            self.shm.unlink()

    def __enter__(self) -> ShmRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_span(region: Any, offset: int, dt: np.dtype, shape: tuple[int, ...]) -> int:
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if offset < 0 or offset + nbytes > region.size:
        raise ValueError(f"{list(shape)} {dt} ({nbytes} bytes) at offset {offset} "
                         f"overruns region {region.name!r} of {region.size} bytes")
    return nbytes


class CudaRegion:
    """``size`` bytes of device memory of this process, registered under ``name`` by CUDA IPC
    (the worker, another process on the same GPU, opens the handle on its device). Needs
    CuPy. bf16 tensors are viewed as their uint16 bits (CuPy has no bf16)."""

    def __init__(self, name: str, array: Any) -> None:
        import cupy as cp

        from q6serve.kernels.cuda_ipc import allocation_range

        self.name = name
        self.cp = cp
        self.array = array  # keeps the memory alive while the region exists
        self.ptr = int(array.data.ptr)
        self.size = int(array.nbytes)
        self.device = int(array.device.id)
        with array.device:
            # the driver call below needs the device's context current in this thread: a
            # thread whose CuPy calls were all served by the memory pool has none yet
            # (CUresult 201 in a caller's worker thread); cudaFree(0) makes it current
            cp.cuda.runtime.free(0)
            base, _ = allocation_range(self.ptr)
            # a handle names a whole allocation (e.g. a CuPy pool block): send our offset in it
            self.handle = bytes(cp.cuda.runtime.ipcGetMemHandle(base))
        self.offset = self.ptr - base
        self.on_close: Any = None  # set by Client.register_cuda_ipc: unregisters first

    @classmethod
    def create(cls, name: str, size: int, device: int = 0) -> CudaRegion:
        """A fresh allocation of ``size`` bytes on ``device``."""
        import cupy as cp

        with cp.cuda.Device(device):
            return cls(name, cp.empty(size, cp.uint8))

    def ndarray(self, offset: int, dtype: Any, shape: tuple[int, ...]) -> Any:
        """A CuPy view of the region's bytes at ``offset`` (bf16: uint16 bits)."""
        dt = np.dtype(dtype)
        nbytes = _check_span(self, offset, dt, shape)
        view = np.dtype(np.uint16) if dt.name == "bfloat16" else dt
        cp = self.cp
        mem = cp.cuda.UnownedMemory(self.ptr + offset, nbytes, self.array, self.device)
        return cp.ndarray(shape, view, cp.cuda.MemoryPointer(mem, 0))

    def put(self, offset: int, x: Any) -> None:
        """x (NumPy: uploaded; CuPy: copied on the device unless it already is the region's
        view there) at ``offset``. Synchronizes the current stream: the worker reads the
        bytes on its own stream, in another process, once the request arrives (x written by
        the caller's kernels on other streams: synchronize those first)."""
        dst = self.ndarray(offset, x.dtype, x.shape)
        if isinstance(x, np.ndarray):
            dst.set(np.ascontiguousarray(x).view(dst.dtype))
        elif int(x.data.ptr) != int(dst.data.ptr):
            self.cp.copyto(dst, x.view(dst.dtype))
        self.cp.cuda.get_current_stream().synchronize()

    def register_request(self) -> pb.RegisterRegionRequest:
        return pb.RegisterRegionRequest(
            name=self.name, cuda=pb.CudaIpcBuffer(handle=self.handle, device=self.device,
                                                  byte_size=self.size, offset=self.offset))

    def close(self) -> None:
        """Unregister (when registered through a Client), then let the memory go."""
        if self.on_close is not None:
            fn, self.on_close = self.on_close, None
            fn()
        self.array = None

    def __enter__(self) -> CudaRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Region = ShmRegion | CudaRegion
# What a matmul's x_region / y_region may be: a region (offset 0) or (region, offset)
RegionArg = Region | tuple[Region, int]


def split(arg: RegionArg) -> tuple[Region, int]:
    if isinstance(arg, ShmRegion | CudaRegion):
        return arg, 0
    region, offset = arg
    return region, int(offset)


def register_request(region: Region) -> pb.RegisterRegionRequest:
    return region.register_request()


def place_x(req: pb.MatmulRequest, x: Any, dtype: int, arg: RegionArg) -> None:
    """Point ``req`` at x in a region: x's bytes go into the region (no copy when x already
    is the region's view at that offset) and the request carries dtype and shape only."""
    region, offset = split(arg)
    region.put(offset, x)
    req.x.dtype = dtype
    req.x.shape.extend(x.shape)
    req.x_region.region = region.name
    req.x_region.offset = offset


def place_y(req: pb.MatmulRequest, arg: RegionArg) -> None:
    region, offset = split(arg)
    req.y_region.region = region.name
    req.y_region.offset = offset


def read_y(t: pb.Tensor, arg: RegionArg, dtype: np.dtype) -> Any:
    """The reply's y (dtype and shape only) as a view of the region it was written to
    (CuPy for a CudaRegion)."""
    region, offset = split(arg)
    return region.ndarray(offset, dtype, tuple(t.shape))
