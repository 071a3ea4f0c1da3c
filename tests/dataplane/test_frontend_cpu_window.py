"""bench/frontend_cpu.py's CPU window (issue 15, session 9): each process's share of a core over
a window, which the T2 probe reads to say who saturates; a busy process reads near one core, a
sleeping one near none, and a child of this process that is neither the device process nor a
front end counts as a load process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_cpu_window_tells_a_busy_process_from_an_idle_one() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import frontend_cpu
    finally:
        sys.path.remove(str(BENCH))
    spin = "import time\nend = time.time() + 5\nwhile time.time() < end: pass"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    load = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)  # (the interpreters started)
        window = frontend_cpu.CpuWindow(busy.pid, [idle.pid], {busy.pid, idle.pid})
        window.start()
        t0 = time.perf_counter()
        time.sleep(1.0)
        got = window.shares(t0 + 0.1, time.perf_counter())
    finally:
        for p in (busy, idle, load):
            p.kill()
            p.wait()
    assert got["window_s"] > 0.5
    # (a shared 2-core CI machine may give each spinner a fraction of a core; the sleeper
    # takes none)
    assert got["device"] > 0.1 and got["fronts"][0] < 0.02, got
    assert len(got["load"]) == 1 and got["load"][0] > 0.1, got
    assert 0.2 < got["machine_busy_cores"] <= (os.cpu_count() or 1) + 0.01, got
    assert frontend_cpu.cpu_line(got).startswith("cpu (cores, ")


def test_each_front_ends_connections_and_bytes_sent_are_counted() -> None:
    """The T2 probe's view of SO_REUSEPORT's spread: the established connections a process
    accepted on the port (its own outgoing ones are not counted), the bytes sent on each
    (`ss`), and the line that turns them into calls a second and Little's-law times."""
    import shutil
    import socket

    sys.path.insert(0, str(BENCH))
    try:
        import frontend_cpu
    finally:
        sys.path.remove(str(BENCH))
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    accepted = [srv.accept()[0] for _ in clients]
    try:
        me = os.getpid()
        got = frontend_cpu.front_sockets(port, [me])
        assert len(got[me]) == 3, got
        sent = frontend_cpu.bytes_sent(port)
        accepted[0].sendall(b"x" * 5000)
        clients[0].recv(8192)
        later = frontend_cpu.bytes_sent(port)
        if shutil.which("ss"):
            assert set(later) <= got[me], (later, got)  # (`ss` leaves out "bytes_sent:0")
            assert sum(later.values()) - sum(sent.values()) == 5000, (sent, later)
        line = frontend_cpu.per_front_line(
            {"per_front": {me: {"cores": 0.5, "conns": 3, "bytes_out_per_s": 2000.0}}},
            reply_bytes=100.0)
        assert line == "per front end: 3 conns 0.50 cores ~20/s 150.00 ms", line
    finally:
        for s in (*clients, *accepted, srv):
            s.close()
