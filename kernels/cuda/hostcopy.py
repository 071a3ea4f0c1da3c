"""x's copy into the pinned staging buffer with non-temporal stores (issue 14 goal 1, session 22).

Why: the GPU reads x from the pinned staging buffer (a copy-engine node or the copy kernel)
right after the CPU wrote it there. H200 sessions 9 and 21 (bench/RESULTS.md): that read is
slower than the same read of an untouched buffer (1.8 MB: 37 -> 56 us), and session 9's
process-wide glibc tunable (``x86_non_temporal_threshold``, memmove with non-temporal stores)
shortened the staged N=64 call's GPU span by ~13 us. A non-temporal store sends the line to
memory instead of leaving it modified in the writing core's cache, so the device's reads need
no snoop of that core. The tunable is read at process start and applies to every large copy
of the process (a reply's bytes too, which the CPU reads right after), so this is the same
store for the staging fill only: a 61-byte x86-64 SSE2 loop (``movdqu`` loads, ``movntdq``
stores, ``sfence``) placed in an executable anonymous mapping and called through ctypes.

Source of ``_CODE`` (GNU as, ``.intel_syntax noprefix``; System V: rdi = dst 16-byte aligned,
rsi = src, rdx = bytes, a multiple of 64)::

    nt_copy:  test rdx, rdx / jz 2f
    1:        movdqu xmm0..3, [rsi], [rsi+16], [rsi+32], [rsi+48]
              movntdq [rdi], [rdi+16], [rdi+32], [rdi+48], xmm0..3
              add rsi, 64 / add rdi, 64 / sub rdx, 64 / jnz 1b
    2:        sfence / ret

Anywhere else (another architecture, a mapping refused by the system) :func:`available` is
False and :func:`copy_into` copies with NumPy.
"""

from __future__ import annotations

import ctypes
import mmap
import platform
from typing import Any

import numpy as np

_CODE = bytes.fromhex(
    "4885d27434f30f6f06f30f6f4e10f30f6f5620f30f6f5e30660fe707660f"
    "e74f10660fe75720660fe75f304883c6404883c7404883ea4075cc0faef8"
    "c3")
_state: dict[str, Any] = {}  # "fn": the loaded routine or None, "map": its mapping (kept)


def _load() -> Any:
    """The routine (a ctypes function: dst, src, nbytes; the GIL released while it runs), or
    None where it cannot run here. Checked once on a copy of 4 KiB before it is used."""
    if "fn" in _state:
        return _state["fn"]
    _state["fn"] = None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        m = mmap.mmap(-1, mmap.PAGESIZE,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        m.write(_CODE)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(addr)
        src = np.arange(4096, dtype=np.uint8) * np.uint8(7)
        dst = np.zeros(4096 + 64, np.uint8)
        off = (-dst.ctypes.data) % 64
        fn(dst.ctypes.data + off, src.ctypes.data + 1, 4032)
        if not np.array_equal(dst[off : off + 4032], src[1:4033]):
            return None
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    _state["fn"], _state["map"] = fn, m
    return fn


def available() -> bool:
    """Whether :func:`copy_into` uses non-temporal stores on this machine."""
    return _load() is not None


def copy_into(dst: np.ndarray, src: np.ndarray) -> bool:
    """``src``'s bytes (a C-contiguous array) into the start of ``dst`` (a C-contiguous uint8
    array at least as large): the 16-byte aligned middle, in whole 64-byte lines, by
    non-temporal stores, the unaligned head and the tail by NumPy. Returns whether the
    non-temporal routine ran (False: all of it by NumPy)."""
    sb = src.reshape(-1).view(np.uint8)
    n = sb.size
    if dst.dtype != np.uint8 or dst.ndim != 1 or not dst.flags.c_contiguous or dst.size < n:
        # (the routine writes raw memory: never past dst's end)
        raise ValueError(f"copy_into: {n} bytes into a {dst.dtype} array of shape {dst.shape}")
    fn = _load()
    d = dst.ctypes.data
    head = (-d) % 16
    body = (n - head) // 64 * 64 if n > head else 0
    if fn is None or body <= 0:
        dst[:n] = sb
        return False
    if head:
        dst[:head] = sb[:head]
    fn(d + head, sb.ctypes.data + head, body)
    if head + body < n:
        dst[head + body : n] = sb[head + body :]
    return True
