"""``q6serve bench``: a closed-loop load generator against a running worker.

For every (concurrency C, rows N) pair, C callers each send one [N, K] activation, wait for the
reply and send again, for ``--duration`` seconds; unary calls, or one MatmulStream per caller.
Reports rows/s, latency percentiles and the worker's own view (queue, kernel, batch rows).
Each cell is printed as one line on stderr as it finishes; Ctrl-C stops the sweep, prints the
table (or --json) of the finished cells and exits 130.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import names
from .cli_target import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    UsageError,
    add_target_options,
    client_kwargs,
)

EXAMPLE = """example:
  q6serve bench --target 127.0.0.1:50051 --weight blk.0.ffn_down.weight \\
      --concurrency 1 8 64 --n 1 16 64 --dtype f16 --duration 5 --mode stream
  q6serve bench --target 127.0.0.1:50051 --json > bench.json      # first resident weight
  q6serve bench --target 127.0.0.1:50051 --plot latency.png       # needs matplotlib
  q6serve bench --preset decode-7b --preset-args "--backend numpy --row-scale 0.01"

presets (run bench/service.py of a source checkout, which starts its own worker):
  decode-7b          7B-class decode replay (attn_v, ffn_down, lm-head) with time breakdown
  decode-7b-targets  the same bench's --target-report (issue 9's three targets)"""

# --preset NAME: bench/service.py arguments (it lives in the source tree, not the package)
PRESETS: dict[str, list[str]] = {"decode-7b": [], "decode-7b-targets": ["--target-report"]}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="load-generate batched-decode matmuls against a worker",
                       description=__doc__, epilog=EXAMPLE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weight", help="resident weight (default: the first one listed)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8],
                   help="concurrent callers (several values: a sweep; default 1 8)")
    p.add_argument("--n", type=int, nargs="+", default=[1, 16],
                   help="activation rows per call (several values: a sweep; default 1 16)")
    p.add_argument("--dtype", default="f16", choices=names.DTYPES,
                   help="activation dtype (default f16)")
    p.add_argument("--out-dtype", default="f32", choices=names.DTYPES)
    p.add_argument("--precision", default="auto", choices=names.PRECISIONS)
    p.add_argument("--duration", type=float, default=5.0, help="seconds per cell (default 5)")
    p.add_argument("--warmup", type=float, default=0.5,
                   help="seconds of untimed calls before each cell (default 0.5)")
    p.add_argument("--mode", default="unary", choices=("unary", "stream"),
                   help="unary Matmul calls, or one MatmulStream per caller (default unary)")
    p.add_argument("--shm", action="store_true",
                   help="co-located: pass x and y through a shared-memory region per caller "
                   "instead of message bytes (the worker needs --allow-shm)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="run a bench/service.py preset instead (own worker; no --target)")
    p.add_argument("--preset-args", default="",
                   help='extra bench/service.py arguments, e.g. "--backend numpy --json r.json"')
    p.add_argument("--plot", type=Path, metavar="FILE.png",
                   help="plot latency and rows/s vs N per concurrency (needs matplotlib: "
                   "pip install 'q6serve[plot]')")
    add_target_options(p)
    p.set_defaults(func=run)


# -- measuring ------------------------------------------------------------------------------
@dataclass
class Samples:
    latency: list[float] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)
    kernel: list[float] = field(default_factory=list)
    worker: list[float] = field(default_factory=list)  # the worker's handler time per call
    batch_rows: list[int] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)  # each code's first message

    def add(self, seconds: float, out: Any) -> None:
        from q6serve.client.client import Q6ServeError

        if isinstance(out, Q6ServeError):
            self.errors[out.code.name] = self.errors.get(out.code.name, 0) + 1
            self.messages.setdefault(out.code.name, f"{out.code.name}: {out.message}")
            return
        self.latency.append(seconds)
        self.queue.append(out.queue_seconds)
        if out.kernel_seconds is not None:
            self.kernel.append(out.kernel_seconds)
        if out.handler_seconds is not None:
            self.worker.append(out.handler_seconds)
        self.batch_rows.append(out.batch_rows)


@dataclass
class CellResult:
    concurrency: int
    n: int
    mode: str
    seconds: float
    calls: int
    errors: dict[str, int]
    messages: dict[str, str]  # each error code's first message
    rows_per_s: float
    calls_per_s: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    queue_ms: float | None
    kernel_ms: float | None
    worker_ms: float | None  # mean time inside the worker's handler (the rest: client + gRPC)
    batch_rows: float | None

    @classmethod
    def of(cls, c: int, n: int, mode: str, seconds: float, s: Samples) -> CellResult:
        """Figures of one cell; latency figures are None when no call succeeded."""
        def ms(v: list[float], q: float | None = None) -> float | None:
            if not v:
                return None
            return float(np.percentile(v, q) if q is not None else np.mean(v)) * 1e3

        return cls(c, n, mode, seconds, len(s.latency), s.errors, s.messages,
                   len(s.latency) * n / seconds, len(s.latency) / seconds,
                   ms(s.latency, 50), ms(s.latency, 90), ms(s.latency, 99), ms(s.queue),
                   ms(s.kernel), ms(s.worker),
                   float(np.mean(s.batch_rows)) if s.batch_rows else None)


async def _unary_caller(client: Any, weight: str, x: np.ndarray, opts: dict[str, Any],
                        end: float, s: Samples) -> None:
    from q6serve.client.client import Q6ServeError

    while time.perf_counter() < end:
        t0 = time.perf_counter()
        try:
            out = await client.matmul_full(weight, x, **opts)
        except Q6ServeError as e:
            out = e
            if e.code.name == "UNAVAILABLE":
                await asyncio.sleep(0.01)  # do not spin on a worker that is going away
        s.add(time.perf_counter() - t0, out)


async def _stream_caller(client: Any, weight: str, x: np.ndarray, opts: dict[str, Any],
                         end: float, s: Samples, tag: str) -> None:
    """One stream, one request in flight: send, wait for its reply, send the next."""
    replied: asyncio.Queue[None] = asyncio.Queue()
    sent: dict[str, float] = {}
    opts = dict(opts)
    io = (opts.pop("x_region", None), opts.pop("y_region", None))

    async def requests() -> AsyncIterator[tuple[Any, ...]]:
        i = 0
        while time.perf_counter() < end:
            rid = f"{tag}-{i}"
            sent[rid] = time.perf_counter()
            yield (rid, weight, x, *io)
            i += 1
            await replied.get()

    budget = end - time.perf_counter() + 60.0  # the stream's deadline: its run plus slack
    async for out in client.matmul_stream(requests(), timeout=budget, **opts):
        s.add(time.perf_counter() - sent.pop(out.request_id), out)
        replied.put_nowait(None)


async def run_cell(client: Any, weight: str, k: int, c: int, n: int, args: argparse.Namespace,
                   tick: Callable[[int], None], rows: int = 0) -> CellResult:
    """One (C, N) cell; ``rows``: the weight's (sizes y's region with --shm)."""
    from q6serve.client.client import DTYPES

    rng = np.random.default_rng(c * 1000 + n)
    xs = [rng.standard_normal((n, k)).astype(DTYPES[args.dtype]) for _ in range(c)]
    opts = {"precision": args.precision, "out_dtype": args.out_dtype}
    per_caller = [opts] * c
    if getattr(args, "shm", False):
        async with _regions(client, xs, rows, DTYPES[args.out_dtype]) as io:
            xs = [x for x, _ in io]
            return await _run_phases(client, weight, xs, [{**opts, **o} for _, o in io],
                                     c, n, args, tick)
    return await _run_phases(client, weight, xs, per_caller, c, n, args, tick)


@contextlib.asynccontextmanager
async def _regions(client: Any, xs: list[np.ndarray], rows: int, out_dtype: np.dtype,
                   ) -> AsyncIterator[list[tuple[np.ndarray, dict[str, Any]]]]:
    """One shared-memory region per caller holding its x (written once) and its y; yields
    (x as the region's view, matmul options naming the region) per caller."""
    import os
    import secrets

    from .shm import ALIGN

    made: list[Any] = []
    io = []
    try:
        for x in xs:
            y_off = -(-x.nbytes // ALIGN) * ALIGN  # y after x, aligned
            size = y_off + x.shape[0] * rows * out_dtype.itemsize
            region = await client.register_shm(f"bench-{os.getpid()}-{secrets.token_hex(4)}",
                                               size)
            made.append(region)
            view = region.ndarray(0, x.dtype, x.shape)
            view[...] = x  # once: every call sends the same activations
            io.append((view, {"x_region": (region, 0), "y_region": (region, y_off)}))
        yield io
    finally:
        for r in made:
            with contextlib.suppress(Exception):
                await client.unregister_region(r.name)
            r.close()


async def _run_phases(client: Any, weight: str, xs: list[np.ndarray],
                      per_caller: list[dict[str, Any]], c: int, n: int,
                      args: argparse.Namespace, tick: Callable[[int], None]) -> CellResult:
    async def phase(seconds: float, s: Samples) -> float:
        end = time.perf_counter() + seconds
        if args.mode == "unary":
            jobs = [_unary_caller(client, weight, x, o, end, s)
                    for x, o in zip(xs, per_caller, strict=True)]
        else:
            jobs = [_stream_caller(client, weight, x, o, end, s, f"c{i}")
                    for i, (x, o) in enumerate(zip(xs, per_caller, strict=True))]
        t0 = time.perf_counter()
        main = asyncio.gather(*jobs)
        try:
            while not main.done():  # progress: report finished calls while they run
                await asyncio.wait([main], timeout=0.1)
                tick(len(s.latency) + sum(s.errors.values()))
            await main
        except asyncio.CancelledError:  # Ctrl-C: stop the callers and collect them quietly
            main.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await main
            raise
        return time.perf_counter() - t0

    if args.warmup > 0:
        await phase(args.warmup, Samples())
    s = Samples()
    seconds = await phase(args.duration, s)
    return CellResult.of(c, n, args.mode, seconds, s)


async def bench(args: argparse.Namespace, console: Any, doc: dict[str, Any]) -> None:
    """Run the sweep, filling ``doc`` as it goes (the header once the weight is known, then
    each cell the moment it finishes, also printed as one line on ``console``), so whatever
    finished is there if the run is interrupted."""
    import grpc
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from q6serve.client.async_client import AsyncClient
    from q6serve.client.core import Q6ServeError

    async with AsyncClient(args.target, **client_kwargs(args)) as client:
        weights = await client.list()
        if not weights:
            raise Q6ServeError(grpc.StatusCode.NOT_FOUND,
                               "the worker has no resident weights; load or upload one")
        w = await client.get(args.weight) if args.weight else weights[0]
        status = await client.status()
        cells = [(c, n) for c in args.concurrency for n in args.n]
        doc.update({"target": args.target, "weight": w.name, "rows": w.rows, "k": w.k,
                    "backend": status.backend, "device": status.device, "mode": args.mode,
                    "dtype": args.dtype, "precision": args.precision, "planned": len(cells),
                    "shm": bool(getattr(args, "shm", False)),
                    "cells": []})
        per_cell = args.warmup + args.duration
        columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[calls]} calls"))
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("bench", total=len(cells) * per_cell, calls=0)
            for i, (c, n) in enumerate(cells):
                start = time.perf_counter()
                desc = f"C={c} N={n} ({i + 1}/{len(cells)})"

                def tick(calls: int, start: float = start, i: int = i, desc: str = desc) -> None:
                    done = min(per_cell, time.perf_counter() - start)
                    progress.update(task, completed=i * per_cell + done, calls=calls,
                                    description=desc)

                r = await run_cell(client, w.name, w.k, c, n, args, tick, w.rows)
                doc["cells"].append(asdict(r))
                progress.console.print(cell_line(r, i, len(cells)), highlight=False)
            progress.update(task, completed=len(cells) * per_cell)


def cell_line(r: CellResult, i: int, cells: int) -> str:
    """One finished cell as one line (printed as the sweep goes)."""
    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f} ms"

    errors = sum(r.errors.values())
    return (f"cell {i + 1}/{cells} C={r.concurrency} N={r.n}: {r.calls} calls, "
            f"{r.rows_per_s:,.0f} rows/s, p50 {ms(r.p50_ms)}, p99 {ms(r.p99_ms)}, "
            f"{errors} errors")


# -- output ---------------------------------------------------------------------------------
def summary_table(doc: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"{doc['weight']} ({doc['rows']} x {doc['k']}) on {doc['backend']} "
              f"({doc['device']}): {doc['mode']}, x {doc['dtype']}, precision "
              f"{doc['precision']}", title_justify="left")
    for col in ("C", "N", "calls", "errors", "rows/s", "calls/s", "p50 ms", "p90 ms",
                "p99 ms", "worker ms", "queue ms", "kernel ms", "batch rows"):
        t.add_column(col, justify="right")

    def fmt(v: float | None, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    for r in doc["cells"]:
        errors = ", ".join(f"{k} {v}" for k, v in r["errors"].items())
        t.add_row(str(r["concurrency"]), str(r["n"]), str(r["calls"]),
                  f"[red]{errors}[/]" if errors else "0", f"{r['rows_per_s']:,.0f}",
                  f"{r['calls_per_s']:,.1f}", fmt(r["p50_ms"], ".2f"), fmt(r["p90_ms"], ".2f"),
                  fmt(r["p99_ms"], ".2f"), fmt(r["worker_ms"], ".3f"), fmt(r["queue_ms"], ".3f"),
                  fmt(r["kernel_ms"], ".3f"), fmt(r["batch_rows"], ".1f"))
    return t


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    fig, (ax_lat, ax_rows) = plt.subplots(1, 2, figsize=(11, 4.2))
    for c in sorted({r["concurrency"] for r in doc["cells"]}):
        rs = sorted((r for r in doc["cells"] if r["concurrency"] == c), key=lambda r: r["n"])
        ns = [r["n"] for r in rs]
        line = ax_lat.plot(ns, [r["p50_ms"] for r in rs], marker="o", label=f"C={c} p50")
        ax_lat.plot(ns, [r["p99_ms"] for r in rs], ls="--", color=line[0].get_color(),
                    label=f"C={c} p99")
        ax_rows.plot(ns, [r["rows_per_s"] for r in rs], marker="o", label=f"C={c}")
    for ax, ylabel in ((ax_lat, "latency (ms)"), (ax_rows, "rows/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (rows per call)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"q6serve bench: {doc['weight']} ({doc['rows']}x{doc['k']}), {doc['mode']}, "
                 f"{doc['backend']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _matplotlib_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is None


def run_preset(args: argparse.Namespace) -> int:
    import shlex
    import subprocess

    script = Path(__file__).resolve().parents[1] / "bench" / "service.py"
    if not script.is_file():
        raise UsageError(f"--preset needs a source checkout ({script} not found)")
    cmd = [sys.executable, str(script), *PRESETS[args.preset], *shlex.split(args.preset_args)]
    return subprocess.call(cmd)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.preset:
        return run_preset(args)

    if (min(args.concurrency) < 1 or min(args.n) < 1 or not 0 < args.duration < math.inf
            or not 0 <= args.warmup < math.inf):  # (nan fails both)
        raise UsageError("--concurrency and --n must be >= 1, --duration > 0, --warmup >= 0 "
                         "(seconds: finite numbers)")
    if args.plot and _matplotlib_missing():
        raise UsageError("--plot needs matplotlib (pip install 'q6serve[plot]')")
    console = Console(stderr=True)  # progress on stderr keeps --json's stdout clean
    doc: dict[str, Any] = {}
    interrupted = False
    try:
        asyncio.run(bench(args, console, doc))
    except KeyboardInterrupt:  # Ctrl-C: asyncio.run has cancelled the sweep and closed up
        interrupted = True
    if interrupted and not doc.get("cells"):
        print("q6serve bench: interrupted before the first cell finished", file=sys.stderr)
        return EXIT_INTERRUPTED
    doc["interrupted"] = interrupted  # --json readers: the cells are those that finished
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        out = Console()
        (out if out.is_terminal else Console(width=130)).print(summary_table(doc))
    if args.plot:
        plot(doc, args.plot)
        console.print(f"plot written to {args.plot}")
    if interrupted:
        print(f"q6serve bench: interrupted after {len(doc['cells'])} of {doc['planned']} "
              "cells (the table holds those)", file=sys.stderr)
        return EXIT_INTERRUPTED
    failed = sum(sum(r["errors"].values()) for r in doc["cells"])
    empty = [f"C={r['concurrency']} N={r['n']}" for r in doc["cells"]
             if not r["calls"] and not r["errors"]]
    if failed:
        codes = {}
        for r in doc["cells"]:
            for code, n in r["errors"].items():
                codes[code] = codes.get(code, 0) + n
        first = next(m for r in doc["cells"] for m in r["messages"].values())
        print(f"q6serve bench: {failed} calls failed ("
              + ", ".join(f"{c} {n}" for c, n in codes.items()) + f"); first: {first}",
              file=sys.stderr)
    if empty:  # a cell that measured nothing is no result (its figures read n/a)
        print(f"q6serve bench: no call finished in {len(empty)} cell(s) ({', '.join(empty)}) "
              f"within --duration {args.duration:g} s", file=sys.stderr)
    return EXIT_FAILED if failed or empty else EXIT_OK
