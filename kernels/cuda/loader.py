"""The one loader of the kernel sources in this folder.

It inlines ``#include "x.cuh"`` (so NVRTC needs no include path and the cache key covers every
header), prepends ``#line 1 "file"`` markers so compiler messages point at the real file and
line, compiles through CuPy's NVRTC (``cupy.RawModule``; CuPy adds ``-arch`` for the current
device, which the cache key records; a file in ``ARCH_SPECIFIC`` is compiled for ``sm_XXa`` on
the devices it names, through NVRTC directly: CuPy only knows numeric architectures), and
caches modules per process keyed by device, compute
capability, source text, every option and every requested template instantiation (and, in
front of that, by the request itself, so a repeated request costs a dict lookup). A failed
compile raises :class:`KernelCompileError` carrying NVRTC's log.
"""

from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DeviceError

CUDA_DIR = Path(__file__).resolve().parent
BASE_OPTIONS: tuple[str, ...] = ("--std=c++17",)
_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$')
# Files whose kernels use architecture-specific instructions (wgmma: sm_90a), and the compute
# capabilities for which they are built as ``sm_<cc>a``; elsewhere they build as usual and their
# kernels are traps (guarded by ``__CUDA_ARCH_FEAT_SM90_ALL``), which no launch plan picks.
ARCH_SPECIFIC: dict[str, tuple[str, ...]] = {"q6k_wgmma.cu": ("90",)}


class KernelCompileError(DeviceError):
    """NVRTC rejected a kernel source; ``log`` is the compiler's output."""

    def __init__(self, file: str, options: tuple[str, ...], log: str):
        self.file, self.options, self.log = file, options, log
        super().__init__(f"NVRTC failed to compile {file} with {' '.join(options)}:\n{log}")


def source_text(name: str, _seen: frozenset[str] = frozenset()) -> str:
    """``name`` with its local includes inlined, each part under its own ``#line`` marker."""
    if name in _seen:
        return ""  # a header included twice (pragma once semantics)
    path = CUDA_DIR / name
    out = [f'#line 1 "{name}"']
    for no, line in enumerate(path.read_text().splitlines(), start=1):
        m = _INCLUDE.match(line)
        if m:
            out.append(source_text(m.group(1), _seen | {name}))
            out.append(f'#line {no + 1} "{name}"')
        elif line.strip() == "#pragma once":
            out.append("")
        else:
            out.append(line)
    return "\n".join(out) + "\n"


@dataclass(frozen=True)
class CompiledModule:
    module: Any  # cupy.RawModule, or a cupy.cuda.function.Module (ARCH_SPECIFIC)
    key: tuple
    lowered: dict | None = None  # name expression -> mangled name (ARCH_SPECIFIC builds)

    def function(self, name: str) -> Any:
        if self.lowered is not None:
            return ArchKernel(self.module.get_function(self.lowered.get(name, name)))
        return self.module.get_function(name)


class ArchKernel:
    """A ``cupy.cuda.function.Function`` of an ARCH_SPECIFIC module with the parts of
    ``cupy.RawKernel`` the launcher uses: the call, ``num_regs`` and
    ``max_dynamic_shared_size_bytes`` (read and set through the driver)."""

    _NUM_REGS, _MAX_DYN_SMEM = 4, 8  # CUfunction_attribute values

    def __init__(self, fn: Any) -> None:
        self.kernel = fn

    def __call__(self, grid: tuple, block: tuple, args: tuple, *, shared_mem: int = 0) -> None:
        self.kernel(tuple(grid), tuple(block), args, shared_mem)

    def _attr(self, attr: int) -> int:
        from cupy_backends.cuda.api import driver

        return int(driver.funcGetAttribute(attr, self.kernel.ptr))

    @property
    def num_regs(self) -> int:
        return self._attr(self._NUM_REGS)

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._attr(self._MAX_DYN_SMEM)

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, nbytes: int) -> None:
        from cupy_backends.cuda.api import driver

        driver.funcSetAttribute(self.kernel.ptr, self._MAX_DYN_SMEM, int(nbytes))


def arch_specific(file: str, cc: str) -> str | None:
    """``sm_<cc>a`` when ``file`` is built for the architecture-specific target on ``cc``."""
    return f"sm_{cc}a" if str(cc) in ARCH_SPECIFIC.get(file, ()) else None


def _compile_arch(file: str, src: str, opts: tuple[str, ...], names: tuple[str, ...],
                  arch: str) -> tuple[Any, dict]:
    """NVRTC straight to a cubin for ``arch`` (CuPy's RawModule would add its own numeric
    ``-arch`` after ours), with CuPy's ``-ftz=true`` like every other module."""
    from cupy.cuda import function
    from cupy_backends.cuda.libs import nvrtc

    full = (*opts, "-ftz=true", f"-arch={arch}")
    prog = nvrtc.createProgram(src, file, (), ())
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, full)
        except nvrtc.NVRTCError:
            raise KernelCompileError(file, full, nvrtc.getProgramLog(prog)) from None
        lowered = {n: nvrtc.getLoweredName(prog, n) for n in names}
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    mod = function.Module()
    mod.load(cubin)
    return mod, lowered


_cache: dict[tuple, CompiledModule] = {}
_lock = threading.Lock()
# The same request again (file, names, device, options) skips reading, inlining and hashing the
# source (~250 us of host time per call on the H200 machine, which the top-k epilogue paid on
# every call while the GPU waited): the sources are package files, fixed for a process's life.
_by_request: dict[tuple, CompiledModule] = {}


def load(file: str, names: tuple[str, ...], device: int = 0,
         options: tuple[str, ...] = ()) -> CompiledModule:
    """Compile (or fetch) ``file`` with the template instantiations ``names``."""
    req = (file, tuple(names), device, tuple(options))
    hit = _by_request.get(req)
    if hit is not None:
        return hit
    import cupy

    src = source_text(file)
    opts = BASE_OPTIONS + tuple(options)
    with cupy.cuda.Device(device) as dev:
        cc = dev.compute_capability
        arch = arch_specific(file, cc)
        key = (device, cc, arch, hashlib.sha256(src.encode()).hexdigest(), opts, tuple(names))
        with _lock:
            hit = _cache.get(key)
        if hit is not None:
            _by_request[req] = hit
            return hit
        if arch is not None:
            mod, lowered = _compile_arch(file, src, opts, tuple(names), arch)
            out = CompiledModule(mod, key, lowered)
        else:
            mod = cupy.RawModule(code=src, options=opts, name_expressions=tuple(names) or None)
            try:
                mod.compile()
            except cupy.cuda.compiler.CompileException as e:
                raise KernelCompileError(file, (*opts, f"(arch sm_{cc})"), str(e)) from None
            out = CompiledModule(mod, key)
        with _lock:
            _cache[key] = out
            _by_request[req] = out
        return out
