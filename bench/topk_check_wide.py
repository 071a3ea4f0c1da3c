"""One top-k epilogue call (the group form, the only one since session 14) on a wide random y
(default 256 x 152064, k 64), launches blocking (CUDA_LAUNCH_BLOCKING=1 by the caller names the
faulting kernel), every row checked against the NumPy reference: a probe for batches past the
tests' sizes.

    CUDA_LAUNCH_BLOCKING=1 python bench/topk_check_wide.py [N] [COLS] [K]
"""

from __future__ import annotations

import sys

import numpy as np


def main(argv: list[str]) -> int:
    import cupy as cp

    from q6serve.kernels import cuda_topk
    from q6serve.kernels.epilogue import topk_reference

    n, cols, k = (int(v) for v in (argv + ["256", "152064", "64"][len(argv):])[:3])
    y = (np.random.default_rng(n).standard_normal((n, cols)) * 4).astype(np.float32)
    packed = cp.empty((n, 2 * k + 1), cp.int32)
    cuda_topk._fused(cp, cp.asarray(y), k, packed)
    cp.cuda.runtime.deviceSynchronize()
    got = cuda_topk.unpack(cp.asnumpy(packed), k)
    ref = topk_reference(y, k)
    bad = np.flatnonzero((got.indices != ref.indices).any(axis=1)
                         | (np.abs(got.lse - ref.lse) > 1e-5 * np.maximum(1, np.abs(ref.lse))))
    print(f"groups {n}x{cols} k={k}: {n - bad.size}/{n} rows match" +
          (f" (first bad rows {bad[:8].tolist()})" if bad.size else ""))
    return 1 if bad.size else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
