"""Several front-end processes per device: ``q6serve worker --frontends N`` (issue 15 item 2).

One Python gRPC process moves ~5-6k requests/s whatever its handlers do, so the gRPC edge runs
in N processes that listen on one port (SO_REUSEPORT: the kernel spreads connections over
them, as in grpc's multiprocessing example) and feed ONE device process, which alone owns the
backend, the weights, the VRAM accountant, the batchers, the regions and /metrics::

    clients ──TCP──▶ front end 0..N-1 (grpc.aio: interceptor, auth, wire decode, servicer,
                     health, reflection)
                          │ Unix socket per front end: small messages + wake-up
                          │ shared-memory arena per front end: x and y of matmuls
                          ▼
                     device process (this module's FrontendsWorker, the `q6serve worker`
                     process): Engine, RegionTable, Metrics (/metrics), drain

A matmul's activations go into a slot of the front end's arena (one copy, which the bytes
path makes anyway); the device process views them there, runs the batcher, writes y into the
same slot and answers with a ~100-byte message; the front end copies a small y (<= 64 KiB) out
of the slot and frees it at once, or encodes a bigger one from the slot and frees the slot when
the reply's y is gone; the caller's sink (the servicer's reply) runs in the loop trip that
reads the answer. A plain matmul and its reply travel in fixed
struct layouts (``_MM``, ``_MMOK``), everything else as pickled tuples of plain values; the
frames are parsed as they arrive (``_Peer``: no reader task or coroutine per message). Calls
whose x or y do not fit a slot (or when every slot is busy) carry the array in the message
instead. The socket is the wake-up; the small messages to a peer within one loop iteration
(e.g. a batch's replies) go out in one write (``_Out``).

Contract kept from the one-process worker: the same servicer, interceptor (error codes,
auth), health and reflection run in every front end; every request kind (multi-weight, top-k,
regions, streams) is served (small calls stacked per front end: ``EngineProxy``);
admission limits are split over the front ends
(``frontend_limits``), so they hold for the worker as a whole; request metrics are forwarded to the
device process every 200 ms, so one /metrics shows the whole worker; status and flags are the
device process's. SIGTERM to the `q6serve worker` process drains: every front end turns
health NOT_SERVING and stops its server with the grace period, the engine refuses new work,
and when the front ends have exited the regions and weights are freed. A front end that dies
(even mid-call) is logged and replaced; its unfinished calls complete on the device and their
results are dropped; the device process keeps serving the others.

The modules (this one: the device process's start, supervision, control messages and drain;
``client/cmd_worker.py`` starts it):

- ``frontends_ipc``: the device socket's frames and codec, both ends' protocol (``_Peer``,
  ``_Out``), the reply fields, one connected front end (``_Front``);
- ``frontends_arena``: a front end's shared-memory slots (``Arena``);
- ``frontends_calls``: the device process's plain matmuls (merged per loop trip, the direct
  path, the answers into the slots);
- ``frontends_regions``: its region calls (system and CUDA IPC regions, full system-region
  batches);
- ``frontends_pipeline``: launches answered a loop trip later (CUDA-region calls, full
  system-region calls, the lanes' batches);
- ``frontends_stats``: its counters for profiling (``Q6SERVE_DP_STATS``);
- ``frontends_front``: a front-end process (its gRPC server, ``EngineProxy``, ``_Link``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from q6serve.kernels.api import Backend
from q6serve.kernels.errors import InvalidArgument, Unavailable
from q6serve.kernels.hostio import HostIO

from . import envvars, reuseport, wire_requests
from .config import WorkerConfig
from .engine_types import MatmulCall
from .frontends_arena import SLOT_BYTES, Arena
from .frontends_calls import PlainCalls
from .frontends_front import frontend_busy_poll_us
from .frontends_ipc import _Front, _Peer, _portable_error, child_args
from .frontends_pipeline import Pipeline
from .frontends_regions import RegionCalls, _SysCall
from .frontends_stats import STATS_ENV, _DeviceStats
from .regions import table_for
from .servicer import RegionPlane
from .worker import Worker

log = logging.getLogger("q6serve.frontends")
# plain calls read in one loop trip for the same weight, dtypes and K go to the engine as one
# request (FrontendsWorker._queue_call). Env Q6SERVE_DEVICE_MERGE=0 turns it off (experiments).
MERGE_ENV = envvars.DEVICE_MERGE.name
START_TIMEOUT_S = 120.0
_CHILD = "from q6serve.service.frontends_front import frontend_main; frontend_main()"


class FrontendsWorker(PlainCalls, RegionCalls, Pipeline, Worker):
    """The device process of a ``--frontends N`` worker (N >= 1 front-end processes)."""
    def __init__(self, config: WorkerConfig, backend: Backend,
                 registry: CollectorRegistry | None = None) -> None:
        super().__init__(config, backend, registry)
        self.n = config.frontends
        self.slot_bytes = min(SLOT_BYTES, config.frontend_shm_bytes)
        self.slots = max(1, config.frontend_shm_bytes // self.slot_bytes)
        self._dir = Path(tempfile.mkdtemp(prefix="q6serve-fe-"))  # 0700: ours only
        self._sock_path = str(self._dir / "device.sock")
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._fronts: dict[int, _Front] = {}
        self._ready: dict[int, asyncio.Future[None]] = {}
        self._reserved: socket.socket | None = None
        self._unix: asyncio.base_events.Server | None = None
        self._draining = False
        self._supervisor: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pending = 0  # matmuls in this process now
        self.pending_peak = 0  # most matmuls in this process at once (admission tests)
        self.stats: _DeviceStats | None = None  # Q6SERVE_DP_STATS
        # calls to merge at the end of this loop trip, by (weight, x dtype, K, precision, out)
        self._merging: dict[tuple[Any, ...], list[tuple[MatmulCall, Any]]] = {}
        self.merge = bool(envvars.DEVICE_MERGE.read())
        # CUDA-region calls (y in a CUDA region) are launched at the trip's end behind the
        # launches still out, and waited for a loop trip later (_tick), or, once the device
        # may launch no more, before the next launch: the loop reads and launches the next
        # calls while the GPU runs the previous ones. T3 through front ends over CUDA IPC
        # regions, H200, alternated: 414-462k rows/s against 264-329k waiting inline (session
        # 17, 3 pairs of 3; 6 of 7 pairs since session 16). Bytes and system-region calls wait
        # inline: the same pipeline lost T3 through system regions (162-186k against
        # 163-238k) and left T2 even (docs/SCALEOUT.md, session 17). Out: (wait,
        # done(reply, exception), launch number, its slot's completion event or None).
        self._out: collections.deque[tuple[Callable[[], Any],
                                           Callable[[Any, BaseException | None], None], int,
                                           Any]] = collections.deque()
        # Q6SERVE_DP_READY_POLL: the launches out are answered at a loop trip once their launch
        # slot's completion event says they are done (a query, no sync), in order; one not
        # done yet is looked at again a trip later, the loop reading messages meanwhile
        # (bundle A: the loop blocked in those syncs 15 us a CUDA-region call, 43 a system-
        # region one). Where a slot is needed the oldest is still waited for.
        self.ready_poll = bool(envvars.DP_READY_POLL.read())
        self._ws: Any = None  # the CUDA launcher's workspace (its slots), set at start
        self._ws_slots = 0  # its launch slots (kernels/cuda/launch.py SLOTS)
        self._launches = 0  # launches so far (each out entry's number)
        self._tick_due = False
        # CUDA-region calls read in this trip, launched at its end: (call, y's CUDA view or
        # None, done)
        self._cuda_due: list[tuple[MatmulCall, Any, Callable[[Any, BaseException | None],
                                                             None]]] = []
        # full system-region calls read in this trip (x and y page-locked in one region),
        # launched at its end through the same pipeline (``_launch_sys_due``)
        self._sys_due: list[_SysCall] = []
        self.sys_pipe = bool(envvars.DP_SYS_PIPE.read())  # (0: queued to the batcher)
        # of the full system-region calls: launched (by their plan or routed), by their
        # region's plan, and queued to the batcher (the engine would not launch them now);
        # in Q6SERVE_DP_STATS' lines (bench/device_stats_table.py's "sys" cell)
        self.sys_launched = 0
        self.sys_planned = 0
        self.sys_queued = 0
        self.pipelined = [0, 0.0]  # calls launched so, and the loop's seconds in their waits
        self._merge_rows = min(config.max_batch_rows, config.max_request_rows)
        self.merged = [0, 0]  # engine requests that merged several calls, and those calls
        self.merged_direct = 0  # of those requests, run on the direct path (tests)
        # Q6SERVE_DP_LANE_PIPE: the fast lanes' full batches through the same pipeline
        # (LaneServer.pipe), not waited for inline in the lane's flush
        self.lane_pipe = bool(envvars.DP_LANE_PIPE.read())
        # Q6SERVE_FRONTEND_ROUND_ROBIN: the eBPF program and maps that deal new connections to
        # the front ends in turn (service/reuseport.py), passed down to each front end
        self._steering: reuseport.Steering | None = None
        # Q6SERVE_DP_PIN_ARENA: the backend's page-locked ranges (kernels/hostio.py) that each
        # front end's arena joins when it connects (None: arenas stay pageable), and the
        # arenas pinned so far (unpinned when one closes, or at stop before the backend goes)
        self._arena_io: HostIO | None = None
        self._pinned_arenas: set[Arena] = set()
        # Q6SERVE_DP_ARENA_GATHER (with pinned arenas): the backend's ``gathered`` (a merged
        # batch's x DMA'd from its calls' slots), or None: x's rows concatenated (``_staged``)
        self._gather: Callable[..., np.ndarray | None] | None = None
        self.gathered = 0  # merged batches launched so (tests)

    # -- start ------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        frontend_busy_poll_us()  # a bad value fails the start here, not in every front end
        self._init_metrics()
        self.engine = self.make_engine()
        if self.ready_poll:
            self._ws = getattr(getattr(self.backend, "launcher", None), "ws", None)
            if self._ws is not None:
                from ..kernels.cuda.launch import SLOTS

                self._ws_slots = SLOTS
        self.regions = table_for(cfg.allow_shm, cfg.max_regions, cfg.max_region_bytes,
                                 self.backend, self.engine)
        if envvars.DP_PIN_ARENA.read():
            self._arena_io = getattr(self.backend, "hostio", None)
            if self._arena_io is not None and envvars.DP_ARENA_GATHER.read():
                self._gather = getattr(self.backend, "gathered", None)
        self.plane = RegionPlane(self.regions, self.engine)
        self.port = self._reserve_port()
        if envvars.FRONTEND_ROUND_ROBIN.read():
            self._steering = reuseport.make(self.n)
        self._unix = await asyncio.get_running_loop().create_unix_server(
            lambda: _FrontConnection(self), path=self._sock_path)
        for i in range(self.n):
            self._spawn(i)
        try:
            await asyncio.wait_for(self._started(), START_TIMEOUT_S)
        except BaseException:
            await self._teardown()
            raise
        log.info("listening on %s:%d", cfg.host, self.port)  # must stay the first line
        log.info("%s", cfg.describe())
        log.info("%s; %d front-end processes (pids %s), %d arena slots of %d bytes each",
                 self.engine.describe(), self.n,
                 ",".join(str(p.pid) for p in self._procs.values()), self.slots,
                 self.slot_bytes)
        if self._steering is not None:
            log.info("new connections are dealt to the front ends in turn "
                     "(Q6SERVE_FRONTEND_ROUND_ROBIN: an eBPF program on the port's listeners)")
        self._start_metrics_http()
        self.engine.on_health(self._broadcast_health)
        if path := os.environ.get(STATS_ENV):
            self.stats = _DeviceStats(self, path)
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

    async def _started(self) -> None:
        """Every front end reported ready; one that exits first fails the start at once."""
        while not all(f.done() for f in self._ready.values()):
            for i, p in self._procs.items():
                if p.poll() is not None:
                    raise Unavailable(f"front end {i} exited with {p.returncode} while "
                                      "starting (its error is in the log above)")
            await asyncio.sleep(0.05)

    def _reserve_port(self) -> int:
        """Hold the port with a bound, non-listening SO_REUSEPORT socket: the front ends bind it
        too, the kernel spreads connections over the listening ones (``--port 0``: a free
        port, the same for every front end)."""
        host = self.config.host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind((host, self.config.port))
        except OSError as e:
            s.close()
            raise Unavailable(f"cannot bind {self.config.host}:{self.config.port}: "
                              f"{e.strerror}") from None
        self._reserved = s
        return int(s.getsockname()[1])

    def _spawn(self, index: int) -> None:
        """Start front end ``index``: a fresh interpreter (never a fork of a process holding a
        device context), its arguments pickled on stdin."""
        self._ready[index] = asyncio.get_running_loop().create_future()
        steer = self._steering.fds if self._steering is not None else None
        p = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                             pass_fds=steer or ())
        assert p.stdin is not None
        p.stdin.write(child_args((index, self.config, self.port, self._sock_path, self.slots,
                                    self.slot_bytes, logging.getLogger().getEffectiveLevel(),
                                    steer)))
        p.stdin.close()
        self._procs[index] = p

    @property
    def frontend_pids(self) -> dict[int, int]:
        return {i: p.pid for i, p in self._procs.items()}

    @property
    def frontend_calls(self) -> dict[int, int]:
        return {i: f.calls for i, f in self._fronts.items()}

    async def _supervise(self) -> None:
        """Replace a front end that exits while the worker serves (crash, OOM kill)."""
        while not self._draining:
            await asyncio.sleep(0.2)
            for i, p in list(self._procs.items()):
                if p.poll() is None or self._draining:
                    continue
                log.error("front end %d (pid %s) exited with %s; starting a new one", i,
                          p.pid, p.returncode)
                self._spawn(i)

    # -- one front end's connection (_FrontConnection) ---------------------------------------
    def _hello(self, conn: _FrontConnection, msg: tuple[Any, ...]) -> _Front:
        _, index, pid, arena_name, slots, slot_bytes = msg
        assert conn.transport is not None and conn.out is not None
        fe = _Front(index, pid, conn.transport, Arena.attach(arena_name, slots, slot_bytes),
                    conn.out)
        if self._arena_io is not None and fe.arena.pin(self._arena_io):
            self._pinned_arenas.add(fe.arena)
        self._fronts[index] = fe
        if self.stats is not None:
            self.stats.connection(conn)
        fe.send(("ack",))
        return fe

    def _gone(self, fe: _Front) -> None:
        fe.alive = False
        for q in fe.uploads.values():
            q.put_nowait(Unavailable("the front end went away mid-upload"))
        if fe.pending == 0:
            fe.arena.close()
        if self._fronts.get(fe.index) is fe:
            del self._fronts[fe.index]
        if not self._draining:
            log.warning("front end %d (pid %d) disconnected with %d calls in flight",
                        fe.index, fe.pid, fe.pending)

    def _dispatch(self, fe: _Front, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "mm":
            self._matmul(fe, *msg[1:])
        elif kind == "rm":
            self._region_matmul(fe, *msg[1:])
        elif kind == "call":
            self._task(self._call(fe, *msg[1:]))
        elif kind == "metrics":
            if self.metrics is not None:
                for args in msg[1]:
                    self.metrics.observe_requests(*args)
        elif kind == "up":
            q: asyncio.Queue[Any] = asyncio.Queue()
            fe.uploads[msg[1]] = q
            self._task(self._upload(fe, msg[1], msg[2], q))
        elif kind == "upc":
            if (q2 := fe.uploads.get(msg[1])) is not None:
                q2.put_nowait(msg[2])
        elif kind == "ready":
            fut = self._ready.get(fe.index)
            if fut is not None and not fut.done():
                fut.set_result(None)
        else:
            log.error("front end %d sent an unknown message %r", fe.index, kind)

    def _task(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _call(self, fe: _Front, rid: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            if method not in _DEVICE_CALLS:
                raise InvalidArgument(f"unknown device call {method!r}")
            result = await _DEVICE_CALLS[method](self, *args)
            fe.send(("ok", rid, result))
        except BaseException as e:
            fe.send(("err", rid, _portable_error(e)))
            if not isinstance(e, Exception):
                raise

    async def _upload(self, fe: _Front, rid: int, spec: Any, q: asyncio.Queue[Any]) -> None:
        async def chunks() -> AsyncIterator[bytes]:
            while (c := await q.get()) is not None:
                if isinstance(c, BaseException):
                    raise c
                yield c

        try:
            view = await self.engine.upload(spec, chunks())  # type: ignore[union-attr]
            fe.send(("ok", rid, view))
        except BaseException as e:
            fe.send(("err", rid, _portable_error(e)))
            if not isinstance(e, Exception):
                raise
        finally:
            fe.uploads.pop(rid, None)

    def _broadcast_health(self, ok: bool) -> None:
        for fe in self._fronts.values():
            fe.send(("health", ok))

    # -- stop -------------------------------------------------------------------------------
    async def stop(self, grace: float | None = None) -> bool:
        """Drain: front ends turn NOT_SERVING and stop their servers with the grace period
        (their in-flight calls finish on the device), then regions and weights are freed."""
        if self._stopped.is_set() or self.engine is None:
            return self._clean
        grace = self.config.grace_period_s if grace is None else grace
        log.info("draining %d front ends: health NOT_SERVING, grace %.1f s", self.n, grace)
        self._draining = True
        for fe in list(self._fronts.values()):
            fe.send(("drain", grace))
        self.engine.begin_drain()
        deadline = time.monotonic() + grace + 10.0
        while (any(p.poll() is None for p in self._procs.values())
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        # a front end that had to be killed may have left calls unanswered
        self._clean = not any(p.poll() is None for p in self._procs.values())
        await self._teardown()
        if self.regions is not None:
            self.regions.close()
        for arena in self._pinned_arenas:  # (before the backend goes; its copies waited for)
            arena.unpin()
        self._pinned_arenas.clear()
        await self.engine.close()
        self._stop_metrics_http()
        self._stopped.set()
        log.info("stopped")
        return self._clean

    async def _teardown(self) -> None:
        self._draining = True
        if self._supervisor is not None:
            self._supervisor.cancel()
        for p in self._procs.values():
            if p.poll() is None:
                p.kill()
            await asyncio.to_thread(p.wait, 10)
        if self._unix is not None:
            self._unix.close()
        for fe in list(self._fronts.values()):
            fe.transport.close()
        if self._reserved is not None:
            self._reserved.close()
        if self._steering is not None:
            self._steering.close()
            self._steering = None
        shutil.rmtree(self._dir, ignore_errors=True)


class _FrontConnection(_Peer):
    """The device process's end of one front end's socket: its first message is the hello
    (arena name); every later one goes to FrontendsWorker._dispatch."""

    def __init__(self, worker: FrontendsWorker) -> None:
        super().__init__()
        self.worker = worker
        self.fe: _Front | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # unpickle only what our own front-end processes send (peer pid from the kernel)
        sock = transport.get_extra_info("socket")
        pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  12))[0]
        if pid not in {p.pid for p in self.worker._procs.values()}:
            log.error("refused a device-socket connection from pid %d", pid)
            transport.close()

    def message(self, msg: tuple[Any, ...]) -> None:
        if self.fe is None:
            self.fe = self.worker._hello(self, msg)
            self.plain = True  # from now on plain matmuls go to plain_mm
        else:
            self.worker._dispatch(self.fe, msg)

    def plain_mm(self, payload: memoryview) -> None:
        assert self.fe is not None
        self.worker._plain_mm(self.fe, payload)

    def region_mm(self, payload: memoryview) -> None:
        assert self.fe is not None
        self.worker._region_frame(self.fe, payload)

    def lost(self) -> None:
        if self.fe is not None:
            self.worker._gone(self.fe)


async def _dev_load(w: FrontendsWorker, *a: Any) -> Any:
    return await w.engine.load_gguf(*a)  # type: ignore[union-attr]


async def _dev_unload(w: FrontendsWorker, name: str) -> Any:
    return await w.engine.unload(name)  # type: ignore[union-attr]


async def _dev_list(w: FrontendsWorker) -> Any:
    return w.engine.list()  # type: ignore[union-attr]


async def _dev_get(w: FrontendsWorker, name: str) -> Any:
    return w.engine.get(name)  # type: ignore[union-attr]


async def _dev_status(w: FrontendsWorker) -> Any:
    return w.engine.status()  # type: ignore[union-attr]


async def _dev_set_flags(w: FrontendsWorker, changes: dict[str, bool]) -> Any:
    return w.engine.set_flags(changes)  # type: ignore[union-attr]


async def _dev_region(w: FrontendsWorker, op: str, *a: Any) -> Any:
    if op == "matmul":
        owner, io, req_bytes, timeout, t0 = a
        reply, took = await w.plane.matmul(owner, io, wire_requests.parse_matmul_request(req_bytes),
                                           timeout, t0)
        return reply, took
    if op not in ("register", "unregister", "list", "open_lane"):
        raise InvalidArgument(f"unknown region call {op!r}")
    got = await getattr(w.plane, op)(*a)
    if op == "open_lane" and (lanes := w.plane.lanes) is not None:
        if w.lane_pipe:
            lanes.pipe = w._pipe  # (the lanes' full batches through this process's pipeline)
        if w.stats is not None:
            w.stats.lanes(lanes)
    return got


_DEVICE_CALLS: dict[str, Callable[..., Any]] = {
    "load_gguf": _dev_load, "unload": _dev_unload, "list": _dev_list, "get": _dev_get,
    "status": _dev_status, "set_flags": _dev_set_flags, "region": _dev_region}
