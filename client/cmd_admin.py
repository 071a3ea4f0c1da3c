"""Client commands against a running worker: health, load, list, unload, matmul, status, flags.

Every command takes ``--target H:P`` (default ``$Q6SERVE_TARGET`` or 127.0.0.1:50051) and reads
bearer tokens from ``$Q6SERVE_TOKEN`` / ``$Q6SERVE_ADMIN_TOKEN`` (admin commands prefer the
admin token). Failures print the gRPC status and message on one line (``cli.main`` reports
every error and picks the exit code).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from . import names
from .cli_target import UsageError, add_target_options, client_kwargs

# commands that take `--target A,B,...`: a weight row-sharded over those workers (shard i = i-th)
SHARDED_COMMANDS = ("load", "matmul", "list", "unload", "health", "status", "flags")
FLAG_NAMES = ("Q6SERVE_Q6K_SOA", "Q6SERVE_DECODE_MMQ", "Q6SERVE_DYNAMIC_BATCHING")


def _client(args: argparse.Namespace, admin: bool = False):  # type: ignore[no-untyped-def]
    kw = client_kwargs(args, admin)
    if "," in args.target:
        from q6serve.client.sharded import ShardedClient

        if args.command not in SHARDED_COMMANDS:
            raise UsageError(f"takes one --target (several targets, comma-separated, only for "
                             f"{', '.join(SHARDED_COMMANDS)})")
        return ShardedClient(args.target.split(","), **kw)
    from q6serve.client.client import Client

    return Client(args.target, **kw)


def _parser(sub: argparse._SubParsersAction, name: str, help_: str, example: str,
            fn: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_, description=help_[:1].upper() + help_[1:] + ".",
                       epilog="example:\n  " + example,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_options(p, sharded=name in SHARDED_COMMANDS)
    p.set_defaults(func=fn)
    return p


def cmd_health(args: argparse.Namespace) -> int:
    serving = _client(args).health(timeout=args.timeout)
    print("SERVING" if serving else "NOT_SERVING")
    return 0 if serving else 1


def _row_ranges(text: str) -> list[tuple[int, int]]:
    """``B:E`` (one worker) or ``B:E,B:E,...`` (one range per --target, in order)."""
    out = []
    for part in text.split(","):
        begin, sep, end = part.partition(":")
        if not sep or not begin.isdigit() or not end.isdigit():
            raise argparse.ArgumentTypeError(f"{text!r}: write BEGIN:END (rows [BEGIN, END)), "
                                             "comma-separated for several targets")
        b, e = int(begin), int(end)
        if not b < e <= MAX_ROW:  # (the wire's uint64 refused a larger one in its own words)
            raise argparse.ArgumentTypeError(f"{part!r}: BEGIN < END <= {MAX_ROW} (rows "
                                             "[BEGIN, END))")
        out.append((b, e))
    return out


MAX_ROW = (1 << 63) - 1


def _shard_of(args: argparse.Namespace) -> tuple[int, int] | None:
    if (args.shard_index is None) != (args.shard_count is None):
        raise UsageError("--shard-index and --shard-count go together")
    if args.shard_index is None:
        return None
    if args.rows is not None:
        raise UsageError("give --rows or --shard-index/--shard-count, not both")
    i, n = args.shard_index, args.shard_count
    if not 1 <= n <= MAX_ROW:
        raise UsageError(f"--shard-count {n}: give 1 or more")
    if not 0 <= i < n:
        raise UsageError(f"--shard-index {i}: give 0..{n - 1} (of --shard-count {n})")
    return i, n


def cmd_load(args: argparse.Namespace) -> int:
    client = _client(args, admin=True)
    shard = _shard_of(args)
    if "," in args.target:  # each target loads its range: --rows list, else the even split
        if shard is not None:
            raise UsageError("several targets split the rows themselves; "
                             "--shard-index/--shard-count are for one target")
        weights = client.load(args.gguf, args.tensor or (), args.prefix, ranges=args.rows,
                              placement=args.placement)
    else:
        if args.rows is not None and len(args.rows) != 1:
            raise UsageError("one target takes one --rows BEGIN:END")
        weights = client.load(args.gguf, args.tensor or (), args.prefix,
                              rows=args.rows[0] if args.rows else None, shard=shard,
                              placement=args.placement)
    for w in weights:
        part = ("" if w.row_end - w.row_begin == w.tensor_rows
                else f" rows [{w.row_begin}, {w.row_end}) of {w.tensor_rows}")
        print(f"loaded {w.name}: {w.rows}x{w.k}{part} {w.layout} {w.nbytes} bytes "
              f"sha256 {w.sha256}")
    return 0


def _weight_dict(w) -> dict[str, object]:  # type: ignore[no-untyped-def]
    import dataclasses

    return dataclasses.asdict(w)


def cmd_list(args: argparse.Namespace) -> int:
    weights = _client(args).list()
    if args.json:
        print(json.dumps([_weight_dict(w) for w in weights], indent=2))
        return 0
    print(f"{'NAME':40} {'ROWS':>7} {'K':>7} {'BYTES':>12} LAYOUT IN_FLIGHT")
    for w in weights:
        print(f"{w.name:40} {w.rows:>7} {w.k:>7} {w.nbytes:>12} {w.layout:6} {w.in_flight}")
    return 0


def cmd_unload(args: argparse.Namespace) -> int:
    w = _client(args, admin=True).unload(args.name)
    print(f"unloaded {w.name} ({w.nbytes} bytes)")
    return 0


def cmd_matmul(args: argparse.Namespace) -> int:
    from q6serve.client.core import DTYPES
    from q6serve.client.npyio import float_matrix, load_array, save_array

    weights, outputs = args.weight, args.output
    if len(outputs) != len(weights):
        raise UsageError(f"give one --output per --weight, in the same order ({len(weights)} "
                         f"weights, {len(outputs)} outputs)")
    if args.topk is not None and not all(o.endswith(".npz") for o in outputs):
        raise UsageError("--topk writes values, indices and lse to an .npz: name each "
                         "--output FILE.npz")
    for o in outputs:
        _check_output(o)
    x = float_matrix(load_array(args.input), args.input,
                     to=DTYPES[args.dtype] if args.dtype else None,
                     hint="give --dtype f32, f16 or bf16 to convert it")
    # several weights: one multi-weight request (each still batches with other callers)
    out = _client(args).matmul_full(weights[0] if len(weights) == 1 else weights, x,
                                    precision=args.precision, out_dtype=args.out_dtype,
                                    topk=args.topk)
    for o, path in zip(out.outputs or (out,), outputs, strict=True):
        if o.topk is not None:
            import numpy as np

            with open(path, "wb") as f:  # (a file: np.savez would add a suffix to a name)
                np.savez(f, values=o.topk.values, indices=o.topk.indices, lse=o.topk.lse)
            what = f"top-{o.topk.k} values/indices/lse of {o.topk.values.shape[0]} rows"
        else:
            assert o.y is not None
            save_array(path, o.y)
            what = f"y {list(o.y.shape)} {args.out_dtype}"
        ks = "n/a" if o.kernel_seconds is None else f"{o.kernel_seconds * 1e6:.1f} us"
        name = f"{o.weight}: " if o.weight else ""
        print(f"{name}{what} -> {path}; kernel {o.kernel} ({o.layout}, {o.precision}) {ks}, "
              f"queue {o.queue_seconds * 1e6:.1f} us, batch {o.batch_rows} rows / "
              f"{o.batch_requests} requests")
    return 0


def _check_output(path: str) -> None:
    """An --output the result can be written to, checked before the call: np.save wrote a
    directory's name + '.npy' and '' as '.npy' in the working directory, and a missing
    folder failed only once the worker had answered."""
    from pathlib import Path

    p = Path(path)
    if not path or p.is_dir():
        raise UsageError(f"--output {path!r} is {'a directory' if path else 'empty'}: name "
                         "the file to write")
    if not p.parent.is_dir():
        raise UsageError(f"--output {path}: folder {p.parent} does not exist")


def cmd_status(args: argparse.Namespace) -> int:
    status = _client(args).status_dict()  # several targets: one dict per shard, in order
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    if isinstance(status, list):
        for i, (target, st) in enumerate(zip(args.target.split(","), status, strict=True)):
            print(f"shard {i} ({target}):")
            _print_status(st, "  ")
    else:
        _print_status(status)
    return 0


def _print_status(status: dict[str, Any], indent: str = "") -> None:
    v = status["vram"]
    print(f"{indent}{status['backend']} on {status['device']} (q6serve {status['version']}), "
          f"serving={status['serving']}, weights={status['weights_loaded']}")
    for key, value in v.items():
        print(f"{indent}  vram {key:20} {value}")
    for f in status["flags"]:
        print(f"{indent}  flag {f['name']:26} {int(f['enabled'])}")
    for d in status.get("devices", []):  # --devices workers
        dv = d["vram"]
        print(f"{indent}  device {d['ordinal']}: {d['device']}, weights={d['weights_loaded']}, "
              f"reserved {dv['reserved_bytes']} of budget {dv['budget_bytes']} bytes")


def _flag_assignment(text: str) -> tuple[str, bool]:
    name, sep, value = text.partition("=")
    if not name or not sep or value not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"{text!r}: write NAME=0 or NAME=1")
    if not name.startswith("Q6SERVE_"):
        name = "Q6SERVE_" + name
    return name, value == "1"


def cmd_flags(args: argparse.Namespace) -> int:
    changes = dict(args.assignments)
    if len(changes) != len(args.assignments):  # (dict() kept the last one without a word)
        twice = sorted({n for n, _ in args.assignments
                        if sum(m == n for m, _ in args.assignments) > 1})
        raise UsageError(f"{', '.join(twice)} given twice: set each flag once")
    state = _client(args, admin=bool(changes)).flags(changes or None)
    for name, on in state.items():
        print(f"{name}={int(on)}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    _parser(sub, "health", "check a worker's health (exit 0 when SERVING)",
            "q6serve health --target 127.0.0.1:50051", cmd_health)

    p = _parser(sub, "load", "load Q6_K tensors of a GGUF file under the worker's --model-dir",
                "q6serve load --target 127.0.0.1:50051 --gguf model.gguf "
                "--tensor output.weight\n"
                "  q6serve load --target 10.0.0.5:50051,10.0.0.6:50051 --gguf model.gguf "
                "--tensor output.weight   # row-sharded", cmd_load)
    p.add_argument("--gguf", required=True, help="file, relative to the worker's model dir")
    p.add_argument("--tensor", action="append", metavar="NAME",
                   help="tensor to load (repeatable; default: every Q6_K tensor)")
    p.add_argument("--prefix", default="", help="prepended to each weight name")
    p.add_argument("--rows", type=_row_ranges, metavar="BEGIN:END[,...]",
                   help="load only rows [BEGIN, END) of each tensor (row sharding); with "
                        "several --target A,B,...: one range per target")
    p.add_argument("--shard-index", type=int, metavar="I",
                   help="load shard I of --shard-count N (even split of each tensor's rows)")
    p.add_argument("--shard-count", type=int, metavar="N", help="number of shards")
    p.add_argument("--placement", choices=names.PLACEMENTS,
                   help="multi-device workers: split the rows over the devices or replicate "
                        "(default: the worker's --placement)")

    p = _parser(sub, "list", "list resident weights",
                "q6serve list --target 127.0.0.1:50051 --json", cmd_list)
    p.add_argument("--json", action="store_true", help="print JSON")

    p = _parser(sub, "unload", "unload a weight (freed when in-flight requests finish)",
                "q6serve unload --target 127.0.0.1:50051 output.weight", cmd_unload)
    p.add_argument("name", metavar="NAME")

    p = _parser(sub, "matmul", "compute y = x · Wᵀ for x from a .npy file",
                "q6serve matmul --target 127.0.0.1:50051 --weight output.weight "
                "--input x.npy --output y.npy --dtype f16 --precision auto\n"
                "  q6serve matmul --weight blk.0.attn_q.weight --weight blk.0.attn_k.weight "
                "--input x.npy --output q.npy --output k.npy   # one request\n"
                "  q6serve matmul --weight output.weight --topk 64 --input x.npy "
                "--output top.npz", cmd_matmul)
    p.add_argument("--weight", required=True, action="append", metavar="NAME",
                   help="resident weight name; repeat it for several weights of the same K, "
                        "sent as one multi-weight request (one --output each)")
    p.add_argument("--input", required=True, metavar="FILE.npy|FILE.npz[:NAME]",
                   help="x of shape [N, K] (or [K]) in f32/f16/bf16: an .npy, an .npz holding "
                        "one array, or FILE.npz:NAME for one of several")
    p.add_argument("--output", required=True, action="append", metavar="FILE.npy",
                   help="y [N, rows] is written here (one --output per --weight, in order); a "
                        "bf16 y has the .npy type 'bfloat16': read it with `import ml_dtypes; "
                        "np.load(FILE)`; with --topk an .npz of values [N, K] f32, indices "
                        "[N, K] int32 and lse [N] f32")
    p.add_argument("--topk", type=int, metavar="K",
                   help="instead of y, per row the top K (1..256) values, their column "
                        "indices and the row's log-sum-exp, computed on the worker")
    p.add_argument("--dtype", choices=names.DTYPES,
                   help="activation dtype sent on the wire, x converted to it (default: the "
                        "input's own dtype)")
    p.add_argument("--out-dtype", choices=names.DTYPES, default="f32",
                   help="output dtype (default f32)")
    p.add_argument("--precision", choices=names.PRECISIONS, default="auto",
                   help="numerics (default auto: the backend's fastest path)")

    p = _parser(sub, "status", "show backend, device, VRAM accounting, flags and version",
                "q6serve status --target 127.0.0.1:50051 --json", cmd_status)
    p.add_argument("--json", action="store_true", help="print JSON")

    p = _parser(sub, "flags", "show kill-switch flags, or set them with NAME=0|1 (admin)",
                "q6serve flags --target 127.0.0.1:50051 Q6SERVE_Q6K_SOA=0 "
                "Q6SERVE_DYNAMIC_BATCHING=1", cmd_flags)
    p.add_argument("assignments", nargs="*", type=_flag_assignment, metavar="NAME=0|1",
                   help=f"flags: {', '.join(FLAG_NAMES)} (the Q6SERVE_ prefix is optional)")
