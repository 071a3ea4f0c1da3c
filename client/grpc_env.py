"""gRPC's process-wide settings that ``q6serve worker`` makes before gRPC starts (issue 14, T1).

gRPC reads ``GRPC_EXPERIMENTS`` once, when its core is first imported. grpcio 1.8x polls its
sockets with the EventEngine (a poller thread and a thread pool of its own) unless the
``event_engine_*`` experiments are turned off, which gives back the older iomgr path: the
thread that waits on the completion queue (grpc.aio's poller) polls the sockets itself, so a
request reaches the worker's loop with fewer thread wake-ups. VM (2 cores, numpy;
bench/stream_overhead.py at T1's sizes, 3 rounds alternated): the bare echo's round trip 238 ->
169 us p50 with them off in its process (its EventEngine threads' 3 wake-ups and 50 us of CPU a
round trip gone), the worker's 744 -> 704 beyond its kernel (its EventEngine threads' 10.8
wake-ups and 209 us of CPU a round trip -> 3.4 and 69). docs/SERVICE.md has the H200 figures.

The worker sets the variable only where its environment has none (an empty value keeps
gRPC's defaults) and only before gRPC is imported (after that it would not be read: nothing
is changed then). Its front-end processes inherit it. The client library does the same for
its callers: importing ``q6serve.client`` calls :func:`apply` (the caller's own gRPC hops are
half of a round trip's: H200, session 25, the 28-layer decode replay with the worker's
EventEngine off and the caller's on / off, S=8 109.2 / 61.9 ms a step, S=1 67.5 / 27.6; the
caller's CPU a step 41.6 / 26.0 ms). A process that imported gRPC before the package keeps
gRPC's defaults; one that wants them anyway sets ``GRPC_EXPERIMENTS`` empty. Processes it
starts inherit the variable.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

VAR = "GRPC_EXPERIMENTS"
# the experiments turned off ("-NAME"); grpcio 1.84-1.85 know each (an unknown name is logged
# and ignored)
EVENT_ENGINE_OFF = ("-event_engine_client,-event_engine_listener,"
                    "-event_engine_for_all_other_endpoints,-event_engine_callback_cq")


_before_grpc = False  # this process's environment was set up before gRPC was imported


def apply(env: MutableMapping[str, str] | None = None,
          modules: Mapping[str, object] | None = None) -> bool:
    """Set ``GRPC_EXPERIMENTS`` to :data:`EVENT_ENGINE_OFF` in ``env`` (default: this process's
    environment) unless it is set already or gRPC is imported already (``modules``:
    ``sys.modules``). Returns whether gRPC reads (or read) the variable as it now is: gRPC not
    imported yet, or, for this process's environment, an earlier call made before gRPC's import
    (bench/trips_site does so for a worker whose start-up imports gRPC)."""
    global _before_grpc
    own = env is None
    env = os.environ if env is None else env
    modules = sys.modules if modules is None else modules
    if "grpc" in modules or "grpc._cython.cygrpc" in modules:
        return own and _before_grpc
    env.setdefault(VAR, EVENT_ENGINE_OFF)
    _before_grpc = _before_grpc or own
    return True
