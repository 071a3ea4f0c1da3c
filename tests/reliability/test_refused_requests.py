"""Refused requests leave nothing behind (issue 18, item 4).

With the cyclic garbage collector off, a refused 32 MiB request must be freed as soon as it is
answered: nothing may keep it in a reference cycle (an abort raised inside an except block did,
through grpc's AbortError and the handler frames). Unauthenticated callers are refused before
gRPC reads their message at all. Memory is measured with tracemalloc (request bytes are Python
objects), so the figure is the worker's own, exact and independent of the allocator.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from q6serve.client.client import matmul_request
from q6serve.service.config import Budget, WorkerConfig
from q6serve.v1 import q6serve_pb2 as pb
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc
from tests.reliability.harness import RunningWorker, health, random_q6k
from tests.service.svc_util import make_backend

MiB = 1 << 20
BIG = 32 * MiB
TOKEN = "user-token-0123456789"
ADMIN = "admin-token-0123456789"


@pytest.fixture(scope="module")
def worker() -> Iterator[RunningWorker]:
    rw = RunningWorker(WorkerConfig(port=0, vram_budget=Budget(nbytes=64 << 20),
                                    max_message_bytes=64 * MiB, max_request_bytes=64 * MiB,
                                    token=TOKEN,
                                    admin_token=ADMIN), make_backend())
    rw.client(token=ADMIN).upload("w", random_q6k(8, 256, 1), 8, 256)
    yield rw
    rw.stop()


def big_matmul(k: int = BIG // 4 // 8, weight: str = "w") -> pb.MatmulRequest:
    return matmul_request(weight, np.ones((8, k), np.float32), "auto", "f32")


def upload_stream() -> Iterator[pb.UploadWeightRequest]:
    yield pb.UploadWeightRequest(header=pb.UploadHeader(
        name="u", rows=16384, k=1024, format=pb.UPLOAD_FORMAT_F32,
        total_bytes=16384 * 1024 * 4, sha256="0" * 64))
    for _ in range(2):
        yield pb.UploadWeightRequest(chunk=bytes(16 * MiB))


CASES = {
    # refused by the handler after the message was read
    "k-mismatch": ("Matmul", lambda: big_matmul(), TOKEN, grpc.StatusCode.INVALID_ARGUMENT),
    "unknown-weight": ("Matmul", lambda: big_matmul(256 * 4096, "nope"), TOKEN,
                       grpc.StatusCode.NOT_FOUND),
    "stream-k-mismatch": ("MatmulStream", lambda: iter([big_matmul()]), TOKEN, None),
    # refused before the message is read
    "no-token": ("Matmul", lambda: big_matmul(), None, grpc.StatusCode.UNAUTHENTICATED),
    "wrong-token": ("Matmul", lambda: big_matmul(), "nope", grpc.StatusCode.UNAUTHENTICATED),
    "upload-user-token": ("UploadWeight", upload_stream, TOKEN,
                          grpc.StatusCode.PERMISSION_DENIED),
    "stream-no-token": ("MatmulStream", lambda: iter([big_matmul()]), None,
                        grpc.StatusCode.UNAUTHENTICATED),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_big_requests_are_freed_without_the_collector(worker, case):
    method, make, token, code = CASES[case]
    md = [("authorization", f"Bearer {token}")] if token else None
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        with grpc.insecure_channel(worker.target, options=[
                ("grpc.max_send_message_length", 64 * MiB)]) as ch:
            stub = pb_grpc.Q6ServeStub(ch)
            base = tracemalloc.get_traced_memory()[0]
            for _ in range(3):
                request = make()
                try:
                    out = getattr(stub, method)(request, timeout=30, metadata=md)
                    if method == "MatmulStream":
                        (reply,) = list(out)
                        assert reply.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                    else:
                        pytest.fail(f"{case}: {method} succeeded")
                except grpc.RpcError as e:
                    assert e.code() == code, e.details()
                del request
            # the status can reach us a moment before the worker's handler has returned
            deadline = time.monotonic() + 5
            while (held := tracemalloc.get_traced_memory()[0] - base) >= 8 * MiB:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
    finally:
        tracemalloc.stop()
        gc.enable()
    # three refused 32 MiB requests (a leaking worker holds ~2-3 copies of each)
    assert held < 8 * MiB, f"{held / MiB:.1f} MiB still held after 3 refused requests"
    assert health(worker.target) == "SERVING"
