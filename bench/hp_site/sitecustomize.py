"""Loaded by Python at start-up when this folder is on PYTHONPATH (hp's device-job A/Bs in the
replay, issue 14, session 28; a bench hook, never in the product): first bench/trips_site's
hooks as that folder's sitecustomize would run them (job stamps, loop trips, ...), then, for
every ``HP_SET_<NAME>=<INT>`` in the environment, kernels/cuda/launch.py's constant NAME set to
INT in this process before any call binds (e.g. ``HP_SET_NT_FILL_MIN=0``: x's staging fill by
NumPy at every size). With the job stamps on (Q6SERVE_JOB_STAMPS), a multi-weight call's row is
named by its part count and x's bytes too (``many3:57344B``; job_stamps names it ``many3``
alone, so one worker's S=1 and S=8 calls of a kind would share a row). A variant of
bench/replay_ab.py gives its worker these in its env; the worker's own start check reads
Q6SERVE_ names only, so these pass it. A NAME that is not an int constant of launch.py stops the
process (a typo must not read as the default)."""

import os
import runpy
import sys

_here = os.path.dirname(os.path.abspath(__file__))
runpy.run_path(os.path.join(os.path.dirname(_here), "trips_site", "sitecustomize.py"))


def _many_role_by_x() -> None:
    """ManyCall.launch (job_stamps' stamped one) wrapped: the job's row named first by part
    count and x's bytes (the stamped launch keeps a role already set: ``setdefault``)."""
    from q6serve.kernels.cuda import launch as L

    stamped = L.ManyCall.launch
    cells = dict(zip(stamped.__code__.co_freevars, stamped.__closure__ or (), strict=True))
    row = cells["row"].cell_contents

    def launch(self, *args):
        row().setdefault("role", f"many{len(self.parts)}:{self.b.x_bytes}B")
        return stamped(self, *args)

    L.ManyCall.launch = launch


if os.environ.get("Q6SERVE_JOB_STAMPS"):
    try:
        _many_role_by_x()
    except (ImportError, KeyError, AttributeError, ValueError) as _e:
        print(f"# hp_site: multi-weight rows by x not set ({_e!r})", file=sys.stderr, flush=True)

_sets = {k[len("HP_SET_"):]: v for k, v in os.environ.items() if k.startswith("HP_SET_")}
if _sets:
    from q6serve.kernels.cuda import launch as _launch

    for _name, _raw in sorted(_sets.items()):
        _old = getattr(_launch, _name, None)
        if not isinstance(_old, int) or isinstance(_old, bool):
            raise SystemExit(f"HP_SET_{_name}: launch.{_name} is not an int constant")
        setattr(_launch, _name, int(_raw))
        print(f"# hp_site: launch.{_name} {_old} -> {int(_raw)} (pid {os.getpid()})",
              file=sys.stderr, flush=True)

# HP_ALT_<NAME>=<INT>: launch.NAME switched to INT on SIGUSR1 and back to its value at start on
# SIGUSR2 (bench/hp_toggle_ab.py: one worker, two states, alternated between replay runs; for
# constants read per call, e.g. NT_FILL_MIN: a bound sequence is not rebound)
_alts = {k[len("HP_ALT_"):]: int(v) for k, v in os.environ.items() if k.startswith("HP_ALT_")}
if _alts:
    import signal

    from q6serve.kernels.cuda import launch as _launch2

    _base = {}
    for _name in _alts:
        _old = getattr(_launch2, _name, None)
        if not isinstance(_old, int) or isinstance(_old, bool):
            raise SystemExit(f"HP_ALT_{_name}: launch.{_name} is not an int constant")
        _base[_name] = _old

    def _to(values: dict) -> None:
        for name, v in values.items():
            setattr(_launch2, name, v)

    signal.signal(signal.SIGUSR1, lambda *_: _to(_alts))
    signal.signal(signal.SIGUSR2, lambda *_: _to(_base))
    print(f"# hp_site: SIGUSR1 sets {_alts}, SIGUSR2 {_base} (pid {os.getpid()})",
          file=sys.stderr, flush=True)

# HP_YB_PROBE=<path> ({pid} replaced): Workspace.y_block (a large y's pinned block) timed and
# counted per size: kept blocks reused vs a block from CuPy's pool (every kept one still held
# by an array, or none large enough yet); written as JSON at exit (session 28: is a
# multi-weight call's "y out", 22 us in situ, the pool's fallback?)
if os.environ.get("HP_YB_PROBE"):
    import atexit
    import json
    import time

    from q6serve.kernels.cuda import launch as _launch3

    _yb_path = os.environ["HP_YB_PROBE"].replace("{pid}", str(os.getpid()))
    _yb_rows: dict = {}
    _yb_orig = _launch3.Workspace.y_block

    def _y_block(self, nbytes):
        t0 = time.perf_counter()
        kept = list(self._yb_ptr)
        out = _yb_orig(self, nbytes)
        dt = time.perf_counter() - t0
        r = _yb_rows.setdefault(str(nbytes), {"n": 0, "kept": 0, "new_kept": 0, "us": []})
        r["n"] += 1
        if out[0] in kept:
            r["kept"] += 1
        elif out[0] in self._yb_ptr:
            r["new_kept"] += 1
        if len(r["us"]) < 20000:
            r["us"].append(dt * 1e6)
        return out

    _launch3.Workspace.y_block = _y_block

    def _yb_dump() -> None:
        if not _yb_rows:
            return
        rows = {}
        for k, r in _yb_rows.items():
            us = sorted(r["us"])
            rows[k] = {"n": r["n"], "kept": r["kept"], "new_kept": r["new_kept"],
                       "pool": r["n"] - r["kept"] - r["new_kept"],
                       "p50_us": us[len(us) // 2] if us else None}
        with open(_yb_path, "w") as f:
            json.dump(rows, f)

    atexit.register(_yb_dump)
