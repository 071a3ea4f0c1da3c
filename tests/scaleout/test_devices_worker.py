"""`q6serve worker --devices 0,1` over gRPC on two NumPy devices: sharded and replicated loads
give the reference's results, GetStatus lists each device, /metrics carries device labels."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from scaleout_util import LoopWorker, assert_close, reference, write_gguf

from q6serve.client.client import Client
from q6serve.client.sharded import ShardedClient

ROWS, K = 37, 512


def _x(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, K)).astype(np.float32)


def test_sharded_and_replicated_over_grpc(start_devices: Callable[..., LoopWorker],
                                          model_dir: Path) -> None:
    blocks = write_gguf(model_dir / "m.gguf", {"w": (ROWS, K, 11)})["w"]
    w = start_devices()
    with Client(w.target, timeout=10) as c:
        (s,) = c.load("m.gguf", ["w"])  # the worker's default: shard
        (r,) = c.load("m.gguf", ["w"], prefix="r/", placement="replicate")
        assert (s.rows, r.rows, s.row_end, r.tensor_rows) == (ROWS, ROWS, ROWS, ROWS)
        assert s.sha256 == r.sha256
        for n in (1, 6):
            x = _x(n, n)
            want = reference(blocks, ROWS, K, x)
            assert_close(c.matmul("w", x), want)
            assert_close(c.matmul("r/w", x), want)
        st = c.status()
        assert [(d.index, d.ordinal, d.weights_loaded) for d in st.devices] == \
            [(0, 0, 2), (1, 1, 2)]
        assert st.vram.weights_bytes == sum(d.vram.weights_bytes for d in st.devices)
        assert st.weights_loaded == 2 and st.device.startswith("2 devices")
        # replicated: 2 + 2 parts' bytes; sharded: one copy's bytes over both devices
        assert r.nbytes == 2 * s.nbytes
        assert c.unload("w").rows == ROWS
        assert [d.weights_loaded for d in c.status().devices] == [1, 1]


def test_device_metrics_are_labelled_and_bounded(start_devices: Callable[..., LoopWorker],
                                                 model_dir: Path) -> None:
    write_gguf(model_dir / "m.gguf", {"w": (ROWS, K, 12)})
    w = start_devices()
    with Client(w.target, timeout=10) as c:
        c.load("m.gguf", ["w"])
        c.matmul("w", _x(3))
    reg = w.worker.registry
    for dev in ("0", "1"):
        assert reg.get_sample_value("q6serve_device_batch_rows_total", {"device": dev}) == 3
        assert reg.get_sample_value("q6serve_device_weights_loaded", {"device": dev}) == 1
    devices = {s.labels["device"] for fam in reg.collect() if fam.name.startswith(
        "q6serve_device_") for s in fam.samples if "device" in s.labels}
    assert devices == {"0", "1"}
    assert reg.get_sample_value("q6serve_weights_loaded") == 1


def test_sharded_client_over_multi_device_workers(start_devices: Callable[..., LoopWorker],
                                                  model_dir: Path) -> None:
    """Two workers of two devices each: 37 rows -> worker shards of 19 + 18 -> 10+9, 9+9."""
    blocks = write_gguf(model_dir / "m.gguf", {"w": (ROWS, K, 13)})["w"]
    a, b = start_devices(), start_devices(placement="replicate")
    x = _x(5)
    with ShardedClient([a.target, b.target], timeout=10) as c:
        (m,) = c.load("m.gguf", ["w"])
        assert m.rows == ROWS
        assert_close(c.matmul("w", x), reference(blocks, ROWS, K, x))


def test_cli_status_lists_devices(start_devices: Callable[..., LoopWorker],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    from q6serve.client.cli import main

    w = start_devices()
    assert main(["status", "--target", w.target]) == 0
    out = capsys.readouterr().out
    assert "device 0: cpu" in out and "device 1: cpu" in out
