"""A small f16 y's way out in one kernel (kernels/cuda/launch.py ``Y16_COPY``, ``COPY_H_SRC``):
the device's f32 y converted and written into the pinned out buffer by ``q6_copy_h`` in place of
the conversion kernel and the copy kernel, for a single call's bound sequence and a multi-weight
one; off (0), unaligned or past the copy kernel's limit, the two steps as before. On the fake
device the fake ``q6_copy_h`` converts with NumPy (the plumbing: addresses, counts, the
captured order); the GPU test holds the kernel's bits to CuPy's conversion."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from q6serve.kernels.cuda import launch as launch_mod
from tests.kernels.test_cuda_backend_host import QKV, fake_backend, fake_weight


def _fake(monkeypatch, y16: int, limit: int = 1 << 20):
    """A fake backend with the copy kernel up to ``limit`` bytes and ``Y16_COPY`` = ``y16``;
    ``order``: each capture's nodes (copies, kernels by name, the conversion, events)."""
    monkeypatch.setattr(launch_mod, "Y16_COPY", y16)
    be, cp = fake_backend(monkeypatch)
    be.launcher.copy_kernel_max = limit
    order: list[str] = []

    def raw_kernel(src: str, name: str):
        assert f"void {name}(" in src

        def launch(grid, block, args, stream=None) -> None:
            assert stream is be.ctx.stream
            if cp.capturing is not None:
                order.append(name)
            s, d, n = int(args[0]), int(args[1]), int(args[2])
            if name == "q6_copy":
                cp.op(lambda: ctypes.memmove(d, s, n))
            elif name == "q6_copy_h":  # n f32 values -> n f16, 8 a thread (the tail: 1)
                assert grid[0] * block[0] >= min(-(-n // 8), launch_mod.COPY_MAX_BLOCKS
                                                 * launch_mod.COPY_THREADS)

                def run() -> None:
                    f = np.ctypeslib.as_array((ctypes.c_float * n).from_address(s))
                    h = np.ctypeslib.as_array((ctypes.c_uint16 * n).from_address(d))
                    with np.errstate(over="ignore"):
                        h[:] = f.astype(np.float16).view(np.uint16)
                    cp.count("q6_copy_h")

                cp.op(run)

        return launch

    cp.RawKernel = raw_kernel
    copyto = cp.copyto

    def conv(dst, src, casting="same_kind") -> None:
        if cp.capturing is not None:
            order.append("convert")
        copyto(dst, src, casting=casting)

    cp.copyto = conv
    monkeypatch.setattr(launch_mod, "_external_record",
                        lambda: (lambda ev, st, flags: order.append("event") or 0))
    return be, cp, order


def _h(y: np.ndarray) -> np.ndarray:
    """y rounded to f16 (overflow to infinity, as the conversion does)."""
    with np.errstate(over="ignore"):
        return y.astype(np.float16)


def _y(be, n: int, rows: int, i: int) -> np.ndarray:
    """Values in the fake device's f32 y that f16 rounds (some to subnormals, some overflow)."""
    rng = np.random.default_rng(i)
    y = (rng.standard_normal((n, rows)) * 10.0 ** rng.integers(-7, 6, (n, rows))).astype(
        np.float32)
    be.launcher.ws._dev["y"].a[: y.nbytes] = y.reshape(-1).view(np.uint8)
    return y


@pytest.mark.parametrize("y16,want", [
    (1, ["q6_copy", "event", "event", "q6_copy_h"]),
    (0, ["q6_copy", "event", "event", "convert", "q6_copy"]),
])
@pytest.mark.parametrize("n", [1, 8])
def test_small_f16_y_in_one_kernel(monkeypatch, y16, want, n):
    """A single call's small f16 y (3584 rows: 7 / 57 KB): with Y16_COPY one kernel after the
    end event converts and writes it into the pinned buffer (no conversion node, no copy); the
    result is the device y rounded to f16 on every call (direct, capture, graph, cached)."""
    be, cp, order = _fake(monkeypatch, y16)
    w = fake_weight(be, 3584, 3584)
    rng = np.random.default_rng(2)
    be.matmul(w, rng.standard_normal((n, 3584)).astype(np.float16), out_dtype=np.float16)
    for i in range(5):
        y = _y(be, n, 3584, i)
        res = be.launch(w, rng.standard_normal((n, 3584)).astype(np.float16),
                        out_dtype=np.float16).wait()
        assert res.y.dtype == np.float16
        np.testing.assert_array_equal(res.y.view(np.uint16), _h(y).view(np.uint16))
    assert order == want
    assert cp.counts.get("q6_copy_h", 0) == (6 if y16 else 0)


def test_f32_and_large_f16_y_unchanged(monkeypatch):
    """An f32 y, and an f16 y past the small-y buffer (18944 rows at N=8: 303 KB, converted in
    the sequence, copied per call into a pinned block), keep their ways out."""
    be, cp, order = _fake(monkeypatch, 1)
    for rows, n, out in ((3584, 1, None), (18944, 8, np.float16)):
        w = fake_weight(be, rows, 3584)
        rng = np.random.default_rng(3)
        be.matmul(w, rng.standard_normal((n, 3584)).astype(np.float16), out_dtype=out)
        for i in range(4):
            y = _y(be, n, rows, i)
            res = be.launch(w, rng.standard_normal((n, 3584)).astype(np.float16),
                            out_dtype=out).wait()
            np.testing.assert_array_equal(res.y, y if out is None else _h(y))
    assert "q6_copy_h" not in order and cp.counts.get("q6_copy_h", 0) == 0


@pytest.mark.parametrize("limit", [0, 4 << 10])
def test_copy_engine_or_over_the_limit_converts_first(monkeypatch, limit):
    """Where the copy kernel would not take y's bytes (off, or 7 KB over a 4 KiB limit) the
    conversion kernel and the copy engine's download stay, whatever Y16_COPY says."""
    be, _, order = _fake(monkeypatch, 1, limit)
    w = fake_weight(be, 3584, 3584)
    rng = np.random.default_rng(4)
    be.matmul(w, rng.standard_normal((1, 3584)).astype(np.float16), out_dtype=np.float16)
    for i in range(4):
        y = _y(be, 1, 3584, i)
        res = be.launch(w, rng.standard_normal((1, 3584)).astype(np.float16),
                        out_dtype=np.float16).wait()
        np.testing.assert_array_equal(res.y, _h(y))
    assert "q6_copy_h" not in order and "convert" in order
    assert not be.launcher._y16_out(256, 520, 64)  # (an unaligned address: never; none ran)


@pytest.mark.parametrize("y16", [1, 0])
def test_multi_weight_small_f16_y_in_one_kernel(monkeypatch, y16):
    """q/k/v as one call, f16 y (N=1: 9 KB): with Y16_COPY its one download is q6_copy_h over
    all parts' y; each part's result is its block rounded to f16."""
    be, _, order = _fake(monkeypatch, y16)
    ws = [fake_weight(be, r, k) for r, k in QKV]
    rng = np.random.default_rng(6)
    be.launch_many(ws, rng.standard_normal((1, 3584)).astype(np.float16),
                   out_dtype=np.float16).wait()
    rows = [r for r, _ in QKV]
    for i in range(5):
        flat = _y(be, 1, sum(rows), i).reshape(-1)
        res = be.launch_many(ws, rng.standard_normal((1, 3584)).astype(np.float16),
                             out_dtype=np.float16).wait()
        off = 0
        for r, part in zip(res, rows, strict=True):
            np.testing.assert_array_equal(r.y.reshape(-1), _h(flat[off : off + part]))
            off += part
    tail = order[-2:] if y16 else order[-3:]
    assert tail == (["event", "q6_copy_h"] if y16 else ["event", "convert", "q6_copy"])
    assert order.count("event") == len(QKV) + 1


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8])
def test_y16_copy_on_the_gpu(rng, monkeypatch, n):
    """On a device: with Y16_COPY a small f16 y (single and q/k/v) equals the conversion kernel
    and copy's bit for bit on every kind of call; q6_copy_h alone on a count that is not whole
    8-value words (its tail) writes exactly those halves, each CuPy's conversion of its f32."""
    from q6serve.kernels.api import Layout, iter_aos_chunks
    from tests.conftest import random_blocks
    from tests.kernels.test_cuda_backend_host import _gpu_backend

    be = _gpu_backend()(0)
    w = be.load(iter_aos_chunks(random_blocks(rng, 3584 * 14), 3584, 3584, 64 << 20),
                3584, 3584, Layout.SOA)
    qkv = [be.load(iter_aos_chunks(random_blocks(rng, r * 14), r, 3584, 64 << 20), r, 3584,
                   Layout.SOA) for r in (3584, 512, 512)]
    try:
        x = rng.standard_normal((n, 3584)).astype(np.float16)
        f16 = np.float16
        monkeypatch.setattr(launch_mod, "Y16_COPY", 0)
        ref = be.matmul(w, x, out_dtype=f16).y
        ref_q = [r.y for r in be.launch_many(qkv, x, out_dtype=f16).wait()]
        for cw in (w, *qkv):
            cw.data.plans.clear()
        monkeypatch.setattr(launch_mod, "Y16_COPY", 1)
        for _ in range(5):
            np.testing.assert_array_equal(be.launch(w, x, out_dtype=f16).wait().y, ref)
            for r, want in zip(be.launch_many(qkv, x, out_dtype=f16).wait(), ref_q,
                               strict=True):
                np.testing.assert_array_equal(r.y, want)
        assert be.launcher._copy_h_fn is not None  # (it ran)
        cp, lc = be.ctx.cp, be.launcher
        vals = (rng.standard_normal(1003 + 16) * 10.0 ** rng.integers(-9, 7, 1019)).astype(
            np.float32)
        with be.ctx.dev:
            dsrc = cp.asarray(vals)
            host = cp.cuda.alloc_pinned_memory(2 * len(vals))
            dst = np.frombuffer(host, np.uint16, len(vals))
            dst[:] = 7
            with be.ctx.stream:
                assert lc._y16_out(host.ptr, int(dsrc.data.ptr), 1003)  # 125 words and 3
            be.ctx.stream.synchronize()
            want = dsrc[:1003].astype(cp.float16).get().view(np.uint16)
        np.testing.assert_array_equal(dst[:1003], want)
        assert (dst[1003:] == 7).all()  # (nothing past the count)
    finally:
        for cw in (w, *qkv):
            be.free(cw)
