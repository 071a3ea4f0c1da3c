"""Q6SERVE_FRONTEND_GC_FREEZE (service/frontends.py ``freeze_startup``): off by default; on, a
front end's start-up objects leave the cyclic GC's generations, so a full collection walks only
what came after them."""

from __future__ import annotations

import gc

from q6serve.service import envvars
from q6serve.service.frontends_front import freeze_startup


def test_off_by_default_and_on_with_the_switch() -> None:
    assert envvars.FRONTEND_GC_FREEZE.default is False
    gc.unfreeze()
    try:
        assert not freeze_startup({}) and gc.get_freeze_count() == 0
        assert not freeze_startup({"Q6SERVE_FRONTEND_GC_FREEZE": "0"})
        assert gc.get_freeze_count() == 0
        keep = [[i] for i in range(50_000)]  # start-up's objects
        assert freeze_startup({"Q6SERVE_FRONTEND_GC_FREEZE": "1"})
        assert gc.get_freeze_count() >= len(keep)
        gc.collect()  # what a full collection then walks: not the frozen ones
        assert len(gc.get_objects(2)) < len(keep) // 10
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0  # (the test process as it was)
