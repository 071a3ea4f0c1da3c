"""Loaded by Python at start-up when this folder is on PYTHONPATH (bench/t2_timeline.py puts it
there for the worker it starts, never for its callers): if Q6SERVE_FE_STAMPS names a folder,
installs bench/frontend_stamps.py's stall log in the worker's processes and its per-call
stamps in each front end (a front end is started as ``python -c``; service/frontends.py)."""

import os
import sys

if folder := os.environ.get("Q6SERVE_FE_STAMPS"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import frontend_stamps

    front = sys.argv == ["-c"]
    frontend_stamps.install_stalls(folder, "front" if front else "device")
    if front:
        frontend_stamps.install_front()
