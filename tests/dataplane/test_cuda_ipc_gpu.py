"""CUDA IPC regions on a GPU (``-m gpu``; skipped without CuPy or a GPU): this process's
device buffers registered with a `q6serve worker --backend cuda --allow-shm` in another
process (an IPC handle cannot be opened by the process that exported it), with one process
and with --frontends 2. x is read from and y written into the caller's memory on the device;
results equal the bytes path's; bad regions get a clear status; unregistering closes the
handle (the worker's mapped bytes go back to 0)."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from q6serve.client.client import Client, Q6ServeError
from tests.service.svc_util import random_q6k

try:
    import cupy
except ImportError:  # CI: no CuPy at all
    cupy = None


def _gpus() -> int:
    if cupy is None:
        return 0
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_gpus() == 0, reason="needs CuPy and a CUDA GPU")]

ROWS, K = 2048, 3584
C = grpc.StatusCode


@contextlib.contextmanager
def cuda_worker(frontends: int, seed: int, env: dict[str, str] | None = None,
                ) -> Iterator[tuple[str, np.ndarray]]:
    """A `q6serve worker --backend cuda` in another process with weight "w" uploaded:
    (target, its blocks); stopped with SIGTERM (exit 0) at the end."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "q6serve.client.cli", "worker", "--port", "0", "--backend",
         "cuda", "--vram-budget", "2GiB", "--allow-shm", "--frontends", str(frontends),
         "--max-region-bytes", str(64 << 20), "--grace-period", "2"],
        stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        m = re.search(r"listening on (\S+:\d+)$", first.strip())
        assert m, first
        blocks = random_q6k(ROWS, K, seed)
        with Client(m.group(1)) as c:
            c.upload("w", blocks, ROWS, K)
        yield m.group(1), blocks
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "frontends-2"])
def worker(request: pytest.FixtureRequest) -> Iterator[tuple[str, np.ndarray]]:
    with cuda_worker(request.param, 1) as w:
        yield w


def same(got: np.ndarray, want: np.ndarray) -> None:
    """The device path runs the kernel the batch path runs (same dispatch): equal up to the
    output's rounding (bit-equal is expected; the tolerance only keeps a last-bit difference
    in a conversion from hiding the other checks)."""
    tol = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[want.dtype.name]
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=tol,
                               atol=tol)


def code_of(fn: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(Q6ServeError) as e:
        fn()
    return e.value.code, e.value.message


def test_device_buffers_in_and_out(worker: tuple[str, np.ndarray],
                                   rng: np.random.Generator) -> None:
    target, _ = worker
    x = rng.standard_normal((8, K)).astype(np.float16)
    with Client(target) as c:
        for out_dtype in ("f32", "f16", "bf16"):
            want = c.matmul_full("w", x, precision="f16", out_dtype=out_dtype)
            with c.register_cuda_ipc("dev", 1 << 20) as dev:
                xd = dev.ndarray(0, np.float16, x.shape)
                xd.set(x)
                cupy.cuda.get_current_stream().synchronize()
                yoff = 1 << 19
                dev.ndarray(yoff, np.float32, (8, ROWS)).fill(np.nan)  # poison: y is written
                out = c.matmul_full("w", xd, precision="f16", out_dtype=out_dtype,
                                    x_region=dev, y_region=(dev, yoff))
                assert isinstance(out.y, cupy.ndarray) and out.y.shape == (8, ROWS)
                assert out.kernel == want.kernel
                got = cupy.asnumpy(out.y)
                if out_dtype == "bf16":  # a CUDA region holds bf16 as its uint16 bits
                    got = got.view(want.y.dtype)
                same(got, want.y)
                # x inline, y on the device; x on the device, y back in the reply
                y2 = c.matmul("w", x, precision="f16", out_dtype=out_dtype,
                              y_region=(dev, yoff))
                same(cupy.asnumpy(y2).view(want.y.dtype), want.y)
                y3 = c.matmul("w", xd, precision="f16", out_dtype=out_dtype, x_region=dev)
                same(y3, want.y)
            assert c.list_regions() == []
        # a CuPy array from the memory pool: the region starts inside a pool block
        pool = cupy.zeros(3 << 20, cupy.uint8)
        with c.register_cuda_ipc("pool", array=pool[4096 : (2 << 20) + 4096]) as region:
            info = c.list_regions()[0]
            assert info.kind == "cuda" and info.byte_size == 2 << 20
            y = c.matmul("w", x, precision="f16", x_region=(region, 0),
                         y_region=(region, 1 << 20))
            same(cupy.asnumpy(y), c.matmul("w", x, precision="f16"))


def test_bad_cuda_regions(worker: tuple[str, np.ndarray], rng: np.random.Generator) -> None:
    from q6serve.client.shm import CudaRegion

    target, _ = worker
    x = rng.standard_normal((4, K)).astype(np.float16)
    with Client(target) as c, c.register_cuda_ipc("r", 16384) as r:
        code, msg = code_of(lambda: c.matmul("w", x, y_region=(r, 0)))  # 4 x 2048 f32 > 16 KiB
        assert code == C.INVALID_ARGUMENT and "overruns region 'r'" in msg, msg
        # the allocation's end, the device, the handle: each refused at registration
        fake = CudaRegion("past", cupy.empty(65536, cupy.uint8))
        fake.size = 32 << 20  # within --max-region-bytes, past the (pool) allocation
        code, msg = code_of(lambda: c.register_region(fake))
        assert code == C.INVALID_ARGUMENT and "does not fit the CUDA allocation" in msg, msg
        fake.size, fake.device = 4096, 7
        code, msg = code_of(lambda: c.register_region(fake))
        assert code == C.INVALID_ARGUMENT and "device" in msg, msg
        fake.device, fake.handle = 0, b"\x01" * 64
        code, msg = code_of(lambda: c.register_region(fake))
        assert code == C.INVALID_ARGUMENT and "cannot open the CUDA IPC handle" in msg, msg
        assert [i.name for i in c.list_regions()] == ["r"]
        assert c.status().serving
    with Client(target) as c:
        assert c.list_regions() == []
        assert c.matmul("w", x).shape == (4, ROWS)  # the worker serves on


def test_lane_on_a_cuda_region(worker: tuple[str, np.ndarray],
                               rng: np.random.Generator) -> None:
    """A fast lane over a CUDA IPC region (LaneServer._cuda: CudaSupport.start, no task per
    request): x read from and y written into the caller's device memory, equal to the bytes
    path's; a refusal answered on the lane, which goes on; nothing left registered."""
    target, _ = worker
    x = rng.standard_normal((64, K)).astype(np.float16)
    with Client(target) as c:
        want = c.matmul("w", x, precision="f16")
        with c.register_cuda_ipc("lanedev", 4 << 20) as dev, c.open_lane(dev) as lane:
            dev.ndarray(0, np.float16, x.shape).set(x)
            cupy.cuda.get_current_stream().synchronize()
            for y_off in (1 << 21, 3 << 20, 1 << 21):
                dev.ndarray(y_off, np.float32, (64, ROWS)).fill(np.nan)  # poison: y is written
                cupy.cuda.get_current_stream().synchronize()
                y = lane.matmul("w", shape=x.shape, dtype=np.float16, y_offset=y_off,
                                precision="f16")
                assert isinstance(y, cupy.ndarray)
                same(cupy.asnumpy(y), want)
            code, msg = code_of(lambda: lane.matmul("w", shape=x.shape, dtype=np.float16,
                                                    y_offset=(4 << 20) - 4096))
            assert code == C.INVALID_ARGUMENT and "overruns region 'lanedev'" in msg, msg
            same(cupy.asnumpy(lane.matmul("w", shape=x.shape, dtype=np.float16,
                                          y_offset=1 << 21, precision="f16")), want)
        assert c.list_regions() == []


def test_cuda_region_calls_launched_behind_each_other(tmp_path: Any,
                                                      rng: np.random.Generator) -> None:
    """6 callers' 64-row calls with x and y in their own CUDA IPC buffers, through two front
    ends, are launched behind each other by the device process's pipeline (at a loop trip's
    end, a launch slot each, waited for a trip later: its counters) and every y equals the
    bytes path's."""
    import json
    import os
    import time
    from concurrent.futures import ThreadPoolExecutor

    stats = tmp_path / "dp_stats.jsonl"
    env = {**os.environ, "Q6SERVE_DP_STATS": str(stats)}
    with cuda_worker(2, 2, env) as (target, _):
        xs = [rng.standard_normal((64, K)).astype(np.float16) for _ in range(6)]

        def caller(i: int) -> int:
            with Client(target) as c:
                want = c.matmul_full("w", xs[i], precision="f16").y
                with c.register_cuda_ipc(f"d{i}", 2 << 20) as dev:
                    xd = dev.ndarray(0, np.float16, xs[i].shape)
                    xd.set(xs[i])
                    cupy.cuda.get_current_stream().synchronize()
                    for _ in range(30):
                        out = c.matmul_full("w", xd, precision="f16", x_region=dev,
                                            y_region=(dev, 1 << 20))
                        same(cupy.asnumpy(out.y), want)
                return 30

        with ThreadPoolExecutor(6) as pool:
            assert sum(pool.map(caller, range(6))) == 180
        time.sleep(1.3)  # one more line of the device process's counters
        last = json.loads(stats.read_text().splitlines()[-1])
        assert last["pipelined_batches"] >= 90, last  # (the first of a kind is measured)
        with Client(target) as c:
            assert c.list_regions() == [] and c.status().serving


def test_place_graphs_follow_x_and_the_weight(tmp_path: Any, rng: np.random.Generator) -> None:
    """A CUDA-region call repeated at one place runs as that place's graph (x's and y's copies
    inside: Q6SERVE_DP_PLACE_GRAPH, the device process's ``place_launches``) and reads the x
    there now, each y equal to the bytes path's; after the weight is unloaded and another
    uploaded under its name, the same place computes with the new weight (the graphs lived
    with the old weight's bound sequences)."""
    import json
    import os
    import time

    stats = tmp_path / "dp_stats.jsonl"
    env = {**os.environ, "Q6SERVE_DP_STATS": str(stats), "Q6SERVE_DP_PLACE_GRAPH": "1"}
    with cuda_worker(2, 3, env) as (target, _), Client(target) as c:
        with c.register_cuda_ipc("d", 2 << 20) as dev:
            xd = dev.ndarray(0, np.float16, (64, K))
            for rnd in range(2):
                for _ in range(12):
                    x = rng.standard_normal((64, K)).astype(np.float16)
                    want = c.matmul_full("w", x, precision="f16").y
                    xd.set(x)
                    cupy.cuda.get_current_stream().synchronize()
                    out = c.matmul_full("w", xd, precision="f16", x_region=dev,
                                        y_region=(dev, 1 << 20))
                    same(cupy.asnumpy(out.y), want)
                if rnd == 0:  # another weight under the same name, the same places
                    c.unload("w")
                    c.upload("w", random_q6k(ROWS, K, 4), ROWS, K)
        time.sleep(1.3)  # one more line of the device process's counters
        last = json.loads(stats.read_text().splitlines()[-1])
        # (per round: the first call measured, a slot's first two calls at a place direct)
        assert last["place_launches"] >= 8, last
        assert c.list_regions() == [] and c.status().serving
