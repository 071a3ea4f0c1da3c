"""Random and mutated raw messages to every Q6Serve method through two front-end processes,
with shared-memory regions allowed (tests/reliability/test_request_corpus.py covers the
one-process worker with built messages): every call ends with a defined status, never
UNKNOWN or INTERNAL, and afterwards the worker still serves, a region unlinked under it is
FAILED_PRECONDITION with its name, and its accounting is back where it started.

Mutations start from valid messages (a matmul with bytes, one through a region, a region's
registration), so most of them parse and reach the checks behind the decoder."""

from __future__ import annotations

import hashlib
import random
import time
from collections import Counter
from collections.abc import Callable
from multiprocessing import shared_memory

import grpc
import numpy as np

from q6serve.kernels import q6k
from q6serve.v1 import q6serve_pb2 as pb
from tests.dataplane.test_frontends import Running, start  # noqa: F401  (fixture)
from tests.reliability.harness import health, vram_figures

SVC = "/q6serve.v1.Q6Serve/"
UNARY = ("LoadWeights", "ListWeights", "GetWeight", "UnloadWeight", "Matmul", "GetStatus",
         "SetFlags", "RegisterRegion", "UnregisterRegion", "ListRegions", "OpenLane")
SECONDS = 4.0
C = grpc.StatusCode
UNDEFINED = {C.UNKNOWN, C.INTERNAL, C.UNAVAILABLE, C.DEADLINE_EXCEEDED, C.DATA_LOSS}


def _raw(b: bytes) -> bytes:
    return b


def _mutate(rng: random.Random, b: bytes) -> bytes:
    out = bytearray(b)
    for _ in range(rng.randint(1, 8)):
        op, at = rng.random(), rng.randrange(len(out) + 1)
        if op < 0.4 and out:
            out[min(at, len(out) - 1)] = rng.randrange(256)
        elif op < 0.6:
            out[at:at] = rng.randbytes(rng.randint(1, 20))
        elif op < 0.8 and out:
            del out[at : at + rng.randint(1, 50)]
        else:
            out += rng.randbytes(rng.randint(1, 40))
    return bytes(out)


def test_raw_messages_through_frontends_get_defined_statuses(
        start: Callable[..., Running]) -> None:  # noqa: F811
    r = start()
    ch = grpc.insecure_channel(r.target)
    unary = {m: ch.unary_unary(SVC + m, request_serializer=_raw, response_deserializer=_raw)
             for m in UNARY}
    stream = ch.stream_stream(SVC + "MatmulStream", request_serializer=_raw,
                              response_deserializer=_raw)
    upload = ch.stream_unary(SVC + "UploadWeight", request_serializer=_raw,
                             response_deserializer=_raw)
    client = r.client()
    before = vram_figures(client)

    data = q6k.random_blocks(8, 256, np.random.default_rng(0)).tobytes()
    header = pb.UploadWeightRequest(header=pb.UploadHeader(
        name="w", rows=8, k=256, total_bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest())).SerializeToString()
    chunk = pb.UploadWeightRequest(chunk=data).SerializeToString()
    shm = shared_memory.SharedMemory(create=True, size=1 << 16)
    try:
        register = pb.RegisterRegionRequest(name="r1", system=pb.SystemShm(
            key=shm.name, offset=0, byte_size=1 << 16)).SerializeToString()
        plain = pb.MatmulRequest(weight="w")
        plain.x.dtype, plain.x.data = pb.DTYPE_F16, np.ones(256, np.float16).tobytes()
        plain.x.shape.extend([1, 256])
        via = pb.MatmulRequest(weight="w")
        via.x.dtype = pb.DTYPE_F16
        via.x.shape.extend([1, 256])
        via.x_region.region, via.y_region.region, via.y_region.offset = "r1", "r1", 4096
        seeds = [plain.SerializeToString(), via.SerializeToString(), register]

        def setup() -> None:  # (again at the end: a mutation may unload or unregister them)
            for name, call in (("UnloadWeight", pb.UnloadWeightRequest(name="w")),
                               ("UnregisterRegion", pb.UnregisterRegionRequest(name="r1"))):
                try:
                    unary[name](call.SerializeToString(), timeout=10)
                except grpc.RpcError as e:
                    assert e.code() == C.NOT_FOUND, e
            upload(iter([header, chunk]), timeout=10)
            unary["RegisterRegion"](register, timeout=10)
            np.ndarray((1, 256), np.float16, buffer=shm.buf)[:] = 1
            unary["Matmul"](seeds[1], timeout=10)

        setup()
        rng = random.Random(1)
        seen: Counter[tuple[str, str]] = Counter()
        end = time.monotonic() + SECONDS
        calls = 0
        while time.monotonic() < end:
            calls += 1
            if calls % 200 == 0:
                setup()  # the weight and region back, so mutations reach the deeper checks
            seed = rng.randrange(len(seeds))
            if rng.random() < 0.5:  # a mutation sent where its seed belongs
                method = rng.choice(("Matmul", "MatmulStream")) if seed < 2 else "RegisterRegion"
            else:
                method = rng.choice((*UNARY, "MatmulStream", "UploadWeight"))
            payload = (_mutate(rng, seeds[seed]) if rng.random() < 0.8
                       else rng.randbytes(rng.randint(0, 200)))
            try:
                if method == "MatmulStream":
                    list(stream(iter([payload, seeds[1]]), timeout=10))
                elif method == "UploadWeight":
                    upload(iter([payload]), timeout=10)
                else:
                    unary[method](payload, timeout=10)
                seen[(method, "OK")] += 1
            except grpc.RpcError as e:
                assert e.code() not in UNDEFINED, (method, payload.hex(), e.code(), e.details())
                assert e.details(), (method, e.code())
                seen[(method, e.code().name)] += 1
        assert sum(seen.values()) > 100 and len({m for m, _ in seen}) == len(UNARY) + 2

        setup()  # still serving: a fresh upload, registration and region call work
        shm.close()
        shm.unlink()
        try:
            unary["Matmul"](seeds[1], timeout=10)
            raise AssertionError("a call on an unlinked region succeeded")
        except grpc.RpcError as e:
            assert e.code() == C.FAILED_PRECONDITION and "unlinked" in (e.details() or ""), e
        unary["UnregisterRegion"](pb.UnregisterRegionRequest(name="r1").SerializeToString(),
                                  timeout=10)
        unary["UnloadWeight"](pb.UnloadWeightRequest(name="w").SerializeToString(), timeout=10)
    finally:
        try:
            shm.close()
            shm.unlink()
        except FileNotFoundError:
            pass
        ch.close()
    assert health(r.target) == "SERVING"
    assert vram_figures(client) == before
