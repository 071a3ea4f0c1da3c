"""Kill-switch flags: read from the environment at start, changed at run time by SetFlags.

Nothing is frozen at import: :meth:`FlagState.from_env` is called by the worker with the
environment it was given, and :class:`Flags` holds the live state (an immutable snapshot that
is swapped whole, so readers never see half a change).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace

from q6serve.kernels.api import KernelFlags, parse_bool
from q6serve.kernels.errors import InvalidArgument

log = logging.getLogger("q6serve.flags")

# Env/wire name -> FlagState attribute.
FLAG_NAMES: dict[str, str] = {
    "Q6SERVE_Q6K_SOA": "q6k_soa",
    "Q6SERVE_DECODE_MMQ": "decode_mmq",
    "Q6SERVE_DYNAMIC_BATCHING": "dynamic_batching",
}
@dataclass(frozen=True)
class FlagState:
    q6k_soa: bool = True
    decode_mmq: bool = True
    dynamic_batching: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> FlagState:
        kw = {attr: parse_bool(name, env[name]) for name, attr in FLAG_NAMES.items()
              if env.get(name, "").strip()}
        return cls(**kw)

    def as_dict(self) -> dict[str, bool]:
        return {name: getattr(self, attr) for name, attr in FLAG_NAMES.items()}

    def with_changes(self, changes: Mapping[str, bool]) -> FlagState:
        unknown = [n for n in changes if n not in FLAG_NAMES]
        if unknown:
            raise InvalidArgument(f"unknown flag(s) {', '.join(unknown)}; "
                                  f"known: {', '.join(FLAG_NAMES)}")
        return replace(self, **{FLAG_NAMES[n]: bool(v) for n, v in changes.items()})

    def kernel_flags(self) -> KernelFlags:
        return KernelFlags(soa=self.q6k_soa, decode_mmq=self.decode_mmq)

    def __str__(self) -> str:
        return " ".join(f"{n}={int(v)}" for n, v in self.as_dict().items())


assert {f.name for f in fields(FlagState)} == set(FLAG_NAMES.values())


class Flags:
    """The live flag state; listeners run (on the caller's thread) after each change."""

    def __init__(self, initial: FlagState) -> None:
        self._state = initial
        self._listeners: list[Callable[[FlagState, FlagState], None]] = []

    @property
    def state(self) -> FlagState:
        return self._state

    def subscribe(self, fn: Callable[[FlagState, FlagState], None]) -> None:
        self._listeners.append(fn)

    def set(self, changes: Mapping[str, bool], who: str = "SetFlags") -> FlagState:
        old = self._state
        new = old.with_changes(changes)
        self._state = new
        if new != old:
            diff = {n: int(v) for n, v in new.as_dict().items() if old.as_dict()[n] != v}
            log.info("flags changed by %s: %s (now %s)", who, diff, new)
        for fn in self._listeners:
            fn(old, new)
        return new
