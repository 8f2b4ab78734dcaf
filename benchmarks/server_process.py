"""Start ``switchyard serve --port 0`` as a child for one benchmark run, and stop it after.

The server's stdout is read until its ready line (``switchyard: serving NAME on URL``) and then
drained in a thread; its stderr (the logs of every Switchyard process) goes to a file kept after
the run, so that odd server behaviour during a benchmark can be read afterwards.
"""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from workload import BenchmarkError

READY_LINE = re.compile(r"switchyard: serving (?P<name>\S+) on (?P<url>http://\S+)")
STOP_TIMEOUT_S = 30.0


class LaunchedServer:
    """``with LaunchedServer(...) as server:`` gives ``server.base_url`` and ``server.model``.

    Raises ``BenchmarkError`` (with the tail of the server log) if the server exits or does not
    print its ready line within ``ready_timeout_s``. Leaving the block sends SIGTERM and waits.
    """

    def __init__(
        self, model_path: str | None, serve_args: list[str], ready_timeout_s: float = 300.0
    ) -> None:
        self.argv = [sys.executable, "-m", "switchyard", "serve", "--port", "0"]
        if model_path is not None:
            self.argv += ["--model", model_path]
        self.argv += serve_args
        self.ready_timeout_s = ready_timeout_s
        self.log_path = Path(tempfile.mkstemp(prefix="switchyard-bench-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None
        self.base_url = ""
        self.model = ""

    def __enter__(self) -> LaunchedServer:
        print(f"starting: {' '.join(self.argv)} (log: {self.log_path})", file=sys.stderr)
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                self.argv, stdout=subprocess.PIPE, stderr=log, text=True
            )
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(
            target=_forward_lines, args=(self.process.stdout, lines), daemon=True
        ).start()
        try:
            self._wait_until_ready(lines)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _wait_until_ready(self, lines: queue.Queue[str | None]) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise BenchmarkError(self._failure("did not become ready in time")) from None
            if line is None:
                raise BenchmarkError(self._failure("exited before it was ready"))
            match = READY_LINE.search(line)
            if match:
                self.model, self.base_url = match["name"], match["url"]
                return

    def stop(self) -> None:
        """SIGTERM the server (it stops its own children), then SIGKILL after a grace period."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"server ignored SIGTERM for {STOP_TIMEOUT_S:.0f} s; killing it", file=sys.stderr)
            self.process.kill()
            self.process.wait()

    def exit_code(self) -> int | None:
        """None while it runs; after ``stop()``, 0 for a clean shutdown (non-zero: a process of
        the server died, or it did not stop cleanly)."""
        return None if self.process is None else self.process.poll()

    def _failure(self, what: str) -> str:
        log_lines = self.log_path.read_text(errors="replace").splitlines()[-15:]
        tail = "\n".join(f"  | {line}" for line in log_lines)
        return f"the server {what} (log {self.log_path}):\n{tail}"


def _forward_lines(stream, lines: queue.Queue[str | None]) -> None:
    """Put every stdout line on ``lines``, then None at end of file (keeps the pipe drained)."""
    for line in stream:
        lines.put(line)
    lines.put(None)
