"""service/reuseport.py (Q6SERVE_FRONTEND_ROUND_ROBIN): an eBPF SK_REUSEPORT program deals the
connections to a port's SO_REUSEPORT listeners in turn; a listener's slot that is empty leaves
the choice to the kernel's hash. In one process here (four listeners on one port); the worker's
front ends are tests/dataplane/test_frontends.py's. Skipped where the kernel refuses the
program (no CAP_BPF / CAP_NET_ADMIN, or unprivileged BPF off)."""

from __future__ import annotations

import collections
import socket
from collections.abc import Iterator

import pytest

from q6serve.service import reuseport


@pytest.fixture
def steering() -> Iterator[reuseport.Steering]:
    got = reuseport.make(4)
    if got is None:
        pytest.skip("this kernel or these privileges refuse an SK_REUSEPORT eBPF program")
    yield got
    got.close()


def _listeners(n: int) -> tuple[list[socket.socket], int]:
    out, port = [], 0
    for _ in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", port))
        port = s.getsockname()[1]
        s.listen(64)
        s.setblocking(False)
        out.append(s)
    return out, port


def _accepted(listeners: list[socket.socket]) -> collections.Counter[int]:
    got: collections.Counter[int] = collections.Counter()
    for i, s in enumerate(listeners):
        while True:
            try:
                s.accept()[0].close()
            except BlockingIOError:
                break
            got[i] += 1
    return got


def test_connections_are_dealt_in_turn(steering: reuseport.Steering) -> None:
    listeners, port = _listeners(4)
    try:
        for i, s in enumerate(listeners):
            assert reuseport.join(steering.fds, i, port, s.fileno())
        conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]
        got = _accepted(listeners)
        assert got == {0: 4, 1: 4, 2: 4, 3: 4}, got
        assert steering.count() == 16
        for c in conns:
            c.close()
    finally:
        for s in listeners:
            s.close()


def test_an_empty_slot_leaves_the_kernels_hash(steering: reuseport.Steering) -> None:
    """Only listeners 0 and 1 joined: the connections dealt to slots 2 and 3 go where the
    kernel's hash puts them (any of the four), none is refused."""
    listeners, port = _listeners(4)
    try:
        for i in (0, 1):
            assert reuseport.join(steering.fds, i, port, listeners[i].fileno())
        conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]
        got = _accepted(listeners)
        assert sum(got.values()) == 16 and got[0] >= 4 and got[1] >= 4, got
        for c in conns:
            c.close()
    finally:
        for s in listeners:
            s.close()


def test_a_process_finds_its_listener_by_port() -> None:
    listeners, port = _listeners(1)
    other = socket.create_connection(("127.0.0.1", port))
    try:
        fd = reuseport.listener(port)
        assert fd is not None and fd == listeners[0].fileno()
        assert reuseport.listener(1) is None
    finally:
        other.close()
        listeners[0].close()
