"""What every ``q6serve`` command shares: ``--target``/token/TLS options, the client they
make, and the one error reporter behind the exit codes.

Conventions: ``--target`` defaults to ``$Q6SERVE_TARGET`` and must name a port; bearer tokens
come from ``$Q6SERVE_TOKEN`` / ``$Q6SERVE_ADMIN_TOKEN`` (never the command line, so they stay
out of shell history and process lists). No gRPC import here: parsing stays light.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

from .targets import DEFAULT_PORT, check_target

DEFAULT_TARGET = f"127.0.0.1:{DEFAULT_PORT}"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(ValueError):
    """The command line asks for something impossible; the message says what to write."""


# -- argument types (argparse turns their ValueError/ArgumentTypeError into a usage error) ---------
def target_arg(text: str) -> str:
    """One target H:P, or A,B,... (one per shard); each must name its port."""
    for t in text.split(",") if "," in text and "://" not in text else [text]:
        try:
            check_target(t)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return text


def port_arg(text: str) -> int:
    """A TCP port: 0..65535 (0 picks a free one); the rule is WorkerConfig's."""
    from q6serve.kernels.errors import InvalidArgument
    from q6serve.service.config_limits import check_port

    try:
        port = int(text)
        check_port(port, "")
    except (ValueError, InvalidArgument):
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: give 0..65535 (0 = a free "
                                         "port)") from None
    return port


def seconds_arg(text: str) -> float:
    """A --timeout: seconds, finite and > 0 (nan and inf reached gRPC as a deadline already
    passed, 0 as a race with the call)."""
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds > 0 (a finite number)")
    return v


def add_target_options(p: argparse.ArgumentParser, timeout: float = 60.0,
                       sharded: bool = False) -> None:
    p.add_argument("--target", type=target_arg,
                   default=os.environ.get("Q6SERVE_TARGET", DEFAULT_TARGET),
                   help=f"worker address H:P (default $Q6SERVE_TARGET or {DEFAULT_TARGET})"
                        + ("; A,B,... for a weight row-sharded over several workers"
                           if sharded else ""))
    p.add_argument("--timeout", type=seconds_arg, default=timeout,
                   help=f"deadline of each call in seconds (default {timeout:g})")
    p.add_argument("--tls-ca", type=Path, help="PEM root certificate(s): use TLS")
    p.add_argument("--tls-cert", type=Path, help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key", type=Path, help="PEM client key (mutual TLS)")


def client_kwargs(args: argparse.Namespace, admin: bool = False) -> dict[str, Any]:
    """Keyword arguments for Client/AsyncClient/ShardedClient from the options and env."""
    env = os.environ
    token = (env.get("Q6SERVE_ADMIN_TOKEN") if admin else None) or env.get("Q6SERVE_TOKEN")
    kw: dict[str, Any] = {"token": token or None, "timeout": args.timeout}
    if args.tls_ca:
        kw["root_certificates"] = _pem(args.tls_ca, "--tls-ca")
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise UsageError("--tls-cert and --tls-key go together")
        kw["certificate_chain"] = _pem(args.tls_cert, "--tls-cert")
        kw["private_key"] = _pem(args.tls_key, "--tls-key")
    return kw


def _pem(path: Path, option: str) -> bytes:
    """The PEM file an option names; an empty one is refused (it read as "no TLS" once)."""
    data = path.read_bytes()
    if not data:
        raise UsageError(f"{option} {path}: the file is empty: give a PEM file")
    return data


# -- errors -> one line and an exit code ---------------------------------------------------------
def report(args: argparse.Namespace, e: BaseException) -> int | None:
    """Print ``e`` as one line (what is wrong, what to do) and return its exit code; None for
    an exception no user input explains (a bug: let its traceback show)."""
    cmd = f"q6serve {getattr(args, 'command', '')}".rstrip()
    code, text = _classify(args, e)
    if code is None:
        return None
    print(f"{cmd}: {' '.join(text.split())}", file=sys.stderr)  # one line, whatever e held
    return code


def _classify(args: argparse.Namespace, e: BaseException) -> tuple[int | None, str]:
    mods = sys.modules
    core = mods.get("q6serve.client.core")
    if core is not None and isinstance(e, core.Q6ServeError):
        return EXIT_FAILED, f"{e.code.name}: {e.message}{_hint(args, e)}"
    errors = mods.get("q6serve.kernels.errors")
    if errors is not None and isinstance(e, errors.Q6Error):
        # local work (a GGUF file, quantizing, starting a worker): the caller's input unless
        # the machine is what failed
        machine = e.grpc_code in ("UNAVAILABLE", "INTERNAL", "RESOURCE_EXHAUSTED", "UNKNOWN")
        return (EXIT_FAILED, f"{e.grpc_code}: {e}") if machine else (EXIT_USAGE, f"error: {e}")
    if isinstance(e, FileNotFoundError) and e.filename:
        return EXIT_USAGE, f"error: {e.filename}: no such file"
    if isinstance(e, OSError | ValueError):  # local files, PEMs, input arrays, bad values
        return EXIT_USAGE, f"error: {e}"
    return None, ""


def _hint(args: argparse.Namespace, e: Any) -> str:
    name = e.code.name
    target = getattr(args, "target", "")
    if name == "UNAVAILABLE" and "drain" not in e.message.lower():
        return (f" -- no worker answers at {target}: check --target (or $Q6SERVE_TARGET), "
                "or start one with `q6serve worker`")
    if name == "DEADLINE_EXCEEDED" and hasattr(args, "timeout"):
        return f" -- the call took longer than --timeout {args.timeout:g} s"
    if name == "UNAUTHENTICATED":
        return " -- set $Q6SERVE_TOKEN (or $Q6SERVE_ADMIN_TOKEN for admin commands)"
    return ""


def fail(args: argparse.Namespace, e: Exception, code: int = EXIT_FAILED) -> int:
    """Report ``e`` as :func:`report` does; ``code`` for anything it does not classify."""
    got = report(args, e)
    if got is None:
        print(f"q6serve {args.command}: {e}", file=sys.stderr)
        return code
    return got
