"""The tuning variables (service/envvars.py): one parser, refusals naming the variable, and the
worker refusing a bad one at start in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from q6serve.service import envvars
from q6serve.service.envvars import VARS, EnvError, Var


def test_unset_or_empty_means_the_default() -> None:
    for var in VARS:
        assert var.read({}) == var.default
        assert var.read({var.name: "  "}) == var.default


@pytest.mark.parametrize("raw,want", [("0", False), ("1", True), ("off", False), (" yes ", True)])
def test_a_switch_reads_as_the_flags_do(raw: str, want: bool) -> None:
    assert envvars.PIPELINE.read({"Q6SERVE_PIPELINE": raw}) is want


@pytest.mark.parametrize("var,raw", [
    (envvars.PIPELINE, "2"), (envvars.PIN_REGIONS, "maybe"),
    (envvars.JOB_BATCHES, "0"), (envvars.JOB_BATCHES, "2.0"), (envvars.JOB_BATCHES, "x"),
    (envvars.MMAP_THRESHOLD, "-1"), (envvars.FRONTEND_STACKS, "two"),
    (envvars.BUSY_POLL_US, "-0.5"), (envvars.BUSY_POLL_US, "nan"), (envvars.BUSY_POLL_US, "inf"),
    (envvars.DEFER_KERNEL_US, "soon"), (envvars.GIL_SWITCH_US, "0"),
    (envvars.GIL_SWITCH_US, "2000000"),
    (envvars.Q6K_PAIRS, "maybe"), (envvars.Y_CHUNKS, "17"), (envvars.Y_CHUNKS, "-1"),
    (envvars.LAUNCH_SLOTS, "0"), (envvars.LAUNCH_SLOTS, "5"), (envvars.LAUNCH_SLOTS, "three"),
    (envvars.DEFER_SLOTS, "0"), (envvars.DEFER_SLOTS, "5"), (envvars.DEFER_SLOTS, "1.5"),
    (envvars.DEFER_NOW, "soon"), (envvars.MULTI_PIPELINE, "2"),
    (envvars.MULTI_LAUNCH, "2"), (envvars.MULTI_LAUNCH, "both"),
    (envvars.TIMING_ANCHOR, "3"), (envvars.TIMING_ANCHOR, "yes"),
    (envvars.COPY_KERNEL_MAX, "-1"), (envvars.COPY_KERNEL_MAX, "64K"),
])
def test_a_bad_value_is_refused_naming_the_variable(var: Var, raw: str) -> None:
    with pytest.raises(EnvError, match=f"^{var.name}={raw!r}: "):
        var.read({var.name: raw})
    with pytest.raises(EnvError, match=var.name):
        envvars.check({var.name: raw})


def test_good_values_are_read_as_numbers() -> None:
    assert envvars.JOB_BATCHES.read({"Q6SERVE_JOB_BATCHES": " 4 "}) == 4
    assert envvars.BUSY_POLL_US.read({"Q6SERVE_BUSY_POLL_US": "250.5"}) == 250.5
    assert envvars.GIL_SWITCH_US.read({"Q6SERVE_GIL_SWITCH_US": "1000000"}) == 1_000_000
    envvars.check({var.name: "" for var in VARS})  # nothing set: nothing refused


def test_every_tuning_variable_of_the_code_is_in_the_table() -> None:
    """A Q6SERVE_ variable read with os.environ.get/env.get outside envvars would escape the
    worker's start check: the ones the code names are the table's, the flags', the CLI's."""
    import pathlib
    import re

    root = pathlib.Path(envvars.__file__).resolve().parents[1]
    named = set()
    for path in [*root.glob("service/*.py"), *root.glob("kernels/**/*.py")]:
        named |= set(re.findall(r'"(Q6SERVE_[A-Z0-9_]+)"', path.read_text()))
    from q6serve.service.flags import FLAG_NAMES

    others = {"Q6SERVE_DP_STATS"}  # a path for the front ends' stats dump (benches)
    others |= {"Q6SERVE_TOKEN", "Q6SERVE_ADMIN_TOKEN", "Q6SERVE_TLS_CERT", "Q6SERVE_TLS_KEY",
               "Q6SERVE_TLS_CLIENT_CA"}  # the worker's config (service/config.py)
    assert named - set(FLAG_NAMES) - others <= {v.name for v in VARS}


def test_the_worker_refuses_a_bad_variable_in_one_line() -> None:
    env = {"Q6SERVE_BUSY_POLL_US": "soon", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "q6serve.client.cli", "worker", "--port", "0"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == ("q6serve worker: error: Q6SERVE_BUSY_POLL_US='soon': give "
                                "microseconds the loop polls before it sleeps (0: never), "
                                "0 or more")


def test_an_x86_worker_takes_ring_lanes_unless_told_not_to() -> None:
    # the worker's side of the lane ring is on by default (it costs nothing until a caller asks
    # for a ring with Lane(ring=True)); Q6SERVE_LANE_RING=0 turns it off; other hosts never
    from q6serve.service import lane

    assert lane.ring_allowed({}) is lane.ORDERED_STORES
    assert lane.ring_allowed({"Q6SERVE_LANE_RING": "0"}) is False
    assert lane.ring_allowed({"Q6SERVE_LANE_RING": "1"}) is lane.ORDERED_STORES
