"""A MatmulStream whose client never reads its replies stalls only itself (issue 18, item 1).

The stream's window (slots and bytes) is held by a request until its reply has been written
to the transport, so a client that stops reading stops the stream from taking more requests:
the worker computes at most a window's worth of replies for it, and other callers are served.
Runs on the backend under test (Q6SERVE_TEST_BACKEND=cuda on a GPU machine).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from q6serve.client.client import matmul_request
from q6serve.service.config import Budget, WorkerConfig
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc
from tests.reliability.harness import RunningWorker, health, random_q6k, vram_figures
from tests.service.svc_util import InstrumentedBackend, assert_close, reference, wait_until

ROWS, K = 4096, 256
N = 64
REPLY = N * ROWS * 4  # 1 MiB of f32 per reply
WINDOW = 4 * REPLY
SENT = 200
MAX_COMPUTED = 16
STREAMS = 12


def prepare(c, rng, seed: int) -> tuple[np.ndarray, dict[str, int], np.ndarray]:
    """The weight "w" uploaded: (its blocks, the figures before, an x for N-row requests)."""
    blocks = random_q6k(ROWS, K, seed)
    c.upload("w", blocks, ROWS, K)
    return blocks, vram_figures(c), rng.standard_normal((N, K)).astype(np.float32)


def sent(x: np.ndarray) -> Iterator[object]:
    """SENT requests of ``x`` on "w"."""
    for i in range(SENT):
        yield matmul_request("w", x, "auto", "f32", str(i))


@pytest.fixture
def worker() -> Iterator[tuple[RunningWorker, InstrumentedBackend]]:
    backend = InstrumentedBackend()
    rw = RunningWorker(WorkerConfig(port=0, vram_budget=Budget(nbytes=256 << 20),
                                    max_stream_bytes=WINDOW, max_batch_delay_us=0),
                       backend)
    yield rw, backend
    rw.stop()


def test_a_client_that_never_reads_stalls_only_itself(worker, rng):
    rw, backend = worker
    c = rw.client()
    blocks, before, x = prepare(c, rng, 7)

    with grpc.insecure_channel(rw.target) as ch:
        # a plain stub: the call is started but its replies are never read
        call = pb_grpc.Q6ServeStub(ch).MatmulStream(sent(x), timeout=60)
        wait_until(lambda: len(backend.launches) >= 1, what="the first launch")
        # give an unbounded server every chance to run ahead (it did: 4 GB in 20 s)
        time.sleep(1.0)
        computed = sum(backend.launches) // N
        # The window (4 replies) plus what HTTP/2 lets through to the client's receive
        # buffers (typically 2 more; the client's window can grow by BDP probing) -- far
        # from all 200 (the unbounded server computed them all, 4 GB in the run).
        assert computed <= MAX_COMPUTED, f"{computed} requests computed for a stream that " \
            f"read nothing (window {WINDOW // REPLY})"

        # other callers are served meanwhile, with right answers
        y = c.matmul("w", x[:3])
        assert_close(y, reference(blocks, ROWS, K, x[:3]))
        assert health(rw.target) == "SERVING"
        call.cancel()
    wait_until(lambda: c.get("w").in_flight == 0, what="the stalled stream's work to end")
    assert vram_figures(c) == before
    # the stream's requests did not queue on: launches stopped with the stream
    assert sum(backend.launches) <= MAX_COMPUTED * N + 3


def test_a_reading_client_gets_every_reply_through_a_small_window(worker, rng):
    """The window throttles, it never drops: 40 requests of 4x the window's byte share each
    all come back, exact."""
    rw, _ = worker
    c = rw.client()
    blocks = random_q6k(ROWS, K, 8)
    c.upload("w", blocks, ROWS, K)
    xs = {str(i): rng.standard_normal((N, K)).astype(np.float32) for i in range(40)}
    got = {}
    for out in c.matmul_stream((rid, "w", x) for rid, x in xs.items()):
        got[out.request_id] = out.y
    assert set(got) == set(xs)
    for rid, x in xs.items():
        assert_close(got[rid], reference(blocks, ROWS, K, x))


def test_many_streams_that_never_read_hold_a_bounded_total(rng):
    """Streams of one connection share its budget (here 4 replies' worth): twelve
    non-reading streams together get the budget plus what the transport takes per stream
    (~2 replies each, typically 28 in all) computed, not 12 windows (72); a stream on another
    connection is still served. The client's HTTP/2 windows stay at their start size (no BDP
    probing): what the transport takes is the client's to grow, and on the H200 a fast backend
    let grpc's probe grow them to ~6 replies a stream (78 computed), which is gRPC's buffer
    for that client, not the worker's budget."""
    backend = InstrumentedBackend()
    rw = RunningWorker(WorkerConfig(port=0, vram_budget=Budget(nbytes=256 << 20),
                                    max_stream_bytes=WINDOW,
                                    max_stream_bytes_per_connection=WINDOW,
                                    max_batch_delay_us=0), backend)
    try:
        c = rw.client()
        blocks = random_q6k(ROWS, K, 9)
        c.upload("w", blocks, ROWS, K)
        x = rng.standard_normal((N, K)).astype(np.float32)

        def requests() -> Iterator[object]:
            for i in range(50):
                yield matmul_request("w", x, "auto", "f32", str(i))

        with grpc.insecure_channel(rw.target, options=[("grpc.http2.bdp_probe", 0)]) as ch:
            stub = pb_grpc.Q6ServeStub(ch)
            calls = [stub.MatmulStream(requests(), timeout=60) for _ in range(STREAMS)]
            wait_until(lambda: len(backend.launches) >= 1, what="the first launch")
            time.sleep(1.0)
            computed = sum(backend.launches) // N
            assert computed <= 4 + 3 * STREAMS, f"{computed} requests computed for " \
                f"{STREAMS} streams that read nothing (budget: {WINDOW // REPLY} replies for " \
                "the connection, plus what the transport takes per stream)"
            # another connection's stream gets its replies meanwhile
            outs = list(c.matmul_stream([("a", "w", x[:2]), ("b", "w", x[2:4])]))
            assert sorted(o.request_id for o in outs) == ["a", "b"]
            assert_close(outs[0].y, reference(blocks, ROWS, K, x[:2] if outs[0].request_id
                                              == "a" else x[2:4]))
            for call in calls:
                call.cancel()
        wait_until(lambda: rw.worker.stream_budget.used == 0, what="the budget to empty")
        assert health(rw.target) == "SERVING"
    finally:
        rw.stop()


def test_a_stream_that_never_reads_does_not_hold_the_others_budget(rng):
    """The worker-wide stream budget here is one window: one MatmulStream that never reads
    fills it with replies it does not take. Another connection's streams must not wait on it
    (they waited for ever: the budget was only given back by writes): the stalled stream is
    cancelled once its write has been blocked for ``admission.STALL_S`` while a connection
    below its fair share waits, and every clean call is answered promptly."""
    backend = InstrumentedBackend()
    rw = RunningWorker(WorkerConfig(port=0, vram_budget=Budget(nbytes=256 << 20),
                                    max_stream_bytes=WINDOW,
                                    max_stream_bytes_per_connection=WINDOW,
                                    max_stream_bytes_total=WINDOW, max_batch_delay_us=0),
                       backend)
    try:
        c = rw.client()
        blocks, before, x = prepare(c, rng, 10)
        budget = rw.worker.stream_budget
        with grpc.insecure_channel(rw.target) as ch:
            # (its deadline bounds how long gRPC keeps the call once the worker drops it)
            call = pb_grpc.Q6ServeStub(ch).MatmulStream(sent(x), timeout=8)
            # it holds the whole budget with replies nobody takes
            wait_until(lambda: rw.run(lambda: budget.used) >= WINDOW - REPLY, timeout=30,
                       what="the non-reader to fill the budget")
            took = []
            for i in range(8):  # a reply as big as the non-reader's: it needs the budget
                t0 = time.perf_counter()
                outs = list(c.matmul_stream([(str(i), "w", x)], timeout=20))
                took.append(time.perf_counter() - t0)
                assert_close(outs[0].y, reference(blocks, ROWS, K, x))
            # bounded for a loaded 2-core CI machine; before, the first call waited for the
            # non-reader's deadline (for ever without one)
            assert max(took) < 3.0, [round(t, 3) for t in took]
            assert sorted(took)[len(took) // 2] < 1.0, [round(t, 3) for t in took]
            assert rw.run(lambda: budget.dropped) >= 1
            # what the stalled stream held stays charged to its connection, not the total
            assert rw.run(lambda: sum(budget.lingering.values())) > 0
            call.cancel()
        wait_until(lambda: rw.run(lambda: (budget.used, budget.lingering)) == (0, {}),
                   timeout=20, what="the budget to empty")
        assert vram_figures(c) == before
        assert health(rw.target) == "SERVING"
    finally:
        rw.stop()
