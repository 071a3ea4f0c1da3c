"""Client library and the ``q6serve`` command line.

    from q6serve.client import Client, AsyncClient, ShardedClient, Q6ServeError, RetryPolicy

The names are resolved on first use, so importing the package (as the CLI does) loads
neither gRPC nor NumPy.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"Client": "client", "Q6ServeError": "client", "MatmulOutput": "client",
            "Weight": "client", "TopK": "client", "AsyncClient": "async_client",
            "RetryPolicy": "retry", "ShardedClient": "sharded"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
