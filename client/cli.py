"""The ``q6serve`` command line: one module per subcommand, registered here.

Each subcommand module exposes ``register(subparsers)``; it adds its parser and sets
``func`` to a callable taking the parsed args and returning an exit code. Errors a user can
cause never end in a traceback: :func:`main` turns them (and Ctrl-C) into one line on stderr
and an exit code from :data:`EXIT_CODES`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from .cli_target import EXIT_INTERRUPTED, EXIT_USAGE, report

# Subcommand modules, in --help order. Imported lazily so `q6serve quantize` never loads gRPC
# servers and `q6serve health` never loads the kernels.
COMMANDS: tuple[str, ...] = ("cmd_demo", "cmd_quantize", "cmd_worker", "cmd_admin", "cmd_upload",
                             "cmd_bench")

EPILOG = """exit codes (every command):
  0    success
  1    failed: a call or the worker failed (the gRPC status and message are printed), or
       a check did (health NOT_SERVING, a wrong demo result, failed bench calls)
  2    usage error: a bad argument, or an input file the command cannot use
  130  interrupted (Ctrl-C); bench first prints the cells it finished

Run `q6serve COMMAND --help` for each command's options and an example."""


class Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line (which argument, what to do), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("q6serve")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="q6serve",
        description="GPU worker serving Q6_K (GGUF) batched-decode matmuls over gRPC.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"q6serve {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"q6serve.client.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"q6serve {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        code = report(args, e)
        if code is None:
            raise  # a bug, not a user error: the traceback is what to report
        return code


if __name__ == "__main__":
    sys.exit(main())
