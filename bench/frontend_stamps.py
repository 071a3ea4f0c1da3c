"""Per-call stamps inside a ``--frontends`` worker, for bench/t2_timeline.py (issue 15, T2's
p99; a bench diagnostic, never in the product: only bench/timeline_site/sitecustomize.py
installs it, when ``Q6SERVE_FE_STAMPS`` names a folder).

In a front end (``install_front``) every MatmulStream reply's request_id becomes

    "PID START IN SENT READ RESOLVED END SEND"

in integer microseconds of perf_counter (CLOCK_MONOTONIC: one clock for every process of the
host, so the caller subtracts its own stamps): the front end's pid; START, when the worker took
the request's bytes (the interceptor's RPC_START, ``Took.start``); IN, when the servicer handed
the decoded call to the EngineProxy (``start_matmul``); SENT, when its stack left for the
device process (the end of ``EngineProxy._flush``, whose last step writes the socket); READ,
when the front end began reading the device process's answer (``_Link._answer``); RESOLVED,
when this caller's future was settled (``_resolve``: the answer's earlier callers' sinks ran
before); END, when its reply was encoded (``wire_replies.stream_reply``, in its sink); SEND, when
the stream's writer handed it to gRPC (``_Replies.send``). Calls that miss a stamp (the direct path,
errors) keep their request_id.

In every worker process (``install_stalls``: the device process and each front end) the
interpreter's pauses are logged to ``DIR/stalls-ROLE-PID.jsonl``: each cyclic-GC collection of
at least 0.1 ms (every full one) and each stretch of at least 0.5 ms that the event loop ran
without looking at its sockets (between two selector calls), as [start us, length us, kind,
the thread's CPU us in it (less than the length: it waited for a core or the GIL)], kind
"gc0".."gc2" (then also the objects it collected, and after a full one the objects the GC
tracks) or "loop", written every 0.5 s by a daemon
thread, which also writes the process's cumulative counters then as [when us, loop busy us,
"cpu", loop in select us, process CPU us, loop thread CPU us] (busy: the loop's time outside
its selector's select, less a busy-polling spin's own steps).
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import threading
import time
from typing import Any

GC_MIN_S = 1e-4
LOOP_MIN_S = 5e-4
SPIN_GAP_S = 1e-5


def _us(t: float) -> int:
    return int(t * 1e6)


def install_stalls(folder: str, role: str) -> None:
    """Log this process's GC pauses and long loop iterations (module docstring)."""
    pc = time.perf_counter
    got: list[list[Any]] = []
    tt = time.thread_time
    gc_start = [0.0, 0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_start[0], gc_start[1] = pc(), tt()
        elif (d := pc() - gc_start[0]) >= GC_MIN_S or info.get("generation") == 2:
            got.append([_us(gc_start[0]), _us(d), f"gc{info.get('generation', '?')}",
                        _us(tt() - gc_start[1]), info.get("collected", 0),
                        len(gc.get_objects()) if info.get("generation") == 2 else 0])

    gc.callbacks.append(on_gc)
    inner = selectors.EpollSelector.select
    last = [0.0, 0.0]  # when the previous select returned (0: none yet), the thread's CPU then
    # the loop's time outside select (its work) and inside; a gap after an empty select shorter
    # than SPIN_GAP_S is a busy-polling spin's own step (service/threads.py), not work
    busy = [0.0, 0.0]
    found = [True]  # the previous select returned events

    def select(self: Any, timeout: float | None = None) -> Any:
        t = pc()
        if last[0]:
            d = t - last[0]
            if d >= LOOP_MIN_S:
                got.append([_us(last[0]), _us(d), "loop", _us(tt() - last[1])])
            if found[0] or d >= SPIN_GAP_S:
                busy[0] += d
        events: Any = ()
        try:
            events = inner(self, timeout)
            return events
        finally:
            last[0], last[1] = pc(), tt()
            busy[1] += last[0] - t
            found[0] = bool(events)

    selectors.EpollSelector.select = select  # type: ignore[method-assign]
    path = os.path.join(folder, f"stalls-{role}-{os.getpid()}.jsonl")
    main_clock = time.pthread_getcpuclockid(threading.main_thread().ident or 0)

    def writer() -> None:
        while True:
            time.sleep(0.5)
            # the cumulative counters: [when, "cpu", loop busy, in select, process CPU, the
            # loop (main) thread's CPU], us
            got.append([_us(pc()), _us(busy[0]), "cpu", _us(busy[1]), _us(time.process_time()),
                        _us(time.clock_gettime(main_clock))])
            out, got[:] = got[:], []
            with open(path, "a") as f:
                f.write("".join(json.dumps(x) + "\n" for x in out))

    threading.Thread(target=writer, daemon=True, name="fe-stamps").start()


def install_front() -> None:
    """Stamp each stream reply's request_id in this front end (module docstring)."""
    from q6serve.service import frontends_proxy, rawmsg, servicer, wire_replies

    pc = time.perf_counter
    pid = os.getpid()
    calls: dict[int, list[float]] = {}  # id(future) -> [IN, SENT]
    flushed: list[Any] = []  # futures stacked in the flush that runs now
    read = [0.0]  # READ of the answer being read
    now: list[tuple[float, ...] | None] = [None]  # (IN, SENT, READ, RESOLVED) of the sink
    tags: dict[int, str] = {}  # id(encoded reply) -> its stamps until SEND

    start_matmul = frontends_proxy.EngineProxy.start_matmul

    def stamped_start(self: Any, call: Any, sink: Any = None) -> Any:
        t = pc()
        fut = start_matmul(self, call, sink)
        calls[id(fut)] = [t, 0.0]
        return fut

    send_group = frontends_proxy.EngineProxy._send_group

    def stamped_group(self: Any, key: Any, members: Any, rows: int) -> None:
        flushed.extend(f for _, f, _ in members)
        send_group(self, key, members, rows)

    flush = frontends_proxy.EngineProxy._flush

    def stamped_flush(self: Any) -> None:
        try:
            flush(self)
        finally:
            t = pc()
            for f in flushed:
                if (c := calls.get(id(f))) is not None:
                    c[1] = t
            flushed.clear()

    answer = frontends_proxy._Link._answer

    def stamped_answer(self: Any, msg: Any) -> None:
        read[0] = pc()
        answer(self, msg)

    resolve = frontends_proxy._resolve

    def stamped_resolve(fut: Any, sink: Any, outcome: Any) -> None:
        c = calls.pop(id(fut), None)
        now[0] = (c[0], c[1], read[0], pc()) if c is not None and c[1] else None
        try:
            resolve(fut, sink, outcome)
        finally:
            now[0] = None

    stream_reply = wire_replies.stream_reply

    def stamped_reply(r: Any, request_id: str, took: Any = None) -> Any:
        out = stream_reply(r, request_id, took)
        if took is not None and (c := now[0]) is not None:
            tags[id(out)] = f"{pid} " + " ".join(str(_us(t)) for t in (took.start, *c, pc()))
        return out

    replies_init = servicer._Replies.__init__

    def stamped_init(self: Any, send: Any, window: Any) -> None:
        def stamped_send(item: Any) -> Any:
            if (tag := tags.pop(id(item), None)) is not None:
                tag = f"{tag} {_us(pc())}"
                if isinstance(item, bytes):  # a spliced reply: a later request_id field wins
                    item = item + rawmsg.record(1, len(tag)) + tag.encode()
                else:
                    item.request_id = tag
            return send(item)

        replies_init(self, stamped_send, window)

    frontends_proxy.EngineProxy.start_matmul = stamped_start  # type: ignore[method-assign]
    frontends_proxy.EngineProxy._send_group = stamped_group  # type: ignore[method-assign]
    frontends_proxy.EngineProxy._flush = stamped_flush  # type: ignore[method-assign]
    frontends_proxy._Link._answer = stamped_answer  # type: ignore[method-assign]
    frontends_proxy._resolve = stamped_resolve
    wire_replies.stream_reply = stamped_reply
    servicer._Replies.__init__ = stamped_init  # type: ignore[method-assign]


FIELDS = ("start", "in", "sent", "read", "resolved", "end", "send")


def parse(request_id: str) -> tuple[int, list[float]] | None:
    """(front end pid, [START .. SEND] in seconds) of a stamped request_id, else None."""
    parts = request_id.split()
    if len(parts) != 1 + len(FIELDS):
        return None
    try:
        return int(parts[0]), [int(v) * 1e-6 for v in parts[1:]]
    except ValueError:
        return None
