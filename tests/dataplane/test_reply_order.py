"""What a request's sink schedules (a front end's reply message, a stream's write) runs before
the batcher's next launch, which may run its device job on the loop's own thread
(Device.inline_s): otherwise every reply would wait for the next batch's whole job."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from q6serve.kernels.api import KernelTiming, Layout, MatmulResult, Precision
from q6serve.service.batcher import Batcher, BatchKey, BatchSettings
from q6serve.service.device_thread import Device

KEY = BatchKey("f32", Precision.EXACT, "f32")


def test_the_sinks_work_runs_before_the_next_inline_job() -> None:
    events: list[tuple[str, float]] = []

    def run(x: np.ndarray, key: BatchKey) -> MatmulResult:
        events.append(("job", float(x[0, 0])))
        return MatmulResult(x * 2, "t", Layout.SOA, Precision.EXACT,
                            KernelTiming(host_seconds=1e-6))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        dev = Device("t", inline_s=10.0)
        # one batch at a time, one row each: the second waits for the first to finish
        b = Batcher("w", dev, run, BatchSettings(max_rows=1, max_delay_s=0.0,
                                                 max_inflight_batches=1),
                    lambda: True, lambda s: None)
        await b.enqueue(np.zeros((1, 4), np.float32), KEY, None)  # 1-row jobs known: inline
        events.clear()

        def sink(fut: Any) -> None:  # as FrontendsWorker._matmul_done: the write is a handle
            loop.call_soon(events.append, ("reply", fut.result().y[0, 0] / 2))

        first = b.enqueue(np.ones((1, 4), np.float32), KEY, None, sink)
        second = b.enqueue(np.full((1, 4), 2.0, np.float32), KEY, None, sink)
        await asyncio.gather(first, second)
        for _ in range(3):
            await asyncio.sleep(0)
        assert dev.inline_jobs == 2
        assert events == [("job", 1.0), ("reply", 1.0), ("job", 2.0), ("reply", 2.0)]
        await b.close()
        dev.close()

    asyncio.run(main())
