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
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"{list(shape)} {dt} ({nbytes} bytes) at offset {offset} "
                             f"overruns region {self.name!r} of {self.size} bytes")
        return np.frombuffer(self.shm.buf, dtype=dt, count=nbytes // dt.itemsize,
                             offset=offset).reshape(shape)

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


# What a matmul's x_region / y_region may be: a region (offset 0) or (region, offset)
RegionArg = ShmRegion | tuple[ShmRegion, int]


def split(arg: RegionArg) -> tuple[ShmRegion, int]:
    if isinstance(arg, ShmRegion):
        return arg, 0
    region, offset = arg
    return region, int(offset)


def register_request(region: ShmRegion) -> pb.RegisterRegionRequest:
    return pb.RegisterRegionRequest(
        name=region.name, system=pb.SystemShm(key=region.key, offset=0,
                                              byte_size=region.size))


def place_x(req: pb.MatmulRequest, x: np.ndarray, dtype: int, arg: RegionArg) -> None:
    """Point ``req`` at x in a region: x's bytes go into the region (no copy when x already
    is the region's view at that offset) and the request carries dtype and shape only."""
    region, offset = split(arg)
    dst = region.ndarray(offset, x.dtype, x.shape)
    if dst.__array_interface__["data"][0] != x.__array_interface__["data"][0]:
        dst[...] = x
    req.x.dtype = dtype
    req.x.shape.extend(x.shape)
    req.x_region.region = region.name
    req.x_region.offset = offset


def place_y(req: pb.MatmulRequest, arg: RegionArg) -> None:
    region, offset = split(arg)
    req.y_region.region = region.name
    req.y_region.offset = offset


def read_y(t: pb.Tensor, arg: RegionArg, dtype: np.dtype) -> np.ndarray:
    """The reply's y (dtype and shape only) as a view of the region it was written to."""
    region, offset = split(arg)
    return region.ndarray(offset, dtype, tuple(t.shape))
