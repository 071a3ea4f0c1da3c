"""Named resident weights, refcounted so in-flight work keeps a weight alive through unload.

Used from the event loop thread only (no locks). ``remove`` takes the name away at once (new
requests get NOT_FOUND); the memory is released by ``on_unused`` once the last in-flight
request has let go of the entry.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from q6serve.kernels.api import ResidentWeight
from q6serve.kernels.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted

MAX_NAME_LEN = 256
# Host memory outside the VRAM budget, as fixed costs (GetStatus.host_overhead_bytes): what a
# resident weight's bookkeeping holds (entry, backend handle and slab objects, name, sha256:
# 1.6 KB of RSS measured on the NumPy backend, 2026-12-01) and what its batcher adds while it
# has one (task, queue, events, closures: 4.0 KB measured).
WEIGHT_HOST_BYTES = 2048
BATCHER_HOST_BYTES = 4096


def check_name(name: str) -> str:
    if not name or len(name) > MAX_NAME_LEN or not name.isprintable():
        raise InvalidArgument(f"weight name {name[:64]!r} must be 1..{MAX_NAME_LEN} printable "
                              f"characters (got {len(name)})")
    return name


@dataclass(eq=False, slots=True)
class WeightEntry:
    """One resident weight. Kept small (slots, no per-entry event, task or closure until it
    is used): a worker may hold 65536 of them, and each object here is one more for every
    full collection of the cyclic GC to walk (docs/RELIABILITY.md, "Many weights")."""

    name: str
    rows: int
    k: int
    sha256: str
    source: str
    resident: ResidentWeight  # swapped by relayouts (in the device thread)
    refs: int = 0
    removed: bool = False
    freed: asyncio.Future[None] | None = None  # made by an unload that waits for the free
    batcher: Any = None  # the weight's Batcher while it has one (the engine's to make)
    row_begin: int = 0  # row-sharded loads: global rows [row_begin, row_begin + rows)
    tensor_rows: int = 0  # rows of the whole source tensor (0: same as rows)

    @property
    def nbytes(self) -> int:
        return self.resident.nbytes


class Registry:
    def __init__(self, on_unused: Callable[[WeightEntry], None],
                 limit: int | None = None) -> None:
        self._weights: dict[str, WeightEntry] = {}
        self._claimed: set[str] = set()  # names being loaded right now
        self._on_unused = on_unused
        self.limit = limit  # resident + loading weights (--max-weights); None: no limit

    def __len__(self) -> int:
        return len(self._weights)

    def entries(self) -> list[WeightEntry]:
        return sorted(self._weights.values(), key=lambda e: e.name)

    @contextlib.contextmanager
    def claim(self, names: list[str]) -> Iterator[None]:
        """Hold names for a load in progress: a second load of the same name fails at once."""
        for n in names:
            check_name(n)
        dup = sorted(n for n, c in collections.Counter(names).items() if c > 1)  # O(names)
        if dup:
            raise InvalidArgument(f"names repeated in one load: {dup}")
        self.check_available(names)
        self._claimed.update(names)
        try:
            yield
        finally:
            self._claimed.difference_update(names)
            if not self._claimed:
                self._claimed = set()  # a set keeps its largest table: let 65536 names go

    def claimed(self) -> set[str]:
        """Names being loaded right now."""
        return set(self._claimed)

    def check_available(self, names: list[str]) -> None:
        """ALREADY_EXISTS for a name resident or loading; RESOURCE_EXHAUSTED past ``limit``."""
        taken = [n for n in names if n in self._weights or n in self._claimed]
        if taken:
            raise AlreadyExists(f"weight(s) already loaded or loading: {', '.join(taken)}")
        held = len(self._weights) + len(self._claimed)
        if self.limit is not None and held + len(names) > self.limit:
            raise ResourceExhausted(
                f"{len(names)} more weight(s) would exceed --max-weights {self.limit} "
                f"({len(self._weights)} resident, {len(self._claimed)} loading; each holds "
                f"~{WEIGHT_HOST_BYTES} bytes of host memory outside the VRAM budget)")

    def add(self, entry: WeightEntry) -> None:
        if entry.name in self._weights:
            raise AlreadyExists(f"weight {entry.name!r} is already loaded")
        self._weights[entry.name] = entry

    def get(self, name: str) -> WeightEntry:
        try:
            return self._weights[name]
        except KeyError:
            raise NotFound(f"no weight named {name[:MAX_NAME_LEN]!r} "
                           f"({len(self._weights)} loaded)") from None

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[WeightEntry]:
        """The entry, kept alive (not freed) until the block exits."""
        entry = self.acquire(name)
        try:
            yield entry
        finally:
            self.release(entry)

    def acquire(self, name: str) -> WeightEntry:
        """The entry, kept alive until :meth:`release` (for work that outlives a block)."""
        entry = self.get(name)
        entry.refs += 1
        return entry

    def release(self, entry: WeightEntry) -> None:
        entry.refs -= 1
        if entry.removed and entry.refs == 0:
            self._on_unused(entry)

    def remove(self, name: str) -> WeightEntry:
        entry = self.get(name)
        del self._weights[name]
        if not self._weights:
            self._weights = {}  # a dict keeps its largest table after deletes: let it go
        entry.removed = True
        if entry.refs == 0:
            self._on_unused(entry)
        return entry
