"""``--target`` / token / TLS options shared by the ``upload`` and ``bench`` commands.

Same conventions as the admin commands: ``--target`` defaults to ``$Q6SERVE_TARGET``; bearer
tokens come from ``$Q6SERVE_TOKEN`` / ``$Q6SERVE_ADMIN_TOKEN`` (never the command line, so they
stay out of shell history and process lists).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_TARGET = "127.0.0.1:50051"


def add_target_options(p: argparse.ArgumentParser, timeout: float = 60.0) -> None:
    p.add_argument("--target", default=os.environ.get("Q6SERVE_TARGET", DEFAULT_TARGET),
                   help=f"worker address H:P (default $Q6SERVE_TARGET or {DEFAULT_TARGET})")
    p.add_argument("--timeout", type=float, default=timeout,
                   help=f"deadline of each call in seconds (default {timeout:g})")
    p.add_argument("--tls-ca", type=Path, help="PEM root certificate(s): use TLS")
    p.add_argument("--tls-cert", type=Path, help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key", type=Path, help="PEM client key (mutual TLS)")


def client_kwargs(args: argparse.Namespace, admin: bool = False) -> dict[str, Any]:
    """Keyword arguments for Client/AsyncClient from the parsed options and environment."""
    env = os.environ
    token = (env.get("Q6SERVE_ADMIN_TOKEN") if admin else None) or env.get("Q6SERVE_TOKEN")
    kw: dict[str, Any] = {"token": token or None, "timeout": args.timeout}
    if args.tls_ca:
        kw["root_certificates"] = args.tls_ca.read_bytes()
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise SystemExit(f"q6serve {args.command}: --tls-cert and --tls-key go together")
        kw["certificate_chain"] = args.tls_cert.read_bytes()
        kw["private_key"] = args.tls_key.read_bytes()
    return kw


def fail(args: argparse.Namespace, e: Exception, code: int = 1) -> int:
    """Print a failed call's gRPC status and message (or a local error) and return ``code``."""
    what = f"{e.code.name}: {e.message}" if hasattr(e, "code") and hasattr(e, "message") \
        else str(e)
    print(f"q6serve {args.command}: {what}", file=sys.stderr)
    return code
