"""A front-end process of a ``--frontends N`` worker (service/frontends.py): the gRPC server
(the same servicer, interceptor, health and reflection as one process runs) over the proxies of
the device process's engine and region plane (frontends_proxy.py); its limits are its part of
the worker's, its request metrics go to the device process. Started by
``FrontendsWorker._spawn`` as ``python -c`` running ``frontend_main``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import signal
import sys
from collections.abc import Mapping
from typing import Any

from q6serve.kernels.errors import FailedPrecondition

from . import envvars, reuseport, wire, wire_standard
from .admission import Admission, StreamBudget, StreamSlots
from .affinity import cores_of, pin_process
from .auth import TokenAuth
from .config import WorkerConfig
from .frontends_arena import Arena
from .frontends_ipc import read_child_args
from .frontends_proxy import EngineProxy, _Link, _PlaneProxy
from .interceptor import ErrorInterceptor
from .servicer import Q6ServeServicer
from .threads import busy_poll
from .worker import build_server, stop_server

# a front end's loop may busy-poll (service/threads.py's busy_poll: select without blocking
# for up to this many us after its last event before it sleeps) so that a device answer or a
# gRPC event finds it running instead of woken from epoll. Env Q6SERVE_FRONTEND_BUSY_POLL_US
# (read when a front end starts). Off by default: on the H200 (16 cores) T2 through 8 front
# ends was not faster with 1000 us in an alternated A/B (13.1k/13.3k off, 14.5k/13.4k on; p99
# 8.2 -> 8.8/10.6 ms): the wait for the device's answer got shorter (server other 2.9 -> 2.3 ms)
# and gRPC's own transport longer (1.3 -> 1.6-1.9 ms; the spinning loop holds the GIL that
# gRPC's threads need). bench/RESULTS.md, issue 15 session 9.
FRONTEND_BUSY_POLL_ENV = envvars.FRONTEND_BUSY_POLL_US.name


def frontend_busy_poll_us(env: Mapping[str, str] | None = None) -> float:
    """A front end's spin before it sleeps, in us (0: off, the default)."""
    return float(envvars.FRONTEND_BUSY_POLL_US.read(env))  # type: ignore[arg-type]

METRICS_FLUSH_S = 0.2


class _MetricsForwarder:
    """The interceptor's request metrics, batched to the device process's one registry
    (grouped by labels: the device process looks each label set up once per batch)."""

    def __init__(self, link: _Link) -> None:
        self.link = link
        self.buf: dict[tuple[str, str, str], list[float]] = {}

    def observe_request(self, service: str, method: str, code: str, seconds: float) -> None:
        if (got := self.buf.get((service, method, code))) is None:
            self.buf[(service, method, code)] = [seconds]
        else:
            got.append(seconds)

    def flush(self) -> None:
        if self.buf and not self.link.out.transport.is_closing():
            buf, self.buf = self.buf, {}
            self.link.out.send(("metrics", [(*k, v) for k, v in buf.items()]))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(METRICS_FLUSH_S)
            self.flush()


class FrontendServicer(Q6ServeServicer):
    """The servicer over an EngineProxy: the engine's synchronous queries become device
    calls (awaited here); everything else is Q6ServeServicer's."""

    async def ListWeights(self, request: Any, context: Any) -> Any:
        return wire.list_response(await self.engine.link.call("list"))  # type: ignore[attr-defined]

    async def GetWeight(self, request: Any, context: Any) -> Any:
        return wire.get_response(
            await self.engine.link.call("get", request.name))  # type: ignore[attr-defined]

    async def GetStatus(self, request: Any, context: Any) -> Any:
        return wire.status_response(
            await self.engine.link.call("status"))  # type: ignore[attr-defined]

    async def SetFlags(self, request: Any, context: Any) -> Any:
        return wire.set_flags_response(await self.engine.link.call(  # type: ignore[attr-defined]
            "set_flags", wire.flag_changes(request)))


def share(total: int, n: int, index: int) -> int:
    """Front end ``index``'s part of a worker-wide limit ``total``: the parts of the N front
    ends add up to ``total`` (at least 1 each, so a limit below N admits N)."""
    return max(1, total // n + (index < total % n))


def frontend_limits(cfg: WorkerConfig, index: int) -> tuple[int, int, int]:
    """(unary RPCs in flight, bytes of all MatmulStream windows, streaming calls open) of
    front end ``index``: the worker's --max-inflight-rpcs, --max-stream-bytes-total and
    --max-streams split over the front ends, so
    the worker as a whole holds what one process would. The split is static, with no
    traffic between front ends on the hot path; a connection lives on one front end, so the
    per-connection limits apply unchanged (each capped by its front end's part)."""
    n = cfg.frontends
    return (share(cfg.max_inflight_rpcs, n, index), share(cfg.max_stream_bytes_total, n, index),
            share(cfg.max_streams, n, index))


def freeze_startup(env: Mapping[str, str] | None = None) -> bool:
    """With ``Q6SERVE_FRONTEND_GC_FREEZE=1`` (off by default: not measured on the H200), what
    a front end's start-up made (modules, gRPC's server, the servicer: ~47k objects the GC
    tracks) leaves the cyclic GC's generations (``gc.freeze``), so that a full collection
    walks only what came since. On the VM under T2-shaped load a front end ran a full
    collection every ~10k calls, 34-41 ms of CPU (64-94 ms of wall time) each, a stall of every
    call in flight on it; with the switch none came in 13k calls a front end
    (bench/t2_timeline.py, bench/RESULTS.md, session 11). True if it froze."""
    if not envvars.FRONTEND_GC_FREEZE.read(env):
        return False
    gc.freeze()
    return True


def frontend_main() -> None:
    """Entry point of a front-end process (FrontendsWorker._spawn): arguments on stdin."""
    (index, config, port, sock_path, slots, slot_bytes, log_level,
     steer) = read_child_args(sys.stdin.buffer)
    if config.cpus:  # its own core of --cpus where there are enough (service/affinity.py)
        pin_process(cores_of(config.cpus, index + 1, config.frontends))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the device drains
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s frontend{index}: %(name)s: "
                               "%(message)s")
    asyncio.run(_frontend(index, config, port, sock_path, slots, slot_bytes, steer))


async def _frontend(index: int, cfg: WorkerConfig, port: int, sock_path: str, slots: int,
                    slot_bytes: int, steer: tuple[int, int, int] | None = None) -> None:
    busy_poll(asyncio.get_running_loop(), lambda: True, frontend_busy_poll_us())
    arena = Arena.create(slots, slot_bytes)
    link = _Link(arena)
    try:
        await asyncio.get_running_loop().create_unix_connection(lambda: link, sock_path)
        link.out.send(("hello", index, os.getpid(), arena.name, slots, slot_bytes))
        ack = await link.acked
    finally:
        arena.unlink()  # mapped on both sides (or failed): the name is not needed any more
    if ack[0] != "ack":
        raise FailedPrecondition(f"the device process refused front end {index}: {ack!r}")
    metrics = _MetricsForwarder(link)
    flushing = asyncio.get_running_loop().create_task(metrics.run())
    auth = TokenAuth(cfg.token, cfg.admin_token)
    proxy = EngineProxy(link)
    inflight, stream_bytes, streams = frontend_limits(cfg, index)
    servicer = FrontendServicer(proxy, max_stream_bytes=cfg.max_stream_bytes,  # type: ignore[arg-type]
                                auth=auth, plane=_PlaneProxy(link),
                                stream_budget=StreamBudget(stream_bytes,
                                                           cfg.max_stream_bytes_per_connection))
    interceptor = ErrorInterceptor(metrics, auth,  # type: ignore[arg-type]
                                   Admission(inflight, cfg.max_inflight_rpcs_per_connection,
                                             cfg.min_inflight_rpcs_per_connection,
                                             cfg.reply_timeout_s), cfg.receive_limit,
                                   streams=StreamSlots(streams, cfg.max_streams_per_connection))
    server, health, _ = build_server(dataclasses.replace(cfg, port=port), servicer,
                                     interceptor, reuseport=True)
    await server.start()
    if steer is not None:  # (Q6SERVE_FRONTEND_ROUND_ROBIN) before "ready": before any caller
        reuseport.join(steer, index, port)
        for fd in steer:  # the group holds the program, the program its maps
            os.close(fd)

    async def set_health(ok: bool) -> None:
        for service in ("", wire.SERVICE_NAME):
            await health.set(service, wire_standard.health_status(ok))

    await set_health(True)
    health_tasks: set[asyncio.Task[None]] = set()

    def on_health(ok: bool) -> None:
        t = asyncio.get_running_loop().create_task(set_health(ok))
        health_tasks.add(t)
        t.add_done_callback(health_tasks.discard)

    link.on_health = on_health
    freeze_startup()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM,
                            lambda: link.stop_order.done() or link.stop_order.set_result(
                                cfg.grace_period_s))
    link.out.send(("ready",))
    grace = await link.stop_order
    await health.enter_graceful_shutdown()
    link.serving = False
    await stop_server(server, interceptor, grace)
    metrics.flush()
    link.out.flush()  # what is pending goes before the socket closes
    flushing.cancel()
    with contextlib.suppress(Exception):
        await link.drain()
    link.out.transport.close()  # writes what is buffered first
    arena.close()
