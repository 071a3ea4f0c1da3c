"""A front-end process's proxies of the device process (service/frontends.py): ``_Link``,
its end of the device socket (request ids -> futures; answers read from the arena's slots),
``EngineProxy``, what the servicer needs of an Engine (small calls stacked per weight: one
message and one engine request for several callers), and ``_PlaneProxy``, the device
process's region plane (a region call as one "rm" frame). Made by the front end's start-up
(frontends_front.py ``_frontend``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import numpy as np

from q6serve.kernels.api import dtype_name
from q6serve.kernels.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable

from . import envvars, wire_replies, wire_requests
from .engine import MatmulReply
from .engine_types import MatmulCall
from .frontends_arena import Arena
from .frontends_ipc import (
    _LAYOUT_OF,
    _LE,
    _NAME,
    _PRECISION_OF,
    _desc,
    _dress,
    _Out,
    _Peer,
    _portable_error,
    _reply,
)
from .regions import RegionIO, YSpec

log = logging.getLogger("q6serve.frontends")
GROUP_MAX_ROWS = 64  # a front end stacks small calls up to this many rows (EngineProxy)
# a front end's stacked requests per (weight, dtypes, K) on the device at once; later calls
# wait for one of them to be answered and go stacked (EngineProxy: fewer, larger messages).
# Env Q6SERVE_FRONTEND_STACKS (read when a front end starts; 0: no limit). Two: one measured
# better only with round-robin connections, and T2 under the default connection hash fell with
# it in session 13's closing check (bench/RESULTS.md, issue 15 session 13).
STACKS_IN_FLIGHT = int(envvars.FRONTEND_STACKS.default)
STACKS_ENV = envvars.FRONTEND_STACKS.name


def stacks_in_flight(env: Mapping[str, str] | None = None) -> int:
    """STACKS_IN_FLIGHT, or the env's count (0: unlimited)."""
    return int(envvars.FRONTEND_STACKS.read(env)) or 1 << 30


# a reply's y in a slot at most this big is copied out at once, so the slot is free at once
# and the callers share the copy; a bigger one is viewed in place and its slot freed when the
# last view goes (a weakref.finalize per view, ~3 us: more than copying a small y)
COPY_Y_BYTES = 64 << 10

# (call, its future, its sink): a matmul of a front end not answered yet
_Pending = tuple[MatmulCall, "asyncio.Future[Any]", "Callable[[Any], None] | None"]


def _resolve(fut: asyncio.Future[Any], sink: Callable[[Any], None] | None,
             outcome: Any) -> None:
    """Settle ``fut`` with ``outcome`` (an exception: failed) and tell its sink in this trip,
    as the Engine does (``Batcher._resolve``); a caller that gave up is skipped. A failing
    sink is logged: it must not take the device socket down with it."""
    if fut.done():
        return
    if isinstance(outcome, BaseException):
        fut.set_exception(outcome)
    else:
        fut.set_result(outcome)
    if sink is not None:
        try:
            sink(fut)
        except Exception:
            log.exception("a matmul's sink failed")


class _Link(_Peer):
    """The front end's connection to the device process: request ids -> futures. Its first
    message from the device process is the ack of the hello (``acked``)."""

    out: _Out

    def __init__(self, arena: Arena) -> None:
        super().__init__()
        self.arena = arena
        self._ids = 0
        # rid -> (future, slot, stack, sink, weight names): see request
        self._waiting: dict[int, tuple[Any, ...]] = {}
        self.free_slots = list(range(arena.slots))
        self.serving = True
        self.loop = loop = asyncio.get_running_loop()
        self.acked: asyncio.Future[tuple[Any, ...]] = loop.create_future()
        # the device process's drain order: the grace period (0.0: the device process is gone)
        self.stop_order: asyncio.Future[float] = loop.create_future()
        self.on_health: Callable[[bool], None] = lambda ok: None
        self.rows: dict[str, int] = {}  # weight -> rows, seen in replies (stream back-pressure)

    def request(self, msg: tuple[Any, ...], slot: int = -1,
                fut: asyncio.Future[Any] | None = None, group: _Stack | None = None,
                sink: Callable[[Any], None] | None = None, names: tuple[str, ...] = (),
                ) -> tuple[int, asyncio.Future[Any]]:
        """Send ``msg``; ``fut`` (made here unless given) gets the answer, then ``sink(fut)``
        runs; ``names``: the weights of a matmul (their rows are noted from the reply).
        ``group``: the request is several callers' matmuls stacked (EngineProxy._send_group):
        each of their futures gets its rows of y, ``fut`` is not used."""
        self._ids = rid = self._ids + 1
        if fut is None:
            fut = self.loop.create_future()
        self._waiting[rid] = (fut, slot, group, sink, names)
        self.out.send((msg[0], rid, *msg[1:]))
        return rid, fut

    async def call(self, method: str, *args: Any) -> Any:
        _, fut = self.request(("call", method, args))
        return await fut

    def free(self, slot: int) -> None:
        self.free_slots.append(slot)

    def _y(self, slot: int, out: tuple[int, str, tuple[int, ...]],
           in_slot: list[int]) -> np.ndarray:
        """y at ``out`` (offset, dtype, shape) of ``slot``: a copy when small (COPY_Y_BYTES),
        else a view that holds the slot (``in_slot`` counts them, see _free_part). A view's
        slices do not hold it (their base is the arena): each holder needs its own view."""
        off, dt, shape = out
        y = self.arena.array(slot, _LE[dt], shape, writable=False, offset=off)
        if y.nbytes <= COPY_Y_BYTES:
            return y.copy()
        in_slot[0] += 1
        weakref.finalize(y, self._free_part, slot, in_slot)
        return y

    def _answer_group(self, group: _Stack, slot: int, fields: tuple[Any, ...],
                      out: Any) -> None:
        """A stacked request's reply: each caller its rows of y (slices of one copy of a
        small y; views of the slot for a big one, see _y)."""
        in_slot = [1]  # one for this loop: the slot is not freed while callers are served
        y: Any = out
        if isinstance(out, tuple):
            off, dt, shape = out
            if shape[0] * shape[1] * _LE[dt].itemsize <= COPY_Y_BYTES:
                y = self._y(slot, out, in_slot)
        kernel, layout, precision, queue, kernel_s, rows, reqs, device_s, topk = fields
        layout, precision = _LAYOUT_OF[layout], _PRECISION_OF[precision]
        row = 0
        for c, f, sink in group.members:
            n = c.x.shape[0]
            if f.done():  # the caller gave up
                row += n
                continue
            if isinstance(y, tuple):
                part = self._y(slot, (off + row * shape[1] * _LE[dt].itemsize, dt,
                                      (n, shape[1])), in_slot)
            else:
                part = y[row : row + n]
            row += n
            _resolve(f, sink, MatmulReply(part, kernel, layout, precision, queue, kernel_s,
                                          rows, reqs, device_s, topk))
        self.rows[group.key[0]] = int(out[2][1] if isinstance(out, tuple) else out.shape[1])
        if slot >= 0:
            self._free_part(slot, in_slot)

    def _free_part(self, slot: int, in_slot: list[int]) -> None:
        in_slot[0] -= 1
        if not in_slot[0]:
            self.free(slot)

    def message(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind in ("ok", "err", "mmok", "rmok"):
            self._answer(msg)
        elif kind == "health":
            self.on_health(msg[1])
        elif kind == "drain":
            self.serving = False
            if not self.stop_order.done():
                self.stop_order.set_result(float(msg[1]))
        elif not self.acked.done():
            self.acked.set_result(msg)

    def lost(self) -> None:
        """The device process went away: every waiting call fails, the front end stops."""
        self.serving = False
        waiting, self._waiting = self._waiting, {}
        gone = Unavailable("the worker's device process went away")
        for fut, _, group, sink, _ in waiting.values():
            if group is None:
                _resolve(fut, sink, gone)
                continue
            group.answered()  # the calls waiting behind it then fail, not sent
            for _, f, s in group.members:
                _resolve(f, s, gone)
        if not self.acked.done():
            self.acked.set_exception(Unavailable("the device process closed the connection"))
        if not self.stop_order.done():
            self.stop_order.set_result(0.0)

    def _answer(self, msg: tuple[Any, ...]) -> None:
        kind, rid = msg[0], msg[1]
        got = self._waiting.pop(rid, None)
        if got is None:
            return
        fut, slot, group, sink, names = got
        if group is not None:
            group.answered()
        if kind == "err":
            if slot >= 0:
                self.free(slot)
            if group is None:
                _resolve(fut, sink, msg[2])
            elif len(group.members) > 1 and isinstance(msg[2],
                                                       InvalidArgument | FailedPrecondition):
                group.one_by_one()  # maybe one caller's input: each gets its own answer
            else:
                for _, f, s in group.members:
                    _resolve(f, s, msg[2])
            return
        if kind == "ok":
            _resolve(fut, sink, msg[2])
            return
        if kind == "rmok":  # y is in the caller's region (_PlaneProxy.matmul)
            dt, shape = msg[3]
            _resolve(fut, sink, _reply(msg[2], YSpec(_LE[dt], tuple(shape))))
            return
        reply, outs = msg[2], msg[3]
        if group is not None:
            self._answer_group(group, slot, reply, outs[0])
            return
        ys: list[np.ndarray | None] = []
        in_slot = [1]  # ys viewing the slot (+ this loop): it is free once all are gone
        for out in outs:
            ys.append(self._y(slot, out, in_slot) if isinstance(out, tuple) else out)
        for name, y in zip(names if isinstance(reply, tuple) else [n for n, _ in reply], ys,
                           strict=True):
            if y is not None:
                self.rows[name] = int(y.shape[1])
        if slot >= 0:
            self._free_part(slot, in_slot)
        _resolve(fut, sink, _dress(reply, ys))
        # a caller that gave up: y (and with it the slot, if viewed) goes with this frame


class _Stack:
    """Several callers' calls sent as one request (EngineProxy._send_group), in order. When
    the stack was refused as INVALID_ARGUMENT or FAILED_PRECONDITION, which may be one
    caller's input, they are sent again one by one (as the batcher isolates such a request,
    each caller then gets its own answer)."""

    __slots__ = ("key", "members", "proxy")

    def __init__(self, proxy: EngineProxy, key: tuple[Any, ...],
                 members: list[_Pending]) -> None:
        self.proxy, self.key, self.members = proxy, key, members

    def one_by_one(self) -> None:
        for c, f, sink in self.members:
            if not f.done():
                self.proxy._send(c, f, sink)

    def answered(self) -> None:
        """The device process answered the stack (or went away)."""
        self.proxy._answered(self.key)


class EngineProxy:
    """What the servicer needs of an Engine, answered by the device process."""

    # a multi-weight call goes to the device process whole, which fans it out to the
    # weights' batchers (the servicer leaves the fan-out to this engine)
    takes_multi_weight = True

    def __init__(self, link: _Link) -> None:
        self.link = link
        # groupable calls not sent yet by (weight, x dtype, K, precision, out dtype)
        self._groups: dict[tuple[Any, ...], list[_Pending]] = {}
        self._stacks: dict[tuple[Any, ...], int] = {}  # stacked requests in flight, by key
        self.stacks_in_flight = stacks_in_flight()
        self._flushing = False
        self._rows: dict[str, _Rows] = {}  # what get answers, by weight

    @property
    def serving(self) -> bool:
        return self.link.serving

    def start_matmul(self, call: MatmulCall, sink: Callable[[Any], None] | None = None,
                     ) -> asyncio.Future[MatmulReply]:
        """As Engine.start_matmul; ``sink(fut)`` runs in the loop trip that resolves the
        future (the one that reads the device process's answer; not when the future is
        cancelled from outside).

        Plain single-weight calls of a few rows wait for the end of this loop iteration and
        go to the device process stacked with the others for the same weight, dtypes and K
        (up to GROUP_MAX_ROWS rows: one IPC message and one engine request for all of them;
        the device process's per-request work was T2's ceiling, bench/RESULTS.md). While
        ``stacks_in_flight`` stacks of that key are on the device (one running, one queued in
        its batcher), they wait for the first answer instead: the device could not run them
        sooner, and they go as one larger stack."""
        link = self.link
        if not link.serving:
            raise Unavailable("the worker is draining and takes no new requests")
        fut: asyncio.Future[Any] = link.loop.create_future()
        x = call.x
        if (call.weights or call.topk or x.ndim != 2
                or not 1 <= x.shape[0] <= GROUP_MAX_ROWS // 2):
            self._send(call, fut, sink)
            return fut
        key = (call.weight, x.dtype, x.shape[1], call.precision, call.out_dtype)
        if (waiting := self._groups.get(key)) is None:
            self._groups[key] = [(call, fut, sink)]
        else:
            waiting.append((call, fut, sink))
        if not self._flushing and self._stacks.get(key, 0) < self.stacks_in_flight:
            self._flushing = True
            link.loop.call_soon(self._flush)
        return fut

    def _send(self, call: MatmulCall, fut: asyncio.Future[Any],
              sink: Callable[[Any], None] | None) -> None:
        """One call as one request; its x in a free slot when it fits."""
        x, link = call.x, self.link
        slot = link.free_slots.pop() if link.free_slots else -1
        if slot >= 0 and x.nbytes <= link.arena.slot_bytes:
            link.arena.array(slot, x.dtype.newbyteorder("<"), x.shape, writable=True)[...] = x
            xs: Any = _desc(x)
        else:
            xs = np.ascontiguousarray(x)
        link.request(("mm", call.weight, call.weights, call.topk, call.precision.value,
                      dtype_name(call.out_dtype), call.timeout, xs, slot), slot, fut,
                     sink=sink, names=call.weights or (call.weight,))

    def _flush(self) -> None:
        """The waiting calls out, one request per key split at GROUP_MAX_ROWS rows, except
        for keys with ``stacks_in_flight`` stacks on the device (their first answer flushes)."""
        self._flushing = False
        for key in [k for k in self._groups
                    if self._stacks.get(k, 0) < self.stacks_in_flight or not self.link.serving]:
            live = [p for p in self._groups.pop(key) if not p[1].done()]  # not cancelled
            chunk: list[_Pending] = []
            rows = 0
            for p in live:
                n = p[0].x.shape[0]
                if chunk and rows + n > GROUP_MAX_ROWS:
                    self._send_group(key, chunk, rows)
                    chunk, rows = [], 0
                chunk.append(p)
                rows += n
            if chunk:
                self._send_group(key, chunk, rows)
        self.link.out.flush_now()  # the stacks go now, not a loop iteration later

    def _answered(self, key: tuple[Any, ...]) -> None:
        """A stack of ``key`` was answered: calls waiting for it go out (end of this trip:
        with the other answers read with this one, one stack)."""
        if (n := self._stacks[key] - 1) > 0:
            self._stacks[key] = n
        else:
            del self._stacks[key]
        if key in self._groups and not self._flushing:
            self._flushing = True
            self.link.loop.call_soon(self._flush)

    def _send_group(self, key: tuple[Any, ...], members: list[_Pending], rows: int) -> None:
        if not self.link.serving:
            for _, f, sink in members:
                _resolve(f, sink, Unavailable("the worker is draining and takes no new "
                                              "requests"))
            return
        weight, dtype, k, precision, out_dtype = key
        link = self.link
        dtype = dtype.newbyteorder("<")
        shape = (rows, k)
        slot = link.free_slots.pop() if link.free_slots else -1
        if slot >= 0 and rows * k * dtype.itemsize <= link.arena.slot_bytes:
            # straight into the slot: no concatenated copy
            np.concatenate([c.x for c, _, _ in members],
                           out=link.arena.array(slot, dtype, shape, writable=True))
            xs: Any = (_NAME.get(dtype) or dtype_name(dtype), shape)
        else:
            xs = np.concatenate([c.x for c, _, _ in members])
        # the longest deadline: a caller's own deadline still ends its RPC (gRPC enforces it)
        timeout: float | None = 0.0
        for c, _, _ in members:
            if c.timeout is None:
                timeout = None
                break
            timeout = max(timeout, c.timeout)
        self._stacks[key] = self._stacks.get(key, 0) + 1
        link.request(("mm", weight, (), 0, precision.value,
                      _NAME.get(out_dtype) or dtype_name(out_dtype), timeout, xs, slot), slot,
                     group=_Stack(self, key, members))

    async def matmul(self, call: MatmulCall) -> MatmulReply:
        # shielded: a cancelled caller must not cancel the future the reply resolves (its
        # slot is freed only when the device process has answered)
        return await asyncio.shield(self.start_matmul(call))

    def get(self, name: str) -> Any:
        """Sync, for the stream's back-pressure estimate only: rows seen in replies."""
        rows = self.link.rows.get(name)
        if rows is None:
            raise NotFound(f"rows of {name!r} not seen yet")
        if (got := self._rows.get(name)) is None or got.rows != rows:
            got = self._rows[name] = _Rows(rows)  # (one per call was ~1 us of the stream's)
        return got

    async def load_gguf(self, *a: Any) -> Any:
        return await self.link.call("load_gguf", *a)

    async def upload(self, spec: Any, chunks: AsyncIterator[bytes]) -> Any:
        rid, fut = self.link.request(("up", spec))
        try:
            async for c in chunks:
                if fut.done():
                    break  # refused already (header, budget): stop reading the client
                self.link.out.send(("upc", rid, bytes(c)))
                await self.link.drain()
            else:
                self.link.out.send(("upc", rid, None))
        except BaseException as e:
            self.link.out.send(("upc", rid, _portable_error(e)
                                     if isinstance(e, Exception) else
                                     Unavailable("the upload was cancelled")))
            raise
        return await fut

    async def unload(self, name: str) -> Any:
        return await self.link.call("unload", name)


@dataclasses.dataclass(frozen=True)
class _Rows:
    rows: int


# wire_requests.matmul_call's x for a request whose x is in a region
_NO_X = np.empty((0, 0), np.float32)


class _PlaneProxy:
    """The device process's RegionPlane, seen from a front end."""

    def __init__(self, link: _Link) -> None:
        self.link = link

    async def register(self, owner: str, name: str, src: Any) -> Any:
        return await self.link.call("region", "register", owner, name, src)

    async def unregister(self, owner: str, name: str) -> Any:
        return await self.link.call("region", "unregister", owner, name)

    async def list(self, owner: str) -> Any:
        return await self.link.call("region", "list", owner)

    async def open_lane(self, owner: str, region: str) -> Any:
        return await self.link.call("region", "open_lane", owner, region)  # lanes: device side

    async def matmul(self, owner: str, io: RegionIO, req: Any, timeout: float | None,
                     t0: float) -> Any:
        """x and y both in regions: one "rm" message of plain values (the device process
        answers from the engine's sink, FrontendsWorker._region_matmul); otherwise (x or y
        inline) the request itself goes as a device call."""
        if io.x is None or io.y is None:
            return await self.link.call("region", "matmul", owner, io,
                                        req.SerializeToString(), timeout, t0)
        call = wire_requests.matmul_call(req, timeout, _NO_X)  # the request's checks, x aside
        assert io.x_dtype is not None and io.x_shape is not None
        decoded = time.perf_counter()
        _, fut = self.link.request((
            "rm", owner, (io.x.region, io.x.offset, _NAME.get(io.x_dtype) or
                          dtype_name(io.x_dtype), tuple(io.x_shape)),
            (io.y.region, io.y.offset), call.weight, call.precision.value,
            _NAME.get(call.out_dtype) or dtype_name(call.out_dtype), timeout))
        return await fut, wire_replies.Took(t0, decoded)
