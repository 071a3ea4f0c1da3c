"""``q6serve demo``: the whole service on this machine in one command.

Starts a worker process on the best backend (CUDA if a GPU is usable, else NumPy) on a free port,
writes a Q6_K GGUF file with the shapes of a 7B-class model (or takes ``--gguf FILE``), loads
it through gRPC, runs batched-decode matmuls at several N from concurrent callers, checks every
result against the NumPy reference, prints what it measured, unloads, and exits non-zero if
any result was wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import names
from .cli_target import UsageError

EXAMPLE = """example:
  q6serve demo                           # synthetic 7B-class tensors on the best backend
  q6serve demo --backend numpy --n 1 8 64 --callers 16
  q6serve demo --gguf model.gguf --tensor output.weight --max-weight-mib 0   # a real file"""

# Qwen2-7B-class shapes (rows x K): hidden 3584, FFN 18944, 512-wide KV heads, 152064 vocab.
SHAPES = {"blk.0.attn_v.weight": (512, 3584), "blk.0.ffn_down.weight": (3584, 18944),
          "output.weight": (152064, 3584)}
# Relative (Frobenius) error allowed per resolved precision, against f32 math on exactly
# dequantized weights: exact is f32 rounding; f16 rounds weights/activations to 11 bits;
# q8_1 quantizes activations to int8 per 32 values (~0.5% each).
TOLERANCE = {"exact": 1e-5, "f16": 2e-3, "q8_1": 3e-2}
CPU_MAX_WEIGHT_MIB = 3.0  # NumPy default: rows cut so each weight stays <= 3 MiB of Q6_K


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="start a local worker, serve a 7B-shaped model, check and "
                       "time batched decode; print a table", description=__doc__,
                       epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="auto", choices=("auto", "numpy", "cuda"),
                   help="worker backend (default auto: CUDA if usable, else NumPy)")
    p.add_argument("--gguf", type=Path, metavar="FILE",
                   help="serve this GGUF file's Q6_K tensors instead of a synthetic model")
    p.add_argument("--tensor", action="append", metavar="NAME",
                   help="with --gguf: tensor to serve (repeatable; default every Q6_K one)")
    p.add_argument("--n", type=int, nargs="+", default=[1, 4, 16, 64],
                   help="activation rows per call (default 1 4 16 64)")
    p.add_argument("--callers", type=int, default=8, help="concurrent callers (default 8)")
    p.add_argument("--calls", type=int, default=3, help="calls per caller and N (default 3)")
    p.add_argument("--dtype", default="f16", choices=names.DTYPES,
                   help="activation dtype on the wire (default f16)")
    p.add_argument("--precision", default="auto", choices=names.PRECISIONS,
                   help="numerics (default auto: the backend's fastest path)")
    p.add_argument("--max-weight-mib", type=float, default=None,
                   help="serve at most this many MiB of rows per weight (0 = full size; "
                   f"default: full on CUDA, {CPU_MAX_WEIGHT_MIB:g} on NumPy)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead")
    p.set_defaults(func=run)


# -- the model file -------------------------------------------------------------------------
def cap_rows(rows: int, k: int, max_mib: float) -> int:
    """Rows of a ``rows x k`` Q6_K weight that fit ``max_mib`` (a multiple of 64; 0 = all)."""
    from q6serve.kernels import q6k

    if max_mib <= 0:
        return rows
    row_bytes = k // q6k.QK_K * q6k.BLOCK_BYTES
    return max(64, min(rows, int(max_mib * 2**20 // row_bytes) // 64 * 64))


def synthetic_model(path: Path, shapes: dict[str, tuple[int, int]], seed: int = 0) -> None:
    """Quantize the smallest matrix for real (ggml's quantizer); fill the rest with random
    valid blocks (quantizing hundreds of MiB would take minutes and test nothing more)."""
    from q6serve.kernels import q6k
    from q6serve.kernels.gguf_io import write_q6k_gguf
    from q6serve.kernels.quantize import quantize_q6_k

    rng = np.random.default_rng(seed)
    smallest = min(shapes, key=lambda n: shapes[n][0] * shapes[n][1])
    tensors = {}
    for name, (rows, k) in shapes.items():
        if name == smallest:
            w = (rng.standard_normal((rows, k)) * 0.02).astype(np.float32)
            tensors[name] = (quantize_q6_k(w), rows, k)
            continue
        tensors[name] = (q6k.random_blocks(rows, k, rng, 1e-4, 4e-4), rows, k)
    write_q6k_gguf(path, tensors)


# -- measuring ------------------------------------------------------------------------------
@dataclass
class Cell:
    weight: str
    rows: int
    k: int
    n: int
    calls: int
    kernel: str
    precision: str
    p50_ms: float
    p99_ms: float
    rows_per_s: float
    kernel_share: float | None  # mean kernel time / end-to-end latency; None if not reported
    batch_rows_mean: float
    batch_rows_max: int
    max_rel_err: float
    ok: bool
    wall_s: float  # the cell's timed run (without warm-up and checking)


async def run_cell(client: Any, name: str, w32: np.ndarray, n: int, callers: int, calls: int,
                   dtype: np.dtype, precision: str, rng: np.random.Generator,
                   warm_all: bool = False) -> Cell:
    """``callers`` coroutines each make ``calls`` sequential calls; all results are checked.
    ``warm_all``: warm up with one concurrent round (a GPU backend compiles kernels per batch
    size on first use, and coalesced batches come in sizes a single call never meets)."""
    rows, k = w32.shape
    xs = [[rng.standard_normal((n, k)).astype(dtype) for _ in range(calls)]
          for _ in range(callers)]
    warm = [mine[0] for mine in xs] if warm_all else [xs[0][0]]
    await asyncio.gather(*(client.matmul_full(name, x, precision=precision) for x in warm))

    async def caller(mine: list[np.ndarray]) -> list[tuple[float, Any]]:
        done = []
        for x in mine:
            t0 = time.perf_counter()
            out = await client.matmul_full(name, x, precision=precision)
            done.append((time.perf_counter() - t0, out))
        return done

    t0 = time.perf_counter()
    per_caller = await asyncio.gather(*(caller(mine) for mine in xs))
    wall = time.perf_counter() - t0
    results = [r for rs in per_caller for r in rs]
    flat_x = [x for mine in xs for x in mine]
    # one BLAS call checks the whole cell: reference rows in the same order as the results
    ref = np.concatenate(flat_x).astype(np.float32) @ w32.T
    errs, ok = [], True
    for i, (_, out) in enumerate(results):
        want = ref[i * n : (i + 1) * n]
        errs.append(float(np.linalg.norm(out.y.astype(np.float32) - want)
                          / max(float(np.linalg.norm(want)), 1e-30)))
        ok &= errs[-1] <= TOLERANCE.get(out.precision, 0.0)  # each against its own precision
    lat = np.array([t for t, _ in results])
    outs = [o for _, o in results]
    kern = [o.kernel_seconds / t for t, o in results if o.kernel_seconds is not None]
    precisions = {o.precision for o in outs}
    batch = [o.batch_rows for o in outs]
    return Cell(name, rows, k, n, len(results), "/".join(sorted({o.kernel for o in outs})),
                "/".join(sorted(precisions)), float(np.percentile(lat, 50) * 1e3),
                float(np.percentile(lat, 99) * 1e3), len(results) * n / wall,
                float(np.mean(kern)) if kern else None, float(np.mean(batch)), max(batch),
                max(errs), ok, wall)


# -- output ---------------------------------------------------------------------------------
def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _label(name: str) -> str:
    return name.removeprefix("blk.").removesuffix(".weight")


def weights_table(weights: list[Any], full_rows: dict[str, int]) -> Any:
    from rich.table import Table

    t = Table(title="Resident weights (loaded through gRPC)", title_justify="left")
    for col, right in (("weight", False), ("rows x K", True), ("full rows", True),
                       ("resident", True), ("layout", False)):
        t.add_column(col, justify="right" if right else "left")
    for w in weights:
        t.add_row(w.name, f"{w.rows} x {w.k}", str(full_rows.get(w.name, w.rows)),
                  _mib(w.nbytes), w.layout)
    return t


def cells_table(cells: list[Cell], callers: int, calls: int, dtype: str) -> Any:
    from rich.table import Table

    t = Table(title=f"y = x · Wᵀ through gRPC: {callers} concurrent callers x {calls} calls "
              f"at each N, x in {dtype}", title_justify="left")
    cols = ("weight", "N", "p50 ms", "p99 ms", "rows/s", "kernel %", "batch rows",
            "max rel err", "kernel")
    for col in cols:
        t.add_column(col, justify="left" if col in ("weight", "kernel") else "right")
    last = None
    for c in cells:
        if last is not None and c.weight != last:
            t.add_section()
        share = "n/a" if c.kernel_share is None else f"{c.kernel_share * 100:.0f}%"
        err = f"[green]{c.max_rel_err:.1e} ✓[/]" if c.ok else f"[red]{c.max_rel_err:.1e} ✗[/]"
        t.add_row(_label(c.weight) if c.weight != last else "", str(c.n), f"{c.p50_ms:.2f}",
                  f"{c.p99_ms:.2f}", f"{c.rows_per_s:,.0f}", share,
                  f"{c.batch_rows_mean:.1f} (max {c.batch_rows_max})", err,
                  f"{c.kernel} ({c.precision})")
        last = c.weight
    return t


def vram_line(v: Any, backend: str) -> str:
    where = "host memory" if backend == "numpy" else "VRAM"
    return (f"{where} used: {_mib(v.reserved_bytes)} (weights {_mib(v.weights_bytes)}, "
            f"scratch {_mib(v.scratch_bytes)}, staging {_mib(v.staging_bytes)}) of a "
            f"{_mib(v.budget_bytes)} budget; {_mib(v.device_free_bytes)} free of "
            f"{_mib(v.device_total_bytes)}")


# -- the run --------------------------------------------------------------------------------
def _reference_weights(path: Path, names: list[str], rows: dict[str, int],
                       ) -> dict[str, np.ndarray]:
    """f32 ``[rows, K]`` of each served weight, exactly dequantized from the file's bytes."""
    from q6serve.kernels import q6k
    from q6serve.kernels.gguf_io import read_q6k_tensors

    out = {}
    for t in read_q6k_tensors(path, names):
        r = rows[t.name]
        blocks = np.asarray(t.aos).reshape(-1, q6k.BLOCK_BYTES)[: r * t.k // q6k.QK_K]
        out[t.name] = q6k.dequantize_aos(blocks, r, t.k)
    return out


async def serve_and_check(target: str, args: argparse.Namespace, path: Path,
                          plan: dict[str, tuple[int, int, int]], full_rows: dict[str, int],
                          console: Any) -> int:
    """Load ``plan`` ({name: (rows served, rows in the file, K)}), run every cell, print,
    unload. ``full_rows``: the model's real row counts (shown next to the served ones)."""
    from q6serve.client.async_client import AsyncClient
    from q6serve.client.client import DTYPES

    async with AsyncClient(target, timeout=300.0) as client:
        before = (await client.status()).vram.reserved_bytes
        weights = []
        for name, (rows, total, _) in plan.items():
            sel = {"rows": (0, rows)} if rows < total else {}
            weights += await client.load(path.name, [name], **sel)
        status = await client.status()
        w32 = _reference_weights(path, list(plan), {n: r for n, (r, _, _) in plan.items()})
        rng = np.random.default_rng(1)
        cells = []
        with console.status("") as live:  # a spinner on terminals, nothing in logs
            for w in weights:
                for n in args.n:
                    live.update(f"{_label(w.name)}: N={n}, {args.callers} callers ...")
                    cells.append(await run_cell(client, w.name, w32[w.name], n, args.callers,
                                                args.calls, DTYPES[args.dtype],
                                                args.precision, rng,
                                                warm_all=status.backend != "numpy"))
        for w in weights:
            await client.unload(w.name)
        after = (await client.status()).vram.reserved_bytes

    ok = all(c.ok for c in cells)
    if args.json:
        print(json.dumps({"backend": status.backend, "device": status.device,
                          "vram": {f.name: getattr(status.vram, f.name)
                                   for f in status.vram.DESCRIPTOR.fields},
                          "cells": [asdict(c) for c in cells], "ok": ok}, indent=2))
        return 0 if ok else 1
    console.print(weights_table(weights, full_rows))
    console.print(vram_line(status.vram, status.backend))
    console.print(cells_table(cells, args.callers, args.calls, args.dtype))
    console.print("[dim]p50/p99: end-to-end latency of a call (encode, gRPC, queue, kernel, "
                  "decode); rows/s: activation rows served per second; kernel %: share of a "
                  "call's latency spent in its batch's kernel; batch rows: rows of the "
                  "coalesced launch a call ran in (dynamic batching).[/]")
    back = "back to" if after == before else "[red]NOT back to[/]"
    console.print(f"unloaded everything: reserved memory {back} {_mib(before)}")
    n_calls = sum(c.calls for c in cells)
    if ok:
        tol = ", ".join(f"{p} {t:.0e}" for p, t in TOLERANCE.items())
        console.print(f"[bold green]all {n_calls} results match the NumPy reference[/] "
                      f"(relative error allowed: {tol})")
    else:
        bad = [f"{_label(c.weight)} N={c.n}" for c in cells if not c.ok]
        console.print(f"[bold red]results differ from the reference in: {', '.join(bad)}[/]")
    return 0 if ok and after == before else 1


def _plan(path: Path, names: list[str] | None, max_mib: float) -> dict[str, tuple[int, int, int]]:
    from q6serve.kernels.gguf_io import list_tensors

    infos = [t for t in list_tensors(path) if t.is_q6k and (not names or t.name in names)]
    missing = set(names or ()) - {t.name for t in infos}
    if missing:
        raise UsageError(f"no Q6_K tensor(s) {sorted(missing)} in {path}")
    if not infos:
        raise UsageError(f"{path} has no Q6_K tensors")
    shapes = {t.name: (t.shape[0], t.shape[-1]) for t in infos}
    return {n: (cap_rows(r, k, max_mib), r, k) for n, (r, k) in shapes.items()}


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from q6serve.client.client import Client, Q6ServeError
    from q6serve.client.worker_process import WorkerProcess, WorkerStartError

    console = Console() if sys.stdout.isatty() else Console(width=130)
    if min(args.n) < 1 or args.callers < 1 or args.calls < 1:
        raise UsageError("--n, --callers and --calls must be >= 1")
    mib = args.max_weight_mib
    if mib is not None and not 0 <= mib < float("inf"):  # (nan fails it too)
        raise UsageError(f"--max-weight-mib {mib:g}: give MiB >= 0 (0 = full size)")
    say = (lambda *a, **k: None) if args.json else console.print
    with tempfile.TemporaryDirectory(prefix="q6serve-demo-") as tmp:
        gguf = args.gguf.resolve() if args.gguf is not None else None
        if gguf is not None and not gguf.is_file():
            raise UsageError(f"no such file: {gguf}")
        model_dir = gguf.parent if gguf is not None else Path(tmp)
        # the worker as deployed: its own process (a worker thread in this process would share
        # the GIL with the callers' encoding and decoding, and its latencies with them)
        worker = WorkerProcess(["--backend", args.backend, "--host", "127.0.0.1", "--model-dir",
                                str(model_dir), "--vram-budget", "0.9"], Path(tmp) / "worker.log")
        try:
            worker.start()
        except WorkerStartError as e:
            console.print(f"[red]q6serve demo: the worker did not start: {escape(e.last_line)}[/]",
                          highlight=False)
            return 2
        try:
            with Client(worker.target) as c:
                st = c.status()
            backend, device = st.backend, st.device
            max_mib = args.max_weight_mib
            if max_mib is None:
                max_mib = CPU_MAX_WEIGHT_MIB if backend == "numpy" else 0.0
            say(f"[bold]q6serve demo[/] on backend [cyan]{backend}[/] ({device})")
            if gguf is not None:
                path = gguf
            else:
                path = Path(tmp) / "demo-7b-shapes.gguf"
                shapes = {n: (cap_rows(r, k, max_mib), k) for n, (r, k) in SHAPES.items()}
                t0 = time.perf_counter()
                synthetic_model(path, shapes)
                say(f"wrote {path.name}: {len(shapes)} Q6_K tensors with 7B-class shapes in "
                    f"{time.perf_counter() - t0:.1f} s")
                if max_mib > 0:
                    say(f"  rows cut to <= {max_mib:g} MiB per weight to keep the CPU run short "
                        "(--max-weight-mib 0: full size)")
            plan = _plan(path, args.tensor, max_mib)
            full_rows = {n: r for n, (_, r, _) in plan.items()}
            if gguf is None:
                full_rows = {n: SHAPES[n][0] for n in plan}
            say(f"worker listening on {worker.target} (its own process, gRPC over loopback)")
            return asyncio.run(serve_and_check(worker.target, args, path, plan, full_rows,
                                               console))
        except Q6ServeError as e:  # the worker's own words, without a client traceback
            console.print(f"[red]q6serve demo: {e.code.name}: {escape(e.message)}[/]",
                          highlight=False)
            return 1
        finally:
            worker.stop()
