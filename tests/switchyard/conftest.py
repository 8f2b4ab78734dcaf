"""A launcher whose children are stand-ins and whose clock the test moves: its restart
decisions (API servers, worker groups) are exact, with no process started."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator

import pytest

from switchyard.launcher import Launcher
from switchyard.restart_backoff import RestartBackoff
from switchyard.serve_config import ServeConfig


class Process:
    """A stand-in for a child's ``subprocess.Popen``: ``poll()`` gives ``returncode``; a signal
    in ``exits_on`` ends it (code ``-signum``); SIGKILL always does."""

    def __init__(self, exits_on: frozenset[int] = frozenset({signal.SIGTERM})) -> None:
        self.returncode: int | None = None
        self.exits_on = exits_on
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)
        if self.returncode is None and (signum in self.exits_on or signum == signal.SIGKILL):
            self.returncode = -signum

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@pytest.fixture
def make_launcher(tmp_path, monkeypatch) -> Iterator[Callable[..., Launcher]]:
    """``make_launcher(gpus=None, **serve_config)``: a ready launcher of stand-ins (the
    scheduler, each worker group's processes as ``serve`` names them, the API servers), on a
    host whose visible CUDA devices are ``gpus`` (None: the workers run on the CPU), at
    ``launcher.clock`` 0. ``launcher.starts`` gets (name, argv, time) of each process started
    after that; ``launcher.environments`` the variables each process was last started with."""
    made: list[Launcher] = []

    def make(gpus: list[str] | None = None, **serve_config) -> Launcher:
        serve_config.setdefault("api_servers", 2)
        launcher = Launcher(ServeConfig(tmp_path, "model", **serve_config))
        made.append(launcher)
        launcher.clock = 0.0
        launcher.starts, launcher.crashes, launcher.environments = [], [], {}

        def spawn(name: str, argv: list[str], *_args, **variables) -> None:
            launcher.children[name] = Process()
            launcher.starts.append((name, argv, launcher.clock))
            launcher.environments[name] = variables

        def spawn_api_server(name: str) -> None:
            spawn(name, [])
            backoff = launcher._api_server_restarts.setdefault(name, RestartBackoff())
            backoff.started(launcher.clock)

        monkeypatch.setattr(launcher, "_spawn", spawn)
        monkeypatch.setattr(launcher, "_spawn_api_server", spawn_api_server)
        monkeypatch.setattr("switchyard.launcher.visible_cuda_devices", lambda device: gpus)
        launcher.group_devices = launcher._devices_by_group()
        spawn("scheduler", [])
        for group in launcher._group_roles():
            launcher.worker_groups.start(group, launcher.clock)
        for index in range(launcher.config.api_servers):
            spawn_api_server(f"api-server-{index}")
        launcher._ready = True
        launcher.starts.clear()
        return launcher

    yield make
    for launcher in made:
        launcher._run_dir.cleanup()
