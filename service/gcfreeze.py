"""Short full collections of the cyclic GC while a worker holds very many weights.

A full (generation 2) collection walks every GC-tracked object of the process. Each resident
weight keeps ~5 (its entry, the backend's handle and storage list), a load of N tensors makes
~10 per tensor while it parses and loads, and 65536 weights made collections of 0.1-0.45 s:
steps of the event loop that delay every health check by as much (docs/RELIABILITY.md, "Many
weights"). From ``FREEZE_AT`` weights on, the worker moves every object alive to the GC's
permanent generation (``gc.freeze``) as a load goes and after it; a full collection then walks
only what was made since. Objects frozen are still freed by their reference counts (weights
unload as before); what freezing costs is that a reference cycle already garbage at the moment
of a freeze is not collected while frozen. So when the weights of all engines of the process
drop below ``FREEZE_AT`` again, everything is let back (``gc.unfreeze``) and the next full
collection takes care of such cycles.
"""

from __future__ import annotations

import gc
import threading

FREEZE_AT = 4096  # resident (or loading) weights in the process from which the GC is frozen

_lock = threading.Lock()
_counts: dict[int, int] = {}  # weights per owner (an engine's id)
_frozen = False
_collect = False  # a collection was asked for (abandoned calls; engine._trim_heap runs it)


def freeze() -> None:
    """Move everything alive out of the GC's generations now (a long load, every
    FREEZE_AT tensors; safe from any thread)."""
    global _frozen
    with _lock:
        gc.freeze()
        _frozen = True


def settle(owner: int, weights: int) -> None:
    """``owner`` holds ``weights`` now: freeze when the process holds at least FREEZE_AT,
    unfreeze when it holds fewer and a freeze is in force."""
    global _frozen
    with _lock:
        if weights:
            _counts[owner] = weights
        else:
            _counts.pop(owner, None)
        if sum(_counts.values()) >= FREEZE_AT:
            gc.freeze()
            _frozen = True
        elif _frozen:
            gc.unfreeze()
            _frozen = False


def frozen() -> bool:
    return _frozen


def collect_soon() -> None:
    """Ask for one full collection at the next heap trim: a call abandoned by its client
    (a cancelled stream, a dropped reply) leaves its handler's frames in reference cycles
    with whatever they still hold, freed only by the cyclic GC, and then returned to the
    OS by the trim (docs/RELIABILITY.md, "RSS after an attack")."""
    global _collect
    _collect = True


def collect_if_asked() -> int:
    """Run the collection collect_soon asked for, if any; returns the objects it freed."""
    global _collect
    if not _collect:
        return 0
    _collect = False
    return gc.collect()
