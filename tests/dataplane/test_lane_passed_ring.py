"""The lane's ring passed with its setup record (SCM_RIGHTS on the lane's AF_UNIX socket, setup
name "fd") instead of named as "fd:N" for the worker to open through /proc/<pid>/fd/N: the
caller closes its descriptor before the worker answers (so a worker that looked the
descriptor up in /proc, or a caller in another pid namespace, gets nothing: the ring must come
with the record); every check of a ring holds for a passed one (a plain memfd of this user,
sealed against shrinking, RING_BYTES long, mapped read-write, one lane per block); nothing
passed is kept (the worker's descriptors back where they started)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from q6serve.client.lane import REPLY, REQUEST, RING_BYTES, RING_SETUP, ring_memfd
from q6serve.service import lane as slane
from tests.dataplane.test_lane_hostile import K, Worker, _memfd, _socket_lane

pytestmark = pytest.mark.skipif(not slane.ORDERED_STORES, reason="ring lanes: x86-64 only")


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker()
    try:
        yield w
    finally:
        w.stop()


def _passed(lane: object, fds: list[int], close: bool = False) -> tuple[int, str]:
    """A setup record named "fd" with ``fds`` passed (closed here before the answer is read
    when ``close``): the reply's (code, message)."""
    rec = REQUEST.pack(0, 0, 0, 0, 0, 0, 0, 0, RING_SETUP, 2, 0) + b"fd"
    assert socket.send_fds(lane.sock, [rec], fds) == len(rec)  # type: ignore[attr-defined]
    if close:
        for fd in fds:
            os.close(fd)
    lane._read_into(lane._head)  # type: ignore[attr-defined]
    _, code, msg_len, *_ = REPLY.unpack(lane._head)  # type: ignore[attr-defined]
    return code, lane._read(msg_len).decode() if msg_len else ""  # type: ignore[attr-defined]


def _fds(pid: int) -> int:
    """The worker's descriptors once its lanes closed are let go (two looks 0.2 s apart agree)."""
    n = -1
    for _ in range(50):
        time.sleep(0.2)
        n, last = len(os.listdir(f"/proc/{pid}/fd")), n
        if n == last:
            break
    return n


def test_a_ring_passed_and_closed_before_the_answer_serves(worker: Worker) -> None:
    c = worker.client
    x = np.ones((1, K), np.float32)
    want = c.matmul("w", x)
    with c.register_shm("io", 1 << 16) as region:
        # the client's own lane: its memfd closed right after the send
        with c.open_lane(region) as lane:
            assert lane.ring
            np.testing.assert_array_equal(lane.matmul("w", x), want)
        # by hand: closed before the worker reads the record (a /proc look-up finds nothing)
        with _socket_lane(c, region) as lane:
            assert _passed(lane, [ring_memfd()], close=True) == (0, "")
    assert worker.alive()


def test_bad_passed_rings_are_refused_and_nothing_is_kept(worker: Worker) -> None:
    c = worker.client
    x = np.ones((1, K), np.float32)
    want = c.matmul("w", x)
    rd, wr = os.pipe()
    sealed = ring_memfd()
    ro = os.open(f"/proc/self/fd/{sealed}", os.O_RDONLY)
    cases = [([], 3, "no descriptor came"),
             ([rd], 3, "no memfd"),  # a pipe
             ([_memfd(RING_BYTES, 0)], 3, "sealed against shrinking"),
             ([_memfd(RING_BYTES, fcntl.F_SEAL_GROW)], 3, "sealed against shrinking"),
             ([_memfd(2 * RING_BYTES, fcntl.F_SEAL_SHRINK)], 3, "must be 2048 bytes"),
             ([ro], 9, "read-write")]  # FAILED_PRECONDITION
    try:
        with c.register_shm("io", 1 << 16) as region:
            with _socket_lane(c, region) as lane:  # (the worker's lanes started, one open)
                pass
            base = _fds(worker.proc.pid)
            for fds, code, words in cases:
                with _socket_lane(c, region) as lane:
                    got = _passed(lane, fds)
                    assert got[0] == code and words in got[1], (fds, got)
                    np.testing.assert_array_equal(lane.matmul("w", x), want)  # the lane serves
            # two passed: the first is the ring, the other closed (the kernel's, beyond one)
            two = [ring_memfd(), ring_memfd()]
            with _socket_lane(c, region) as one, _socket_lane(c, region) as other:
                assert _passed(one, two) == (0, "")
                # the same block passed by a second lane: refused (one lane per block)
                got = _passed(other, [two[0]])
                assert got[0] == 3 and "another lane" in got[1], got
            for fd in two:
                os.close(fd)
            # a descriptor passed with a later record (not the first after the ticket): not
            # taken, the setup refused
            with _socket_lane(c, region) as lane:
                np.testing.assert_array_equal(lane.matmul("w", x), want)
                fd = ring_memfd()
                got = _passed(lane, [fd], close=True)
                assert got[0] == 3 and "no descriptor came" in got[1], got
            assert _fds(worker.proc.pid) == base, (base, os.listdir(f"/proc/{worker.proc.pid}/fd"))
    finally:
        for fd in (rd, wr, sealed, ro, *[f for fds, _, _ in cases for f in fds
                                         if f not in (rd, ro)]):
            with contextlib.suppress(OSError):
                os.close(fd)
    assert worker.alive()
