"""The launch path's split into modules (kernels/cuda/launch.py's docstring) keeps one rule:
launch.py holds every setting (constants, env readers, the per-call rules and the driver hooks
tests replace) and the modules beside it read them there per call, as ``launch.NAME``, so a
bench or test that sets ``launch.NAME`` (bench/backend_wall.py --variants, bench/table_wall.py,
bench/hp_site's HP_SET_, monkeypatch) reaches every reader. A module that bound a setting by
value (``from .launch import X_SPLIT_MIN``, or its own copy) would silently ignore such a set."""

from __future__ import annotations

import ast
import os
import pathlib

import pytest

from q6serve.kernels.cuda import launch

CUDA_DIR = pathlib.Path(launch.__file__).parent
PARTS = ("launcher", "plans", "sequence", "copies", "workspace", "bound_call", "region_call",
         "many")
ROOT = pathlib.Path(__file__).resolve().parents[2]
SKIP_DIRS = {".venv", ".git", "build", "node_modules", "__pycache__", ".pytest_cache"}


def _settings() -> set[str]:
    """The names launch.py itself defines (its settings) and the driver hooks it imports at its
    top for tests to replace; not the names of its parts it imports last."""
    tree = ast.parse(pathlib.Path(launch.__file__).read_text())
    own: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            own.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.ImportFrom) and node.lineno < _parts_line(tree):
            own.update(a.asname or a.name for a in node.names)
    return own - {"annotations"}


def _parts_line(tree: ast.Module) -> int:
    """The line of launch.py's first import after its settings (its parts, imported last)."""
    last_def = max(n.lineno for n in tree.body if not isinstance(n, (ast.Import, ast.ImportFrom)))
    return min(n.lineno for n in tree.body if isinstance(n, ast.ImportFrom)
               and n.lineno > last_def)


def _moved() -> dict[str, str]:
    """launch.py's re-exported names of its parts: name -> the module it comes from."""
    tree = ast.parse(pathlib.Path(launch.__file__).read_text())
    return {a.asname or a.name: node.module for node in tree.body
            if isinstance(node, ast.ImportFrom) and node.lineno >= _parts_line(tree)
            for a in node.names}


@pytest.mark.parametrize("part", PARTS)
def test_parts_read_settings_through_the_launch_module(part):
    tree = ast.parse((CUDA_DIR / f"{part}.py").read_text())
    settings = _settings() - {"np", "os", "sys", "Any", "cuda_topk", "hostcopy", "BFLOAT16",
                              "env_switch"}
    bound: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.module == "launch" or (node.module or "").endswith("cuda.launch"):
                bound += [a.asname or a.name for a in node.names]
            else:
                bound += [a.asname or a.name for a in node.names if a.name in settings]
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in settings:
            bound.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound += [n.id for t in targets for n in ast.walk(t)
                      if isinstance(n, ast.Name) and n.id in settings]
    assert not bound, f"{part}.py binds launch.py's settings by value: {sorted(bound)}"
    # and it does read some through the module (the rule is not vacuous for it)
    reads = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
             and isinstance(n.value, ast.Name) and n.value.id == "launch"}
    assert reads and reads <= settings, (part, sorted(reads - settings))


def test_moved_names_are_their_modules_objects():
    moved = _moved()
    assert {"Launcher", "RegionCall", "Workspace", "BoundCall", "ManyCall", "LaunchPlan",
            "Step", "kernel_name", "clusters_fit"} <= set(moved)
    for name, module in moved.items():
        got = getattr(__import__(f"q6serve.kernels.cuda.{module}", fromlist=[name]), name)
        assert getattr(launch, name) is got, name
    # no module __getattr__: CPython 3.11 does not specialize attribute reads of a module that
    # has one, and the parts read launch.NAME on every call
    assert "__getattr__" not in vars(launch)


@pytest.mark.parametrize("part", ["plans", "region_call", "launcher", "loader"])
def test_each_module_imports_first(part):
    """Any module of the package imported first in a fresh process (the package imports launch
    first, and launch its parts last, once its settings are defined)."""
    import subprocess
    import sys

    code = f"import q6serve.kernels.cuda.{part}; from q6serve.kernels.cuda import launch; " \
           "print(launch.Launcher.__module__)"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == "q6serve.kernels.cuda.launcher", (
        got.stderr[-2000:])


def _tree_files():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for f in filenames:
            if f.endswith(".py"):
                yield pathlib.Path(dirpath) / f


def test_what_the_tree_sets_on_launch_is_launch_own():
    """Every ``<launch>.NAME = ...`` and ``setattr(<launch>, "NAME", ...)`` in the tree (tests,
    benches) names a setting launch.py defines: a class or function of one of its parts set
    there would reach no caller (the parts use their own)."""
    own = _settings()
    wrong: list[str] = []
    for path in _tree_files():
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        aliases = {a.asname or "launch" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                   and ((n.module or "").endswith("kernels.cuda") or (n.level and n.module in
                                                                      (None, "cuda")))
                   for a in n.names if a.name == "launch"}
        if not aliases:
            continue
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                    and isinstance(n.value, ast.Name) and n.value.id in aliases
                    and n.attr not in own):
                wrong.append(f"{path.relative_to(ROOT)}:{n.lineno} {n.attr}")
            if (isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", ""))
                    == "setattr" and len(n.args) > 1 and isinstance(n.args[0], ast.Name)
                    and n.args[0].id in aliases and isinstance(n.args[1], ast.Constant)
                    and n.args[1].value not in own):
                wrong.append(f"{path.relative_to(ROOT)}:{n.lineno} {n.args[1].value}")
    assert not wrong, wrong


def test_a_setting_set_on_launch_reaches_a_part(monkeypatch):
    """Y_BLOCKS (read by workspace.py per call): 0 kept blocks -> every large y from the pool."""
    from types import SimpleNamespace

    import numpy as np

    from q6serve.kernels.cuda.workspace import Workspace

    pool: list[int] = []

    class Pinned(bytearray):  # CuPy's PinnedMemoryPointer: a buffer with an address
        ptr = 0x1000

    def alloc(n):
        pool.append(n)
        return Pinned(n)

    cp = SimpleNamespace(cuda=SimpleNamespace(alloc_pinned_memory=alloc))
    ws = Workspace(SimpleNamespace(cp=cp))
    monkeypatch.setattr(launch, "Y_BLOCKS", 0)
    ws.y_block(4096)
    ws.y_block(4096)
    assert pool == [4096, 4096] and not ws._yb  # nothing kept
    monkeypatch.setattr(launch, "Y_BLOCKS", 8)
    _, blk = ws.y_block(4096)
    assert len(ws._yb) == 1 and isinstance(blk, np.ndarray)


def test_driver_lookups_type_the_entry_point_or_give_none(monkeypatch):
    """kernels/cuda/driver.py's lookups (one helper, _driver_fn): the entry point with its
    argument types and an int (CUresult) back; None where the library has no such entry point
    or there is no library (a device-less host). Here on libc, as the driver is absent."""
    import ctypes
    import ctypes.util

    from q6serve.kernels.cuda import driver

    libc = ctypes.util.find_library("c")
    if libc is None:
        pytest.skip("no libc to stand in for the driver")
    real = ctypes.CDLL
    monkeypatch.setattr(ctypes, "CDLL", lambda name: real(libc))
    f = driver._driver_fn("strlen", ctypes.c_char_p)
    assert f(b"q6serve") == 7 and f.argtypes == [ctypes.c_char_p] and f.restype is ctypes.c_int
    assert driver._driver_fn("cuNoSuchEntryPoint") is None
    for hook in (driver._host_device_ptr, driver._driver_launch_ex,
                 driver._driver_max_clusters, driver._external_record):
        assert hook() is None  # (libc has none of the driver's)

    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert driver._driver_fn("strlen", ctypes.c_char_p) is None
