"""Loaded by Python at start-up when this folder is on PYTHONPATH: installs bench/loop_trips.py's
loop-trip counter in the process if Q6SERVE_LOOP_TRIPS names an output file (a diagnostic for
bench/stream_overhead.py --trips; nothing else puts this folder on the path)."""

import os
import sys

if os.environ.get("Q6SERVE_LOOP_TRIPS"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import loop_trips

    loop_trips.install(os.environ["Q6SERVE_LOOP_TRIPS"])
