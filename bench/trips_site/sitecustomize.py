"""Loaded by Python at start-up when this folder is on PYTHONPATH: installs bench/loop_trips.py's
loop-trip counter in the process if Q6SERVE_LOOP_TRIPS names an output file, and
bench/reply_stamps.py's absolute times in stream replies if Q6SERVE_REPLY_STAMPS is set, and
bench/lane_stamps.py's fast-lane stamps if Q6SERVE_LANE_STAMPS names an output file
and bench/job_stamps.py's device-job stamps if Q6SERVE_JOB_STAMPS names an output file
(diagnostics for bench/stream_overhead.py --trips / --stamps and bench/lane_latency.py
--stamps; nothing else puts this folder on the path)."""

import os
import sys

# `q6serve worker` sets gRPC up before it imports gRPC (client/grpc_env.py: GRPC_EXPERIMENTS is
# read once, at gRPC's import); the stamps below import gRPC first, so a worker's process does
# it here, as its own start would have (other processes on this path keep their environment's)
_argv = getattr(sys, "orig_argv", sys.argv)
if "worker" in _argv and any(a.endswith(("q6serve.client.cli", "q6serve")) for a in _argv):
    from q6serve.client import grpc_env

    grpc_env.apply()

if os.environ.get("Q6SERVE_LOOP_TRIPS"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import loop_trips

    loop_trips.install(os.environ["Q6SERVE_LOOP_TRIPS"])

if os.environ.get("Q6SERVE_REPLY_STAMPS"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import reply_stamps

    reply_stamps.install()

if os.environ.get("Q6SERVE_LANE_STAMPS"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import lane_stamps

    lane_stamps.install(os.environ["Q6SERVE_LANE_STAMPS"])

if os.environ.get("Q6SERVE_JOB_STAMPS"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import job_stamps

    job_stamps.install(os.environ["Q6SERVE_JOB_STAMPS"])
