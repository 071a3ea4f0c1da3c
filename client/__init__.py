"""Client library and the ``q6serve`` command line.

    from q6serve.client import Client, AsyncClient, ShardedClient, Q6ServeError, RetryPolicy

The names are resolved on first use, so importing the package (as the CLI does) loads
neither gRPC nor NumPy.

Importing the package turns gRPC's EventEngine off for this process where
``GRPC_EXPERIMENTS`` is unset and gRPC is not imported yet (:mod:`.grpc_env`, as
``q6serve worker`` does for itself): a caller's round trip then crosses fewer threads (H200,
the 28-layer decode replay, session 25: S=8 109.2 -> 61.9 ms a step, S=1 67.5 -> 27.6). An
empty ``GRPC_EXPERIMENTS`` keeps gRPC's defaults; where gRPC was imported first nothing
changes (gRPC reads the variable once, at its import).
"""

from __future__ import annotations

import importlib
from typing import Any

from . import grpc_env

grpc_env.apply()  # before anything of the package imports gRPC (grpc_env itself does not)

_EXPORTS = {"Client": "client", "Q6ServeError": "client", "MatmulOutput": "client",
            "Weight": "client", "TopK": "client", "AsyncClient": "async_client",
            "RetryPolicy": "retry", "ShardedClient": "sharded"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
