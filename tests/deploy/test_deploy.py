"""Deployment files: valid for the tools that read them, consistent with each other, and (the
slow tests) runnable: each role started with exactly the command and environment that
docker-compose.yml or the Kubernetes pod gives it, on 127.0.0.1 (and on the CPU where the pod's
worker asks for CUDA), with CURVE keys made by the
files' own keygen step and the operator's API key, answers a chat request, and takes its
streams back when a worker or the scheduler is killed and restarted as the orchestrator would.
No Docker engine or cluster needed (tests/deploy/test_deploy_safety.py checks what they lock
down)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import promql_parser
import pytest
import yaml
from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor
from prometheus_client.parser import text_string_to_metric_families

from api_server.metrics import SCHEDULER_METRIC_NAMES
from scheduler.config import SchedulerConfig
from tests.support.clients import free_port
from tests.support.deploy import (
    COMPOSE_FILES,
    COMPOSE_LAYOUTS,
    COMPOSE_SECRETS,
    IMAGE_CURVE_KEYS_DIR,
    K8S_DIR,
    K8S_SECRETS,
    MODELS_CLAIM,
    ROOT,
    expand_k8s_variables,
    flag,
    is_role,
    k8s,
    kubernetes_validate,
    pod_containers,
    resolved_compose,
    run_compose_config,
)
from tests.support.serve_process import wait_until_ready
from tests.support.streams import (
    assert_same_as_undisturbed,
    mixed_request,
    pauses,
    report,
    run_all,
    run_with_fault,
)

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "switchyard.json"
"""The Kubernetes version the manifests are validated for (the README states it)."""
IMAGE_MODEL_DIR = "/models/SmolLM2-135M-Instruct"
ROLES = ("scheduler", "worker", "api_server")
STARTUP_TIMEOUT_S = 180
WORKER_LIVENESS_FILE = "/tmp/worker.alive"
"""Where the pod's worker beats (its --liveness-file), on its own /tmp volume."""


def compose() -> dict:
    """docker-compose.yml as written (anchors merged, nothing interpolated)."""
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def seconds(duration: str) -> float:
    """A compose duration ("40s", "1m30s") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert "".join(f"{n}{u}" for n, u in parts) == duration, duration
    return sum(float(number) * units[unit] for number, unit in parts)


# -- docker-compose ----------------------------------------------------------------------------


def test_compose_files_match_the_compose_spec():
    checker = Path(sys.executable).with_name("check-jsonschema")
    files = sorted({path for layout in COMPOSE_LAYOUTS.values() for path in layout})
    completed = subprocess.run(
        [str(checker), "--builtin-schema", "vendor.compose-spec", *map(str, files)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_docker_compose_accepts_the_files_once_the_operator_gives_the_secrets():
    for files in (COMPOSE_FILES[:1], COMPOSE_FILES):
        completed = run_compose_config(COMPOSE_SECRETS, *files)
        assert completed.returncode == 0, completed.stderr
        services = json.loads(completed.stdout)["services"]
        assert set(services) == {
            *("keygen", "scheduler", "worker", "api-server", "load-balancer"),
            *("prometheus", "grafana"),
        }
    gpu_worker = services["worker"]["command"]
    assert gpu_worker[-1] == "--device=cuda"
    assert gpu_worker[:-1] == resolved_compose()["services"]["worker"]["command"]


def test_compose_runs_each_role_in_its_own_container_of_one_image():
    services = compose()["services"]
    modules = {name: s["command"][2] for name, s in services.items() if is_role(s)}
    assert modules == {"scheduler": "scheduler", "worker": "worker", "api-server": "api_server"}
    for name in [*modules, "keygen"]:
        assert services[name]["build"]["dockerfile"] == "deploy/Dockerfile"
        assert services[name]["image"] == services["scheduler"]["image"]
    assert services["api-server"]["deploy"]["replicas"] == 2
    for role in ("worker", "api-server"):
        address = flag(services[role]["command"], "--scheduler-addr")
        assert address.startswith("tcp://scheduler:")


def test_the_roles_share_one_dev_shm_for_image_pixels():
    services = compose()["services"]
    assert services["scheduler"]["ipc"] == "shareable"
    assert services["worker"]["ipc"] == services["api-server"]["ipc"] == "service:scheduler"
    pod = k8s("Deployment")["spec"]["template"]["spec"]
    (dshm,) = [volume for volume in pod["volumes"] if volume["name"] == "dshm"]
    assert dshm["emptyDir"]["medium"] == "Memory"
    for name, container in pod_containers().items():
        mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
        assert mounts["/dev/shm"] == "dshm", name


def test_compose_api_servers_drain_before_they_are_killed_and_check_readiness():
    api_server = compose()["services"]["api-server"]
    shutdown_timeout = float(flag(api_server["command"], "--shutdown-timeout"))
    assert seconds(api_server["stop_grace_period"]) > shutdown_timeout
    assert "/ready" in " ".join(api_server["healthcheck"]["test"])
    port = flag(api_server["command"], "--port")
    assert f"'http://127.0.0.1:{port}/ready'" in api_server["healthcheck"]["test"][-1]


def test_prometheus_scrapes_per_request_series_from_every_replica_and_the_scheduler_once():
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    (discovery,) = jobs["switchyard"]["dns_sd_configs"]
    assert discovery["names"] == ["api-server"] and discovery["port"] == 8000
    assert jobs["switchyard-scheduler"]["static_configs"] == [{"targets": ["api-server:8000"]}]
    (drop,) = jobs["switchyard"]["metric_relabel_configs"]
    (keep,) = jobs["switchyard-scheduler"]["metric_relabel_configs"]
    assert (drop["action"], keep["action"]) == ("drop", "keep")
    assert drop["regex"] == keep["regex"]
    services = compose()["services"]
    assert services["prometheus"]["volumes"][0].startswith("./deploy/prometheus/prometheus.yml:")


def test_grafana_is_provisioned_with_the_dashboard_on_the_prometheus_datasource():
    grafana = ROOT / "deploy" / "grafana"
    (datasource,) = yaml.safe_load(
        (grafana / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    )["datasources"]
    assert datasource["url"] == "http://prometheus:9090"
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == datasource["uid"]
        assert panel["targets"]


def test_the_dashboard_and_adapter_queries_are_valid_promql():
    """Parsed by promql-parser, with Grafana's interval variable given a value ($model sits
    inside a label matcher's string, where any text is valid)."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    variable = dashboard["templating"]["list"][0]["definition"]
    assert variable.startswith("label_values(") and variable.endswith(", model_name)")
    queries.append(variable.removeprefix("label_values(").removesuffix(", model_name)"))
    adapter = yaml.safe_load((ROOT / "deploy" / "prometheus" / "adapter-values.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    queries.append(rule["seriesQuery"])
    queries.append(
        rule["metricsQuery"]
        .replace("<<.Series>>", "m")
        .replace("{<<.LabelMatchers>>}", '{pod="p"}')
        .replace("<<.GroupBy>>", "pod")
    )
    for query in queries:
        promql_parser.parse(query.replace("$__rate_interval", "1m"))  # raises on a syntax error


# -- Kubernetes --------------------------------------------------------------------------------


def test_k8s_manifests_pass_kubernetes_validate(tmp_path):
    manifests = [p for p in sorted(K8S_DIR.glob("*.yaml")) if p.name != "servicemonitor.yaml"]
    manifests.append(MODELS_CLAIM)  # opt-in, apart from the rest (test_layouts_k8s.py)
    kubernetes_validate(manifests, tmp_path)


def test_the_service_monitor_matches_the_prometheus_operator_schema():
    """kubernetes-validate has no CRD schemas; the Operator's own (cloudcoil's models of its
    CRD) must take the manifest whole: dumped back, nothing was dropped as unknown."""
    document = yaml.safe_load((K8S_DIR / "servicemonitor.yaml").read_text())
    monitor = ServiceMonitor.model_validate(document)
    assert monitor.model_dump(by_alias=True, exclude_none=True) == document


def test_k8s_pods_drain_probe_and_scale_as_the_code_expects():
    config = k8s("ConfigMap")["data"]
    pod = k8s("Deployment")["spec"]["template"]
    labels = pod["metadata"]["labels"]
    containers = pod_containers()
    assert set(containers) == {"scheduler", "worker", "api-server"}
    api_server = containers["api-server"]
    pre_stop = api_server["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace > pre_stop + float(config["SHUTDOWN_TIMEOUT"])
    for sidecar in pod["spec"]["initContainers"]:  # stopped after the API server drains
        assert sidecar["restartPolicy"] == "Always"

    assert api_server["startupProbe"]["httpGet"]["path"] == "/health"
    startup = api_server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model load
    assert api_server["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert api_server["livenessProbe"]["httpGet"]["path"] == "/health"
    worker = containers["worker"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    # The worker's probes read the file its loop beats into, on a writable volume; the
    # startup probe allows for the model's load, the liveness probe for far more than a step
    # (the scheduler fences a step past --stall-timeout, 30 s, long before).
    beats_into = flag(worker["command"], "--liveness-file")
    (mount,) = [m for m in worker["volumeMounts"] if beats_into.startswith(m["mountPath"] + "/")]
    assert not mount.get("readOnly")
    for probe in (worker["startupProbe"], worker["livenessProbe"]):
        command = probe["exec"]["command"]
        assert command[:4] == ["python", "-m", "worker.liveness", beats_into]
        assert float(flag(command, "--max-age")) >= 10 * SchedulerConfig.stall_timeout_s
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model load

    service = k8s("Service")
    assert service["spec"]["selector"] == labels
    assert k8s("PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == labels
    monitor = k8s("ServiceMonitor")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    port_names = {port["name"] for port in service["spec"]["ports"]}
    assert {endpoint["port"] for endpoint in monitor["endpoints"]} <= port_names

    hpa = k8s("HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"]["name"] == k8s("Deployment")["metadata"]["name"]
    (metric,) = hpa["metrics"]
    adapter = yaml.safe_load((ROOT / "deploy" / "prometheus" / "adapter-values.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert re.fullmatch(rule["name"]["matches"], "switchyard:num_requests_waiting")


# -- the roles as plain processes --------------------------------------------------------------


def role_processes(source: str) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, command, environment) of every process ``source`` starts for one server, as the
    files give them (replicas expanded; compose's as Docker Compose resolves them, given
    ``COMPOSE_SECRETS``; the pod's with ``K8S_SECRETS`` as its Secrets)."""
    if source == "compose":
        services = resolved_compose()["services"]
        result = []
        for name, service in services.items():
            if not is_role(service):
                continue  # keygen (run before), prometheus, grafana
            replicas = service.get("deploy", {}).get("replicas", 1)
            environment = {key: str(value) for key, value in service["environment"].items()}
            for replica in range(replicas):
                result.append((f"{name}-{replica}", list(service["command"]), environment))
        return result
    config = k8s("ConfigMap")["data"]
    result = []
    for name, container in pod_containers().items():
        assert container["envFrom"] == [{"configMapRef": {"name": "switchyard"}}]
        environment = dict(config)
        for variable in container.get("env", []):
            secret = variable["valueFrom"]["secretKeyRef"]
            environment[variable["name"]] = K8S_SECRETS[secret["name"], secret["key"]]
        command = [expand_k8s_variables(arg, environment) for arg in container["command"]]
        result.append((name, command, environment))
    return result


def make_curve_keys(source: str, keys_dir: Path) -> None:
    """CURVE keys in ``keys_dir`` as the files make them: compose's one-shot keygen service
    (its command, run twice as two ``docker compose up`` would: the second keeps the keys),
    or the ``switchyard keygen`` that deployment.yaml tells the operator to put in a Secret."""
    on_path = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    if source == "k8s":
        command = ["switchyard", "keygen", "--output", str(keys_dir)]
        subprocess.run(command, env=on_path, check=True, timeout=60)
        return
    keygen = resolved_compose()["services"]["keygen"]
    (volume,) = keygen["volumes"]
    assert volume["target"] == IMAGE_CURVE_KEYS_DIR and not volume.get("read_only")
    keys_dir.mkdir(mode=0o700)  # the image's directory, which a new volume copies
    shell, flag_c, script = keygen["command"]
    script = script.replace("$$", "$").replace(IMAGE_CURVE_KEYS_DIR, str(keys_dir))
    contents = []
    for _ in range(2):
        subprocess.run([shell, flag_c, script], env=on_path, check=True, timeout=60)
        contents.append({path.name: path.read_bytes() for path in keys_dir.iterdir()})
    assert contents[0] and contents[0] == contents[1]


def on_loopback(command: list[str], substitutions: dict[str, str], http_port: int) -> list[str]:
    """``command`` with container addresses and paths mapped onto this machine."""
    result = []
    for argument in command:
        for old, new in substitutions.items():
            argument = argument.replace(old, new)
        if argument.startswith("--port="):
            argument = f"--port={http_port}"
        result.append(argument)
    container_only = ("0.0.0.0", "/models/", "scheduler:", IMAGE_CURVE_KEYS_DIR)
    unmapped = [
        old
        for old, new in zip(command, result, strict=True)
        if old == new and any(value in old for value in container_only)
    ]
    assert not unmapped, f"not mapped to this machine: {unmapped}"
    return result


@dataclass(eq=False)
class Role:
    """One process a deployment file starts, as it starts it (``start`` again is what the
    orchestrator does when it exits)."""

    name: str
    argv: list[str]
    environment: dict[str, str]
    log: Path
    process: subprocess.Popen | None = None
    restarts: int = 0

    @property
    def kind(self) -> str:
        """``scheduler``, ``worker`` or ``api_server``."""
        return self.argv[2]

    def start(self) -> None:
        with self.log.open("a") as log:
            self.process = subprocess.Popen(self.argv, env=self.environment, stdout=log, stderr=log)


@contextlib.contextmanager
def deployment(
    source: str, model_dir: Path, tmp_path: Path
) -> Iterator[tuple[dict[str, Role], list[tuple[str, str]]]]:
    """Every role of ``source`` started as its file gives it, on this machine; yields them
    by name and each API server's (URL, API key) once all answer /ready. Stops them all."""
    frontend, backend = free_port(), free_port()
    keys_dir = tmp_path / "curve"
    make_curve_keys(source, keys_dir)
    # The image's model directory under its own name, which clients name the model by
    # (hard links: nothing copied).
    image_model = tmp_path / "models" / Path(IMAGE_MODEL_DIR).name
    shutil.copytree(model_dir, image_model, copy_function=os.link)
    substitutions = {
        "--device=cuda": "--device=cpu",  # the pod's worker holds a GPU; this machine has none
        IMAGE_MODEL_DIR: str(image_model),
        IMAGE_CURVE_KEYS_DIR: str(keys_dir),
        "--host=0.0.0.0": "--host=127.0.0.1",
        WORKER_LIVENESS_FILE: str(tmp_path / "worker.alive"),
    }
    for container_port, port in ((5555, frontend), (5556, backend)):
        for host in ("0.0.0.0", "scheduler", "127.0.0.1"):
            substitutions[f"tcp://{host}:{container_port}"] = f"tcp://127.0.0.1:{port}"
    # The key and the CURVE keys only as the files give them (the test's cache dir stays).
    given_by_files = ("SWITCHYARD_API_KEY", "SWITCHYARD_CURVE_KEYS_DIR")
    base_environment = {k: v for k, v in os.environ.items() if k not in given_by_files}
    roles: dict[str, Role] = {}
    api_servers: list[tuple[str, str]] = []
    try:
        for name, command, environment in role_processes(source):
            assert command[:2] == ["python", "-m"] and command[2] in ROLES
            http_port = free_port()
            if command[2] == "api_server":
                api_key = environment["SWITCHYARD_API_KEY"]
                api_servers.append((f"http://127.0.0.1:{http_port}", api_key))
            argv = [sys.executable, *on_loopback(command, substitutions, http_port)[1:]]
            role = Role(name, argv, {**base_environment, **environment}, tmp_path / f"{name}.log")
            role.start()
            roles[name] = role
        processes = {name: role.process for name, role in roles.items()}
        logs = {name: role.log for name, role in roles.items()}
        for url, _ in api_servers:
            wait_until_ready(url, processes, STARTUP_TIMEOUT_S, logs)
        yield roles, api_servers
    finally:
        for role in roles.values():
            role.process.terminate()
        for role in roles.values():
            try:
                role.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                role.process.kill()


@dataclass
class Deployed:
    """One source's running deployment (``deployment``) and the directory it runs in."""

    source: str
    work_dir: Path
    roles: dict[str, Role]
    api_servers: list[tuple[str, str]]


@pytest.fixture(scope="module", params=["compose", "k8s"])
def deployed(request, default_model_dir, tmp_path_factory) -> Iterator[Deployed]:
    """Each source's deployment, started once for both slow tests of that source: pytest runs
    a module-scoped parameter's tests together, in file order, so the test that kills roles
    runs after the one that only asks them (and counts only its own restarts)."""
    source = request.param
    work_dir = tmp_path_factory.mktemp(f"deploy-{source}")
    with deployment(source, default_model_dir, work_dir) as (roles, api_servers):
        yield Deployed(source, work_dir, roles, api_servers)


@pytest.mark.slow
def test_the_roles_answer_with_the_deployment_files_commands(deployed: Deployed):
    source, roles, api_servers = deployed.source, deployed.roles, deployed.api_servers
    assert len(api_servers) == (2 if source == "compose" else 1)
    logs = {name: role.log for name, role in roles.items()}
    for url, api_key in api_servers:
        answer_and_log(url, api_key, logs, source)
    check_metrics_against_the_dashboards(api_servers[0][0])
    if source == "k8s":  # the worker's probes, as the kubelet runs them, pass
        worker = pod_containers()["worker"]
        alive = str(deployed.work_dir / "worker.alive")
        for probe in (worker["startupProbe"], worker["livenessProbe"]):
            _, _, module, *rest = probe["exec"]["command"]
            command = [
                sys.executable,
                "-m",
                module,
                *(a.replace(WORKER_LIVENESS_FILE, alive) for a in rest),
            ]
            assert subprocess.run(command, timeout=60).returncode == 0


class Orchestrator:
    """What docker-compose.yml's ``restart: unless-stopped`` and the pod's ``restartPolicy:
    Always`` do to a role whose process exits: start it again with the same command (here at
    once: compose's and the kubelet's back-offs start at 0.1 s and 10 s)."""

    def __init__(self, roles: dict[str, Role]) -> None:
        self.roles = roles
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> Orchestrator:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            for role in self.roles.values():
                if role.process.poll() is not None:
                    role.restarts += 1
                    role.start()


def restart_policies(source: str) -> dict[str, str]:
    """Each role's restart policy, by kind, as the file gives it."""
    if source == "compose":
        services = resolved_compose()["services"].values()
        return {s["command"][2]: s["restart"] for s in services if is_role(s)}
    spec = k8s("Deployment")["spec"]["template"]["spec"]
    pod_policy = spec.get("restartPolicy", "Always")
    return {
        container["command"][2]: container.get("restartPolicy", pod_policy)
        for container in pod_containers().values()
    }


@pytest.mark.slow
def test_a_killed_worker_or_scheduler_that_the_orchestrator_restarts_costs_a_pause(
    deployed: Deployed,
):
    """``kill -9`` of the worker, then of the scheduler, with streams in flight: the
    orchestrator starts the killed process again, the worker registers with the scheduler
    (the restarted worker; the running one with the restarted scheduler), the API server
    submits its streams to the new scheduler, and every stream ends as undisturbed."""
    source, roles = deployed.source, deployed.roles
    expected = {"unless-stopped"} if source == "compose" else {"Always"}
    assert set(restart_policies(source).values()) == expected
    (url, api_key), *_ = deployed.api_servers
    headers = {"Authorization": f"Bearer {api_key}"}
    by_kind = {role.kind: role for role in roles.values()}
    assert {kind: role.restarts for kind, role in by_kind.items()} == dict.fromkeys(by_kind, 0)
    bodies = [mixed_request(index) for index in range(5)]
    undisturbed = run_all(url, bodies, headers=headers)
    with Orchestrator(roles):
        for kind in ("worker", "scheduler"):
            pid = by_kind[kind].process.pid
            streams, killed_at, open_then = run_with_fault(  # 5 streams of 24 tokens: soon
                url,
                bodies,
                lambda pid=pid: os.kill(pid, signal.SIGKILL),
                max_delay_s=0.1,
                headers=headers,
            )
            assert any(open_then), kind
            assert_same_as_undisturbed(streams, undisturbed)
            report(f"{source}: kill -9 of the {kind}", pauses(streams, killed_at, open_then))
    assert {kind: role.restarts for kind, role in by_kind.items()} == {
        "scheduler": 1,
        "worker": 1,  # it stays up when the scheduler dies
        "api_server": 0,
    }


def answer_and_log(url: str, api_key: str, logs: dict[str, Path], source: str) -> None:
    """Without the API key the server refuses (401); with it, a greedy chat answer is right,
    and the JSON logs name the request."""
    request_id = f"deploy-{source}-{url.rsplit(':', 1)[1]}"
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 20,
        "temperature": 0,
    }
    refused = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert refused.status_code == 401, refused.text
    response = httpx.post(
        f"{url}/v1/chat/completions",
        json=body,
        headers={"X-Request-Id": request_id, "Authorization": f"Bearer {api_key}"},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert "Paris" in response.json()["choices"][0]["message"]["content"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [line for path in logs.values() for line in path.read_text().splitlines()]
        if any(json_record(line).get("request_id") == request_id for line in lines):
            return
        time.sleep(0.1)
    raise AssertionError(f"no JSON log line names {request_id}")


def json_record(line: str) -> dict:
    """A JSON log line's record ({} for anything else, such as a line still being written)."""
    try:
        record = json.loads(line)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def check_metrics_against_the_dashboards(url: str) -> None:
    """Every series the Grafana dashboard and the Prometheus relabelling name exists."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    names = {sample.name for f in text_string_to_metric_families(text) for sample in f.samples}
    dashboard = DASHBOARD.read_text()
    used = set(re.findall(r"(switchyard:[a-z0-9_]+|http_[a-z_]+)", dashboard))
    assert used and used <= names, sorted(used - names)

    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    regex = config["scrape_configs"][0]["metric_relabel_configs"][0]["regex"]
    scheduler_series = {name for name in names if re.fullmatch(regex, name)}
    expected = {name for name in names if family_of(name) in SCHEDULER_METRIC_NAMES}
    assert scheduler_series == expected
    assert {family_of(name) for name in expected} == set(SCHEDULER_METRIC_NAMES)


def family_of(sample_name: str) -> str:
    return sample_name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
