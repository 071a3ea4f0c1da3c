"""The ``q6serve`` command line: one module per subcommand, registered here.

Each subcommand module exposes ``register(subparsers)``; it adds its parser and sets
``func`` to a callable taking the parsed args and returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in --help order. Imported lazily so `q6serve quantize` never loads gRPC
# servers and `q6serve health` never loads the kernels.
COMMANDS: tuple[str, ...] = ("cmd_demo", "cmd_quantize", "cmd_worker", "cmd_admin", "cmd_upload",
                             "cmd_bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="q6serve",
        description="GPU worker serving Q6_K (GGUF) batched-decode matmuls over gRPC.",
        epilog="Run `q6serve COMMAND --help` for each command's options and an example.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"q6serve.client.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
