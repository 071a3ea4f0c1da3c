"""Multi-device worker core on two NumPy "devices": row-sharded and replicated placement give
the reference's results; VRAM, status and metrics are per device; loads are all or nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from scaleout_util import assert_close, random_q6k, reference, write_gguf

from q6serve.kernels.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from q6serve.kernels.numpy_backend import NumpyBackend
from q6serve.service.config import Budget, WorkerConfig
from q6serve.service.devices import MultiDeviceEngine, parse_devices
from q6serve.service.engine_types import MatmulCall, UploadSpec
from q6serve.service.metrics import Metrics

ROWS, K = 37, 512  # 37 rows over 2 devices: 19 + 18


def run_engine(config: WorkerConfig, body: Callable[[MultiDeviceEngine, Metrics],
                                                      Awaitable[Any]], devices: int = 2,
               placement: str = "shard") -> Any:
    async def main() -> Any:
        metrics = Metrics(CollectorRegistry(), version="t", backend="numpy", device="cpu")
        eng = MultiDeviceEngine([NumpyBackend(threads=1) for _ in range(devices)], config,
                                metrics, placement)
        try:
            return await body(eng, metrics)
        finally:
            await eng.close()

    return asyncio.run(main())


def _x(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, K)).astype(np.float32)


def sample(m: Metrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


def test_parse_devices() -> None:
    assert parse_devices("0,1") == (0, 1) and parse_devices("3") == (3,)
    for bad in ("", "0,0", "-1", "a"):
        with pytest.raises(InvalidArgument):
            parse_devices(bad)


@pytest.mark.parametrize("placement", ["shard", "replicate"])
def test_gguf_placement_matches_reference(base_config: WorkerConfig, model_dir: Path,
                                          placement: str) -> None:
    blocks = write_gguf(model_dir / "m.gguf", {"w": (ROWS, K, 3), "v": (3, K, 4)})

    async def body(eng: MultiDeviceEngine, m: Metrics) -> None:
        views = await eng.load_gguf("m.gguf", [], placement=placement)
        assert [(v.name, v.rows, v.row_begin, v.tensor_rows) for v in views] == \
            [("w", ROWS, 0, ROWS), ("v", 3, 0, 3)]
        assert views[0].sha256 == hashlib.sha256(blocks["w"]).hexdigest()
        parts = [str(p.rows) for p in eng.placement_of("w").parts]
        assert parts == (["[0, 19)", "[19, 37)"] if placement == "shard"
                         else ["[0, 37)", "[0, 37)"])
        xs = [_x(n, n) for n in (1, 3, 8, 2, 5, 1)]
        ys = await asyncio.gather(*(eng.matmul(MatmulCall("w", x)) for x in xs))
        for x, y in zip(xs, ys, strict=True):
            assert_close(y.y, reference(blocks["w"], ROWS, K, x))
        y3 = await eng.matmul(MatmulCall("v", xs[1]))  # 3 rows over 2 devices: 2 + 1
        assert_close(y3.y, reference(blocks["v"], 3, K, xs[1]))
        per_dev = [sample(m, "q6serve_device_batches_total", device=d) for d in ("0", "1")]
        assert all(n > 0 for n in per_dev), per_dev  # both devices worked
        if placement == "shard":  # every request ran on both devices
            rows = [sample(m, "q6serve_device_batch_rows_total", device=d) for d in ("0", "1")]
            assert rows[0] == rows[1] == sum(len(x) for x in xs) + 3
        ds = eng.device_status()
        assert [d.weights_loaded for d in ds] == [2, 2]
        assert all(d.vram.weights > 0 for d in ds)
        st = eng.status()
        assert st.weights_loaded == 2 and st.vram.weights == sum(d.vram.weights for d in ds)
        assert st.device.startswith("2 devices")
        assert sample(m, "q6serve_vram_weights_bytes") == st.vram.weights
        assert sample(m, "q6serve_device_vram_weights_bytes", device="1") == ds[1].vram.weights
        assert (await eng.unload("w")).rows == ROWS
        with pytest.raises(NotFound):
            await eng.matmul(MatmulCall("w", xs[0]))
        await eng.unload("v")
        assert [d.vram.weights for d in eng.device_status()] == [0, 0]

    run_engine(base_config, body)


def test_worker_row_range_then_device_split(base_config: WorkerConfig,
                                            model_dir: Path) -> None:
    """A worker that is shard 1 of 2 of a cluster splits its own rows over its devices."""
    blocks = write_gguf(model_dir / "m.gguf", {"w": (ROWS, K, 5)})["w"]

    async def body(eng: MultiDeviceEngine, m: Metrics) -> None:
        from q6serve.service.shards import RowSelect

        (v,) = await eng.load_gguf("m.gguf", ["w"], rows=RowSelect(shard=(1, 2)))
        assert (v.row_begin, v.row_end, v.tensor_rows) == (19, 37, ROWS)
        assert [str(p.rows) for p in eng.placement_of("w").parts] == ["[19, 28)", "[28, 37)"]
        x = _x(4)
        assert_close((await eng.matmul(MatmulCall("w", x))).y,
                     reference(blocks, ROWS, K, x)[:, 19:37])

    run_engine(base_config, body)


@pytest.mark.parametrize("fmt", ["q6_k", "f32"])
def test_upload_is_split_over_devices(base_config: WorkerConfig, fmt: str) -> None:
    if fmt == "q6_k":
        data = random_q6k(ROWS, K, 9).tobytes()
    else:
        data = np.random.default_rng(1).standard_normal((ROWS, K)).astype(np.float32).tobytes()

    async def chunks() -> Any:
        for i in range(0, len(data), 4096):
            yield data[i : i + 4096]

    async def body(eng: MultiDeviceEngine, m: Metrics) -> None:
        spec = UploadSpec("u", ROWS, K, fmt, len(data), hashlib.sha256(data).hexdigest())
        v = await eng.upload(spec, chunks())
        from q6serve.kernels import q6k

        if fmt == "q6_k":
            aos = np.frombuffer(data, np.uint8).reshape(-1, q6k.BLOCK_BYTES)
        else:
            from q6serve.kernels.quantize import quantize_q6_k

            aos = quantize_q6_k(np.frombuffer(data, np.float32).reshape(ROWS, K))
        assert v.sha256 == hashlib.sha256(aos).hexdigest() and v.rows == ROWS
        x = _x(2)
        assert_close((await eng.matmul(MatmulCall("u", x))).y, reference(aos, ROWS, K, x))
        with pytest.raises(AlreadyExists):
            await eng.upload(spec, chunks())

    run_engine(base_config, body)


def test_load_that_does_not_fit_one_device_leaves_nothing(base_config: WorkerConfig,
                                                          model_dir: Path) -> None:
    """Replicated, a weight needs its full size on every device: over budget on each, the
    load fails and neither device keeps anything."""
    write_gguf(model_dir / "m.gguf", {"w": (512, 1024, 6)})  # 430 kB of Q6_K
    # per device: replicated needs 430 kB + 1.57 MB matmul scratch, a half shard 215 kB + 1.31 MB
    cfg = dataclasses.replace(base_config, vram_budget=Budget(nbytes=1_750_000))

    async def body(eng: MultiDeviceEngine, m: Metrics) -> None:
        with pytest.raises(ResourceExhausted):
            await eng.load_gguf("m.gguf", ["w"], placement="replicate")
        assert eng.list() == [] and all(len(e.registry) == 0 for e in eng.engines)
        assert [d.vram.reserved for d in eng.device_status()] == [0, 0]
        (v,) = await eng.load_gguf("m.gguf", ["w"], placement="shard")  # half on each: fits
        assert v.rows == 512

    run_engine(cfg, body)


def test_flags_reach_every_device(base_config: WorkerConfig, model_dir: Path) -> None:
    write_gguf(model_dir / "m.gguf", {"w": (ROWS, K, 2)})

    async def body(eng: MultiDeviceEngine, m: Metrics) -> None:
        await eng.load_gguf("m.gguf", ["w"])
        state = eng.set_flags({"Q6SERVE_DYNAMIC_BATCHING": False})
        assert not state.dynamic_batching
        assert all(not e.flags.state.dynamic_batching for e in eng.engines)
        with pytest.raises(InvalidArgument):
            eng.set_flags({"NOPE": True})

    run_engine(base_config, body)
