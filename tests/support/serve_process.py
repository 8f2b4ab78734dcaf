"""`switchyard serve` as a child process for end-to-end tests, and what they ask of it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx

from tests.support.clients import wait_until

READY_TIMEOUT_S = 300
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


class ServeProcess:
    """A `switchyard serve --port 0` child in its own session, ready once its ready line shows.

    ``log_path``: where its processes' logs (stderr) go; they pass through by default.
    """

    def __init__(self, *flags: str, log_path: Path | None = None) -> None:
        self.log_path = log_path
        with contextlib.ExitStack() as files:
            stderr = files.enter_context(log_path.open("w")) if log_path is not None else None
            self.process = subprocess.Popen(
                [sys.executable, "-m", "switchyard", "serve", "--port", "0", *flags],
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                start_new_session=True,
            )
        self.base_url = self._wait_for_ready_line()

    def _wait_for_ready_line(self) -> str:
        found: list[str] = []

        def read() -> None:
            for line in self.process.stdout:
                match = re.search(r"on (http://\S+)", line)
                if match:
                    found.append(match.group(1))
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(READY_TIMEOUT_S)
        if not found:
            self.kill()
            raise RuntimeError("switchyard serve did not become ready")
        return found[0]

    def children(self) -> list[tuple[int, str]]:
        """(pid, command line) of every process in the serve process's session."""
        listing = subprocess.run(
            ["ps", "-o", "pid=,sid=,args=", "-e"], capture_output=True, text=True, check=True
        ).stdout
        result = []
        for line in listing.splitlines():
            pid, sid, args = line.strip().split(None, 2)
            if int(sid) == self.process.pid and int(pid) != self.process.pid:
                result.append((int(pid), args))
        return result

    def pids_of(self, title: str) -> list[int]:
        """Pids of the children whose process title starts with ``title``."""
        return [pid for pid, args in self.children() if args.startswith(title)]

    def terminate(self, timeout: float = 30) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL the whole session (cleanup after a test, whatever state it left)."""
        if self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def gauges(self) -> dict[str, float]:
        """The scheduler's gauges from /metrics."""
        metrics = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        values = {}
        for name in GAUGES:
            match = re.search(rf"^switchyard:{name}\{{[^}}]*\}} (\S+)$", metrics, re.MULTILINE)
            values[name] = float(match.group(1))
        return values


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie does not count)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True)
    return bool(state.stdout.strip()) and not state.stdout.strip().startswith("Z")


def chat_messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def long_chat(max_tokens: int = 2000, stream: bool = True) -> dict:
    """A chat request for the default model that runs until ``max_tokens`` (or an abort)."""
    return {
        "model": DEFAULT_MODEL_NAME,
        "messages": chat_messages("Tell me a very long story."),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def wait_until_ready(
    url: str,
    processes: Mapping[str, subprocess.Popen],
    timeout_s: float,
    logs: Mapping[str, Path] | None = None,
) -> None:
    """Poll ``url``/ready until it answers 200; fail at once if one of ``processes`` exits
    (showing the end of its log file when ``logs`` has one)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, process in processes.items():
            if process.poll() is not None:
                log = logs[name].read_text()[-3000:] if logs and name in logs else ""
                raise AssertionError(f"{name} exited with {process.returncode}\n{log}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} was not ready within {timeout_s:g} s")


@contextlib.contextmanager
def role_processes(
    commands: Mapping[str, list[str]], log_dir: Path
) -> Iterator[tuple[dict[str, subprocess.Popen], dict[str, Path]]]:
    """Each ``python -m`` argv of ``commands`` as its own process, started in order, its stderr
    in ``log_dir/NAME.log``; yields (processes, logs) and terminates them all on the way out."""
    logs = {name: log_dir / f"{name}.log" for name in commands}
    processes: dict[str, subprocess.Popen] = {}
    try:
        for name, argv in commands.items():
            with logs[name].open("w") as log:
                processes[name] = subprocess.Popen([sys.executable, "-m", *argv], stderr=log)
        yield processes, logs
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            process.wait(timeout=30)


def gauges_settle(serve: ServeProcess, timeout_s: float = 10) -> dict[str, float]:
    """The gauges once nothing runs, waits or holds a KV block (or as they are at the timeout)."""
    idle = {"num_requests_running": 0.0, "num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.0}
    wait_until(lambda: serve.gauges() == idle, timeout_s, interval_s=0.2)
    return serve.gauges()


MAX_STREAM_BACKLOG = 16
"""``--max-stream-backlog``: a client that never reads is found within a few steps."""
COMPILE_TIMEOUT_S = 10
"""``--grammar-compile-timeout``: a slow grammar fails within seconds (test_hostile_sampling)."""
MASK_TIMEOUT_S = 0.2
"""``--grammar-mask-timeout``: a grammar whose masks grow slow fails within a few tokens
(test_hostile_sampling)."""
MASK_TIME_PER_TOKEN_S = 0.005
"""``--grammar-mask-time-per-token``: such a grammar's masks, each well under the limit above,
spend the request's budget first (test_hostile_sampling).

All four are the limits of the hostile-input modules' shared server (tests/e2e/conftest.py)."""


class SharedServe:
    """A `switchyard serve` that several modules use in turn: started by the first to ask; a
    module that leaves it busy (a grammar still compiling) stops it, and the next module to
    ask gets a fresh one."""

    def __init__(self, *flags: str) -> None:
        self.flags = flags
        self._serve: ServeProcess | None = None

    def get(self) -> ServeProcess:
        if self._serve is None or self._serve.process.poll() is not None:
            self._serve = ServeProcess(*self.flags)
        return self._serve

    def stop(self) -> None:
        if self._serve is not None:
            self._serve.kill()
            self._serve = None
