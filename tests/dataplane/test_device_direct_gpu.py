"""The device process's direct path for merged front-end calls on a GPU (``-m gpu``; skipped
without CuPy or a GPU): x concatenated into the CUDA backend's pinned upload buffer
(``Backend.staging``) runs the launch a batch of the same rows runs, through its captured
graph and cached call too (several trips): every call's rows equal that batch's (the same
kernel: bit-equal up to the output's rounding)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from q6serve.kernels.api import KernelFlags, Layout, Precision
from tests.dataplane.test_cuda_ipc_gpu import _gpus, same
from tests.dataplane.test_device_direct import Device

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_gpus() == 0, reason="needs CuPy and a CUDA GPU")]

ROWS, K = 512, 2048


def test_merged_direct_calls_from_the_pinned_staging_equal_the_batch(
        rng: np.random.Generator) -> None:
    from q6serve.kernels.cuda_backend import CudaBackend

    backend = CudaBackend()

    async def main() -> None:
        d = Device(3, backend, "f16", "f16", ROWS, K)
        await d.start()
        dev = d.worker.engine.device  # type: ignore[union-attr]
        w = d.worker.engine.registry.get("w").resident  # type: ignore[union-attr]
        for trip in range(6):
            xs = [rng.uniform(-1, 1, (n, K)).astype(np.float16) for n in (1, 3, 2)]
            answers = await d.trip(xs, 10 * trip)
            flags = KernelFlags(soa=w.layout is Layout.SOA,
                                decode_mmq=d.worker.engine.flags.state.decode_mmq)  # type: ignore[union-attr]
            want = backend.matmul(w, np.concatenate(xs), precision=Precision.F16,
                                  flags=flags).y
            row = 0
            for slot, x in enumerate(xs):
                same(d.y(slot, answers[10 * trip + slot]), want[row : row + len(x)])
                row += len(x)
        assert dev.direct_jobs >= 4  # (the first trip measures the job)
        await d.close()

    asyncio.run(main())
