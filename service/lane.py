"""The fast lane (issue 15 item 3): Matmuls of a co-located caller without RPCs.

After ``OpenLane`` (gRPC: identity, region ownership, the one-time ticket), the caller talks to
this worker over a Unix stream socket in fixed little-endian records (the byte layouts are in
the .proto's "Fast lane" section): a 40-byte request naming the weight and where x and y lie in
the caller's region, and a 56-byte reply with status and timing; x and y never travel, and the
socket is the wake-up (one write and one read per direction). Each request runs exactly as a
Matmul naming x_region/y_region (the same checks, the batcher, CUDA regions on the device), so
lane requests batch with everyone else's: with a system region as a front end's "rm" call runs
in the device process (``LaneServer._direct``: no task per request; a lone request on an
idle device on the direct path, ``Engine.run_now``, in the trip that read it; full batches,
N = --max-batch-rows, read in one trip as one pipeline on the loop, ``LaneServer._flush``:
request i + 1 launched before i is waited for, so the GPU runs one while the loop answers
the other); with a CUDA IPC region through ``CudaPlane.start`` (``LaneServer._cuda``: no task
either); otherwise (an engine without ``start_matmul``) through ``regions.matmul`` in a task.
A system-region request repeated at the same places (weight, shapes, dtypes, precision, x and
y offsets) runs by its region's plan (``_Plan``: the backend's region call, on CUDA one graph
launch for x's copy, the kernels and y's copy) once a call of it ran alone on its x: no views,
route or dispatch per request; the engine still checks and accounts each launch.

One ``LaneServer`` per worker (the device process with --frontends), started by the first
OpenLane, closed with the region table (drain).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import functools
import logging
import math
import mmap
import os
import platform
import secrets
import shutil
import socket
import stat
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from q6serve.kernels.errors import (
    FailedPrecondition,
    InvalidArgument,
    Q6Error,
    ResourceExhausted,
    Unavailable,
)

from . import envvars, regions, wire_requests
from .engine import Engine
from .engine_types import MatmulCall
from .regions import RegionIO, RegionRef, RegionTable
from .threads import outcome, ring_poll, ring_unpoll

log = logging.getLogger("q6serve.lane")

REQUEST = struct.Struct("<QIIQQBBBBHH")  # seq n k x_off y_off x_dt out_dt prec 0 name_len 0
REPLY = struct.Struct("<QIIIIIIddd")  # seq code msg_len y_cols rows reqs 0 queue kernel device
TICKET_BYTES = 32
TICKET_TTL_S = 60.0
TICKET_WAIT_S = 10.0  # from connecting to the ticket
MAX_PIPELINED = 64  # requests of one lane in the worker at once; the reader waits beyond
MAX_NAME_BYTES = 1024
ACCEPTED = b"\x00"
FULL = b"\x02"  # the answer to a ticket when --max-regions lanes are open (then closed)
# The ring (the worker takes ring lanes unless Q6SERVE_LANE_RING=0; the caller's lane asks for one
# unless Q6SERVE_LANE_RING=0 in its own environment or ``Lane(ring=False)``): after the ticket, a
# request record with seq 0 and flags RING_SETUP (its 9th field) whose name (name_len bytes) is
# "fd" and which comes, the first bytes after ACCEPTED, with the caller's descriptor of a memfd
# of RING_BYTES sealed against shrinking (F_SEAL_SHRINK) passed on the socket (SCM_RIGHTS: read
# with recvmsg, ``_LaneConn._read_first``; no /proc, so a caller in another pid namespace that
# shares the socket passes it too; the caller may close its own at once). Until session 30 the
# name was "fd:N", N the caller's descriptor, opened as /proc/<the caller's pid>/fd/N while the
# caller waited for the answer (a caller in another pid namespace got none). The memfd is
# the ring's own block (never the caller's region's bytes). Sealed, no one can
# shrink the block under the worker's mapping (until session 30 the ring was a /dev/shm object
# the caller could truncate: the worker's next look at it was a SIGBUS). The worker maps it and
# answers on the socket (a reply record, seq 0); both sides' mappings are all there is of it
# (nothing leaks when either side dies); from then on requests and
# replies go through the block, the socket carrying only doorbells (any byte: "look at the ring"),
# each sent only when the other side's flag says it sleeps. The block, little-endian:
R_SEQ, R_REQ, R_CSLEEP = 0, 8, 64  # request seq (written last), request record, caller sleeps
R_RSEQ, R_REP, R_WSLEEP = 128, 136, 192  # reply seq (written last), reply record, worker sleeps
R_NAME, R_MSG, RING_BYTES = 256, 1280, 2048  # weight name (<= 1024 bytes), error message
RING_NAME_MAX, RING_MSG_MAX = R_MSG - R_NAME, RING_BYTES - R_MSG
RING_SETUP = 2  # the setup record's flags (1: the ring in the region's tail, until s29)
RING_PASSED = "fd"  # a setup record's name when the memfd comes with it (SCM_RIGHTS)
RING_ENV = "Q6SERVE_LANE_RING"
SEQ = struct.Struct("<Q")
FLAG = struct.Struct("<I")


# The ring's records are published by storing their sequence last, which another process sees
# in that order only where stores are not reordered with stores (x86-64's TSO); elsewhere (Arm)
# it would need release/acquire fences that Python cannot issue, so no ring lanes there.
ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")


def ring_allowed(env: Any = None) -> bool:
    """Whether this worker takes ring lanes (``Q6SERVE_LANE_RING``, envvars.LANE_RING, on an
    x86-64 host)."""
    return bool(envvars.LANE_RING.read(env)) and ORDERED_STORES


@dataclass(frozen=True)
class Ticket:
    owner: str
    region: str
    expires: float


class LaneServer:
    def __init__(self, table: RegionTable, engine: Any) -> None:
        self.table, self.engine = table, engine
        self._dir = tempfile.mkdtemp(prefix="q6serve-lane-")  # 0700: this user only
        self.path = os.path.join(self._dir, "lane.sock")
        self._tickets: dict[bytes, Ticket] = {}
        self._server: asyncio.base_events.Server | None = None
        self._lanes: set[asyncio.BaseTransport] = set()
        self.open_lanes = 0  # lanes whose ticket was taken (and not closed since)
        self.direct = 0  # requests run by _direct (tests, benches)
        self.now = 0  # of which run here and now, on the direct path (Engine.run_now)
        self.pauses = 0  # times a lane had MAX_PIPELINED requests in the worker (tests)
        self.blocks = 0  # times a lane's unsent replies passed the high-water mark (tests)
        self.piped = 0  # of the direct ones, full batches run by _flush's pipeline (tests)
        self.cuda = 0  # of the direct ones, on a CUDA IPC region (_cuda) (tests)
        self.planned = 0  # of the piped ones, launched by their region's plan (_Plan) (tests)
        self.flushes = 0  # _flush's pipelines run (benches: piped / flushes = calls a trip)
        config = getattr(engine, "config", None)  # (a --devices worker's set has none)
        self._full_rows = config.max_batch_rows if config is not None else math.inf
        self._pipe: list[_Piped] = []  # full batches read in this trip, for _flush
        # Q6SERVE_DP_LANE_PIPE: the device process's pipeline (FrontendsWorker._pipe: launch
        # now behind the launches out, wait and answer a loop trip later), set by a --frontends
        # worker; None: _flush waits for its launches before it returns
        self.pipe: Callable[[Callable[[], Any], Callable[[Any, BaseException | None], None],
                             Callable[[], None]], None] | None = None
        # what the engine offers, looked up once (not per request)
        self._start_matmul = hasattr(engine, "start_matmul")
        self._launch_now = hasattr(engine, "launch_now")
        self._run_now = getattr(engine, "run_now", None)
        self._flags = getattr(engine, "flags", None)  # (its state: a plan's validity)
        self._rows_of = (engine.rows_of if hasattr(engine, "rows_of")
                         else lambda name: engine.get(name).rows)
        self.ring_ok = ring_allowed()
        self._rings: dict[_LaneConn, _Ring] = {}  # ring lanes, polled by the loop's selector
        self._polled = False  # (this server is one of the selector's rings)
        self.rung = 0  # ring requests taken (tests, benches)

    async def start(self) -> None:
        self._server = await asyncio.get_running_loop().create_unix_server(
            lambda: _LaneConn(self), path=self.path)
        self.table.on_close.append(self.close)
        log.info("fast lane socket %s", self.path)

    def ticket(self, owner: str, region: str) -> bytes:
        """A one-time ticket. Lanes open are at most --max-regions (each holds at most
        MAX_PIPELINED requests: what lanes add to the worker's load stays bounded), checked
        here and again when a lane comes with its ticket (``_LaneConn``: the FULL answer).
        Unused tickets hold no lane: an owner keeps at most --max-regions of them, its oldest
        dropped for a new one (until session 30 they counted against the lanes' limit for
        their TICKET_TTL_S, so one owner's unused tickets kept everyone else out)."""
        now = time.monotonic()
        for t in [t for t, v in self._tickets.items() if v.expires < now]:
            del self._tickets[t]  # unused tickets expire
        self._full()
        mine = [t for t, v in self._tickets.items() if v.owner == owner]
        if len(mine) >= self.table.max_regions:
            del self._tickets[mine[0]]  # (its oldest: dicts keep their insertion order)
        t = secrets.token_bytes(TICKET_BYTES)
        self._tickets[t] = Ticket(owner, region, now + TICKET_TTL_S)
        return t

    def _full(self) -> None:
        """RESOURCE_EXHAUSTED where --max-regions lanes are open."""
        if self.open_lanes >= self.table.max_regions:
            raise ResourceExhausted(f"{self.open_lanes} lanes open: at most "
                                    f"{self.table.max_regions} (--max-regions); close a lane "
                                    "first")

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._polled:
            with contextlib.suppress(RuntimeError):  # (no loop running: nothing polls)
                ring_unpoll(asyncio.get_running_loop(), self)
            self._polled = False
        for w in list(self._lanes):
            w.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- the ring ------------------------------------------------------------------------
    def _ring_setup(self, conn: _LaneConn, key: str) -> None:
        """The setup record: ``conn``'s lane over the ring its caller names in ``key`` (a
        sealed memfd, ``_map_passed``; mapped for the lane's life, let go in ``_ring_drop``),
        answered on the socket. A block that is another lane's ring already is refused (two
        lanes taking each other's requests and replies)."""
        assert conn.ticket is not None and conn.transport is not None
        try:
            if not self.ring_ok:
                raise FailedPrecondition(
                    f"this worker takes no ring lanes (start it with {RING_ENV}=1)"
                    if ORDERED_STORES else "this worker takes no ring lanes: its host "
                    f"({platform.machine()}) may reorder the ring's stores")
            if conn.ring is not None:
                raise InvalidArgument("this lane has a ring already")
            if key != RING_PASSED:
                raise InvalidArgument(f"a ring's setup names {key[:80]!r}: it must be "
                                      f"{RING_PASSED!r}, sent with the caller's memfd of "
                                      f"{RING_BYTES} bytes sealed against shrinking "
                                      "(F_SEAL_SHRINK) passed on the socket (SCM_RIGHTS)")
            ring = _Ring(*_map_passed(conn.take_passed()))
            if any(r.inode == ring.inode for r in self._rings.values()):
                ring.close()
                raise InvalidArgument("that ring serves another lane already")
            if not self._polled:
                if not ring_poll(asyncio.get_running_loop(), self):
                    ring.close()
                    raise FailedPrecondition("this worker's event loop cannot poll a ring")
                self._polled = True
        except Exception as e:
            conn.transport.write(_failed(0, e))
            return
        conn.ring = ring
        self._rings[conn] = ring
        conn.transport.write(REPLY.pack(0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0))

    def _ring_drop(self, conn: _LaneConn) -> None:
        """``conn``'s ring let go (its lane closed): its mapping closed."""
        ring = self._rings.pop(conn, None)
        conn.ring = None
        if ring is not None:
            ring.close()
        if not self._rings and self._polled:  # the last ring gone: the loop's sleeps uncapped
            with contextlib.suppress(RuntimeError):  # (no loop running: nothing polls)
                ring_unpoll(asyncio.get_running_loop(), self)
            self._polled = False

    def poll(self) -> bool:
        """The selector's look at the rings (threads.RingPoller): a new request seq on a
        lane with nothing in the worker is taken in this loop trip (``_ring_take``)."""
        got = None
        unpack = SEQ.unpack_from
        for conn, ring in self._rings.items():
            if conn.inflight or conn.blocked:
                continue  # (one request at a time on a ring: its next waits for the reply)
            s = unpack(ring.mv, R_SEQ)[0]
            if s != ring.seen:
                ring.seen = s
                if got is None:
                    got = []
                got.append((conn, s))
        if got is None:
            return False
        for conn, _ in got:
            conn.inflight += 1  # (taken: not polled again until answered)
        asyncio.get_running_loop().call_soon(self._ring_take, got)
        return True

    def sleeping(self, on: bool) -> None:
        flag = 1 if on else 0
        for ring in self._rings.values():
            FLAG.pack_into(ring.mv, R_WSLEEP, flag)

    def _ring_take(self, got: list[tuple[_LaneConn, int]]) -> None:
        """The ring requests the selector saw, each as a socket record is (``_request``);
        the last one ``alone`` (the ones before it may join its batch). A record that cannot
        be one (its name too long) is refused with a status; the rest is ``_direct``'s."""
        last = len(got) - 1
        for i, (conn, s) in enumerate(got):
            ring = conn.ring
            if ring is None:  # (its lane closed in between)
                continue
            self.rung += 1
            try:
                mv = ring.mv
                head = REQUEST.unpack_from(mv, R_REQ)
                name_len = head[9]
                if name_len > RING_NAME_MAX:
                    raise InvalidArgument(f"a ring record's weight name of {name_len} bytes: "
                                          f"at most {RING_NAME_MAX}")
                name = bytes(mv[R_NAME : R_NAME + name_len]).decode("utf-8", "replace")
                self._request(conn, (s, *head[1:]), name, i == last)
            except Exception as e:
                conn.answer(_failed(s, e))

    def _request(self, conn: _LaneConn, head: tuple[int, ...], name: str,
                 alone: bool = False) -> None:
        """One request record of ``conn``'s lane: run now (``_direct``) or in a task.
        ``alone``: no further record of this lane waits in its buffer (one that does could
        join this one's batch)."""
        seq, n, k, x_off, y_off, x_dt, out_dt, prec, _, _, _ = head
        t = conn.ticket
        assert t is not None
        if self._direct(conn, t, seq, name, n, k, x_off, y_off, x_dt, out_dt, prec, alone):
            return
        task = asyncio.get_running_loop().create_task(
            self._one(conn, t, seq, name, n, k, x_off, y_off, x_dt, out_dt, prec))
        conn.tasks.add(task)
        task.add_done_callback(conn.task_done)

    def _direct(self, conn: _LaneConn, t: Ticket, seq: int, name: str, n: int, k: int,
                x_off: int, y_off: int, x_dt: int, out_dt: int, prec: int,
                alone: bool = False) -> bool:
        """One request with x and y in a system region, as a front end's "rm" call runs in
        the device process (service/frontends.py ``_region_matmul``): the checks of
        ``regions.matmul`` now, in this loop trip; the call queued with a sink that answers
        (y already in place where the backend took the route, else copied there), lets the
        region go and frees its place in the lane -- no task, no coroutine, no future awaited
        per request (on the H200 a lane call cost the device process ~550 us of CPU that way).
        A request ``alone`` (no other record of its lane, nor another lane's bytes, waiting in
        this trip) that the engine would run at once as an inline job anyway runs here and
        now instead (``Engine.run_now``, the direct path MatmulStream takes: the device idle,
        nothing of its weight queued; no queue, future, sink or loop trip) and is answered
        before its region is let go. False: not for this path (a CUDA region, an engine
        without ``start_matmul``): the caller runs it as a task. A refusal is answered here.
        A CUDA IPC region: ``_cuda`` (no task either)."""
        table, engine = self.table, self.engine
        if not self._start_matmul:
            return False
        region = None
        key = None
        try:
            region = table.hold_name(t.owner, t.region)  # (no RegionRef a request: ~1 us)
            if region.kind != regions.SYSTEM:
                if table.cuda is None:  # (a CUDA region exists only where it is set)
                    table.let_go(region)
                    region = None
                    return False
                self._cuda(conn, seq, region, name, n, k, x_off, y_off, x_dt, out_dt, prec)
                self.direct += 1
                self.cuda += 1
                return True
            plans = region.plans
            pkey = (name, n, k, x_off, y_off, x_dt, out_dt, prec)
            plan = plans.get(pkey) if plans else None
            full = n >= self._full_rows and self._launch_now
            if plan is not None:  # a repeat of a request planned before: its fields
                region.mapping.check_alive("x", region.name)  # checked then
                if not engine.serving:
                    raise Unavailable("the worker is draining and takes no new requests")
                if full:
                    self._piped(conn, _Piped(conn, seq, plan.call, region, y_off, plan.dest,
                                             None, plan, pkey), alone)
                    return True
                if self._now(conn, seq, region, plan, pkey, alone):
                    return True
                plan = None  # (not alone: queued below, where others may join its batch)
            x_dtype, out, precision = _codes(x_dt, out_dt, prec)
            call = MatmulCall(name, region.array(x_off, x_dtype, (n, k), "x"), precision, out)
            if not engine.serving:
                raise Unavailable("the worker is draining and takes no new requests")
            rows = self._rows_of(name)
            dest = region.array(y_off, out, (n, rows), "y", writable=True, alive=True)
            base = region.mapping.addr  # (a system region's: set)
            key = table.route(call.x, dest, base + x_off, base + y_off)
            held = region
            # a call alone on its x may leave the backend's region call for a plan
            state = (self._flags.state if key is not None and plans is not None
                     and self._flags is not None and len(plans) < regions.VIEW_CACHE
                     else None)
            if full:
                # a full batch joins no other: run by this trip's pipeline (_flush)
                p = _Piped(conn, seq, call, held, y_off, dest, key)
                if state is not None:
                    key.want = True
                    p.pkey, p.state = pkey, state
                self._piped(conn, p, alone)
                return True
            run_now = self._run_now
            lone = alone and run_now is not None and not self._lane_ready(conn)
            if lone and state is not None:
                key.want = True
            r = run_now(call) if lone else None
            if r is not None:  # run here and now: the direct path (Engine.run_now)
                self.direct += 1
                self.now += 1
                try:
                    taken = table.unroute(key)
                    if (state is not None and key.call is not None
                            and self._flags.state is state):
                        plans[pkey] = _Plan(call, dest, key.call, state)
                    key = None
                    regions.place_y(held, y_off, r.y, dest, taken)
                    rec = REPLY.pack(seq, 0, 0, int(r.y.shape[1]), r.batch_rows,
                                     r.batch_requests, 0, r.queue_seconds,
                                     _nan(r.kernel_seconds), _nan(r.device_seconds))
                except Exception as e:
                    rec = _failed(seq, e)
                conn.answer(rec)  # the reply first, the bookkeeping after it
                table.let_go(held)  # (if answering raised, the handler below lets it go)
                return True

            self._queue(_Piped(conn, seq, call, held, y_off, dest, key))
            self.direct += 1
            return True
        except Exception as e:
            table.unroute(key)
            table.let_go(region)
            conn.answer(_failed(seq, e))
            return True

    def _now(self, conn: _LaneConn, seq: int, region: regions.Region, plan: _Plan,
             pkey: tuple[Any, ...], alone: bool) -> bool:
        """A request planned before (not a full batch) run here and now by its plan when it
        is ``alone`` and the engine runs it on the direct path (``Engine.run_now`` with the
        plan's launch), answered before its region is let go; False: nothing was done (a
        stale plan is dropped). A refusal or failure raises (the plan dropped)."""
        run_now = self._run_now
        if not alone or run_now is None or self._lane_ready(conn):
            return False
        if not plan.live(self._flags):
            region.plans.pop(pkey, None)
            return False
        try:
            r = run_now(plan.call, None, plan.launch)
        except Exception:
            region.plans.pop(pkey, None)
            raise
        if r is None:
            return False
        self.direct += 1
        self.now += 1
        self.planned += 1
        try:
            rec = REPLY.pack(seq, 0, 0, int(r.y.shape[1]), r.batch_rows, r.batch_requests, 0,
                             r.queue_seconds, _nan(r.kernel_seconds), _nan(r.device_seconds))
        except Exception as e:
            rec = _failed(seq, e)
        conn.answer(rec)  # the reply first, the bookkeeping after it
        self.table.let_go(region)
        return True

    def _piped(self, conn: _LaneConn, p: _Piped, alone: bool) -> None:
        """A full batch ``p`` to this trip's pipeline (:meth:`_flush`): run at once when
        nothing else was read in this trip, else at the trip's end."""
        self._pipe.append(p)
        self.direct += 1
        if alone and not self._lane_ready(conn):  # nothing else read in this trip
            self._flush()
        elif len(self._pipe) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _cuda(self, conn: _LaneConn, seq: int, region: regions.Region, name: str, n: int,
              k: int, x_off: int, y_off: int, x_dt: int, out_dt: int, prec: int) -> None:
        """A request on a lane over a CUDA IPC region (held): the checks of
        ``regions.matmul`` now, the job through ``CudaPlane.start`` (the device process's
        "rm" path for CUDA regions, FrontendsWorker._cuda_region_matmul), answered from its
        end by ``_cuda_done`` -- no task, coroutine, future or shield per request, as
        ``_one`` (``regions.matmul``, ``CudaSupport.matmul``) took; with ``self.pipe``
        (Q6SERVE_DP_LANE_PIPE) through ``CudaSupport.launch_now`` in the device process's
        pipeline. A refusal raises here (the caller answers it and lets the region go);
        nothing was queued then."""
        table, engine = self.table, self.engine
        assert table.cuda is not None
        x_dtype, out, precision = _codes(x_dt, out_dt, prec)
        call = MatmulCall(name, region.array(x_off, x_dtype, (n, k), "x"), precision, out)
        if not engine.serving:
            raise Unavailable("the worker is draining and takes no new requests")
        rows = engine.rows_of(name)
        dest = region.array(y_off, out, (n, rows), "y", writable=True)
        done = functools.partial(self._cuda_done, conn, seq, region, rows)
        cuda = table.cuda
        if self.pipe is not None:  # launched now behind the launches out (its place's graph
            # where it has one), answered a loop trip later, as the front ends' CUDA-region
            # calls (FrontendsWorker._launch_cuda_due); where none may launch, as before
            self.pipe(lambda: cuda.launch_now(engine, call, dest), done,
                      lambda: cuda.start(engine, call, dest, done))
            return
        cuda.start(engine, call, dest, done)

    def _cuda_done(self, conn: _LaneConn, seq: int, region: regions.Region, rows: int,
                   r: Any, exc: BaseException | None) -> None:
        """A CUDA-region request's end (y written into the region by the job): the reply,
        then the region let go."""
        if exc is not None:
            rec = _failed(seq, exc if isinstance(exc, Exception)
                          else Unavailable("the call was cancelled"))
        else:
            try:
                rec = REPLY.pack(seq, 0, 0, rows, r.batch_rows, r.batch_requests, 0,
                                 r.queue_seconds, _nan(r.kernel_seconds),
                                 _nan(r.device_seconds))
            except Exception as e:
                rec = _failed(seq, e)
        try:
            conn.answer(rec)
        finally:
            self.table.let_go(region)

    def _queue(self, p: _Piped) -> None:
        """``p`` queued (``start_matmul``) with a sink that answers it."""
        def answered(fut: asyncio.Future[Any]) -> None:
            self._answer(p, *outcome(fut))

        engine = self.engine
        if type(engine) is Engine:  # its sink runs in the trip that resolves the call
            engine.start_matmul(p.call, answered)
        else:  # (a --devices worker's sharded call does not call a sink)
            engine.start_matmul(p.call).add_done_callback(answered)

    def _answer(self, p: _Piped, r: Any, exc: BaseException | None) -> None:
        """``p``'s reply (``r``, or the failure ``exc``): y into place unless the backend
        wrote it there, the record written, then its region let go."""
        try:
            route = p.route
            taken = self.table.unroute(route) or p.plan is not None  # (a plan's y: in place)
            if exc is not None:
                raise exc
            if (route is not None and route.call is not None and p.pkey is not None
                    and self._flags is not None and self._flags.state is p.state):
                p.region.plans[p.pkey] = _Plan(p.call, p.dest, route.call, p.state)
            y = r.y
            regions.place_y(p.region, p.y_off, y, p.dest, taken)
            rec = REPLY.pack(p.seq, 0, 0, int(y.shape[1]), r.batch_rows, r.batch_requests, 0,
                             r.queue_seconds, _nan(r.kernel_seconds), _nan(r.device_seconds))
        except Exception as e:
            rec = _failed(p.seq, e)
        try:
            p.conn.answer(rec)  # the reply first, the region let go after it
        finally:  # (a sink's raise reaches no handler: the region is never left held)
            self.table.let_go(p.region)

    def _flush(self) -> None:
        """The full batches read in the last trip, pipelined in this one callback
        (``Engine.launch_now``): request i + 1 is launched before i is waited for and
        answered, so the GPU runs one while the loop answers the other and prepares the
        next (at most the device's launch slots in flight; with one slot, one after the
        other). Each launch is waited for before this returns: nothing else launches
        between. A request the engine will not launch now (its cost unknown, the device
        busy elsewhere) is queued as any other, after the launches in flight are answered."""
        pipe, self._pipe = self._pipe, []
        self.flushes += 1
        if self.pipe is not None:
            for p in pipe:
                self._pipe_one(p)
            return
        engine = self.engine
        slots = getattr(getattr(engine, "device", None), "now_slots", 1)
        waiting: collections.deque[tuple[_Piped, Any]] = collections.deque()

        def answer_oldest() -> None:
            q, finish = waiting.popleft()
            try:
                r = finish()
            except Exception as e:
                self._answer(q, None, e)
            else:
                self._answer(q, r, None)

        for p in pipe:
            while len(waiting) >= slots:  # a slot freed first (no launch_now refused for it)
                answer_oldest()
            plan = p.plan
            if plan is not None and not plan.live(self._flags):
                self._unplan(p)  # stale (weight, flags, page-locked ranges): as any other
            try:
                launch = None if p.plan is None else p.plan.launch
                finish = engine.launch_now(p.call, launch)
                while finish is None and waiting:  # a launch slot freed, or the device idle
                    answer_oldest()
                    finish = engine.launch_now(p.call, launch)
            except Exception as e:  # a refusal (the checks), or the launch failed
                if p.plan is not None:
                    self._unplan(p)  # (not that way again)
                self._answer(p, None, e)
                continue
            if finish is None:
                try:
                    if p.plan is not None:
                        self._unplan(p)  # queued: routed as any other
                    self._queue(p)
                except Exception as e:
                    self._answer(p, None, e)
                continue
            if p.plan is not None:
                self.planned += 1
            self.piped += 1
            waiting.append((p, finish))
        while waiting:
            answer_oldest()

    def _pipe_one(self, p: _Piped) -> None:
        """A full batch through the device process's pipeline (``self.pipe``): launched now
        behind the launches out (its region's plan when it has a live one), waited for and
        answered a loop trip later (``_answer``), so that the loop reads and launches the next
        lanes' requests while the GPU runs this one (T3's 8 callers with one request in flight
        each: a lone request was waited for inline, the loop blocked on its x's DMA, the
        kernels and y's DMA); one the engine will not launch now is queued as in ``_flush``."""
        plan = p.plan
        if plan is not None and not plan.live(self._flags):
            self._unplan(p)  # stale (weight, flags, page-locked ranges): as any other
        try:
            self.pipe(functools.partial(self._launch_piped, p),  # type: ignore[misc]
                      functools.partial(self._answer, p),
                      functools.partial(self._queue_unplanned, p))
        except Exception as e:  # a refusal (the checks), or the launch failed
            if p.plan is not None:
                self._unplan(p)  # (not that way again)
            self._answer(p, None, e)

    def _launch_piped(self, p: _Piped) -> Callable[[], Any] | None:
        """``Engine.launch_now`` of ``p`` (by its plan's launch, if it has one): the wait, or
        None (the engine will not launch it now)."""
        finish = self.engine.launch_now(p.call, None if p.plan is None else p.plan.launch)
        if finish is not None:
            self.planned += p.plan is not None
            self.piped += 1
        return finish

    def _queue_unplanned(self, p: _Piped) -> None:
        """``p`` queued (the engine would not launch it now): routed as any other."""
        try:
            if p.plan is not None:
                self._unplan(p)
            self._queue(p)
        except Exception as e:
            self._answer(p, None, e)

    def _unplan(self, p: _Piped) -> None:
        """``p``'s plan dropped from its region; ``p`` routed as any call whose x lies in a
        region (no other call may take its y's route), asking for a new one."""
        p.region.plans.pop(p.pkey, None)
        p.plan = None
        x_off = p.pkey[3]  # (name, n, k, x_off, y_off, x_dt, out_dt, prec)
        base = p.region.mapping.addr
        p.route = self.table.route(p.call.x, p.dest, base + x_off, base + p.y_off)
        if p.route is not None and self._flags is not None:
            p.route.want, p.state = True, self._flags.state

    def _lane_ready(self, conn: _LaneConn) -> bool:
        """Whether another lane's bytes wait to be read in this loop trip (its read handle is
        in asyncio's ready queue): its request could join this one's batch, so this one is
        queued (``start_matmul``: launched at the trip's end) rather than run now."""
        if len(self._lanes) < 2:  # (one lane open: no other's bytes can wait)
            return False
        for h in getattr(asyncio.get_running_loop(), "_ready", ()):
            t = getattr(h._callback, "__self__", None)
            if t is not None and t is not conn.transport and t in self._lanes:
                return True
        return False

    async def _one(self, conn: _LaneConn, t: Ticket, seq: int, name: str, n: int, k: int,
                   x_off: int, y_off: int, x_dt: int, out_dt: int, prec: int) -> None:
        try:
            io = RegionIO(RegionRef(t.region, x_off), wire_requests.lane_dtype(x_dt, "x_dtype"),
                          (n, k), RegionRef(t.region, y_off))
            out = wire_requests.lane_dtype(out_dt, "out_dtype", default_f32=True)
            precision = wire_requests.lane_precision(prec)

            def make_call(x: Any) -> MatmulCall:
                return MatmulCall(name, x, precision, out)

            if not self.engine.serving:
                raise Unavailable("the worker is draining and takes no new requests")
            r = await regions.matmul(self.table, self.engine, t.owner, io, make_call)
            rec = REPLY.pack(seq, 0, 0, int(r.y.shape[1]), r.batch_rows, r.batch_requests, 0,
                             r.queue_seconds, _nan(r.kernel_seconds), _nan(r.device_seconds))
        except Exception as e:
            rec = _failed(seq, e)
        conn.write(rec)


@dataclass(slots=True)
class _Piped:
    """A lane request checked and routed by ``LaneServer._direct``, on its way to the engine:
    where its reply goes and what to let go once answered."""

    conn: _LaneConn
    seq: int
    call: MatmulCall
    region: Any  # regions.Region, held until answered
    y_off: int
    dest: np.ndarray
    route: Any  # the table's y route key (unroute once)
    plan: _Plan | None = None  # launched by its region's plan (then not routed)
    pkey: Any = None  # the plan's key in region.plans (to make one from this call, or drop)
    state: Any = None  # the engine's flag state when a plan was asked for


@dataclass(slots=True)
class _Plan:
    """A full-batch lane request's repeats (same weight, shapes, dtypes, precision and places
    in one system region): its call and y's view, settled by the first such call, and the
    backend's region call (``Route.call``: the CUDA backend's ``RegionCall``, the whole call
    one graph launch) that launches it without a route, the engine's own launch or the
    backend's per-call checks. Valid while the backend's call is ``live()`` and the engine's
    flags are the state it was made under; the engine still checks and accounts each launch
    (``Engine.launch_now``)."""

    call: MatmulCall
    dest: np.ndarray
    rc: Any
    state: Any

    def live(self, flags: Any) -> bool:
        return flags.state is self.state and self.rc.live()

    def launch(self, x: np.ndarray, key: Any) -> Any:
        """``Engine.launch_now``'s launch: the backend's region call (x and y its own)."""
        return self.rc.launch()


class _LaneConn(asyncio.Protocol):
    """One lane's connection: its ticket, then request records handled as they arrive (no
    reader task, no coroutine per record). At most MAX_PIPELINED requests of a lane are in the
    worker at once: reading pauses beyond, and what was read waits in the buffer."""

    def __init__(self, server: LaneServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.ticket: Ticket | None = None
        self.uid = self.pid = -1  # the caller's (SO_PEERCRED, when it connected)
        self.inflight = 0  # requests read and not yet answered
        self.paused = False  # MAX_PIPELINED requests in the worker: reading paused
        # the replies not yet sent past the transport's high-water mark (a caller that does
        # not read them): reading paused, and a ring lane's ring not looked at, until they go
        self.blocked = False
        self.tasks: set[asyncio.Task[None]] = set()  # requests run in a task (_one)
        self._timer: asyncio.TimerHandle | None = None
        self.ring: _Ring | None = None  # requests and replies through a ring (LaneServer)
        # the descriptor that came (SCM_RIGHTS) with the first bytes after ACCEPTED: the ring's
        # memfd of a setup record named RING_PASSED (closed unless its setup takes it)
        self.passed = -1
        self._first: socket.socket | None = None  # that first read's socket (a dup), waiting

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server._lanes.add(transport)
        sock = transport.get_extra_info("socket")
        self.pid, self.uid, _ = struct.unpack("3i", sock.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        # a connection that never sends its ticket is dropped, not kept forever
        self._timer = asyncio.get_running_loop().call_later(TICKET_WAIT_S, transport.close)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._parse()

    def _parse(self) -> None:
        assert self.transport is not None
        buf = self.buf
        if self.ticket is None:
            if len(buf) < TICKET_BYTES:
                return
            raw = bytes(buf[:TICKET_BYTES])
            del buf[:TICKET_BYTES]
            if self._timer is not None:
                self._timer.cancel()
            t = self.server._tickets.pop(raw, None)
            if self.uid != os.getuid() or t is None or t.expires < time.monotonic():
                log.warning("refused a lane connection (uid %d, %s ticket)", self.uid,
                            "no valid" if t is None else "an expired")
                self.transport.close()
                return
            if self.server.open_lanes >= self.server.table.max_regions:
                self.transport.write(FULL)  # (--max-regions lanes open: this one is not)
                self.transport.close()
                return
            self.ticket = t
            self.server.open_lanes += 1
            self.transport.write(ACCEPTED)
            if not buf:  # the caller waits for ACCEPTED: its next bytes may carry its ring's fd
                self._read_first()
                return
        if self.ring is not None:  # doorbells: the selector looks at the ring now
            del buf[:]
            self.server.poll()
            return
        pos = 0
        while not (self.paused or self.blocked) and len(buf) - pos >= REQUEST.size:
            head = REQUEST.unpack_from(buf, pos)
            name_len = head[9]
            if name_len > MAX_NAME_BYTES:
                log.warning("closed a lane after a malformed record: a weight name of %d "
                            "bytes", name_len)
                del buf[:]
                self.transport.close()
                return
            end = pos + REQUEST.size + name_len
            if len(buf) < end:
                break
            name = bytes(buf[pos + REQUEST.size : end]).decode("utf-8", "replace")
            pos = end
            if head[0] == 0 and head[8] == RING_SETUP:
                self.server._ring_setup(self, name)
                self._drop_passed()  # (a setup that did not take it)
                if self.ring is not None:  # what follows it: doorbells
                    del buf[:]
                    return
                continue
            self.inflight += 1
            if self.inflight >= MAX_PIPELINED:
                self.paused = True
                self.server.pauses += 1
                self.transport.pause_reading()
            self.server._request(self, head, name, len(buf) - pos < REQUEST.size)
        del buf[:pos]

    def _read_first(self) -> None:
        """The first read after ACCEPTED done with recvmsg (asyncio's transport reads with
        recv, which drops a passed descriptor): the transport's reading paused, a dup of the
        socket read once when readable (``_first_ready``), then the transport reads again."""
        assert self.transport is not None
        self.transport.pause_reading()
        sock = self.transport.get_extra_info("socket")
        self._first = socket.socket(fileno=os.dup(sock.fileno()))
        self._first.setblocking(False)
        asyncio.get_running_loop().add_reader(self._first.fileno(), self._first_ready)

    def _first_ready(self) -> None:
        first = self._first
        if first is None:
            return
        try:
            data, fds, _, _ = socket.recv_fds(first, 1 << 16, 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, fds = b"", []
        self._end_first()
        for fd in fds[1:]:  # (at most one asked for; the kernel closes any beyond)
            os.close(fd)
        if fds:
            self.passed = fds[0]
        if self.transport is None or self.transport.is_closing():
            self._drop_passed()
            return
        if not data:  # the caller hung up
            self._drop_passed()
            self.transport.close()
            return
        self.buf += data
        self._parse()
        self._drop_passed()  # (the first record was no ring setup)
        self._resume()

    def _end_first(self) -> None:
        first, self._first = self._first, None
        if first is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(first.fileno())
            first.close()

    def take_passed(self) -> int:
        """The passed descriptor, now the caller's of this call (-1: none came)."""
        fd, self.passed = self.passed, -1
        return fd

    def _drop_passed(self) -> None:
        if self.passed >= 0:
            os.close(self.take_passed())

    def write(self, rec: bytes) -> None:
        ring = self.ring
        if ring is not None:
            if ring.put(rec) and self.transport is not None \
                    and not self.transport.is_closing():
                self.transport.write(b"\x01")  # the doorbell: the caller sleeps
            return
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(rec)

    def answer(self, rec: bytes) -> None:
        """A request's reply record; its place in the lane is free again."""
        self.write(rec)
        self._freed()

    def task_done(self, task: asyncio.Task[None]) -> None:
        """A request run in a task (it wrote its reply) is over."""
        self.tasks.discard(task)
        self._freed()

    def _freed(self) -> None:
        self.inflight -= 1
        if self.paused and self.inflight < MAX_PIPELINED:
            self.paused = False
            self._resume()

    def _resume(self) -> None:
        """Reading again, unless paused for another reason (what waits in the buffer next)."""
        if (not self.paused and not self.blocked and self.transport is not None
                and not self.transport.is_closing()):
            self.transport.resume_reading()
            asyncio.get_running_loop().call_soon(self._parse)

    def pause_writing(self) -> None:
        """The replies not sent yet passed the high-water mark (the caller does not read
        them): no more requests of this lane are read (a ring lane's ring is not looked at)
        until they drain; its requests wait in the caller's socket or ring."""
        self.blocked = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
        self.server.blocks += 1

    def resume_writing(self) -> None:
        self.blocked = False
        self._resume()
        if self.ring is not None:  # (a request may wait in the ring: look now)
            self.server.poll()

    def connection_lost(self, exc: Exception | None) -> None:
        # requests in flight finish on the device (their regions let go); replies are dropped
        if self._timer is not None:
            self._timer.cancel()
        self.server._lanes.discard(self.transport)  # type: ignore[arg-type]
        if self.ticket is not None:  # (one of the lanes open)
            self.server.open_lanes -= 1
        self.server._ring_drop(self)  # (a killed caller's ring: let go, nothing kept)
        self._end_first()
        self._drop_passed()


def _map_passed(fd: int) -> tuple[mmap.mmap, tuple[int, int]]:
    """The ring whose descriptor came with its setup record (SCM_RIGHTS; -1: none came): a
    memfd of this user, RING_BYTES long and sealed against shrinking, mapped read-write; with
    the block's (device, inode). No path is opened (no /proc: a caller in another pid
    namespace that shares the lane's socket passes it the same way). Anything else is refused
    (INVALID_ARGUMENT, FAILED_PRECONDITION); the descriptor is closed either way."""
    if fd < 0:
        raise InvalidArgument(f"no descriptor came with the ring's setup {RING_PASSED!r}: "
                              "send the ring's memfd with it (SCM_RIGHTS)")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument("the ring's passed descriptor is no memfd")
        if st.st_uid != os.getuid():
            raise InvalidArgument("the ring's passed descriptor is not a file of this user")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0  # (not a memfd)
        if not seals & fcntl.F_SEAL_SHRINK:
            raise InvalidArgument("the ring's passed descriptor is no memfd sealed against "
                                  "shrinking (F_SEAL_SHRINK): a ring must be one")
        size = os.fstat(fd).st_size  # (after the seal: it cannot shrink from now on)
        if size != RING_BYTES:
            raise InvalidArgument(f"a ring's memfd must be {RING_BYTES} bytes, not {size}")
        try:
            return mmap.mmap(fd, RING_BYTES), (st.st_dev, st.st_ino)
        except OSError as e:  # (e.g. passed read-only)
            raise FailedPrecondition(f"cannot map the ring's passed descriptor read-write: "
                                     f"{e.strerror}") from None
    finally:
        os.close(fd)


class _Ring:
    """A lane's ring block: its own shared-memory object, mapped for the lane's life."""

    __slots__ = ("inode", "mm", "mv", "seen")

    def __init__(self, mm: mmap.mmap, inode: tuple[int, int] = (0, 0)) -> None:
        self.mm, self.inode = mm, inode
        self.mv = memoryview(mm)
        self.seen = SEQ.unpack_from(self.mv, R_SEQ)[0]  # (what is there now is no request)

    def put(self, rec: bytes) -> bool:
        """A reply record (its message cut to RING_MSG_MAX) into the ring, its seq last;
        True: the caller's flag says it sleeps (ring its doorbell)."""
        mv = self.mv
        if len(rec) == REPLY.size:
            mv[R_REP : R_REP + REPLY.size] = rec
        else:
            f = list(REPLY.unpack_from(rec))
            msg = rec[REPLY.size : REPLY.size + RING_MSG_MAX]
            f[2] = len(msg)
            REPLY.pack_into(mv, R_REP, *f)
            mv[R_MSG : R_MSG + len(msg)] = msg
        SEQ.pack_into(mv, R_RSEQ, SEQ.unpack_from(rec)[0])
        return FLAG.unpack_from(mv, R_CSLEEP)[0] != 0

    def close(self) -> None:
        """The mapping closed (the view first)."""
        self.mv.release()
        self.mm.close()


_CODES: dict[tuple[int, int, int], tuple[np.dtype, np.dtype, Any]] = {}


def _codes(x_dt: int, out_dt: int, prec: int) -> tuple[np.dtype, np.dtype, Any]:
    """A record's (x dtype, out dtype, precision) numbers decoded (a refusal raises), kept per
    combination: only valid ones are kept, a few dozen at most (~1.3 us a request less)."""
    got = _CODES.get((x_dt, out_dt, prec))
    if got is None:
        # (out's checked first, as before)
        out = wire_requests.lane_dtype(out_dt, "out_dtype", default_f32=True)
        got = (wire_requests.lane_dtype(x_dt, "x_dtype"), out, wire_requests.lane_precision(prec))
        _CODES[(x_dt, out_dt, prec)] = got
    return got


def _nan(v: float | None) -> float:
    return math.nan if v is None else v


def _failed(seq: int, e: Exception) -> bytes:
    """The reply record of a request that failed with ``e`` (its status and message)."""
    code, msg = _status(e)
    data = msg.encode()[:65536]
    return REPLY.pack(seq, code, len(data), 0, 0, 0, 0, math.nan, math.nan, math.nan) + data


def _status(e: Exception) -> tuple[int, str]:
    from .interceptor import status_code

    if isinstance(e, Q6Error):
        return int(status_code(e).value[0]), str(e)
    log.error("lane request failed", exc_info=e)
    return 13, "internal error (logged by the worker)"  # INTERNAL


async def open_lane(server: LaneServer | None, table: RegionTable, engine: Any, owner: str,
                    region: str) -> tuple[LaneServer, str, bytes]:
    """OpenLane: check the region is the caller's, start the server on first use; return
    (server, socket path, ticket)."""
    with table.use(owner, RegionRef(region, 0)):  # allowed, known, owned (or the error)
        pass
    if server is None:
        server = LaneServer(table, engine)
        await server.start()
    return server, server.path, server.ticket(owner, region)

