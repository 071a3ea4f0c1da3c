"""Absolute times in a MatmulStream reply, for splitting a round trip's "transport" into the
way up and the way down (issue 14 T1; a bench diagnostic, never in the product).

``install()`` wraps ``q6serve.service.wire_replies.stream_reply`` in this process so that every
stream reply's request_id becomes ``"START END"``: perf_counter() when the worker took the request's
raw bytes (RPC_START, Took.start) and when the reply was encoded. perf_counter is
CLOCK_MONOTONIC, one clock for every process of the host, so the caller subtracts its own
times: up = START - the caller's write, down = the caller's read done - END. The worker gets it
through bench/trips_site/sitecustomize.py (``Q6SERVE_REPLY_STAMPS=1``); bench servers of
bench/stream_overhead.py call it directly.
"""

from __future__ import annotations

import sys
import time
from typing import Any


def install() -> None:
    from q6serve.service import rawmsg, wire_replies

    inner = wire_replies.stream_reply

    def stamped(r: Any, request_id: str, took: Any = None) -> Any:
        out = inner(r, request_id, took)
        if took is None:
            return out
        end = time.perf_counter()
        if (trips := sys.modules.get("loop_trips")) is not None:  # where in its loop step
            trips.mark("taken", took.start)
            trips.mark("encoded")
        tag = f"{took.start!r} {end!r}"
        if isinstance(out, bytes):  # a spliced reply: a later request_id field wins
            return out + rawmsg.record(1, len(tag)) + tag.encode()
        out.request_id = tag
        return out

    wire_replies.stream_reply = stamped


def stamp(start: float) -> str:
    """The request_id of an echo reply built now for a request taken at ``start``."""
    end = time.perf_counter()
    if (trips := sys.modules.get("loop_trips")) is not None:  # where in its loop step
        trips.mark("taken", start)
        trips.mark("encoded")
    return f"{start!r} {end!r}"


def parse(request_id: str) -> tuple[float, float] | None:
    """(START, END) of a stamped reply's request_id, else None."""
    parts = request_id.split()
    if len(parts) != 2:
        return None
    try:
        return float(parts[0]), float(parts[1])
    except ValueError:
        return None
