"""The worker's limits: their defaults and rules in one place, for ``WorkerConfig`` and for the
``q6serve worker`` CLI (which builds its ``--help`` from here). Light on purpose: every CLI
command imports it at start, so it imports nothing heavier than the error types.
"""

from __future__ import annotations

import re

from q6serve.kernels.errors import InvalidArgument

MAX_PORT = 65535
MAX_MESSAGE_BYTES = 256 * 2**20  # gRPC message size: replies, and the ceiling of requests
# Largest request message the worker reads. gRPC's core refuses a larger one before Python
# sees it (RESOURCE_EXHAUSTED "Received message larger than max"): grpcio copies a message
# into Python in one step of the event loop with the GIL held (page faults of two fresh
# buffers, most of it): ~1.3 ms per MiB on the CI VM alone, 2-4 ms under load, so this
# bounds what one request can delay health and every other call by. 16 MiB: x of N = 256
# rows in f32 for K up to 16384, in f16 up to 32768; bigger activations go in shared-memory
# regions. (At 32 MiB one copy took 60-110 ms on the loaded CI VM: docs/RELIABILITY.md.)
MAX_REQUEST_BYTES = 16 * 2**20
MAX_CONCURRENT_STREAMS = 1 << 16  # HTTP/2 streams per connection
MAX_UPLOAD_BYTES = 8 * 2**30
MAX_WEIGHTS = 1 << 16  # resident weights (host bookkeeping: registry.WEIGHT_HOST_BYTES each)
# Unary calls admitted at once (request read, reply not yet written; more wait in the queue),
# and the bounds of one connection's fair share of them, limit / active connections
# (service/admission.py).
MAX_INFLIGHT_RPCS = 512
MAX_INFLIGHT_RPCS_PER_CONNECTION = 64
MIN_INFLIGHT_RPCS_PER_CONNECTION = 8
# A reply its client has not taken this many seconds after it was computed is dropped
# (CANCELLED) while other calls wait for an admission place (service/admission.py).
REPLY_TIMEOUT_S = 2.0
# Unary calls whose request is read at once, for hosts that send big requests (interceptor.py,
# BIG_REQUEST_BYTES): gRPC's Python layer copies each into Python in one step of the event
# loop, so this bounds how many such copies can queue ahead of a health check (and each place
# stays taken a gap after its big read: interceptor.GAP_S_PER_MIB). A call whose request has
# not arrived READ_TIMEOUT_S after its read began, while others wait to be read, is cancelled.
MAX_READING_RPCS = 1
READ_TIMEOUT_S = 1.0
# MatmulStream: bytes of requests admitted and replies not yet written, per stream, for all
# the streams of one connection, for all streams of the worker.
MAX_STREAM_BYTES = 64 * 2**20
MAX_STREAM_BYTES_PER_CONNECTION = 256 * 2**20
MAX_STREAM_BYTES_TOTAL = 1 * 2**30
# Streaming calls (MatmulStream, UploadWeight, health Watch) open at once, per connection and
# in the worker (admission.StreamSlots: ~25 KiB each even when idle, so at most ~100 MiB);
# --max-streams-per-connection and --max-streams.
MAX_STREAMS_PER_CONNECTION = 256
MAX_STREAMS = 4096
# --frontends: front-end processes, each committing its --frontend-shm-bytes arena in /dev/shm at
# start (1000 were taken on a 2-core VM: 64 GB of arenas asked, ~180 processes spawned before it
# was stopped); --frontend-shm-bytes: below one MiB the arena holds no decode call's x and y
# (they travel in the message instead, and the arena only costs).
MAX_FRONTENDS = 64
MIN_FRONTEND_SHM_BYTES = 1 << 20

SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
         "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str, what: str) -> int:
    """``"64MiB"``, ``"1G"``, ``"1048576"``: a whole number of bytes >= 1."""
    m = SIZE.match(text)
    value = 0
    if m:
        value = int(float(m.group(1)) * UNITS[(m.group(2) or "").lower().rstrip("b")])
    if value < 1:
        raise InvalidArgument(f"{what} {text!r}: give bytes >= 1 (64MiB, 1G, 1048576)")
    return value


def check_port(port: int | None, what: str) -> None:
    """A TCP port to listen on: 0..65535 (0 picks a free one); None: not listening."""
    if port is not None and not 0 <= port <= MAX_PORT:
        raise InvalidArgument(f"{what} {port!r} is not a port: give 0..{MAX_PORT} "
                              "(0 = a free port)")


def show_size(n: int) -> str:
    """Bytes as the CLI shows defaults: 256MiB, 8GiB, 1000."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)
