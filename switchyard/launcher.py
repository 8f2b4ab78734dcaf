"""Start every Switchyard process on one machine, watch them, and stop them all together.

The launcher binds the HTTP socket itself and hands it to each API server process (so several
share one port), starts the scheduler and the worker on ``ipc://`` sockets in a private temporary
directory, and waits until ``/health`` answers. If any child exits, it stops the rest and exits
non-zero so an orchestrator restarts the whole unit. Children get ``PR_SET_PDEATHSIG`` so that
even a ``kill -9`` of the launcher leaves no orphan.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from interfaces import envs
from scheduler.config import SchedulerConfig

logger = logging.getLogger("switchyard")

READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``switchyard serve`` needs; flags map one to one."""

    model_dir: Path
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_servers: int = 1
    max_model_len: int | None = None
    kv_cache_memory: str | None = None
    block_size: int = 16
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    enable_prefix_caching: bool = True
    device: str | None = None
    dtype: str | None = None
    api_key: str | None = field(default=None, repr=False)
    """Passed to the API servers in their environment (SWITCHYARD_API_KEY), never in argv."""
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.api_servers < 1:
            raise ValueError(f"--api-servers must be at least 1, got {self.api_servers}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launcher dies, however it dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def child_environment(api_key: str | None) -> dict[str, str]:
    """The launcher's environment for a child, with SWITCHYARD_API_KEY set to ``api_key`` (or
    removed, for children that do not serve clients)."""
    env = {key: value for key, value in os.environ.items() if key != envs.API_KEY_VARIABLE}
    if api_key:
        env[envs.API_KEY_VARIABLE] = api_key
    return env


def _bind_listener(host: str, port: int) -> socket.socket:
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(2048)
    listener.set_inheritable(True)
    return listener


class Launcher:
    """Owns the child processes of one ``switchyard serve``."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.children: dict[str, subprocess.Popen] = {}
        self.port = config.port
        self._run_dir = tempfile.TemporaryDirectory(prefix="switchyard-")
        self._stopping = threading.Event()

    def _ipc(self, name: str) -> str:
        return f"ipc://{Path(self._run_dir.name) / name}"

    def _spawn(
        self, name: str, argv: list[str], pass_fds: tuple[int, ...] = (), api_key: str | None = None
    ) -> None:
        """Start ``python -m argv``; only a child given ``api_key`` sees SWITCHYARD_API_KEY."""
        command = [sys.executable, "-m", *argv]
        logger.debug("starting %s: %s", name, " ".join(command))
        self.children[name] = subprocess.Popen(
            command, preexec_fn=_die_with_parent, pass_fds=pass_fds, env=child_environment(api_key)
        )

    def start(self) -> None:
        """Start all processes; returns once the API answers ``/health`` with 200."""
        config = self.config
        frontend, backend = self._ipc("frontend.sock"), self._ipc("backend.sock")
        listener = _bind_listener(config.host, config.port)
        self.port = listener.getsockname()[1]
        self._spawn("scheduler", self._scheduler_argv(frontend, backend))
        self._spawn("worker", self._worker_argv(backend))
        for index in range(config.api_servers):
            argv = self._api_server_argv(frontend, listener.fileno())
            fds = (listener.fileno(),)
            self._spawn(f"api-server-{index}", argv, pass_fds=fds, api_key=config.api_key)
        listener.close()
        self._wait_until_ready()

    def _scheduler_argv(self, frontend: str, backend: str) -> list[str]:
        config = self.config
        return [
            "scheduler",
            *("--frontend-addr", frontend, "--backend-addr", backend),
            *("--max-num-seqs", str(config.max_num_seqs)),
            *("--max-num-batched-tokens", str(config.max_num_batched_tokens)),
            *(() if config.enable_prefix_caching else ("--no-prefix-caching",)),
        ]

    def _worker_argv(self, backend: str) -> list[str]:
        config = self.config
        argv = [
            "worker",
            *("--model", str(config.model_dir), "--scheduler-addr", backend),
            *("--served-model-name", config.served_model_name),
            *("--block-size", str(config.block_size)),
        ]
        optional = {
            "--max-model-len": config.max_model_len,
            "--kv-cache-memory": config.kv_cache_memory,
            "--device": config.device,
            "--dtype": config.dtype,
        }
        for flag, value in optional.items():
            if value is not None:
                argv += [flag, str(value)]
        return argv

    def _api_server_argv(self, frontend: str, fd: int) -> list[str]:
        config = self.config
        argv = [
            "api_server",
            *("--model", str(config.model_dir), "--scheduler-addr", frontend),
            *("--served-model-name", config.served_model_name, "--fd", str(fd)),
        ]
        if config.max_model_len is not None:
            argv += ["--max-model-len", str(config.max_model_len)]
        if config.allowed_origins:
            argv += ["--allowed-origins", ",".join(config.allowed_origins)]
        return argv

    def _wait_until_ready(self) -> None:
        url = f"http://{_url_host(self.config.host)}:{self.port}/health"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and not self._stopping.is_set():
            if self.dead_child() is not None:
                return
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        if not self._stopping.is_set():
            raise TimeoutError(f"Switchyard was not ready within {READY_TIMEOUT_S:.0f} s")

    def dead_child(self) -> str | None:
        """The name of a child that has exited, or None while all run."""
        for name, process in self.children.items():
            if process.poll() is not None:
                return name
        return None

    def wait(self) -> int:
        """Block until a child exits or ``stop()`` is called; returns the exit code to use."""
        while not self._stopping.wait(0.5):
            name = self.dead_child()
            if name is not None:
                code = self.children[name].returncode
                logger.error("%s exited with code %s; stopping Switchyard", name, code)
                return 1
        return 0

    def stop(self) -> None:
        """Signal-safe request to end ``wait()``."""
        self._stopping.set()

    def shutdown(self) -> None:
        """SIGTERM every child, SIGKILL what is left after the grace period, clean up."""
        for process in self.children.values():
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for name, process in self.children.items():
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in time; killing it", name)
                process.kill()
                process.wait()
        self._run_dir.cleanup()


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
