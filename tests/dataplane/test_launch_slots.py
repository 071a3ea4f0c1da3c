"""``Q6SERVE_LAUNCH_SLOTS`` (kernels/cuda/launch.py): launches in flight at once, an experiment
off by default (2); CPU only, the parsing and what follows it (no CuPy needed to import the
launcher's module)."""

from __future__ import annotations

import pytest

from q6serve.kernels.cuda.launch import slots_from_env


@pytest.mark.parametrize(("raw", "want"), [(None, 2), ("", 2), (" ", 2), ("1", 1), ("3", 3),
                                           ("4", 4)])
def test_slots_from_env(raw: str | None, want: int) -> None:
    env = {} if raw is None else {"Q6SERVE_LAUNCH_SLOTS": raw}
    assert slots_from_env(env) == want


@pytest.mark.parametrize("raw", ["0", "5", "-1", "two", "2.5"])
def test_bad_slots_refused(raw: str) -> None:
    with pytest.raises(ValueError, match="Q6SERVE_LAUNCH_SLOTS"):
        slots_from_env({"Q6SERVE_LAUNCH_SLOTS": raw})
