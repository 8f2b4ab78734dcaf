"""Start every Switchyard process on one machine, watch them, and stop them all together.

The launcher binds the HTTP socket itself and hands it to each API server process (so several
share one port), starts the scheduler and the worker groups (each of ``tensor_parallel_size``
ranks, which meet on a free loopback port of their own): ``data_parallel_size`` hybrid groups
or, disaggregated, ``prefill_workers`` prefill groups and ``decode_workers`` decode groups, and
an embedding worker when an embedding model is served (beside the text generation model, or
alone), on ``ipc://`` sockets in a private temporary directory, and waits until ``/ready``
answers and every text generation group serves. On the CPU the workers share the machine's
cores evenly; on CUDA each group runs on GPUs of its own (``switchyard.devices``).
Children get ``PR_SET_PDEATHSIG`` so that even a ``kill -9`` of the launcher leaves no orphan.

When a child dies: an API server is started again on the same socket, after a back-off that
doubles with each exit in a row (``switchyard.restart_backoff``), while the scheduler, the
workers and the other API servers serve on (the scheduler has already aborted the dead one's
requests); only when no API server has stayed up for ``API_SERVER_OUTAGE_LIMIT_S`` does the
launcher stop the unit and exit 1. A worker group whose process dies, or that the scheduler
reports away (``/health``'s ``groups_away``: it died or stalled) while its processes run, is
stopped and started again whole under the same name, up to ``--restart-limit`` times a
minute (``switchyard.worker_restarts``); the scheduler keeps its requests for its return. A
scheduler that dies is started again at once within the same limit, every worker group with it
as part of that one restart (their KV cache was the dead scheduler's), and the API servers,
which kept their streams open, submit each again with the tokens it already streamed
(``api_server.resubmission``). Nothing is started
again past the restart limit, with restarts off (``--restart-limit 0`` or
``--migration-limit 0``), or for a child that dies before the unit was first ready: then the
launcher gives the survivors ``FAILURE_GRACE_S`` to fail their requests with clear errors and
report 503 on /health, stops everything and exits non-zero for the orchestrator to restart the
unit.

SIGTERM stops the API servers first (each drains for up to ``shutdown_timeout_s``), then the
scheduler and the worker, and exits 0. Once every child has exited, the shared-memory segments
(image pixels) of this unit's namespace that a crashed process left are unlinked.
"""

from __future__ import annotations

import ctypes
import json
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
from dataclasses import replace
from pathlib import Path
from secrets import token_hex

from prometheus_client.parser import text_string_to_metric_families

from interfaces import envs
from interfaces.settings import to_argv
from interfaces.shared_memory import segment_paths
from interfaces.shared_settings import ModelSettings, SchedulerAddress
from interfaces.worker_to_scheduler import WorkerRole
from scheduler.config import SchedulerSettings
from switchyard.devices import VISIBLE_DEVICES_VARIABLE, assign_devices, visible_cuda_devices
from switchyard.groups_away import HealthPoller
from switchyard.restart_backoff import API_SERVER_OUTAGE_LIMIT_S, RestartBackoff
from switchyard.serve_config import ServeConfig
from switchyard.worker_restarts import WorkerGroupRestarts
from worker.settings import WorkerSettings

logger = logging.getLogger("switchyard")

READY_TIMEOUT_S = 600.0
READY_POLL_S = 0.05
"""Between reads of ``/ready`` while starting: a local request, and every start waits on it."""
SERVING_GROUPS_FAMILY = "switchyard:num_requests_running_by_group"
"""The /metrics family with a series for each serving text generation group."""
MAX_METRICS_BYTES = 16 << 20
STOP_TIMEOUT_S = 10.0
"""How long the scheduler and worker get to exit after SIGTERM, and API servers beyond their
drain, before they are killed."""
FAILURE_GRACE_S = 2.0
POLL_INTERVAL_S = 0.25
SCHEDULER = "scheduler"
EMBEDDING_GROUP = "embedding"
"""The embedding worker's group name (a group of its own, of one process)."""


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launcher dies, however it dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def child_environment(api_key: str | None, **variables: str) -> dict[str, str]:
    """The launcher's environment for a child, with SWITCHYARD_API_KEY set to ``api_key`` (or
    removed, for children that do not serve clients), and ``variables`` set."""
    env = {key: value for key, value in os.environ.items() if key != envs.API_KEY_VARIABLE}
    if api_key:
        env[envs.API_KEY_VARIABLE] = api_key
    env.update(variables)
    return env


def _free_port() -> int:
    """A TCP port on the loopback that nothing listens on now (for the ranks' rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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
        self.port = config.bind.port
        self._run_dir = tempfile.TemporaryDirectory(prefix="switchyard-")
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        """Kept open for the launcher's life, so a dead API server can be replaced."""
        self._api_server_restarts: dict[str, RestartBackoff] = {}
        """Each API server's restart schedule, by name."""
        self.worker_groups = WorkerGroupRestarts(
            self.children, self._spawn_worker_group, config.restart_limit_in_effect
        )
        self._health_poller: HealthPoller | None = None
        """Reads /health's groups away once the unit is ready, when worker groups restart."""
        self.group_devices: dict[str, str] = {}
        """Each worker group's ``CUDA_VISIBLE_DEVICES`` on CUDA (``switchyard.devices``), by
        name, set by ``start_engine``; empty on the CPU."""
        self._master_ports: dict[str, int] = {}
        """The rendezvous port each tensor-parallel group was last started with, by name."""
        self._ready = False
        self._owns_shm_namespace = not envs.shm_namespace_set()
        self.shm_namespace = token_hex(4) if self._owns_shm_namespace else envs.shm_namespace()
        """Names this unit's shared-memory segments (image pixels). ``shutdown`` sweeps those a
        crashed process left behind, when the namespace is the unit's own: one given through
        the environment may be shared with other units, whose segments are alive."""

    @property
    def _metrics_dir(self) -> Path:
        """Where the API servers share their metrics (prometheus-client's multiprocess mode),
        so that /metrics on any of them counts every request once."""
        return Path(self._run_dir.name) / "metrics"

    def _ipc(self, name: str) -> str:
        return f"ipc://{Path(self._run_dir.name) / name}"

    def _spawn(
        self,
        name: str,
        argv: list[str],
        pass_fds: tuple[int, ...] = (),
        api_key: str | None = None,
        **variables: str,
    ) -> None:
        """Start ``python -m argv`` with ``variables`` in its environment; only a child given
        ``api_key`` sees SWITCHYARD_API_KEY."""
        command = [sys.executable, "-m", *argv]
        logger.debug("starting %s: %s", name, " ".join(command))
        env = child_environment(
            api_key,
            SWITCHYARD_LOG_LEVEL=self.config.log.level,
            SWITCHYARD_LOG_FORMAT=self.config.log.format,
            **{envs.SHM_NAMESPACE_VARIABLE: self.shm_namespace},
            **variables,
        )
        self.children[name] = subprocess.Popen(
            command, preexec_fn=_die_with_parent, pass_fds=pass_fds, env=env
        )

    def start(self) -> None:
        """Start all processes; returns once the API answers ``/ready`` with 200."""
        config = self.config
        self._listener = _bind_listener(config.bind.host, config.bind.port)
        self.port = self._listener.getsockname()[1]
        self._metrics_dir.mkdir()
        self.start_engine()
        for index in range(config.api_servers):
            self._spawn_api_server(f"api-server-{index}")
        self._wait_until_ready()

    def start_engine(self) -> str:
        """Start the scheduler and the worker groups (no API server); returns the scheduler's
        frontend address, where clients connect (the offline API, ``switchyard.offline``, does).
        ``ValueError``, before any process starts, when the GPUs cannot hold the groups."""
        self.group_devices = self._devices_by_group()
        self._spawn_scheduler()
        for group in self._group_roles():
            self.worker_groups.start(group, time.monotonic())
        return self._ipc("frontend.sock")

    def engine_argv(self, backend: str) -> dict[str, list[str]]:
        """Each engine process's ``python -m`` command line, by name: the scheduler, every
        rank of every text generation worker group, and the embedding worker."""
        argv = {SCHEDULER: self._scheduler_argv(self._ipc("frontend.sock"), backend)}
        for group in self._group_roles():
            argv.update(self._worker_group_argv(backend, group))
        return argv

    def _group_roles(self) -> dict[str, WorkerRole]:
        """Every worker group to start, by name: the text generation groups, then the
        embedding worker's."""
        roles = dict(self.config.worker_groups)
        if self.config.embedding_model_dir is not None:
            roles[EMBEDDING_GROUP] = WorkerRole.EMBEDDING
        return roles

    def _devices_by_group(self) -> dict[str, str]:
        """Each worker group's ``CUDA_VISIBLE_DEVICES`` (``switchyard.devices``); empty when
        the workers run on the CPU or on the one GPU ``--device cuda:N`` names."""
        devices = visible_cuda_devices(self.config.worker.device)
        if devices is None:
            return {}
        groups = [name for name, _ in self.config.worker_groups]
        embedding = EMBEDDING_GROUP if self.config.embedding_model_dir is not None else None
        assigned = assign_devices(groups, self.config.tensor_parallel_size, embedding, devices)
        for group, visible in assigned.items():
            logger.info("worker group %r runs on GPU(s) %s", group, visible)
        return assigned

    def _worker_group_argv(self, backend: str, group: str) -> dict[str, list[str]]:
        """The command line of each process of worker group ``group``, by name; a
        tensor-parallel group's ranks meet on a fresh port each time."""
        role = self._group_roles()[group]
        if role is WorkerRole.EMBEDDING:
            return {"embedding-worker": self._embedding_worker_argv(backend)}
        size = self.config.tensor_parallel_size
        master_port = self._master_port(group) if size > 1 else WorkerSettings.master_port
        argv = {}
        for rank in range(size):
            name = "worker" if len(self.config.worker_groups) == 1 else group
            name += "" if size == 1 else f"-{rank}"
            settings = self._worker_settings(backend, group, role, rank, master_port)
            argv[name] = self._worker_argv(settings)
        return argv

    def _master_port(self, group: str) -> int:
        """A free loopback port for ``group``'s ranks to meet on, none another group holds."""
        others = {port for name, port in self._master_ports.items() if name != group}
        port = _free_port()
        while port in others:
            port = _free_port()
        self._master_ports[group] = port
        return port

    def _spawn_scheduler(self) -> None:
        argv = self._scheduler_argv(self._ipc("frontend.sock"), self._ipc("backend.sock"))
        self._spawn(SCHEDULER, argv)

    def _spawn_worker_group(self, group: str) -> list[str]:
        """Start every process of worker group ``group``, on its devices; returns their
        names."""
        argv = self._worker_group_argv(self._ipc("backend.sock"), group)
        devices = self.group_devices.get(group)
        variables = {VISIBLE_DEVICES_VARIABLE: devices} if devices is not None else {}
        for name, command in argv.items():
            self._spawn(name, command, **variables)
        return list(argv)

    def _num_threads(self) -> int | None:
        """Torch's CPU threads for a worker when several share the cores (evenly)."""
        num_processes = self.config.num_worker_processes
        if num_processes == 1:
            return None
        return max(1, len(os.sched_getaffinity(0)) // num_processes)

    def _worker_settings(
        self, backend: str, group: str, role: WorkerRole, rank: int, master_port: int
    ) -> WorkerSettings:
        """A text generation worker's settings: ``serve``'s, and its place among the others
        (its group named as the launcher names it, so that a restarted group keeps its name)."""
        config = self.config
        placement = {"group": group}
        if role is not WorkerRole.HYBRID:
            transfer_addr = self._ipc(f"kv-{group}-{rank}.sock")
            placement |= {"role": role, "kv_transfer_addr": transfer_addr}
        return replace(
            config.text_worker,
            model=config.model,
            scheduler=SchedulerAddress(backend),
            num_threads=self._num_threads(),
            rank=rank,
            master_port=master_port,
            **placement,
        )

    def _worker_argv(self, settings: WorkerSettings) -> list[str]:
        return ["worker", *to_argv(settings)]

    def _embedding_worker_argv(self, backend: str) -> list[str]:
        config = self.config
        settings = WorkerSettings(
            model=ModelSettings(str(config.embedding_model_dir), config.embedding_model_name),
            scheduler=SchedulerAddress(backend),
            device=config.worker.device,
            num_threads=self._num_threads(),
            role=WorkerRole.EMBEDDING,
            group=EMBEDDING_GROUP,
        )
        return ["worker", *to_argv(settings)]

    def _spawn_api_server(self, name: str) -> None:
        fd = self._listener.fileno()
        argv = self._api_server_argv(self._ipc("frontend.sock"), fd)
        metrics_dir = {envs.PROMETHEUS_MULTIPROC_DIR_VARIABLE: str(self._metrics_dir)}
        self._spawn(name, argv, pass_fds=(fd,), api_key=self.config.api_key, **metrics_dir)
        self._api_server_restarts.setdefault(name, RestartBackoff()).started(time.monotonic())

    def _scheduler_argv(self, frontend: str, backend: str) -> list[str]:
        settings = SchedulerSettings(frontend, backend, scheduling=self.config.scheduler)
        return ["scheduler", *to_argv(settings)]

    def _api_server_argv(self, frontend: str, fd: int) -> list[str]:
        """An API server's command line; its API key goes by environment (``_spawn``). Its
        streams wait for a scheduler that went away only while ``serve`` starts one again
        (restarts on); else they fail at once."""
        config = self.config
        settings = replace(
            config.api_server,
            model=config.model,
            scheduler=SchedulerAddress(frontend),
            fd=fd,
            embedding=config.embedding,
            logits_processors=config.worker.logits_processors,
            scheduler_return_timeout_s=(
                config.api_server.scheduler_return_timeout_s if self.worker_groups.enabled else 0.0
            ),
        )
        return ["api_server", *to_argv(settings)]

    def _wait_until_ready(self) -> None:
        """Until ``/ready`` answers 200, every text generation group serves (``/metrics``
        lists it: ``/ready`` needs only one, and requests that arrived before the others would
        all go to the first) and every ``--lora-modules`` adapter is loaded (``/v1/models``
        lists it)."""
        base_url = f"http://{_url_host(self.config.bind.host)}:{self.port}"
        groups = {name for name, _ in self.config.worker_groups}
        adapters = {name for name, _ in self.config.scheduler.lora_adapters}
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and not self._stopping.is_set():
            if self.dead_child() is not None:
                return
            try:
                with urllib.request.urlopen(f"{base_url}/ready", timeout=2) as response:
                    if (
                        response.status == 200
                        and groups <= serving_groups(base_url)
                        and adapters <= served_models(base_url, self.config.api_key)
                    ):
                        self._become_ready()
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(READY_POLL_S)
        if not self._stopping.is_set():
            raise TimeoutError(f"Switchyard was not ready within {READY_TIMEOUT_S:.0f} s")

    def _become_ready(self) -> None:
        """The unit served: from now on dead children are restarted (worker groups while the
        restart limit allows), and /health is read for groups that left but still run."""
        self._ready = True
        if self.worker_groups.enabled:
            url = f"http://{_url_host(self.config.bind.host)}:{self.port}/health"
            self._health_poller = HealthPoller(url, self._stopping)
            self._health_poller.start()

    def dead_child(self) -> str | None:
        """The name of a child that has exited, or None while all run."""
        for name, process in self.children.items():
            if process.poll() is not None:
                return name
        return None

    def wait(self) -> int:
        """Block until ``stop()`` is called (returns 0) or the unit cannot serve (returns 1):
        the scheduler or a worker group died past the restart limit, a child exited before the
        unit was ready, or no API server has stayed up for ``API_SERVER_OUTAGE_LIMIT_S``. A dead
        API server is started again after its back-off meanwhile; a dead or departed worker
        group, or a dead scheduler with every worker group, at once."""
        while not self._stopping.wait(POLL_INTERVAL_S):
            failure = self._failure(time.monotonic())
            if failure is not None:
                logger.error("%s; stopping Switchyard", failure)
                self._stopping.wait(FAILURE_GRACE_S)  # survivors fail requests, /health says 503
                return 1
        return 0

    def _failure(self, now: float) -> str | None:
        """Why the unit must stop at ``now``, or None; restarts the API servers that are due
        and the worker groups that died or left."""
        for name, process in self.children.items():
            restarted = name in self._api_server_restarts or self.worker_groups.owns(name)
            if self._ready and restarted:
                continue
            code = process.poll()
            if code is not None and name == SCHEDULER and self._ready:
                why = f"{SCHEDULER} exited with code {code}"
                failure = self.worker_groups.restart_with_scheduler(why, now, self._spawn_scheduler)
                if failure is not None:
                    return failure
            elif code is not None:
                return f"{name} exited with code {code}"
        if self._ready:
            failure = self._worker_group_failure(now)
            if failure is not None:
                return failure
        for name, backoff in self._api_server_restarts.items():
            code = self.children[name].poll()
            if code is None:
                continue
            if not backoff.is_waiting:
                delay = backoff.crashed(now)
                logger.error(
                    "%s exited with code %s (%d in a row); starting it again in %g s",
                    *(name, code, backoff.exits_in_a_row, delay),
                )
            elif backoff.is_due(now):
                self._spawn_api_server(name)
        failing = [backoff.failing_for(now) for backoff in self._api_server_restarts.values()]
        if failing and min(failing) >= API_SERVER_OUTAGE_LIMIT_S:
            return f"no API server has stayed up for {API_SERVER_OUTAGE_LIMIT_S:g} s"
        return None

    def _worker_group_failure(self, now: float) -> str | None:
        """Restart the worker groups that died or that /health reports away while they run;
        why the unit must stop instead, or None."""
        failure = self.worker_groups.check(now)
        report = self._health_poller.take() if self._health_poller is not None else None
        if failure is None and report is not None:
            failure = self.worker_groups.replace_away(report, now)
        return failure

    def stop(self) -> None:
        """Signal-safe request to end ``wait()``."""
        self._stopping.set()

    def shutdown(self) -> None:
        """Stop the API servers (they drain), then the scheduler and the worker; SIGKILL any
        child that overstays; clean up."""
        self._stopping.set()  # the /health poller too
        api_servers = {n: p for n, p in self.children.items() if n.startswith("api-server")}
        backends = {n: p for n, p in self.children.items() if n not in api_servers}
        _terminate(api_servers, self.config.api_server.shutdown_timeout_s + STOP_TIMEOUT_S)
        _terminate(backends, STOP_TIMEOUT_S)
        if self._listener is not None:
            self._listener.close()
        self._run_dir.cleanup()
        self._sweep_shared_memory()

    def _sweep_shared_memory(self) -> None:
        """Unlink the segments this unit's processes left: every process has exited, so any
        left is one a crash (a killed API server or scheduler) never got to unlink."""
        if not self._owns_shm_namespace:
            return
        leftovers = segment_paths(self.shm_namespace)
        for path in leftovers:
            path.unlink(missing_ok=True)
        if leftovers:
            logger.warning("removed %d shared-memory segments left behind", len(leftovers))


def _terminate(children: dict[str, subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM ``children``, wait up to ``timeout_s`` in all, SIGKILL the ones still running."""
    for process in children.values():
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout_s
    for name, process in children.items():
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in time; killing it", name)
            process.kill()
            process.wait()


def serving_groups(base_url: str) -> set[str]:
    """The text generation groups the scheduler serves, from the API server's ``/metrics``
    (``switchyard:num_requests_running_by_group``; read as any input: at most
    ``MAX_METRICS_BYTES``, and a page that does not parse names none). ``OSError`` when it
    does not answer."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=2) as response:
        text = response.read(MAX_METRICS_BYTES + 1)
    if len(text) > MAX_METRICS_BYTES:
        return set()
    try:
        families = list(text_string_to_metric_families(text.decode()))
    except ValueError:  # not the exposition format (UnicodeDecodeError is one too)
        return set()
    return {
        sample.labels.get("group", "")
        for family in families
        if family.name == SERVING_GROUPS_FAMILY
        for sample in family.samples
    }


def served_models(base_url: str, api_key: str | None) -> set[str]:
    """The model ids ``/v1/models`` lists (read as any input: at most ``MAX_METRICS_BYTES``,
    and a page that does not parse lists none). ``OSError`` when it does not answer."""
    headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
    request = urllib.request.Request(f"{base_url}/v1/models", headers=headers)
    with urllib.request.urlopen(request, timeout=2) as response:
        text = response.read(MAX_METRICS_BYTES + 1)
    try:
        models = json.loads(text)["data"] if len(text) <= MAX_METRICS_BYTES else []
        return {model["id"] for model in models if isinstance(model.get("id"), str)}
    except (ValueError, TypeError, KeyError, AttributeError):
        return set()


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
