"""Where a direct device job's host time goes, stamped inside the worker (issue 14 item 1,
session 19; a bench diagnostic, never in the product).

``install(path)`` (through bench/trips_site/sitecustomize.py when ``Q6SERVE_JOB_STAMPS`` names
the output file) patches, in this process: ``Device.run_now`` (the direct job on the loop
thread: j0 .. j1), ``BoundCall.launch`` / ``ManyCall.launch`` (a cached call's launch: l0 ..
l1; inside it the graph's launch, g0 .. g1, and the completion event's record, r0 .. r1,
through proxies put on the call), ``BoundCall._wait`` / ``ManyCall._wait`` (w0 .. w1; whether
the event was already done at w0, by cuEventQuery) and the event's synchronize (s0 .. s1, with
the thread's CPU time across it). The kernel's seconds come from the result; a stream reply's
window (wire_replies.stream_reply: the request taken and decoded, ``Took``, the reply encoded) is
joined to the direct jobs run since the last reply. Per job one row; at exit (the worker
drains on SIGTERM, then exits: atexit sees it) the rows' medians per part and per role and the
rows themselves go to ``path`` as JSON, and :func:`summary` prints them. Each stamp costs
~0.3-1 us (of the job it stamps). ``Q6SERVE_JOB_Y_BLOCKS=B`` also sets the launcher's
``Y_BLOCKS`` to B in the stamped process (0: a large y's pinned block from CuPy's pool per
call, as before session 20), for an A/B of the kept blocks in situ.

Parts (us): pre = j0 -> l0 (launch_ieee, CudaBackend.launch's lookup), launch = l0 -> l1: x_in
= l0 -> g0 (x into the pinned buffer, the device's context), graph = g0 -> g1 (the graph
launch), y_out = g1 -> r0 (a large y's way out), record = r0 -> r1; gap = l1 -> w0,
pre_wait = w0 -> s0, wait = s0 -> s1 (its CPU: wait_cpu; a wait that blocks or waits for the
GIL has CPU well below its wall), post = s1 -> w1 (the kernel's events read, y copied out),
after = w1 -> j1 (the result built up to run_now's return), job = j0 -> j1, kernel; beyond =
job - kernel (what the service calls the device job's host path).
"""

from __future__ import annotations

import argparse
import atexit
import collections
import ctypes
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

RING = 50000  # jobs kept
now = time.perf_counter
cpu = time.thread_time_ns


def install(path: str) -> None:
    """Stamp this process's direct jobs (see the module docstring); ``{pid}`` in ``path`` is
    replaced by the process id (workers of one run: one file each)."""
    path = path.replace("{pid}", str(os.getpid()))
    from q6serve.kernels.cuda import launch as L
    from q6serve.service import device_thread, wire_replies

    if os.environ.get("Q6SERVE_JOB_Y_BLOCKS"):  # (an A/B of Workspace.y_block, session 20)
        L.Y_BLOCKS = int(os.environ["Q6SERVE_JOB_Y_BLOCKS"])

    try:
        query = ctypes.PyDLL("libcuda.so.1").cuEventQuery
        query.argtypes = [ctypes.c_void_p]
        query.restype = ctypes.c_int
    except (OSError, AttributeError):
        query = None
    rows: collections.deque[dict[str, Any]] = collections.deque(maxlen=RING)
    local = threading.local()  # per thread: the job being stamped, whether inside run_now
    run_now = device_thread.Device.run_now

    def row() -> dict[str, Any]:
        cur = getattr(local, "cur", None)
        if cur is None:
            cur = local.cur = {}
            local.direct = False
        return cur

    def stamped_run_now(self: Any, fn: Any, *args: Any) -> Any:
        cur = row()
        cur.clear()
        local.direct = True
        cur["j0"] = now()
        try:
            return run_now(self, fn, *args)
        finally:
            cur["j1"] = now()
            local.direct = False
            if "s1" in cur:
                rows.append({**cur, "thread": "loop"})
                if getattr(local, "pending", None) is None:
                    local.pending = []
                local.pending.append(rows[-1])  # (a multi-weight call's parts: several)

    class Graph:
        """A bound sequence's graph with its launch stamped (g0 .. g1)."""

        def __init__(self, g: Any) -> None:
            self.g = g

        def launch(self, stream: Any) -> None:
            cur = row()
            cur["g0"] = now()
            self.g.launch(stream)
            cur["g1"] = now()

    class Event:
        """A cached call's completion event: its record (r0 .. r1) and synchronize (s0 ..
        s1, with the thread's CPU across it) stamped."""

        def __init__(self, ev: Any) -> None:
            self.ev = ev
            self.ptr = ev.ptr

        def record(self, stream: Any = None) -> None:
            cur = row()
            cur["r0"] = now()
            self.ev.record(stream)
            cur["r1"] = now()

        def synchronize(self) -> None:
            cur = row()
            cur["s0"], c0 = now(), cpu()
            try:
                self.ev.synchronize()
            finally:
                cur["s1"], cur["wait_cpu"] = now(), (cpu() - c0) * 1e-9

    def stamped_launch(inner: Any) -> Any:
        def launch(self: Any, *args: Any) -> Any:
            cur = row()
            if not local.direct:  # a job outside run_now (the device thread's, a deferred
                cur.clear()       # launch on the loop): its row spans launch -> wait's end
                cur["j0"] = now()
            cur.setdefault("l0", now())
            if type(self.done) is not Event:
                self.done = Event(self.done)
            if self.b.graph and type(self.b.graph) is not Graph:
                self.b.graph = Graph(self.b.graph)
            # (a cached call's N x rows and x's bytes: the replay's q, o and down differ in
            # K only; a multi-weight call's part count)
            cur.setdefault("role", f"{self.n}x{self.rows}:{self.b.x_bytes}B"
                           if hasattr(self, "rows") else f"many{len(self.parts)}")
            cur["launches"] = cur.get("launches", 0) + 1
            try:
                return inner(self, *args)
            finally:
                cur["l1"] = now()
        return launch

    def stamped_wait(inner: Any) -> Any:
        def wait(self: Any, *args: Any) -> Any:
            cur = row()
            cur["w0"] = now()
            if query is not None:
                cur["done_at_w0"] = query(self.done.ptr) == 0
            out = inner(self, *args)
            cur["w1"] = now()
            res = out[0] if isinstance(out, list) else out
            cur["kernel"] = getattr(res.timing, "host_seconds", None)
            if not local.direct and "j0" in cur and "s1" in cur:
                cur["j1"] = cur["w1"]
                rows.append({**cur, "thread": threading.current_thread().name})
                cur.clear()
            return out
        return wait

    device_thread.Device.run_now = stamped_run_now  # type: ignore[method-assign]
    for cls in (L.BoundCall, L.ManyCall):
        cls.launch = stamped_launch(cls.launch)  # type: ignore[method-assign]
        cls._wait = stamped_wait(cls._wait)  # type: ignore[method-assign]
    handler: collections.deque[dict[str, Any]] = collections.deque(maxlen=RING)
    stream_reply = wire_replies.stream_reply

    def stamped_reply(r: Any, request_id: str, took: Any = None) -> Any:
        e0 = now()
        out = stream_reply(r, request_id, took)
        e1 = now()
        jobs = getattr(local, "pending", None) or []
        jobs = [j for j in jobs if took is not None and j["j0"] >= took.start]
        if jobs:
            ks = [j.get("kernel") for j in jobs]
            handler.append({"start": took.start, "dec": took.decoded, "j0": jobs[0]["j0"],
                            "j1": jobs[-1]["j1"], "e0": e0, "e1": e1,
                            "kernel": None if None in ks else sum(ks),
                            "role": "+".join(j.get("role", "?") for j in jobs)})
        local.pending = []
        return out

    wire_replies.stream_reply = stamped_reply

    def dump() -> None:
        if not rows:  # a child that inherited the variable
            return
        with open(path, "w") as f:
            got = list(rows)
            by = collections.defaultdict(list)
            for r in got:
                t = r.get("thread", "loop")
                by[r.get("role", "?") + ("" if t == "loop" else f"@{t}")].append(r)
            hs = list(handler)
            hby = collections.defaultdict(list)
            for h in hs:
                hby[h["role"]].append(h)
            json.dump({"parts": parts(got), "roles": {k: parts(v) for k, v in by.items()},
                       "handler": handler_parts(hs),
                       "handler_roles": {k: handler_parts(v) for k, v in hby.items()},
                       "rows": got[-2000:], "handler_rows": hs[-2000:]}, f)

    atexit.register(dump)


PARTS = (("pre", "j0", "l0"), ("launch", "l0", "l1"), ("x_in", "l0", "g0"),
         ("graph", "g0", "g1"), ("y_out", "g1", "r0"), ("record", "r0", "r1"),
         ("gap", "l1", "w0"),
         ("pre_wait", "w0", "s0"), ("wait", "s0", "s1"), ("post", "s1", "w1"),
         ("after", "w1", "j1"), ("job", "j0", "j1"))


def span_medians(rows: list[dict[str, Any]],
                 spans: tuple[tuple[str, str, str], ...]) -> dict[str, float]:
    """Per (name, start stamp, end stamp) of ``spans``: the median over ``rows`` of end -
    start, in us."""
    return {name: statistics.median((r[b] - r[a]) * 1e6 for r in rows) for name, a, b in spans}


def parts(rows: list[dict[str, Any]], skip: float = 0.2) -> dict[str, Any]:
    """Medians (us) of each part over the rows (the first ``skip`` of them left out: warm-up,
    first calls' binding and capture), and the share of waits whose event was done at w0."""
    keys = ("j0", "l0", "g0", "g1", "r0", "r1", "l1", "w0", "s0", "s1", "w1")
    full = [r for r in rows if all(k in r for k in keys)]
    full = full[int(len(full) * skip):]
    if not full:
        return {"n": 0}
    out: dict[str, Any] = {"n": len(full), **span_medians(full, PARTS)}
    ks = [r["kernel"] * 1e6 for r in full if r.get("kernel") is not None]
    out["kernel"] = statistics.median(ks) if ks else None
    bey = [(r["j1"] - r["j0"] - r["kernel"]) * 1e6 for r in full if r.get("kernel") is not None]
    out["beyond"] = statistics.median(bey) if bey else None
    out["wait_cpu"] = statistics.median(r["wait_cpu"] * 1e6 for r in full)
    out["done_at_w0"] = sum(bool(r.get("done_at_w0")) for r in full) / len(full)
    out["launches"] = statistics.median(r.get("launches", 0) for r in full)
    return out


HANDLER = (("decode", "start", "dec"), ("pre_job", "dec", "j0"), ("job", "j0", "j1"),
           ("post_job", "j1", "e0"), ("encode", "e0", "e1"), ("window", "start", "e1"))


def handler_parts(rows: list[dict[str, Any]], skip: float = 0.2) -> dict[str, Any]:
    """Medians (us) of a stream request's window on the direct path: the request taken ->
    decoded (``Took``) -> the direct job's start -> its end -> the reply's encoding (wire.
    stream_reply) begun -> ended; beyond = window - kernel. The first ``skip`` left out."""
    rows = rows[int(len(rows) * skip):]
    if not rows:
        return {"n": 0}
    out: dict[str, Any] = {"n": len(rows), **span_medians(rows, HANDLER)}
    bey = [(r["e1"] - r["start"] - r["kernel"]) * 1e6 for r in rows if r["kernel"] is not None]
    out["beyond"] = statistics.median(bey) if bey else None
    out["job_beyond"] = statistics.median(
        (r["j1"] - r["j0"] - r["kernel"]) * 1e6 for r in rows if r["kernel"] is not None
    ) if bey else None
    return out


HCOLS = ("n", "decode", "pre_job", "job", "job_beyond", "post_job", "encode", "window",
         "beyond")

COLS = ("n", "kernel", "job", "beyond", "pre", "launch", "x_in", "graph", "y_out", "record",
        "gap", "pre_wait", "wait", "wait_cpu", "post", "after", "done_at_w0")


def summary(paths: list[str], out: Any = sys.stdout) -> None:
    """One line per stamps file: the parts' medians (us), the shares as fractions."""
    print("# job stamps (us, medians): " + " ".join(COLS), file=out)
    print("# handler (us, medians): " + " ".join(HCOLS), file=out)
    for p in paths:
        try:
            with open(p) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            print(f"{p}: none ({e.__class__.__name__})", file=out)
            continue
        groups = [("all", d.get("parts", {}))]
        if len(d.get("roles", {})) > 1:
            groups += sorted(d["roles"].items())
        for role, g in groups:
            cells = []
            for c in COLS:
                v = g.get(c)
                cells.append("-" if v is None else (f"{v:.2f}" if isinstance(v, float)
                                                    else str(v)))
            print(f"{p.rsplit('/', 1)[-1]} {role}: " + " ".join(cells), file=out)
        hgroups = [("all", d.get("handler", {}))]
        if len(d.get("handler_roles", {})) > 1:
            hgroups += sorted(d["handler_roles"].items())
        for role, g in hgroups:
            if not g.get("n"):
                continue
            cells = [("-" if g.get(c) is None else (f"{g[c]:.2f}" if isinstance(g[c], float)
                                                     else str(g[c]))) for c in HCOLS]
            print(f"{p.rsplit('/', 1)[-1]} handler {role}: " + " ".join(cells), file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="print job stamp files' medians")
    ap.add_argument("paths", nargs="+")
    a = ap.parse_args(argv)
    summary(a.paths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
