"""Many small weights: per-weight cost constant, nothing left behind (issue 18, item 8).

65536 tiny tensors used to stall the worker (name checks quadratic on the event loop, every
unload rescanning all weights, then full collections of the cyclic GC over ~27 objects per
weight). The timings are a benchmark (bench/many_weights.py, figures in docs/RELIABILITY.md);
here: what each weight costs in host memory and in GC-tracked objects is a constant, batchers
are capped, the GC is frozen while very many weights are resident, and unloading them all
gives every byte and figure back.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from q6serve.kernels import gguf_io
from q6serve.kernels.backends import make_backend
from q6serve.kernels.errors import InvalidArgument
from q6serve.service import engine as engine_mod
from q6serve.service import gcfreeze
from q6serve.service.config import Budget, WorkerConfig
from q6serve.service.engine import Engine
from q6serve.service.engine_types import MatmulCall
from q6serve.service.registry import Registry
from tests.reliability.gguf_corpus import File, Tensor, q6k_blocks

PER_WEIGHT_MAX = 6 << 10  # bytes of host memory per resident 1x256 weight with a batcher
# What unloading everything may leave: asyncio's set of all tasks keeps the table it grew to
# for the weights' batcher tasks (128 KiB at 2048; capped by MAX_LIVE_BATCHERS), whatever n.
LEFT_MAX = 256 << 10


def many(path: Path, n: int) -> Path:
    b = q6k_blocks(1, 256, 1)
    path.write_bytes(File(tensors=[Tensor(f"t{i}", [256, 1], data=b)
                                   for i in range(n)]).build())
    return path


def engine_for(tmp_path: Path) -> Engine:
    return Engine(make_backend("numpy"), WorkerConfig(
        port=0, model_dir=tmp_path, vram_budget=Budget(nbytes=1 << 30)))


@pytest.mark.parametrize("n", [512, 2048])
def test_each_weight_costs_a_constant_and_unloading_gives_it_all_back(n, tmp_path, caplog):
    # One INFO line per unload: if an earlier test set the root logger to INFO, pytest's
    # capture would keep 2048 LogRecords (~1.2 KB each) until this test ends: not the worker's
    # memory (that was the "~1 KB/weight left after the other reliability tests").
    caplog.set_level(logging.WARNING, logger="q6serve")
    path = many(tmp_path / "many.gguf", n)

    async def go() -> tuple[float, int]:
        engine = engine_for(tmp_path)
        try:
            gc.collect()
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            await engine.load_gguf(path.name, [])
            gc.collect()
            per_weight = (tracemalloc.get_traced_memory()[0] - base) / n
            for i in range(n):
                await engine.unload(f"t{i}")
            await asyncio.sleep(0)
            gc.collect()
            left = tracemalloc.get_traced_memory()[0] - base
            tracemalloc.stop()
            v = engine.status().vram
            assert (v.weights, v.scratch, v.staging) == (0, 0, 0)
            assert len(engine.list()) == 0
            return per_weight, left
        finally:
            await engine.close()

    per_weight, left = asyncio.run(go())
    assert per_weight < PER_WEIGHT_MAX, f"{per_weight:.0f} bytes per weight"
    # everything but a constant comes back (the registry's containers are renewed when empty)
    assert left < LEFT_MAX, f"{left} bytes left after unloading {n} weights"


def test_handing_file_pages_back_leaves_nothing_behind(tmp_path):
    """What held 1.9 MB after unloading 2048 weights (when tests/reliability ran alone): the
    interpreter's table of interned strings, rebuilt during the load. Each chunk's page
    release read ``chunk.__array_interface__``, a fresh dict whose keys Python 3.11 interns
    and drops again, and that churn rebuilt the table now and then, in whichever test it
    happened. Releases go by file offsets now: 100k of them leave nothing."""
    path = tmp_path / "pages.bin"
    path.write_bytes(bytes(1 << 20))
    m = gguf_io._Mapping(path)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(100_000):  # the old release churned 6 interned keys a call
            m.release(4096 * (i % 8), 4096 * (1 + i % 8) + 100)
        left = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert left < 64 << 10, f"{left} bytes left after 100k page releases"


def test_weights_beyond_the_batcher_cap_cost_few_gc_objects_and_batchers_stay_capped(
        tmp_path, monkeypatch):
    """Past MAX_LIVE_BATCHERS a weight gets its batcher on first use and the oldest idle
    ones are closed: every weight still answers, exactly, and the GC walks ~5 objects per
    idle weight (was ~27: entry, event, batcher task, queue, closures)."""
    monkeypatch.setattr(engine_mod, "MAX_LIVE_BATCHERS", 8)
    monkeypatch.setattr(gcfreeze, "FREEZE_AT", 1 << 30)  # count the objects, do not freeze
    n = 512
    path = many(tmp_path / "many.gguf", n)

    async def go() -> None:
        engine = engine_for(tmp_path)
        try:
            gc.collect()
            before = len(gc.get_objects())
            await engine.load_gguf(path.name, [])
            gc.collect()
            per_weight = (len(gc.get_objects()) - before) / n
            assert per_weight < 6, f"{per_weight:.1f} GC-tracked objects per weight"
            live = sum(e.batcher is not None for e in engine.registry.entries())
            assert live == 8
            x = np.ones((1, 256), np.float32)
            want = (await engine.matmul(MatmulCall("t0", x))).y
            for i in range(0, n, 32):  # 32 at a time: busy batchers are kept past the cap
                ys = await asyncio.gather(*(engine.matmul(MatmulCall(f"t{j}", x))
                                            for j in range(i, i + 32)))
                assert all(np.array_equal(r.y, want) for r in ys)  # same data in every t
                assert len(engine._live) <= 8 + 32
            await asyncio.sleep(0.05)  # retired batchers finish closing
            assert sum(e.batcher is not None for e in engine.registry.entries()) <= 8 + 32
            for i in range(n):
                await engine.unload(f"t{i}")
            assert not engine._live
            v = engine.status().vram
            assert (v.weights, v.scratch, v.staging) == (0, 0, 0)
        finally:
            await engine.close()

    asyncio.run(go())


def test_the_gc_is_frozen_while_many_weights_are_resident(tmp_path, monkeypatch):
    monkeypatch.setattr(gcfreeze, "FREEZE_AT", 64)
    path = many(tmp_path / "many.gguf", 256)

    async def go() -> None:
        engine = engine_for(tmp_path)
        try:
            assert not gcfreeze.frozen()
            await engine.load_gguf(path.name, [])
            assert gcfreeze.frozen() and gc.get_freeze_count() > 0
            e = engine.registry.get("t5")
            assert not any(o is e for o in gc.get_objects())  # out of the collector's walks
            del e
            for i in range(256 - 64):
                await engine.unload(f"t{i}")
            assert gcfreeze.frozen()  # 64 left
            await engine.unload("t255")
            assert not gcfreeze.frozen() and gc.get_freeze_count() == 0  # 63: let back
            await engine.load_gguf(path.name, ["t0"])  # 64 again
            assert gcfreeze.frozen()
            await engine.unload("t0")
            await engine.unload("t254")
            await engine.load_gguf(path.name, ["t0"])  # 63: a small load does not freeze
            assert not gcfreeze.frozen()
        finally:
            await engine.close()
            gc.unfreeze()

    asyncio.run(go())


def test_a_load_naming_many_weights_checks_them_in_linear_time():
    r = Registry(lambda e: None)
    names = [f"w{i}" for i in range(1 << 16)] + ["w7", "w9"]
    with (pytest.raises(InvalidArgument, match=r"names repeated in one load: \['w7', 'w9'\]"),
          r.claim(names)):
        pass
    with r.claim(names[:-2]):
        assert len(r.claimed()) == 1 << 16
    assert not r.claimed()


def test_max_weights_bounds_the_bookkeeping_and_status_shows_it(tmp_path):
    from q6serve.kernels.errors import ResourceExhausted
    from q6serve.service.engine_types import UploadSpec
    from q6serve.service.registry import BATCHER_HOST_BYTES, WEIGHT_HOST_BYTES

    path = many(tmp_path / "many.gguf", 6)

    async def go() -> None:
        engine = Engine(make_backend("numpy"), WorkerConfig(
            port=0, model_dir=tmp_path, vram_budget=Budget(nbytes=1 << 30), max_weights=4))
        try:
            with pytest.raises(ResourceExhausted, match=r"6 more weight\(s\) would exceed "
                               r"--max-weights 4 \(0 resident, 0 loading; each holds"):
                await engine.load_gguf(path.name, [])
            assert engine.status().weights_loaded == 0
            await engine.load_gguf(path.name, ["t0", "t1", "t2", "t3"])
            spec = UploadSpec("u", 1, 256, "q6_k", 210, "0" * 64)
            with pytest.raises(ResourceExhausted, match="--max-weights 4"):
                engine.upload_buffer(spec)  # refused at the header, before any data
            s = engine.status()
            assert (s.weights_loaded, s.max_weights) == (4, 4)
            assert s.host_overhead_bytes == 4 * (WEIGHT_HOST_BYTES + BATCHER_HOST_BYTES)
            await engine.unload("t0")
            await engine.load_gguf(path.name, ["t5"])
            await engine.unload("t5")
            assert engine.status().host_overhead_bytes == 3 * (WEIGHT_HOST_BYTES
                                                               + BATCHER_HOST_BYTES)
        finally:
            await engine.close()

    asyncio.run(go())
