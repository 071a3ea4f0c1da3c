"""Upload buffers hold what was sent, accounted as it arrives (issue 18, item 5).

A header alone commits nothing; data is held in segments reserved as ``staging`` before they
are allocated; f32/f16 segments are quantized as they fill, so the float bytes do not pile up.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from q6serve.kernels import q6k
from q6serve.kernels.api import MemoryInfo
from q6serve.kernels.errors import FormatError, InvalidArgument, ResourceExhausted
from q6serve.kernels.quantize import quantize_q6_k
from q6serve.service.config import Budget, WorkerConfig
from q6serve.service.uploads import UploadBuffer
from q6serve.service.vram import VramAccountant
from q6serve.v1 import q6serve_pb2 as pb
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc
from tests.reliability.harness import RunningWorker, health, vram_figures
from tests.service.svc_util import make_backend, wait_until

MiB = 1 << 20


def accountant(budget: int = 1 << 30) -> VramAccountant:
    return VramAccountant(budget, lambda: MemoryInfo(free=0, total=0))


def feed(buf: UploadBuffer, data: bytes, sizes: list[int], acct: VramAccountant) -> None:
    """Send ``data`` in chunks of the given sizes (cycled), checking after each that the
    accountant holds exactly what the buffer holds."""

    async def go() -> None:
        pos, i = 0, 0
        while pos < len(data):
            n = sizes[i % len(sizes)]
            await buf.add(data[pos : pos + n])
            pos, i = pos + n, i + 1
            assert acct.used("staging") == buf.nbytes
        buf.finish()

    asyncio.run(go())


@pytest.mark.parametrize("fmt", ["f32", "f16"])
def test_float_upload_is_quantized_segment_by_segment(fmt, rng):
    rows, k = 37, 512
    x = rng.standard_normal((rows, k)).astype(np.float32 if fmt == "f32" else np.float16)
    data = x.tobytes()
    acct = accountant()
    # segments of 5 rows; chunks of odd sizes straddle rows and segments
    buf = UploadBuffer("u", rows, k, fmt, len(data), hashlib.sha256(data).hexdigest(), acct,
                       segment_bytes=5 * k * x.itemsize)
    feed(buf, data, [1000, 7, 3 * k * x.itemsize + 1], acct)
    assert len(buf.parts) == 8  # 7 segments of 5 rows and one of 2
    got = np.concatenate(list(buf.chunks(3 * q6k.aos_nbytes(1, k))))
    np.testing.assert_array_equal(got, quantize_q6_k(x))
    np.testing.assert_array_equal(buf.row_blocks(4, 11), got[4 * 2 : 11 * 2])
    # held: the Q6_K blocks (the float segments were released as they were quantized)
    assert acct.used("staging") == rows * q6k.aos_nbytes(1, k)
    buf.release()
    buf.release()
    assert acct.used("staging") == 0


def test_errors_name_the_row_of_the_whole_upload_and_release_everything(rng):
    rows, k = 12, 256
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[9, 17] = 5e9  # in the third segment of 4 rows
    data = x.tobytes()
    acct = accountant()
    buf = UploadBuffer("u", rows, k, "f32", len(data), hashlib.sha256(data).hexdigest(), acct,
                       segment_bytes=4 * k * 4)
    with pytest.raises(FormatError, match="row 9, column 17"):
        feed(buf, data, [4096], acct)
    buf.release()
    assert acct.used("staging") == 0


def test_a_segment_that_does_not_fit_the_budget_is_refused_before_allocation():
    rows, k = 64, 256
    seg = 8 * q6k.aos_nbytes(1, k)
    acct = accountant(budget=3 * seg)  # three segments of 8 Q6_K rows
    buf = UploadBuffer("u", rows, k, "q6_k", rows * seg // 8, "0" * 64, acct,
                       segment_bytes=seg)
    blocks = np.zeros((rows, q6k.BLOCK_BYTES), np.uint8)  # d = 0: finite
    with pytest.raises(ResourceExhausted, match="VRAM budget exceeded"):
        asyncio.run(buf.add(blocks.tobytes()))
    assert len(buf.parts) == 3 and acct.used("staging") == 3 * seg
    buf.release()
    assert acct.used("staging") == 0


def test_sha256_and_length_are_checked_at_the_end():
    k = 256
    data = bytes(2 * q6k.aos_nbytes(1, k))
    buf = UploadBuffer("u", 2, k, "q6_k", len(data), hashlib.sha256(b"x").hexdigest(), None)
    asyncio.run(buf.add(data))
    with pytest.raises(InvalidArgument, match="sha256 mismatch"):
        buf.finish()
    buf = UploadBuffer("u", 2, k, "q6_k", len(data), "0" * 64, None)
    asyncio.run(buf.add(data[:10]))
    with pytest.raises(InvalidArgument, match="ended after 10 of 420 bytes"):
        buf.finish()
    with pytest.raises(InvalidArgument, match="more than the declared 420"):
        asyncio.run(buf.add(data))


# -- against a worker ---------------------------------------------------------------------------
@pytest.fixture
def worker() -> Iterator[RunningWorker]:
    rw = RunningWorker(WorkerConfig(port=0, vram_budget=Budget(nbytes=200 * MiB)),
                       make_backend())
    yield rw
    rw.stop()


def rss() -> int:
    with open("/proc/self/status") as fh:
        return next(int(ln.split()[1]) * 1024 for ln in fh if ln.startswith("VmRSS"))


def test_header_only_uploads_commit_nothing(worker):
    """Four f32 uploads of 64 MiB each (more than the 200 MB budget together) send their
    header and stall: nothing is allocated or reserved for them, the worker serves."""
    c = worker.client()
    before = vram_figures(c)
    rows, k = 16384, 1024
    go = threading.Event()

    def stream(i: int) -> Iterator[pb.UploadWeightRequest]:
        yield pb.UploadWeightRequest(header=pb.UploadHeader(
            name=f"u{i}", rows=rows, k=k, format=pb.UPLOAD_FORMAT_F32,
            total_bytes=rows * k * 4, sha256="0" * 64))
        go.wait(30)

    rss0 = rss()
    with grpc.insecure_channel(worker.target) as ch:
        stub = pb_grpc.Q6ServeStub(ch)
        futs = [stub.UploadWeight.future(stream(i), timeout=60) for i in range(4)]
        time.sleep(0.5)  # the old worker allocated each buffer as soon as its header came
        assert health(worker.target) == "SERVING"
        assert vram_figures(c) == before  # nothing reserved for the headers
        assert rss() - rss0 < 64 * MiB  # the old worker allocated 4 x 64 MiB here
        go.set()
        for f in futs:
            with pytest.raises(grpc.RpcError) as e:
                f.result()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "ended after 0 of" in e.value.details()
    assert vram_figures(c) == before


def test_a_stalled_upload_shows_what_it_holds_and_gives_it_back(worker, rng):
    c = worker.client()
    before = vram_figures(c)
    rows, k = 4096, 1024  # 16 MiB of f32: one segment
    sent = threading.Event()
    go = threading.Event()

    def stream() -> Iterator[pb.UploadWeightRequest]:
        yield pb.UploadWeightRequest(header=pb.UploadHeader(
            name="u", rows=rows, k=k, format=pb.UPLOAD_FORMAT_F32,
            total_bytes=rows * k * 4, sha256="0" * 64))
        yield pb.UploadWeightRequest(chunk=bytes(MiB))
        sent.set()
        go.wait(30)

    with grpc.insecure_channel(worker.target) as ch:
        fut = pb_grpc.Q6ServeStub(ch).UploadWeight.future(stream(), timeout=60)
        sent.wait(10)
        wait_until(lambda: c.status().vram.staging_bytes > 0, what="the upload's segment")
        assert c.status().vram.staging_bytes == rows * k * 4  # the segment it writes into
        go.set()
        with pytest.raises(grpc.RpcError):
            fut.result()
    wait_until(lambda: vram_figures(c) == before, what="the staging to be released")
