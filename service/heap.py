"""The worker's C heap: glibc's mmap threshold fixed (so MB-sized requests and replies are
neither page-faulted in anew each time nor left in RSS) and ``malloc_trim``, which the engine's
trim loop calls to hand free heap pages back. Called by the engine at start and by bench hosts
that receive MB-sized replies."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from . import envvars

# Blocks from this size up get their own mapping, given back to the OS when freed; smaller
# ones come from the heap arenas, whose free pages the trim loop (_trim_heap, every
# TRIM_EVERY_S) hands back. Fixed, because glibc's default threshold moves up to the largest
# block freed. It was 1 MiB (so that MiB-sized requests and replies never stayed in RSS), but
# each such block is page-faulted in fresh on first touch and unmapped when freed: ~4,000
# page faults per layer of the 7B replay at S=64 (4.8 MB replies; bench/replay_sim.py). At
# 32 MiB the H200 replay at S=64 took 720 -> 559 ms a step (single-weight calls), 902 -> 727
# (multi-weight), and RSS after bench/attacks.py's big-buffer attacks came back as with 1 MiB
# (bench/RESULTS.md, "session 7"). Env Q6SERVE_MMAP_THRESHOLD (bytes, read when the engine
# starts) sets another fixed value; 0 leaves glibc's own (moving) threshold.
MMAP_THRESHOLD = int(envvars.MMAP_THRESHOLD.default)
MMAP_ENV = envvars.MMAP_THRESHOLD.name
_M_MMAP_THRESHOLD = -3  # mallopt's parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1


def mmap_threshold() -> int:
    """The worker's fixed mmap threshold in bytes (0: glibc's moving one), from the env."""
    return int(envvars.MMAP_THRESHOLD.read())


def _libc(name: str, argtypes: list[Any]) -> Callable[..., int] | None:
    try:
        fn = getattr(ctypes.CDLL(None), name)  # glibc only
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn  # type: ignore[no-any-return]


malloc_trim = _libc("malloc_trim", [ctypes.c_size_t])
_mallopt = _libc("mallopt", [ctypes.c_int, ctypes.c_int])


def fix_heap_thresholds(mmap_bytes: int, trim_bytes: int = 0) -> bool:
    """Fix glibc's mmap threshold at ``mmap_bytes`` (blocks from there up get their own
    mapping; smaller ones come from the heap) and, with ``trim_bytes``, the free space at the
    heap's top kept before it is given back. The worker fixes only the first (its trim loop
    gives pages back); a caller's process that receives MB-sized replies (bench hosts, the
    replay) fixes both, or each reply is page-faulted in anew. False where mallopt is missing."""
    if _mallopt is None:
        return False
    ok = _mallopt(_M_MMAP_THRESHOLD, mmap_bytes) == 1
    return ok and (not trim_bytes or _mallopt(_M_TRIM_THRESHOLD, trim_bytes) == 1)

