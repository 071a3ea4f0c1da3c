"""``q6serve quantize``: f32/f16 .npy matrices -> one GGUF file of Q6_K tensors."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

EXAMPLE = """example:
  q6serve quantize ffn_down.npy model.gguf --name blk.0.ffn_down.weight
  q6serve quantize a.npy:blk.0.attn_v.weight b.npy:output.weight model.gguf"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize", help="quantize .npy matrices to Q6_K tensors in a GGUF file",
        description="Quantize [rows, K] float32/float16 .npy matrices (K a multiple of 256) "
                    "with ggml's reference Q6_K algorithm into one GGUF file.",
        epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="IN.npy[:NAME]",
                   help="input matrices, optionally IN:NAME; the last positional is OUT.gguf")
    p.add_argument("--name", help="tensor name when a single input has no :NAME")
    p.set_defaults(func=run)


def parse_pairs(items: list[str], name: str | None) -> list[tuple[Path, str]]:
    pairs = []
    for item in items:
        path, sep, tensor = item.rpartition(":") if item.count(":") else ("", "", "")
        if not sep:
            path, tensor = item, ""
        pairs.append((Path(path), tensor))
    if len(pairs) == 1 and not pairs[0][1]:
        if not name:
            raise ValueError("give --name NAME (or IN.npy:NAME) for the tensor")
        pairs[0] = (pairs[0][0], name)
    elif name:
        raise ValueError("--name only applies to a single input without :NAME")
    missing = [str(p) for p, t in pairs if not t]
    if missing:
        raise ValueError(f"no tensor name for {', '.join(missing)}: write IN.npy:NAME")
    names = [t for _, t in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate tensor names in {names}")
    return pairs


def run(args: argparse.Namespace) -> int:
    from q6serve.kernels.errors import Q6Error
    from q6serve.kernels.gguf_io import write_q6k_gguf
    from q6serve.kernels.quantize import quantize_q6_k

    if len(args.inputs) < 2:
        print("error: need at least one IN.npy and the OUT.gguf", file=sys.stderr)
        return 2
    *ins, out = args.inputs
    try:
        pairs = parse_pairs(ins, args.name)
        tensors = {}
        for path, tensor in pairs:
            x = np.load(path, allow_pickle=False)  # never unpickle user files
            if x.dtype not in (np.float32, np.float16) or x.ndim != 2:
                raise ValueError(f"{path}: need a 2-D float32/float16 matrix, "
                                 f"got {x.dtype} {x.shape}")
            tensors[tensor] = (quantize_q6_k(x), x.shape[0], x.shape[1])
            print(f"{tensor}: {x.shape[0]}x{x.shape[1]} {x.dtype} -> "
                  f"{tensors[tensor][0].nbytes} bytes Q6_K")
        write_q6k_gguf(out, tensors)
    except (OSError, ValueError, Q6Error) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
