"""One CUDA device as the backend's parts see it: CuPy, the device, its stream, its kernels.

Storage, launch and the backend share one :class:`DeviceContext`, so every buffer and launch
of a backend lands on its own device and stream whatever the calling thread's current device
is, and every compiled function is looked up in one place.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import Unavailable
from . import loader

PREFETCH_GROUP = 12  # template instantiations per NVRTC program when prefetching


class DeviceContext:
    """CuPy handles of one device; raises :class:`Unavailable` where there is none."""

    def __init__(self, device: int = 0) -> None:
        try:
            import cupy
        except ImportError as e:
            raise Unavailable(f"the CUDA backend needs CuPy (pip install q6serve[cuda12] or "
                              f"[cuda13]); importing it failed: {e}") from None
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # no driver, no device
            raise Unavailable(f"the CUDA backend found no usable GPU: {e}") from None
        if not 0 <= device < count:
            raise Unavailable(f"CUDA device {device} asked for, {count} visible")
        self.cp = cupy
        self.device = device
        self.dev = cupy.cuda.Device(device)
        with self.dev:
            props = cupy.cuda.runtime.getDeviceProperties(device)
            name = props["name"]
            self.name = name.decode() if isinstance(name, bytes) else str(name)
            self.sm_count = int(props["multiProcessorCount"])
            self.smem_sm = int(props.get("sharedMemPerMultiprocessor") or
                               cupy.cuda.runtime.deviceGetAttribute(81, device))
            self.cc = self.dev.compute_capability
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self.pool = cupy.get_default_memory_pool()
        self._fns: dict[str, Any] = {}
        self._lock = threading.Lock()

    def fn(self, file: str, name: str) -> Any:
        """The compiled function ``name`` (a template instantiation or a plain kernel)."""
        fn = self._fns.get(name)
        if fn is None:
            names = () if "<" not in name else (name,)
            fn = loader.load(file, names, self.device).function(name)
            with self._lock:
                self._fns[name] = fn
        return fn

    def prefetch(self, file: str, names: Iterable[str], threads: int = 8,
                 group: int = PREFETCH_GROUP) -> int:
        """Compile the template instantiations ``names`` up front, ``group`` (a dozen) per NVRTC
        program on parallel threads (one program per name costs a whole front-end pass each: the
        GPU tests and the tune would spend minutes compiling; a few names on many cores compile
        sooner in smaller groups). Returns how many were compiled."""
        todo = sorted({n for n in names if "<" in n and n not in self._fns})
        group = max(1, group)
        groups = [tuple(todo[i:i + group]) for i in range(0, len(todo), group)]

        def build(group: tuple[str, ...]) -> None:
            with self.dev:  # a pool thread's current device is 0
                mod = loader.load(file, group, self.device)
                got = {n: mod.function(n) for n in group}
            with self._lock:
                self._fns.update(got)

        with ThreadPoolExecutor(max(1, min(threads, len(groups) or 1))) as ex:
            list(ex.map(build, groups))
        return len(todo)
