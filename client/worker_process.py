"""``q6serve worker`` as a child process, for ``q6serve demo`` and the benches.

The worker runs as it is deployed: its own process, so its own GIL (a worker on a thread of the
caller's process shares the interpreter with the caller's encoding and decoding, and every
latency it shows is partly the caller's). Its address is read from its first log line,
``listening on H:P`` (``--port 0`` picks a free port); the log goes to a file the caller names.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

_LISTENING = re.compile(r"listening on (\S+):(\d+)")


class WorkerStartError(RuntimeError):
    """The worker exited or stayed silent before listening; ``last_line`` is its last words."""

    def __init__(self, last_line: str, log: str) -> None:
        self.last_line, self.log = last_line, log
        super().__init__(f"worker did not start: {last_line}")


class WorkerProcess:
    """``with WorkerProcess(["--backend", "numpy"], log) as w: Client(w.target) ...``

    ``args`` are ``q6serve worker`` options; ``--port 0`` is added unless a port is given.
    ``env``: variables set for the worker on top of this process's environment (given to its
    exec, never set here: os.environ changed while another thread starts a process fails it)."""

    def __init__(self, args: list[str], log_path: Path, start_timeout: float = 180.0,
                 env: dict[str, str] | None = None) -> None:
        port = [] if "--port" in args else ["--port", "0"]
        self.cmd = [sys.executable, "-m", "q6serve.client.cli", "worker", *port, *args]
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.env = None if not env else {**os.environ, **env}
        self.proc: subprocess.Popen[bytes] | None = None
        self.target = ""

    def start(self) -> WorkerProcess:
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env)
        end = time.monotonic() + self.start_timeout
        while time.monotonic() < end:
            m = _LISTENING.search(self.log())
            if m:
                self.target = f"{m.group(1)}:{m.group(2)}"
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        text = self.log()
        lines = [ln for ln in text.splitlines() if ln.strip()]
        raise WorkerStartError(lines[-1] if lines else "no output", text)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM (the worker drains), SIGKILL after ``grace`` s; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> WorkerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
