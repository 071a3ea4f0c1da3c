"""The fast lane's caller spin (client/lane.py): a reply that arrives while the caller polls is
read there, one that arrives after the spin is read by the blocking recv, a reply that never
comes ends in the lane's timeout (UNAVAILABLE), a reply split across the spin's end is read
whole; the default follows the core count (the worker's busy-polling rule) and the env; and
the worker's direct path for a lone lane request (service/lane.py: Engine.run_now in the trip
that read it) answers as before."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from q6serve.client import core
from q6serve.client.client import Q6ServeError
from q6serve.client.lane import ACCEPTED, REPLY, REQUEST, Lane, lane_spin_us
from q6serve.client.shm import ShmRegion
from tests.dataplane.tol import assert_ref
from tests.service.svc_util import RunningWorker, random_q6k, reference

ROWS, K = 8, 256


@pytest.fixture(autouse=True)
def socket_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The socket lane's spin (FakeWorker answers on the socket only): no ring asked for (the
    ring's own wait is test_lane_ring.py's)."""
    monkeypatch.setenv("Q6SERVE_LANE_RING", "0")


class FakeWorker:
    """A lane socket answering each request after ``delay_s`` (None: never), optionally in two
    pieces ``split_s`` apart; y is written into the region as ones before the reply."""

    def __init__(self, tmp: Path, region: ShmRegion, delay_s: float | None,
                 split_s: float = 0.0) -> None:
        self.path = str(tmp / "lane.sock")
        self.region, self.delay_s, self.split_s = region, delay_s, split_s
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(self.path)
        self.srv.listen(1)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _recv(self, conn: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            got = conn.recv(n - len(buf))
            if not got:
                raise ConnectionError
            buf += got
        return buf

    def _serve(self) -> None:
        conn, _ = self.srv.accept()
        with conn:
            try:
                self._recv(conn, 32)  # the ticket
                conn.sendall(ACCEPTED)
                while True:
                    head = REQUEST.unpack(self._recv(conn, REQUEST.size))
                    seq, n, _k, _x_off, y_off = head[:5]
                    self._recv(conn, head[9])
                    if self.delay_s is None:
                        continue
                    time.sleep(self.delay_s)
                    self.region.ndarray(y_off, np.float32, (n, ROWS))[...] = 1.0
                    rec = REPLY.pack(seq, 0, 0, ROWS, n, 1, 0, 0.0, 1e-5, 2e-5)
                    if self.split_s:
                        conn.sendall(rec[:10])
                        time.sleep(self.split_s)
                        conn.sendall(rec[10:])
                    else:
                        conn.sendall(rec)
            except (ConnectionError, OSError):
                pass

    def close(self) -> None:
        self.srv.close()


@pytest.fixture
def region() -> Iterator[ShmRegion]:
    r = ShmRegion.create("io", 1 << 16)
    try:
        yield r
    finally:
        r.close()


def lane_to(fake: FakeWorker, region: ShmRegion, **kw: Any) -> Lane:
    return Lane(region, fake.path, b"t" * 32, **kw)


def call(lane: Lane) -> np.ndarray:
    return lane.matmul("w", np.ones((1, K), np.float32))


def test_reply_during_the_spin(tmp_path: Path, region: ShmRegion) -> None:
    fake = FakeWorker(tmp_path, region, delay_s=0.002)
    with lane_to(fake, region, spin_us=2_000_000) as lane:  # spins far beyond the reply
        for _ in range(3):
            y = call(lane)
            assert y.shape == (1, ROWS) and (y == 1.0).all()
        assert (lane.spun, lane.slept) == (3, 0)
        assert lane.last is not None and lane.last.device_seconds == 2e-5
    fake.close()


def test_reply_after_the_spin(tmp_path: Path, region: ShmRegion) -> None:
    fake = FakeWorker(tmp_path, region, delay_s=0.05)
    with lane_to(fake, region, spin_us=200) as lane:  # gives up polling long before it
        t0 = time.perf_counter()
        assert (call(lane) == 1.0).all()
        assert time.perf_counter() - t0 >= 0.05
        assert (lane.spun, lane.slept) == (0, 1)
    fake.close()
    (tmp_path / "b").mkdir()
    fake = FakeWorker(tmp_path / "b", region, delay_s=0.0)
    with lane_to(fake, region, spin_us=0) as lane:  # no spin: straight to recv
        assert (call(lane) == 1.0).all()
        assert (lane.spun, lane.slept) == (0, 1)
    fake.close()


def test_reply_split_across_the_spins_end(tmp_path: Path, region: ShmRegion) -> None:
    """Part of the head read while spinning, the rest after it: one whole reply."""
    fake = FakeWorker(tmp_path, region, delay_s=0.0, split_s=0.05)
    with lane_to(fake, region, spin_us=5_000) as lane:
        for _ in range(2):
            assert (call(lane) == 1.0).all()
            assert lane._seq == REPLY.unpack(lane._head)[0]
        assert (lane.spun, lane.slept) == (0, 2)


def test_no_reply_times_out_after_the_spin(tmp_path: Path, region: ShmRegion) -> None:
    fake = FakeWorker(tmp_path, region, delay_s=None)
    with lane_to(fake, region, timeout=0.3, spin_us=1_000) as lane:
        t0 = time.perf_counter()
        with pytest.raises(Q6ServeError) as e:
            call(lane)
        took = time.perf_counter() - t0
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and "timed out" in e.value.message
        assert 0.3 <= took < 5.0
        assert (lane.spun, lane.slept) == (0, 1)


def test_a_lane_without_a_timeout_does_not_spin(tmp_path: Path, region: ShmRegion) -> None:
    fake = FakeWorker(tmp_path, region, delay_s=0.01)
    with lane_to(fake, region, timeout=None, spin_us=1_000_000) as lane:
        assert (call(lane) == 1.0).all()
        assert (lane.spun, lane.slept) == (0, 1)  # blocking socket: straight to recv


def test_the_default_spin(monkeypatch: pytest.MonkeyPatch) -> None:
    from q6serve.client import lane as lane_mod

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    assert lane_spin_us({}) == lane_mod.LANE_SPIN_US == 1000.0
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(7)))
    assert lane_spin_us({}) == 0.0  # fewer cores than the rule's: no spin
    monkeypatch.setenv("Q6SERVE_LANE_SPIN_US", "300")
    assert lane_spin_us() == 300.0
    assert lane_spin_us({"Q6SERVE_LANE_SPIN_US": " 250 "}) == 250.0
    assert lane_spin_us({"Q6SERVE_LANE_SPIN_US": "0"}) == 0.0
    for bad in ("soon", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match=r"^Q6SERVE_LANE_SPIN_US="):
            lane_spin_us({"Q6SERVE_LANE_SPIN_US": bad})


BASE = dict(host="127.0.0.1", port=0, grace_period_s=1.0, allow_shm=True)


def test_a_lone_lane_request_takes_the_direct_path(rng: np.random.Generator,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """On an idle device, once a like job has run (its cost known), a lane request runs on the
    direct path in the trip that read it; y and the refusals are as before; its region is let
    go; batches with other callers still form under load (the pipelined records below)."""
    from q6serve.service import batcher
    from q6serve.service.config import Budget, WorkerConfig

    # NumPy's "kernel" is the whole job (~1 ms on the VM): not one to defer to the thread
    monkeypatch.setattr(batcher, "DEFER_KERNEL_S", 1.0)

    # and every NumPy job counts as short: on a loaded machine one took more than the default
    # 3 ms once, and a long job is (rightly) not run on the direct path (5 direct jobs of 8)
    cfg = WorkerConfig(vram_budget=Budget(nbytes=64 << 20), inline_device_us=10_000_000,
                       **BASE)  # type: ignore[arg-type]
    w = RunningWorker(cfg)
    try:
        c = w.client()
        blocks = random_q6k(ROWS, K, 7)
        c.upload("w", blocks, ROWS, K)
        x = rng.standard_normal((2, K)).astype(np.float32)
        with c.register_shm("io", 1 << 16) as region, c.open_lane(region) as lane:
            dev = w.worker.engine.device  # direct_jobs: jobs run by Engine.run_now
            for spin in (0.0, 1e6):
                lane.spin_us = spin
                for _ in range(4):
                    assert_ref(lane.matmul("w", x), reference(blocks, ROWS, K, x))
            assert dev.direct_jobs >= 6 and lane.spun >= 4
            assert lane.last is not None and lane.last.batch_requests == 1
            with pytest.raises(Q6ServeError) as e:
                lane.matmul("w", np.ones((1, 128), np.float32))
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "K=128" in e.value.message
            assert w.call(_users(w)) == [0]
            # pipelined records of one lane: not run one by one, they batch
            now = dev.direct_jobs
            f32 = core._DTYPE_TO_PB["f32"]
            region.ndarray(0, np.float32, x.shape)[...] = x
            lane.sock.sendall(b"".join(REQUEST.pack(s, 2, K, 0, 8192, f32, f32, 0, 0, 1, 0)
                                       + b"w" for s in range(100, 108)))
            rows = []
            for _ in range(8):
                lane._read_into(lane._head)
                rows.append(REPLY.unpack(lane._head)[4])
            assert dev.direct_jobs - now <= 1 and max(rows) > 2  # (at most one ran alone)
            assert w.call(_users(w)) == [0]
    finally:
        w.stop()


async def _users(w: Any) -> list[int]:
    return [r.users for r in w.worker.regions._regions.values()]



def test_lane_latency_bench_breaks_a_round_trip_down(tmp_path: Path) -> None:
    """bench/lane_latency.py --stamps --check in a tiny configuration: per spin a run whose
    stages come from both processes' stamps (each call's seven parts, all present), y checked
    against the NumPy reference."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "lane.json"
    r = subprocess.run([sys.executable, str(root / "bench/lane_latency.py"), "--backend",
                        "numpy", "--rows", "64", "--k", "512", "--paths", "lane", "--spins",
                        "0,300", "--stamps", "--check", "--seconds", "0.3", "--warmup", "0.05",
                        "--json", str(out)], capture_output=True, text=True, timeout=120,
                       cwd=root / "bench")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())["results"]
    for name in ("lane spin 0", "lane spin 300"):
        got = res[name]
        assert got["calls"] > 0 and got["stamped_calls"] == got["calls"]
        parts = got["parts_p50_us"]
        assert set(parts) == {"client_pre", "up", "pre_job", "job", "post_job", "down",
                              "client_post"}
        assert all(np.isfinite(v) for v in parts.values()) and parts["job"] > 0
        assert got["check"]["ok"] and got["spin_us"] == float(name.split()[-1])
        assert got["spun"] + got["slept"] >= got["calls"]


def test_lane_latency_bench_stamps_the_ring_and_the_socket(tmp_path: Path) -> None:
    """bench/lane_latency.py --rings sock,ring --stamps: both lanes' calls stamped on both
    sides (the ring's by its publication and its wait, the worker's ring take), the parts all
    there for every call, the slowest 1%'s parts, the wake-ups per call, y checked."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "lane.json"
    r = subprocess.run([sys.executable, str(root / "bench/lane_latency.py"), "--backend",
                        "numpy", "--rows", "64", "--k", "512", "--paths", "lane", "--rings",
                        "sock,ring", "--stamps", "--check", "--seconds", "0.3", "--warmup",
                        "0.05", "--json", str(out)], capture_output=True, text=True,
                       timeout=120, cwd=root / "bench")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())["results"]
    for name in ("lane sock #1", "lane ring #1"):
        got = res[name]
        assert got["calls"] > 0 and got["stamped_calls"] == got["calls"], (name, got)
        for key in ("parts_p50_us", "parts_slow1_mean_us"):
            assert all(np.isfinite(v) for v in got[key].values()), (name, key, got[key])
        assert got["parts_p50_us"]["job"] > 0 and got["check"]["ok"]
        assert got["caller_switches_per_call"][0] >= 0 and got["p999_us"] >= got["p99_us"]
