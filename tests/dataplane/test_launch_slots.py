"""``Q6SERVE_LAUNCH_SLOTS`` (kernels/cuda/launch.py): launches in flight at once on one launcher
(default 3: the lane's launch_now pipeline takes them all, the batcher's pipelines at most 2); CPU
only, the parsing and what follows it (no CuPy needed to import the launcher's module)."""

from __future__ import annotations

import pytest

from q6serve.kernels.cuda.launch import slots_from_env


@pytest.mark.parametrize(("raw", "want"), [(None, 3), ("", 3), (" ", 3), ("1", 1), ("2", 2),
                                           ("4", 4)])
def test_slots_from_env(raw: str | None, want: int) -> None:
    env = {} if raw is None else {"Q6SERVE_LAUNCH_SLOTS": raw}
    assert slots_from_env(env) == want


def test_the_batcher_keeps_two() -> None:
    """The CUDA backend's batcher pipelines stay at two launches (as measured); launch_now's
    pipeline (the lane's) takes every slot."""
    from q6serve.kernels.cuda.launch import BATCH_SLOTS, SLOTS
    from q6serve.kernels.cuda_backend import CudaBackend

    assert min(SLOTS, 2) == BATCH_SLOTS
    assert CudaBackend.launch_slots == BATCH_SLOTS and CudaBackend.now_slots == SLOTS


@pytest.mark.parametrize("raw", ["0", "5", "-1", "two", "2.5"])
def test_bad_slots_refused(raw: str) -> None:
    with pytest.raises(ValueError, match="Q6SERVE_LAUNCH_SLOTS"):
        slots_from_env({"Q6SERVE_LAUNCH_SLOTS": raw})
