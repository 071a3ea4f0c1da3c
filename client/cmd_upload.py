"""``q6serve upload``: stream Q6_K tensors of a local GGUF file to a worker.

For workers that cannot see this host's files: the tensors' AoS bytes are read from a memory
map and sent in 1 MiB chunks with their sha256 (the worker checks it), so a 450 MB lm-head
never sits in this process's memory at once.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .cli_target import UsageError, add_target_options, client_kwargs

EXAMPLE = """example:
  q6serve upload --target 10.0.0.7:50051 model.gguf --tensor output.weight
  q6serve upload --target 10.0.0.7:50051 model.gguf --prefix L0.      # every Q6_K tensor"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("upload", help="stream Q6_K tensors of a local GGUF file to a worker",
                       description=__doc__, epilog=EXAMPLE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", type=Path, metavar="FILE.gguf", help="a GGUF file on this host")
    p.add_argument("--tensor", action="append", metavar="NAME",
                   help="tensor to upload (repeatable; default every Q6_K tensor)")
    p.add_argument("--prefix", default="", help="prepended to each weight name")
    add_target_options(p, timeout=600.0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from q6serve.client.client import Client
    from q6serve.kernels.gguf_io import read_q6k_tensors

    console = Console(stderr=True)
    if Path(args.gguf).is_dir():  # (the reader's words: "GGUF file DIR does not exist")
        raise UsageError(f"{args.gguf}: a directory, not a GGUF file")
    tensors = read_q6k_tensors(args.gguf, args.tensor)  # a bad file or name: exit 2
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Client(args.target, **client_kwargs(args, admin=True)) as client, \
            Progress(*columns, console=console, disable=not console.is_terminal) as progress:
        for t in tensors:
            name = args.prefix + t.name
            task = progress.add_task(name, total=t.nbytes)
            t0 = time.perf_counter()
            w = client.upload(name, t.aos, t.rows, t.k,
                              progress=lambda n, task=task: progress.advance(task, n))
            dt = time.perf_counter() - t0
            print(f"uploaded {w.name}: {w.rows} x {w.k}, {t.nbytes} bytes in {dt:.2f} s "
                  f"({t.nbytes / dt / 1e6:.0f} MB/s), sha256 {w.sha256}")
    return 0
