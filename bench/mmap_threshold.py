"""What the worker's fixed mmap threshold (1 MiB, service/engine.py: big blocks get their own
mapping and go back to the OS when freed; docs/RELIABILITY.md "RSS after an attack") costs a
T3-sized buffer: allocate, fill and free a 64 x 18944 f16 request's bytes, p50 over 400 rounds
after 50 warm-up rounds, with glibc's default (moving) threshold or the worker's fixed one.

    python bench/mmap_threshold.py default; python bench/mmap_threshold.py fixed
"""

from __future__ import annotations

import ctypes
import sys
import time

import numpy as np

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
SIZE = 64 * 18944 * 2  # a T3 request's x (f16)


def main(argv: list[str]) -> int:
    mode = argv[0] if argv else "default"
    if mode == "fixed":
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 1 << 20)
    src = bytes(np.ones(SIZE, np.uint8))
    for _ in range(50):  # glibc's default threshold rises after the first big free
        b = bytearray(SIZE)
        b[:] = src
        del b
    t = []
    for _ in range(400):
        t0 = time.perf_counter()
        b = bytearray(SIZE)
        b[:] = src
        del b
        t.append(time.perf_counter() - t0)
    print(f"{mode}: alloc + fill + free of {SIZE / 2**20:.1f} MiB, p50 "
          f"{np.median(t) * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
