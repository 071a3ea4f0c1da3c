"""``q6serve quantize``: f32/f16 .npy matrices -> one GGUF file of Q6_K tensors."""

from __future__ import annotations

import argparse
from pathlib import Path

from .cli_target import UsageError

EXAMPLE = """example:
  q6serve quantize ffn_down.npy model.gguf --name blk.0.ffn_down.weight
  q6serve quantize a.npy:blk.0.attn_v.weight b.npy:output.weight model.gguf"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize", help="quantize .npy matrices to Q6_K tensors in a GGUF file",
        description="Quantize [rows, K] float32/float16/bfloat16 .npy (or one-array .npz) "
                    "matrices (K a multiple of 256) with ggml's reference Q6_K algorithm into "
                    "one GGUF file. Values Q6_K cannot represent (|x| above about 2.7e8, "
                    "NaN, Inf) are refused with their row, column and value.",
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
            raise UsageError("give --name NAME (or IN.npy:NAME) for the tensor")
        pairs[0] = (pairs[0][0], name)
    elif name:
        raise UsageError("--name only applies to a single input without :NAME")
    missing = [str(p) for p, t in pairs if not t]
    if missing:
        raise UsageError(f"no tensor name for {', '.join(missing)}: write IN.npy:NAME")
    names = [t for _, t in pairs]
    from q6serve.kernels.gguf_io import MAX_TENSOR_NAME_BYTES

    for t in names:  # (the GGUF readers refuse a longer one: a file nothing can load)
        if len(t.encode()) > MAX_TENSOR_NAME_BYTES:
            raise UsageError(f"tensor name {t[:40]!r}... is {len(t.encode())} bytes: at most "
                             f"{MAX_TENSOR_NAME_BYTES} bytes")
    if len(set(names)) != len(names):
        raise UsageError(f"duplicate tensor names in {names}")
    return pairs


def _check_out(out: str, inputs: list[Path]) -> None:
    """The last positional is OUT.gguf: one that is an input, or named like one, is refused
    (`quantize a.npy b.npy`, the OUT forgotten, wrote the GGUF over b.npy)."""
    p = Path(out)
    if p.suffix in (".npy", ".npz") or any(p.exists() and p.samefile(i) for i in inputs
                                           if i.exists()):
        raise UsageError(f"{out} is an input, not the OUT.gguf: name the GGUF file to write "
                         "last")


def run(args: argparse.Namespace) -> int:
    from q6serve.client.npyio import float_matrix, load_array
    from q6serve.kernels.gguf_io import write_q6k_gguf
    from q6serve.kernels.quantize import quantize_q6_k

    if len(args.inputs) < 2:
        raise UsageError("need at least one IN.npy and the OUT.gguf")
    *ins, out = args.inputs
    pairs = parse_pairs(ins, args.name)
    _check_out(out, [p for p, _ in pairs])
    tensors = {}
    for path, tensor in pairs:
        x = float_matrix(load_array(path), str(path), rows_of_1d=False,
                         hint="save it as float32")
        if not x.shape[0]:
            raise UsageError(f"{path}: the matrix {list(x.shape)} has no rows")
        # refuses values Q6_K cannot hold (an f16 scale overflowing from |x| ~ 2.7e8, blocks
        # zeroed by an overflowing scale search), naming the row, column and value
        tensors[tensor] = (quantize_q6_k(x, what=f"{path} ({tensor})"), x.shape[0], x.shape[1])
        print(f"{tensor}: {x.shape[0]}x{x.shape[1]} {x.dtype} -> "
              f"{tensors[tensor][0].nbytes} bytes Q6_K")
    write_q6k_gguf(out, tensors)
    print(f"wrote {out}")
    return 0
