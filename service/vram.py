"""VRAM accountant: a budget, reserve-before-allocate with rollback, exact figures.

Every byte a backend will allocate is reserved here first (``weights``, ``scratch``: the
matmul workspace sized for the largest resident weight, ``staging``: transient load and
relayout buffers). A reservation that does not fit raises RESOURCE_EXHAUSTED before anything is
allocated; one that is not committed is rolled back when its ``with`` block exits. On the NumPy
backend the same figures govern the host memory holding weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from q6serve.kernels.api import MemoryInfo
from q6serve.kernels.errors import ResourceExhausted

CATEGORIES = ("weights", "scratch", "staging")


@dataclass(frozen=True)
class VramStats:
    budget: int
    weights: int
    scratch: int
    staging: int
    pool_used: int
    pool_total: int
    device_free: int
    device_total: int

    @property
    def reserved(self) -> int:
        return self.weights + self.scratch + self.staging

    @property
    def device_used(self) -> int:
        return self.device_total - self.device_free


class Reservation:
    """Bytes held against the budget; released on exit unless committed (per category)."""

    def __init__(self, acct: VramAccountant, amounts: dict[str, int]) -> None:
        self._acct = acct
        self.amounts = dict(amounts)
        self._kept: dict[str, int] = {}

    def keep(self, category: str, nbytes: int) -> None:
        """Keep ``nbytes`` of ``category`` after exit (adjusting to the exact figure)."""
        self._acct.adjust(category, nbytes - self.amounts.get(category, 0))
        self.amounts[category] = nbytes
        self._kept[category] = nbytes

    def release(self) -> None:
        rest = {c: n for c, n in self.amounts.items() if c not in self._kept}
        self._acct.release(rest)
        self.amounts = dict(self._kept)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class VramAccountant:
    """Thread-safe: reservations come from the event loop and from the device executor."""

    def __init__(self, budget: int, memory: Callable[[], MemoryInfo]) -> None:
        self.budget = int(budget)
        self._memory = memory
        self._lock = threading.Lock()
        self._used = dict.fromkeys(CATEGORIES, 0)

    def check(self, **amounts: int) -> None:
        """Raise RESOURCE_EXHAUSTED if ``amounts`` would not fit now (reserves nothing): lets
        an upload be refused after its header, before its data is buffered."""
        self.reserve(**amounts).release()

    def reserve(self, **amounts: int) -> Reservation:
        """Reserve e.g. ``weights=n, staging=m`` at once, or raise RESOURCE_EXHAUSTED."""
        for c, n in amounts.items():
            if c not in self._used or n < 0:
                raise ValueError(f"bad reservation {c}={n}")
        total = sum(amounts.values())
        with self._lock:
            used = sum(self._used.values())
            if used + total > self.budget:
                detail = ", ".join(f"{c} {n}" for c, n in amounts.items() if n)
                raise ResourceExhausted(
                    f"VRAM budget exceeded: need {total} bytes ({detail}), "
                    f"{self.budget - used} of {self.budget} free "
                    f"(weights {self._used['weights']}, scratch {self._used['scratch']}, "
                    f"staging {self._used['staging']})")
            for c, n in amounts.items():
                self._used[c] += n
        return Reservation(self, amounts)

    def adjust(self, category: str, delta: int) -> None:
        """Correct a held reservation to the exact allocated figure (may exceed the budget
        by what the backend really took: the figure stays exact)."""
        with self._lock:
            self._used[category] += delta

    def release(self, amounts: dict[str, int]) -> None:
        with self._lock:
            for c, n in amounts.items():
                self._used[c] -= n
                assert self._used[c] >= 0, f"VRAM accounting went negative for {c}"

    def used(self, category: str) -> int:
        with self._lock:
            return self._used[category]

    def stats(self) -> VramStats:
        mem = self._memory()
        with self._lock:
            used = dict(self._used)
        return VramStats(budget=self.budget, weights=used["weights"], scratch=used["scratch"],
                         staging=used["staging"], pool_used=mem.pool_used,
                         pool_total=mem.pool_total, device_free=mem.free,
                         device_total=mem.total)
