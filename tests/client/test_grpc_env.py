"""client/grpc_env.py: the worker's and the client library's gRPC experiments, set only where
nothing is set and only before gRPC is imported (gRPC reads GRPC_EXPERIMENTS once, at its
import)."""

from __future__ import annotations

import os
import subprocess
import sys

from q6serve.client import grpc_env


def test_set_where_unset_before_grpc() -> None:
    env: dict[str, str] = {}
    assert grpc_env.apply(env, modules={}) is True
    assert env == {"GRPC_EXPERIMENTS": grpc_env.EVENT_ENGINE_OFF}


def test_a_set_value_is_kept_even_empty() -> None:
    for value in ("", "-event_engine_client"):
        env = {"GRPC_EXPERIMENTS": value}
        assert grpc_env.apply(env, modules={}) is True
        assert env == {"GRPC_EXPERIMENTS": value}


def test_nothing_changes_once_grpc_is_imported() -> None:
    env: dict[str, str] = {}
    assert grpc_env.apply(env, modules={"grpc": object()}) is False
    assert env == {}


def test_grpc_knows_every_experiment_named() -> None:
    """This grpcio reads each name (an unknown one is logged as such and ignored)."""
    r = subprocess.run([sys.executable, "-c", "import grpc, grpc.aio; grpc.aio.server()"],
                       capture_output=True, text=True, timeout=60,
                       env={"GRPC_EXPERIMENTS": grpc_env.EVENT_ENGINE_OFF + ",no_such_one",
                            "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert "Unknown experiment: no_such_one" in r.stderr, r.stderr  # (names are checked)
    assert r.stderr.count("Unknown experiment") == 1, r.stderr


def test_a_process_set_up_before_grpc_says_so_after_too() -> None:
    """Called again once gRPC is imported, apply() says whether the process's first call came
    before gRPC's import (bench/trips_site's worker): True then, False where gRPC came first."""
    code = ("from q6serve.client import grpc_env\n"
            "{first}"
            "import grpc\n"
            "import os\n"
            "print(grpc_env.apply(), os.environ.get('GRPC_EXPERIMENTS'))\n")
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    for first, want in (("grpc_env.apply()\n", f"True {grpc_env.EVENT_ENGINE_OFF}"),
                        ("", f"True {grpc_env.EVENT_ENGINE_OFF}")):  # (the package's import)
        r = subprocess.run([sys.executable, "-c", code.format(first=first)],
                           capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == want, r.stdout
    late = ("import grpc\n"
            "import os\n"
            "from q6serve.client import grpc_env\n"
            "print(grpc_env.apply(), os.environ.get('GRPC_EXPERIMENTS'))\n")
    r = subprocess.run([sys.executable, "-c", late], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False None", r.stdout


def test_the_client_library_sets_up_its_callers_grpc() -> None:
    """Importing q6serve.client (any of it) before gRPC turns the EventEngine off for the
    process (and what it starts) where nothing is set; a set value, empty too, is kept; gRPC
    imported first: nothing changes. The package's import itself loads no gRPC."""
    code = ("import os, sys\n"
            "{first}"
            "import q6serve.client\n"
            "print('grpc' in sys.modules, os.environ.get('GRPC_EXPERIMENTS'))\n")
    base = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    for first, extra, want in (("", {}, f"False {grpc_env.EVENT_ENGINE_OFF}"),
                               ("", {"GRPC_EXPERIMENTS": ""}, "False "),
                               ("", {"GRPC_EXPERIMENTS": "-event_engine_client"},
                                "False -event_engine_client"),
                               ("import grpc\n", {}, "True None")):
        r = subprocess.run([sys.executable, "-c", code.format(first=first)],
                           capture_output=True, text=True, timeout=60, env={**base, **extra})
        assert r.returncode == 0, r.stderr
        assert r.stdout.rstrip("\n") == want, (first, extra, r.stdout)
