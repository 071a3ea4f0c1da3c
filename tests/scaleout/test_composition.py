"""The multi-device worker is composed of per-device Engines (issue 14 item 5): every rule of
one Engine (budget before reading, one read of a file or upload, naming, one metrics poll,
accounting) holds for two NumPy "devices", and the accounting returns to zero."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from scaleout_util import LoopWorker, assert_close, random_q6k, reference, write_gguf

from q6serve.client.client import Client, Q6ServeError
from q6serve.kernels.api import KernelTiming
from q6serve.kernels.errors import AlreadyExists, ResourceExhausted
from q6serve.kernels.numpy_backend import NumpyBackend
from q6serve.service.config import Budget, WorkerConfig
from q6serve.service.devices import MultiDeviceEngine
from q6serve.service.engine_types import UploadSpec
from q6serve.service.metrics import Metrics

ROWS, K = 37, 512


def _x(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, K)).astype(np.float32)


def _accounting(c: Client) -> list[tuple[int, int, int, int, int]]:
    return [(d.weights_loaded, d.vram.weights_bytes, d.vram.scratch_bytes,
             d.vram.staging_bytes, d.vram.reserved_bytes) for d in c.status().devices]


@pytest.mark.parametrize("placement", ["shard", "replicate"])
def test_two_devices_load_upload_matmul_unload_back_to_zero(
        start_devices: Callable[..., LoopWorker], model_dir: Path, placement: str) -> None:
    blocks = write_gguf(model_dir / "m.gguf", {"g": (ROWS, K, 21)})["g"]
    up = random_q6k(ROWS, K, 22)
    w = start_devices(placement)
    with Client(w.target, timeout=10) as c:
        assert _accounting(c) == [(0, 0, 0, 0, 0)] * 2
        c.load("m.gguf", ["g"])
        c.upload("u", up, ROWS, K)
        assert [d[0] for d in _accounting(c)] == [2, 2]
        xs = [_x(n, n) for n in (1, 3, 5)]
        for x in xs:  # unary
            assert_close(c.matmul("g", x), reference(blocks, ROWS, K, x))
            assert_close(c.matmul("u", x), reference(up, ROWS, K, x))
        reqs = [(f"r{i}", "gu"[i % 2], x) for i, x in enumerate(xs * 2)]
        outs = {o.request_id: o for o in c.matmul_stream([*reqs, ("bad", "nope", xs[0])])}
        assert isinstance(outs.pop("bad"), Q6ServeError)
        for rid, name, x in reqs:  # the stream runs through the device engines' fast path
            want = reference(blocks if name == "g" else up, ROWS, K, x)
            assert_close(outs[rid].y, want)
        assert c.unload("g").rows == ROWS and c.unload("u").rows == ROWS
        assert _accounting(c) == [(0, 0, 0, 0, 0)] * 2
        assert c.list() == []


def _engine(config: WorkerConfig) -> tuple[MultiDeviceEngine, Metrics]:
    m = Metrics(CollectorRegistry(), version="t", backend="numpy", device="cpu")
    return MultiDeviceEngine([NumpyBackend(threads=1) for _ in range(2)], config, m), m


def test_upload_over_a_device_budget_is_refused_before_reading(
        base_config: WorkerConfig) -> None:
    """Replicated, each device needs the whole weight: the budget check comes before the
    first chunk is read, and nothing is left reserved on either device."""
    cfg = dataclasses.replace(base_config, vram_budget=Budget(nbytes=1_750_000))
    data = random_q6k(512, 1024, 23).tobytes()  # 430 kB + 1.57 MB scratch per replica
    read: list[int] = []

    async def chunks() -> AsyncIterator[bytes]:
        read.append(1)
        yield data

    async def main() -> None:
        eng, _ = _engine(cfg)
        try:
            spec = UploadSpec("u", 512, 1024, "q6_k", len(data), hashlib.sha256(data).hexdigest())
            with pytest.raises(ResourceExhausted):
                await eng.upload(spec, chunks(), placement="replicate")
            assert read == [] and eng.list() == []
            assert [d.vram.reserved for d in eng.device_status()] == [0, 0]
            v = await eng.upload(spec, chunks(), placement="shard")  # half on each: fits
            assert v.rows == 512 and read == [1]
            with pytest.raises(AlreadyExists):  # the worker's names follow one Registry
                await eng.upload(spec, chunks())
            await eng.unload("u")
            assert [d.vram.reserved for d in eng.device_status()] == [0, 0]
        finally:
            await eng.close()

    asyncio.run(main())


def test_gguf_is_opened_once_for_every_device(base_config: WorkerConfig, model_dir: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from q6serve.kernels import gguf_io

    blocks = write_gguf(model_dir / "m.gguf", {"a": (ROWS, K, 24), "b": (5, K, 25)})
    opened: list[Path] = []
    real = gguf_io.read_q6k_tensors

    def counting(path: Path, names: Any = None, cancelled: Any = None) -> Any:
        opened.append(path)
        return real(path, names, cancelled)

    monkeypatch.setattr(gguf_io, "read_q6k_tensors", counting)

    async def main() -> None:
        eng, _ = _engine(base_config)
        try:
            views = await eng.load_gguf("m.gguf", [])
            assert len(opened) == 1 and {v.name for v in views} == {"a", "b"}
            assert views[0].sha256 == hashlib.sha256(blocks["a"]).hexdigest()
            x = _x(2)
            y = (await eng.matmul(eng_call("a", x))).y
            assert_close(y, reference(blocks["a"], ROWS, K, x))
        finally:
            await eng.close()

    asyncio.run(main())


def eng_call(name: str, x: np.ndarray) -> Any:
    from q6serve.service.engine_types import MatmulCall

    return MatmulCall(name, x)


class _LateTiming(KernelTiming):
    """A device timing whose end event completes only after ``ready`` is set."""

    def __init__(self, seconds: float) -> None:
        super().__init__(host_seconds=seconds)
        self.ready = False

    def seconds(self, wait: bool = False) -> float | None:
        return self.host_seconds if self.ready else None


def test_parked_kernel_timings_reach_worker_and_device_series_through_one_poll() -> None:
    from q6serve.kernels.api import Layout, MatmulResult, Precision
    from q6serve.service.batcher import BatchStats
    from q6serve.service.devices import DeviceFamilies

    m = Metrics(CollectorRegistry(), version="t", backend="numpy", device="cpu")
    fam = DeviceFamilies(m.registry)
    timing = _LateTiming(3e-5)
    stats = BatchStats(MatmulResult(np.zeros((1, 1), np.float32), "k", Layout.SOA,
                                    Precision.F16, timing), 1, 1, (0.0,))
    m.observe_batch(stats)
    fam.observe(m, "1", stats)

    def count(name: str, labels: dict[str, str]) -> float:
        return m.registry.get_sample_value(name, labels) or 0.0

    dev = ("q6serve_device_kernel_duration_seconds_count", {"device": "1"})
    main = ("q6serve_kernel_duration_seconds_count",
            {"kernel": "k", "layout": "soa", "n_bucket": "1"})
    assert count(*dev) == 0 and count(*main) == 0
    assert m.poll() == 2  # not ready: both stay parked
    timing.ready = True
    assert m.poll() == 0
    assert count(*dev) == 1 and count(*main) == 1
