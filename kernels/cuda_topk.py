"""The top-k / log-sum-exp epilogue on the CUDA device (CuPy ops; see kernels/epilogue.py).

Runs :func:`epilogue.topk_xp` with CuPy on the f32 y the matmul left on the device, on the
backend's stream, and downloads only values/indices/lse (N x (8k + 4) bytes instead of
N x rows x 4), packed in one buffer so the download is one copy and one synchronisation.
Rows are processed in chunks of at most ``CHUNK_ELEMS`` elements of y, so the epilogue's
transient device memory is bounded (~5 x 4 bytes per chunk element: the padded copy, the
shifted and exp terms, candidate keys and the sort's buffers: ~40 MiB) whatever N and the
weight's rows. It is CuPy-pool memory freed on return, like the matmul's own split-K partials,
and not part of the accountant's per-weight scratch (service/engine.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .epilogue import TopK, topk_xp

CHUNK_ELEMS = 2 << 20  # elements of y per chunk: 8 MiB of f32 rows, ~40 MiB transient


def topk_on_device(cp: Any, y: Any, k: int, stream: Any) -> TopK:
    """Top-k of device ``y`` f32 [N, cols] on ``stream``; host arrays out. ``cp``: the array
    module (CuPy; the tests pass NumPy with a ``get`` shim to check the chunking)."""
    n, cols = (int(d) for d in y.shape)
    step = max(1, CHUNK_ELEMS // max(cols, 1))
    with stream:
        # one row per input row: values [k] | indices [k] | lse [1], all as int32 bits (an
        # integer copy never touches the bits; an f32 copy could flush denormal patterns)
        packed = cp.empty((n, 2 * k + 1), dtype=cp.int32)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            v, i, s = topk_xp(y[r0:r1], k, cp)
            packed[r0:r1, :k] = v.view(cp.int32)
            packed[r0:r1, k : 2 * k] = i
            packed[r0:r1, 2 * k] = s.view(cp.int32)
        host = packed.get(stream=stream)
    return TopK(np.ascontiguousarray(host[:, :k]).view(np.float32),
                np.ascontiguousarray(host[:, k : 2 * k]),
                np.ascontiguousarray(host[:, 2 * k]).view(np.float32))
