"""What the fast lane's socket costs a request, against a shared-memory ring (a probe for issue
15's next step; nothing here is in the product).

A lane request today is one socket write by the caller, the worker loop's busy poll seeing the
socket ready (epoll), asyncio's read callback (recv, ``data_received``), and one socket write
back that the caller's spin reads (client/lane.py, service/lane.py). A ring would put the
40-byte record and the 56-byte reply in the caller's shared memory, the worker polling it in
its spin and the caller spinning on the reply's sequence number: no syscall a request either
way while both sides spin. This probe answers the records with an echo (the reply packed at
once, no job) so that only the transport is measured, closed loop, ``--callers`` processes of
one call in flight each:

- ``socket``: an asyncio loop with the worker's busy-polling selector
  (``service.threads.busy_poll``), a unix-socket server whose protocol answers each record as
  service/lane.py's does (bytes into a buffer, records unpacked, the reply written); callers
  as client/lane.py's (one ``os.write``, ``os.readv`` spun until the reply is there).
- ``ring``: one shared-memory block, a 128-byte slot a caller (request seq at 0, record at 8,
  reply seq at 64, reply at 72); the server polls every slot's request seq in a Python loop
  (its spin), packs the reply and then its seq; callers write the record then its seq and spin
  on the reply seq. (x86's ordered stores make seq-last publication safe here; a product ring
  would also need a doorbell for a sleeping side.)

Printed per mode: requests/s (the server is the one serial part: with enough callers its
rate is 1 / its cost a request), the server thread's CPU per request (``thread_time``; it
spins, so at saturation this is its cost a request), and the callers' round trip p50.

    python bench/lane_ring_probe.py --callers 1 --seconds 2     # round trip (latency)
    python bench/lane_ring_probe.py --callers 8 --seconds 2     # the server's rate (H200)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import struct
import sys
import tempfile
import time
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

REQUEST = struct.Struct("<QIIQQBBBBHH")  # service/lane.py's record
REPLY = struct.Struct("<QIIIIIIddd")
SEQ = struct.Struct("<Q")
SLOT = 128  # ring: request seq 0, record 8, reply seq 64, reply 72
REC_AT, RSEQ_AT, REP_AT = 8, 64, 72


def _record(seq: int) -> bytes:
    return REQUEST.pack(seq, 1, 18944, 0, 1 << 21, 1, 0, 0, 0, 1, 0) + b"w"


# -- socket -----------------------------------------------------------------------------------
class _Echo(asyncio.Protocol):
    """service/lane.py's _LaneConn, minus the job: each record answered at once."""

    served = 0

    def connection_made(self, transport: Any) -> None:
        self.transport, self.buf = transport, bytearray()

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        while len(buf) - pos >= REQUEST.size:
            head = REQUEST.unpack_from(buf, pos)
            end = pos + REQUEST.size + head[9]
            if len(buf) < end:
                break
            pos = end
            self.transport.write(REPLY.pack(head[0], 0, 0, 3584, 1, 1, 0, 0.0, 2e-5, 4e-5))
            _Echo.served += 1
        del buf[:pos]


def _socket_server(path: str, ready: Any, stop: Any, marks: Any, out: Any) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from q6serve.service.threads import busy_poll

    async def main() -> None:
        loop = asyncio.get_running_loop()
        busy_poll(loop, lambda: True, 1000.0)
        server = await loop.create_unix_server(_Echo, path=path)
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        server.close()

    _serve_timed(lambda: asyncio.run(main()), lambda: _Echo.served, marks, out)


def _socket_caller(path: str, seconds: float, warmup: float, q: Any, warm: Any) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.settimeout(10.0)  # (a non-blocking descriptor: readv returns or raises at once)
    fd, head = s.fileno(), bytearray(REPLY.size)
    view = memoryview(head)
    walls = []
    now = time.perf_counter
    t_end, t_warm, seq = now() + warmup + seconds, now() + warmup, 0
    while True:
        t0 = now()
        if t0 >= t_end:
            break
        seq += 1
        os.write(fd, _record(seq))
        got = 0
        while got < len(head):
            try:
                got += os.readv(fd, (view[got:],))
            except BlockingIOError:
                continue
        if t0 >= t_warm:
            if not walls:
                warm.put(1)  # (the window starts once every caller is past its warm-up)
            walls.append(now() - t0)
    s.close()
    q.put(walls)


# -- ring -------------------------------------------------------------------------------------
def _ring_server(name: str, callers: int, ready: Any, stop: Any, marks: Any, out: Any,
                 ) -> None:
    shm = shared_memory.SharedMemory(name=name)
    served = [0]

    def serve() -> None:
        buf = shm.buf
        seen = [0] * callers
        unpack_seq, unpack_req, pack_rep, pack_seq = (SEQ.unpack_from, REQUEST.unpack_from,
                                                      REPLY.pack_into, SEQ.pack_into)
        ready.set()
        n = 0
        while True:
            for i in range(callers):
                base = i * SLOT
                s = unpack_seq(buf, base)[0]
                if s != seen[i]:
                    seen[i] = s
                    head = unpack_req(buf, base + REC_AT)
                    pack_rep(buf, base + REP_AT, head[0], 0, 0, 3584, 1, 1, 0, 0.0, 2e-5, 4e-5)
                    pack_seq(buf, base + RSEQ_AT, s)
                    served[0] += 1
            n += 1
            if n & 1023 == 0 and stop.is_set():
                break
        del buf

    try:
        _serve_timed(serve, lambda: served[0], marks, out)
    finally:
        shm.close()


def _ring_caller(name: str, i: int, seconds: float, warmup: float, q: Any, warm: Any,
                 ) -> None:
    shm = shared_memory.SharedMemory(name=name)
    buf, base = shm.buf, i * SLOT
    walls = []
    now = time.perf_counter
    unpack_seq, pack_seq = SEQ.unpack_from, SEQ.pack_into
    t_end, t_warm, seq = now() + warmup + seconds, now() + warmup, 0
    while True:
        t0 = now()
        if t0 >= t_end:
            break
        seq += 1
        rec = _record(seq)
        buf[base + REC_AT : base + REC_AT + len(rec)] = rec
        pack_seq(buf, base, seq)
        while unpack_seq(buf, base + RSEQ_AT)[0] != seq:
            pass
        REPLY.unpack_from(buf, base + REP_AT)
        if t0 >= t_warm:
            if not walls:
                warm.put(1)  # (the window starts once every caller is past its warm-up)
            walls.append(now() - t0)
    del buf
    shm.close()
    q.put(walls)


# -- both -------------------------------------------------------------------------------------
def _serve_timed(run: Any, served: Any, marks: Any, out: Any) -> None:
    """Run the server; a thread blocked on the parent's two events (no polling: it takes no
    GIL meanwhile) reads the served count and the server thread's CPU at the window's start
    and end, into ``out["server"]``."""
    import threading

    main_id = threading.main_thread().ident

    def sample() -> None:
        clk = time.pthread_getcpuclockid(main_id)  # type: ignore[arg-type]
        got = []
        for ev in marks:
            ev.wait()
            got.append([time.perf_counter(), time.clock_gettime(clk), served()])
        out["server"] = got

    threading.Thread(target=sample, daemon=True).start()
    run()


def probe(mode: str, callers: int, seconds: float, warmup: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    mgr = ctx.Manager()
    out, ready, stop, q = mgr.dict(), ctx.Event(), ctx.Event(), ctx.Queue()
    marks = (ctx.Event(), ctx.Event())  # the timed window's start and end
    warm = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="ringprobe-")
    shm = None
    if mode == "socket":
        path = os.path.join(tmp, "s.sock")
        server = ctx.Process(target=_socket_server, args=(path, ready, stop, marks, out))
        server.start()
        ready.wait(30)
        procs = [ctx.Process(target=_socket_caller, args=(path, seconds, warmup, q, warm))
                 for _ in range(callers)]
    else:
        shm = shared_memory.SharedMemory(create=True, size=SLOT * callers)
        shm.buf[:] = bytes(SLOT * callers)
        server = ctx.Process(target=_ring_server, args=(shm.name, callers, ready, stop,
                                                                marks, out))
        server.start()
        ready.wait(30)
        procs = [ctx.Process(target=_ring_caller, args=(shm.name, i, seconds, warmup, q,
                                                                  warm))
                 for i in range(callers)]
    for p in procs:
        p.start()
    for _ in procs:  # every caller started and past its warm-up
        warm.get(timeout=60)
    marks[0].set()
    time.sleep(seconds * 0.7)
    marks[1].set()
    walls: list[float] = []
    for _ in procs:
        walls += q.get(timeout=60 + seconds)
    for p in procs:
        p.join(30)
    deadline = time.monotonic() + 5
    while "server" not in out and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    server.join(10)
    if server.is_alive():
        server.kill()
    srv = out.get("server")
    if shm is not None:
        shm.close()
        shm.unlink()
    mgr.shutdown()
    walls.sort()
    res: dict[str, Any] = {"mode": mode, "callers": callers,
                           "p50_us": walls[len(walls) // 2] * 1e6 if walls else float("nan")}
    if srv:
        (w0, c0, n0), (w1, c1, n1) = srv
        n = max(n1 - n0, 1)
        res.update(requests_per_s=n / (w1 - w0), server_cpu_us=(c1 - c0) / n * 1e6,
                   server_busy=(c1 - c0) / (w1 - w0))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="socket,ring")
    ap.add_argument("--callers", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--warmup", type=float, default=0.3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    results = []
    for mode in a.modes.split(","):
        r = probe(mode, a.callers, a.seconds, a.warmup)
        results.append(r)
        print(f"{mode:6s} callers {a.callers}: {r.get('requests_per_s', float('nan')):,.0f} "
              f"requests/s, the server's CPU {r.get('server_cpu_us', float('nan')):.2f} us a "
              f"request (busy {r.get('server_busy', float('nan')):.2f}), round trip p50 "
              f"{r['p50_us']:.2f} us", flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
