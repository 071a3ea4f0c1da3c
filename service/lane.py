"""The fast lane (issue 15 item 3): Matmuls of a co-located caller without RPCs.

After ``OpenLane`` (gRPC: identity, region ownership, the one-time ticket), the caller talks to
this worker over a Unix stream socket in fixed little-endian records (the byte layouts are in
the .proto's "Fast lane" section): a 40-byte request naming the weight and where x and y lie in
the caller's region, and a 56-byte reply with status and timing; x and y never travel, and the
socket is the wake-up (one write and one read per direction). Each request runs exactly as a
Matmul naming x_region/y_region (the same checks, the batcher, CUDA regions on the device), so
lane requests batch with everyone else's: with a system region as a front end's "rm" call runs
in the device process (``LaneServer._direct``: no task per request), otherwise through
``regions.matmul`` in a task.

One ``LaneServer`` per worker (the device process with --frontends), started by the first
OpenLane, closed with the region table (drain).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import shutil
import socket
import struct
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from q6serve.kernels.errors import InvalidArgument, Q6Error, ResourceExhausted, Unavailable

from . import regions, wire
from .engine import Engine, MatmulCall
from .regions import RegionIO, RegionRef, RegionTable

log = logging.getLogger("q6serve.lane")

REQUEST = struct.Struct("<QIIQQBBBBHH")  # seq n k x_off y_off x_dt out_dt prec 0 name_len 0
REPLY = struct.Struct("<QIIIIIIddd")  # seq code msg_len y_cols rows reqs 0 queue kernel device
TICKET_BYTES = 32
TICKET_TTL_S = 60.0
TICKET_WAIT_S = 10.0  # from connecting to the ticket
MAX_PIPELINED = 64  # requests of one lane in the worker at once; the reader waits beyond
MAX_NAME_BYTES = 1024
ACCEPTED = b"\x00"


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
        self._lanes: set[asyncio.StreamWriter] = set()
        self.direct = 0  # requests run by _direct (tests, benches)

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)
        self.table.on_close.append(self.close)
        log.info("fast lane socket %s", self.path)

    def ticket(self, owner: str, region: str) -> bytes:
        """A one-time ticket; lanes open or promised are at most --max-regions (each holds at
        most MAX_PIPELINED requests: what lanes add to the worker's load stays bounded)."""
        now = time.monotonic()
        for t in [t for t, v in self._tickets.items() if v.expires < now]:
            del self._tickets[t]  # unused tickets expire
        if len(self._lanes) + len(self._tickets) >= self.table.max_regions:
            raise ResourceExhausted(f"{len(self._lanes)} lanes open and {len(self._tickets)} "
                                    f"tickets unused: at most {self.table.max_regions} "
                                    "(--max-regions); close a lane first")
        t = secrets.token_bytes(TICKET_BYTES)
        self._tickets[t] = Ticket(owner, region, now + TICKET_TTL_S)
        return t

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._lanes):
            w.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._lanes.add(writer)
        try:
            sock = writer.get_extra_info("socket")
            uid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      12))[1]
            # a connection that never sends its ticket is dropped, not kept forever
            raw = await asyncio.wait_for(reader.readexactly(TICKET_BYTES), TICKET_WAIT_S)
            t = self._tickets.pop(raw, None)
            if uid != os.getuid() or t is None or t.expires < time.monotonic():
                log.warning("refused a lane connection (uid %d, %s ticket)", uid,
                            "no valid" if t is None else "an expired")
                return
            writer.write(ACCEPTED)
            await self._requests(reader, writer, t)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass  # the caller closed its lane (or never sent a ticket)
        except InvalidArgument as e:
            log.warning("closed a lane after a malformed record: %s", e)
        finally:
            self._lanes.discard(writer)
            writer.close()

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        t: Ticket) -> None:
        room = asyncio.Semaphore(MAX_PIPELINED)
        tasks: set[asyncio.Task[None]] = set()
        direct: list[int] = [0]  # requests of the direct path not yet answered
        try:
            while True:
                head = REQUEST.unpack(await reader.readexactly(REQUEST.size))
                seq, n, k, x_off, y_off, x_dt, out_dt, prec, _, name_len, _ = head
                if name_len > MAX_NAME_BYTES:
                    raise InvalidArgument(f"lane request names a weight of {name_len} bytes")
                name = (await reader.readexactly(name_len)).decode("utf-8", "replace")
                await room.acquire()
                if self._direct(writer, t, seq, name, n, k, x_off, y_off, x_dt, out_dt, prec,
                                room, direct):
                    continue
                task = asyncio.get_running_loop().create_task(
                    self._one(writer, t, seq, name, n, k, x_off, y_off, x_dt, out_dt, prec))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                task.add_done_callback(lambda _: room.release())
        finally:
            if tasks:  # the caller hung up: let its requests finish (their slots, regions)
                await asyncio.gather(*tasks, return_exceptions=True)
            while direct[0]:  # (rare: a caller gone with requests on the device)
                await asyncio.sleep(0.005)

    def _direct(self, writer: asyncio.StreamWriter, t: Ticket, seq: int, name: str, n: int,
                k: int, x_off: int, y_off: int, x_dt: int, out_dt: int, prec: int,
                room: asyncio.Semaphore, direct: list[int]) -> bool:
        """One request with x and y in a system region, as a front end's "rm" call runs in
        the device process (service/frontends.py ``_region_matmul``): the checks of
        ``regions.matmul`` now, in this loop trip; the call queued with a sink that answers
        (y already in place where the backend took the route, else copied there), lets the
        region go and frees the lane's room -- no task, no coroutine, no future awaited per
        request (on the H200 a lane call cost the device process ~550 us of CPU that way).
        False: not for this path (a CUDA region, an engine without ``start_matmul``): the
        caller runs it as a task. A refusal is answered here."""
        table, engine = self.table, self.engine
        start = getattr(engine, "start_matmul", None)
        if start is None:
            return False
        region = None
        key = None
        try:
            region = table.hold(t.owner, RegionRef(t.region, x_off))
            assert region is not None
            if region.kind != regions.SYSTEM:
                table.let_go(region)
                region = None
                return False
            out = wire.lane_dtype(out_dt, "out_dtype", default_f32=True)
            call = MatmulCall(name, region.array(x_off, wire.lane_dtype(x_dt, "x_dtype"),
                                                 (n, k), "x"),
                              wire.lane_precision(prec), out)
            if not engine.serving:
                raise Unavailable("the worker is draining and takes no new requests")
            rows = (engine.rows_of(name) if hasattr(engine, "rows_of")
                    else engine.get(name).rows)
            dest = region.array(y_off, out, (n, rows), "y", writable=True, alive=True)
            key = table.route(call.x, dest)
            direct[0] += 1
            held = region

            def answered(fut: asyncio.Future[Any]) -> None:
                try:
                    taken = table.unroute(key)
                    if fut.cancelled():
                        raise Unavailable("the call was cancelled")
                    r = fut.result()
                    y = r.y
                    if not taken and not regions.written(y, dest):
                        held.array(y_off, y.dtype, y.shape, "y", writable=True)[...] = y
                    rec = REPLY.pack(seq, 0, 0, int(y.shape[1]), r.batch_rows,
                                     r.batch_requests, 0, r.queue_seconds,
                                     _nan(r.kernel_seconds), _nan(r.device_seconds))
                except Exception as e:
                    rec = _failed(seq, e)
                finally:
                    table.let_go(held)
                    room.release()
                    direct[0] -= 1
                if not writer.is_closing():
                    writer.write(rec)

            self.direct += 1
            try:
                if type(engine) is Engine:  # its sink runs in the trip that resolves the call
                    start(call, answered)
                else:  # (a --devices worker's sharded call does not call a sink)
                    start(call).add_done_callback(answered)
            except BaseException:
                direct[0] -= 1
                raise
            return True
        except Exception as e:
            table.unroute(key)
            table.let_go(region)
            room.release()
            if not writer.is_closing():
                writer.write(_failed(seq, e))
            return True

    async def _one(self, writer: asyncio.StreamWriter, t: Ticket, seq: int, name: str, n: int,
                   k: int, x_off: int, y_off: int, x_dt: int, out_dt: int, prec: int) -> None:
        try:
            io = RegionIO(RegionRef(t.region, x_off), wire.lane_dtype(x_dt, "x_dtype"), (n, k),
                          RegionRef(t.region, y_off))
            out = wire.lane_dtype(out_dt, "out_dtype", default_f32=True)
            precision = wire.lane_precision(prec)

            def make_call(x: Any) -> MatmulCall:
                return MatmulCall(name, x, precision, out)

            if not self.engine.serving:
                raise Unavailable("the worker is draining and takes no new requests")
            r = await regions.matmul(self.table, self.engine, t.owner, io, make_call)
            rec = REPLY.pack(seq, 0, 0, int(r.y.shape[1]), r.batch_rows, r.batch_requests, 0,
                             r.queue_seconds, _nan(r.kernel_seconds), _nan(r.device_seconds))
        except Exception as e:
            rec = _failed(seq, e)
        if not writer.is_closing():
            writer.write(rec)


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

