"""What an attack's calls held goes back when they end (issue 18: RSS returns to where it was).

Three leaks of *time*, not of memory, kept RSS 150-290 MiB up after attacks although every
accounted figure was back (docs/RELIABILITY.md, "RSS after an attack"): a MatmulStream its
client stopped reading kept its computed replies in its queue until the cyclic GC happened to
collect the abandoned handler; those frames' cycles waited for that GC too; and glibc served
big transient buffers from its heap arenas once the largest freed block had raised its mmap
threshold. Now the replies are let go when the call ends, the cycles are collected at the
next heap trim, and blocks of MMAP_THRESHOLD bytes and more always get their own mapping
(smaller ones come from the heap, whose free pages the trim loop hands back).
"""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from q6serve.client.client import matmul_request
from q6serve.service import gcfreeze, heap
from q6serve.service.config import Budget, WorkerConfig
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc
from tests.reliability.harness import RunningWorker, random_q6k
from tests.service.svc_util import wait_until

K, ROWS, N = 256, 4096, 64
REPLY = N * ROWS * 4  # 1 MiB
STREAMS, SENT = 4, 40


def test_non_reading_streams_let_their_replies_go_when_cancelled():
    rw = RunningWorker(WorkerConfig(port=0, vram_budget=Budget(nbytes=64 << 20),
                                    max_stream_bytes=16 * REPLY, max_batch_delay_us=0))
    c = rw.client()
    c.upload("w", random_q6k(ROWS, K, 3), ROWS, K)
    req = matmul_request("w", np.ones((N, K), np.float32))

    def requests() -> Iterator[object]:
        for _ in range(SENT):
            yield req

    x = np.ones((N, K), np.float32)
    list(c.matmul_stream([(str(i), "w", x) for i in range(4)]))  # the backend's workspaces
    gc.collect()
    gc.disable()  # what is let go must go by reference counts
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        chans = [grpc.insecure_channel(rw.target, options=[("grpc.use_local_subchannel_pool",
                                                            1)]) for _ in range(STREAMS)]
        calls = [pb_grpc.Q6ServeStub(ch).MatmulStream(requests()) for ch in chans]
        # each stream's window fills with replies nobody reads
        wait_until(lambda: tracemalloc.get_traced_memory()[0] - base > STREAMS * 8 * REPLY,
                   what="the streams' replies to pile up", timeout=30)
        for call in calls:
            call.cancel()
        for ch in chans:
            ch.close()
        wait_until(lambda: rw.worker.stream_budget.used == 0 and c.get("w").in_flight == 0,
                   what="the streams to end")
        time.sleep(0.2)
        held = tracemalloc.get_traced_memory()[0] - base
        # before: every queued reply (16 a stream) stayed until a collection
        assert held < STREAMS * 4 * REPLY, f"{held / REPLY:.1f} replies held after the cancel"
        # what the abandoned frames still hold in cycles goes at the next heap trim
        assert gcfreeze.collect_if_asked() > 0
        held = tracemalloc.get_traced_memory()[0] - base
        assert held < 2 * REPLY, f"{held / REPLY:.1f} replies held after the collection"
        assert gcfreeze.collect_if_asked() == 0  # asked once, collected once
    finally:
        tracemalloc.stop()
        gc.enable()
        rw.stop()


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


def mmapped_bytes() -> int | None:
    """glibc's bytes in blocks it mapped on their own (mallinfo2's hblkhd); None without it.
    (Counting 2 MiB lines of /proc/self/maps missed them where the kernel merged the new
    mapping with an adjacent one.)"""
    try:
        f = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    f.restype = _Mallinfo2
    return int(f().hblkhd)


CHECK_MAPPING = """
import sys, time
import numpy as np
import pytest
from q6serve.service import engine
from q6serve.service.config import Budget, WorkerConfig
from tests.reliability.harness import RunningWorker
from tests.reliability.test_rss_after_attacks import mmapped_bytes
from tests.service.svc_util import wait_until

rw = RunningWorker(WorkerConfig(port=0, vram_budget=Budget(nbytes=16 << 20)))
wait_until(lambda: rw.worker.engine._trimmer is not None, what="the trimmer")
time.sleep(0.1)  # the trimmer's first step sets the threshold
size = int(sys.argv[1])
big = np.ones(2 * size, np.uint8)  # freed: raises glibc's default threshold above size
del big
before = mmapped_bytes()
block = np.ones(size - 64, np.uint8)
during = mmapped_bytes()
del block
after = mmapped_bytes()
rw.stop()
print(during - before, during - after)
"""


def _check_mapping(size: int, threshold: str | None) -> tuple[int, int]:
    """In a fresh worker process: how many bytes a block of ``size`` (allocated after a block
    twice as big was freed) mapped on its own, and how many its free unmapped."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    env.pop(heap.MMAP_ENV, None)
    if threshold is not None:
        env[heap.MMAP_ENV] = threshold
    out = subprocess.run([sys.executable, "-c", CHECK_MAPPING, str(size)], cwd=root,
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    mapped, unmapped = (int(v) for v in out.stdout.split()[-2:])
    return mapped, unmapped


def test_big_transient_buffers_get_their_own_mapping():
    """Once a worker runs, a block of MMAP_THRESHOLD bytes or more is mapped on its own (and
    unmapped when freed) even after a bigger block was freed, which moves glibc's default
    threshold above it; a smaller one comes from the heap (no fresh mapping to fault in each
    time; the trim loop hands its free pages back). Q6SERVE_MMAP_THRESHOLD sets the bound. In
    a fresh process: the threshold only decides how the heap *grows*, and a long test session
    has free heap chunks big enough to serve the block without growing."""
    if heap._mallopt is None or mmapped_bytes() is None:
        return  # not glibc (>= 2.33 for mallinfo2): nothing to check
    for size, threshold, own in ((heap.MMAP_THRESHOLD + (1 << 20), None, True),
                                 (2 << 20, None, False),
                                 (2 << 20, str(1 << 20), True)):
        mapped, unmapped = _check_mapping(size, threshold)
        block = size - 64
        if own:
            assert mapped >= block, f"a {size}-byte block came from the heap ({threshold})"
            assert unmapped >= block, f"freeing a {size}-byte block did not unmap it"
        else:
            assert mapped < block and unmapped < block, f"a {size}-byte block was mapped"


def test_the_mmap_threshold_from_the_env(monkeypatch):
    monkeypatch.setenv(heap.MMAP_ENV, "lots")
    with pytest.raises(ValueError, match=r"Q6SERVE_MMAP_THRESHOLD='lots': give .* bytes"):
        heap.mmap_threshold()
    monkeypatch.setenv(heap.MMAP_ENV, "-1")
    with pytest.raises(ValueError, match=r"Q6SERVE_MMAP_THRESHOLD='-1'.* 0 or more"):
        heap.mmap_threshold()
    monkeypatch.setenv(heap.MMAP_ENV, "0")
    assert heap.mmap_threshold() == 0  # glibc's own
    monkeypatch.delenv(heap.MMAP_ENV)
    assert heap.mmap_threshold() == heap.MMAP_THRESHOLD
