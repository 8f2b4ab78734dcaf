"""Each multi-GPU layout run: its roles started as plain processes with exactly the commands
and environments the files give them (docker-compose's as Docker Compose resolves them, the
split Kubernetes layout's as the kubelet and the LeaderWorkerSet controller would), serving
requests with transformers' greedy tokens. One replica of each service or Deployment (replicas
run the same command), every rank of a LeaderWorkerSet group.

This machine has no GPU and no container network, so the test changes these and nothing else
(``on_this_machine``):
- ``--device=cuda`` becomes ``--device=cpu`` (tensor parallelism then runs over gloo);
- a path inside the container becomes what is mounted there: the CURVE keys (made by
  ``switchyard keygen``, as compose's keygen service and the README's Secret make them), the
  models volume (``/models/extra``, holding the tiny random Llama: cheap enough to load in every
  group), the worker's /tmp;
- a container's, Service's or pod's address (``scheduler``, ``worker``, ``eth0``,
  ``switchyard-scheduler``, the pod IP, the group leader's name, ``0.0.0.0``) becomes 127.0.0.1,
  and each port inside a container a free port here.
The model comes from the operator's settings the files document: ``SWITCHYARD_MODEL`` and
``SWITCHYARD_MODELS_DIR`` for compose, the ConfigMap's ``MODEL_DIR`` for Kubernetes."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.deploy.test_deploy import check_metrics_against_the_dashboards
from tests.support.clients import free_port
from tests.support.deploy import (
    IMAGE_CURVE_KEYS_DIR,
    K8S_SECRETS,
    expand_k8s_variables,
    is_role,
    k8s_copy,
    pod_template,
    readme_command,
    resolved_layout,
    split_layout,
)
from tests.support.engine import greedy_tokens
from tests.support.serve_process import wait_until_ready

MODELS_MOUNT = "/models/extra"
LWS_LEADER = "switchyard-tensor-parallel-0.switchyard-tensor-parallel.default"
"""LWS_LEADER_ADDRESS as the LeaderWorkerSet controller sets it for group 0."""
POD_IP = "10.0.0.7"
"""status.podIP as the kubelet gives it (then mapped to 127.0.0.1 like every pod address)."""
CONTAINER_HOSTS = frozenset(
    {"0.0.0.0", "eth0", "scheduler", "worker", "switchyard-scheduler", LWS_LEADER, POD_IP}
)
"""The addresses the files give that mean a container, Service or pod: 127.0.0.1 here."""
STARTUP_TIMEOUT_S = 120
NUM_NEW_TOKENS = 6
BLOCK_SIZE = 16
TINY_BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
"""A KV block of the tiny Llama: K and V, 2 layers, 2 key-value heads of 16 dims, float32."""
PROMPTS = ([1, 450, 7000, 12, 901, 33, 2048], [(37 * i) % 8000 + 3 for i in range(21)])

LAYOUTS = {
    "compose-tp": [("hybrid", 2)],
    "compose-pd": [("decode", 1), ("prefill", 1)],
    "compose-dp": [("hybrid", 1), ("hybrid", 1)],
    "split-pd": [("decode", 1), ("prefill", 1)],
    "split-lws": [("hybrid", 2)],
}
"""Each layout run (the compose file's name, or the split Kubernetes layout's workers) and the
worker groups it registers with the scheduler: (role, ranks), sorted."""
SERVING = re.compile(r"serving group '([^']+)' \((\w+)\): \S+ on (\d+) rank")


@dataclass(frozen=True)
class Process:
    name: str
    command: list[str]
    environment: dict[str, str]


def compose_processes(layout: str, model_dir: Path) -> list[Process]:
    """One replica of each role service of ``deploy/compose.{layout}.yaml`` over the GPU file
    and docker-compose.yml, with the operator's model setting."""
    operator = {
        "SWITCHYARD_MODELS_DIR": str(model_dir.parent),
        "SWITCHYARD_MODEL": f"{MODELS_MOUNT}/{model_dir.name}",
    }
    services = resolved_layout(layout, operator)["services"]
    processes = []
    for name, service in services.items():
        if not is_role(service):
            continue
        for volume in service["volumes"]:
            if volume["target"] == MODELS_MOUNT:
                assert volume["source"] == str(model_dir.parent) and volume["read_only"]
        environment = {key: str(value) for key, value in service["environment"].items()}
        processes.append(Process(name, list(service["command"]), environment))
    return processes


def k8s_processes(layout: str, model_dir: Path, tmp_path: Path) -> list[Process]:
    """Every container of one pod of each Deployment of the split ``layout``, every rank of a
    LeaderWorkerSet group, with the models claim swapped in (the README's sed, on a copy in
    ``tmp_path``) and the ConfigMap's MODEL_DIR and SERVED_MODEL_NAME set as the README says."""
    models = k8s_copy(tmp_path, readme_command("sed -i", "with-models"))
    documents = split_layout(layout, models)
    (config,) = [d["data"] for d in documents if d["kind"] == "ConfigMap"]
    model = {"MODEL_DIR": f"{MODELS_MOUNT}/{model_dir.name}", "SERVED_MODEL_NAME": model_dir.name}
    config = {**config, **model}
    processes = []
    for document in documents:
        if document["kind"] not in ("Deployment", "LeaderWorkerSet"):
            continue
        size = document["spec"].get("leaderWorkerTemplate", {}).get("size", 1)
        for index in range(size):
            controller = {}
            if document["kind"] == "LeaderWorkerSet":
                controller = {
                    "LWS_LEADER_ADDRESS": LWS_LEADER,
                    "LWS_GROUP_SIZE": str(size),
                    "LWS_WORKER_INDEX": str(index),
                }
            for container in pod_template(document)["spec"]["containers"]:
                environment = {**config, **controller, **container_env(container)}
                command = [expand_k8s_variables(a, environment) for a in container["command"]]
                name = f"{document['metadata']['name']}-{index}"
                processes.append(Process(name, command, environment))
    return processes


def container_env(container: dict) -> dict[str, str]:
    """A container's own variables: from the Secrets the README has the operator create, or
    the pod's IP."""
    environment = {}
    for variable in container.get("env", []):
        source = variable["valueFrom"]
        if "secretKeyRef" in source:
            key = source["secretKeyRef"]["name"], source["secretKeyRef"]["key"]
            environment[variable["name"]] = K8S_SECRETS[key]
        else:
            assert source == {"fieldRef": {"fieldPath": "status.podIP"}}
            environment[variable["name"]] = POD_IP
    return environment


def on_this_machine(
    argument: str, paths: dict[str, str], ports: dict[int, int], http_port: int
) -> str:
    """``argument`` with the substitutions of the module's docstring, and only those."""
    if argument == "--device=cuda":
        return "--device=cpu"
    for inside, outside in paths.items():
        argument = argument.replace(inside, outside)
    name, _, value = argument.partition("=")
    if name in ("--host", "--master-addr"):
        assert value in CONTAINER_HOSTS, argument
        return f"{name}=127.0.0.1"
    if name == "--port":
        return f"{name}={http_port}"
    if name == "--master-port":
        return f"{name}={ports[int(value)]}"

    def local(match: re.Match) -> str:
        assert match[1] in CONTAINER_HOSTS, argument
        return f"tcp://127.0.0.1:{ports[int(match[2])]}"

    return re.sub(r"tcp://([\w.-]+):(\d+)", local, argument)


@contextlib.contextmanager
def started(
    processes: list[Process], model_dir: Path, tmp_path: Path
) -> Iterator[tuple[str, str, dict[str, Path]]]:
    """Every process started; yields the API server's URL and key and the logs once it
    answers /ready (with one group serving, maybe not yet all). Stops them all."""
    keys_dir = tmp_path / "curve"
    subprocess.run(
        [sys.executable, "-m", "switchyard", "keygen", "--output", str(keys_dir)],
        check=True,
        timeout=60,
    )
    paths = {
        IMAGE_CURVE_KEYS_DIR: str(keys_dir),
        MODELS_MOUNT: str(model_dir.parent),
        "/tmp/worker.alive": str(tmp_path / "worker.alive"),
    }
    ports = {port: free_port() for port in (5555, 5556, 5557, 29500)}
    given_by_files = ("SWITCHYARD_API_KEY", "SWITCHYARD_CURVE_KEYS_DIR")
    base_environment = {k: v for k, v in os.environ.items() if k not in given_by_files}
    running: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    url, api_key = "", ""
    try:
        for process in processes:
            assert process.command[:2] == ["python", "-m"], process
            http_port = free_port()
            argv = [on_this_machine(a, paths, ports, http_port) for a in process.command[1:]]
            if process.command[2] == "api_server":
                url, api_key = (
                    f"http://127.0.0.1:{http_port}",
                    process.environment["SWITCHYARD_API_KEY"],
                )
            logs[process.name] = tmp_path / f"{process.name}.log"
            with logs[process.name].open("w") as log:
                running[process.name] = subprocess.Popen(
                    [sys.executable, *argv],
                    env={**base_environment, **process.environment},
                    stdout=log,
                    stderr=log,
                )
        assert sum(p.command[2] == "api_server" for p in processes) == 1
        wait_until_ready(url, running, STARTUP_TIMEOUT_S, logs)
        yield url, api_key, logs
    finally:
        for process in running.values():
            process.terminate()
        for process in running.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def serving_groups(scheduler_log: Path, count: int) -> dict[str, tuple[str, int]]:
    """The groups the scheduler serves, by name: (role, ranks), once ``count`` do."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        found = {m[1]: (m[2], int(m[3])) for m in SERVING.finditer(scheduler_log.read_text())}
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_serves_transformers_greedy_tokens(layout, tiny_llama_dir, tmp_path):
    source, name = layout.split("-", 1)
    if source == "compose":
        processes = compose_processes(name, tiny_llama_dir)
    else:
        processes = k8s_processes(layout, tiny_llama_dir, tmp_path)
    (scheduler,) = [p.name for p in processes if p.command[2] == "scheduler"]
    with started(processes, tiny_llama_dir, tmp_path) as (url, api_key, logs):
        groups = serving_groups(logs[scheduler], len(LAYOUTS[layout]))
        assert sorted(groups.values()) == LAYOUTS[layout]
        if layout == "compose-tp":
            assert set(groups) == {"tensor-parallel"}
        headers = {"Authorization": f"Bearer {api_key}"}
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
        reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
        reference.generation_config.eos_token_id = None
        for prompt in PROMPTS:
            body = {"model": tiny_llama_dir.name, "prompt": prompt, "temperature": 0}
            body |= {"max_tokens": NUM_NEW_TOKENS, "ignore_eos": True, "logprobs": 0}
            response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
            assert response.status_code == 200, response.text
            expected = greedy_tokens(reference, prompt, NUM_NEW_TOKENS)
            tokens = response.json()["choices"][0]["logprobs"]["tokens"]
            assert tokens == [tokenizer.decode([token]) for token in expected], prompt

        samples = scrape(url)
        by_group = {
            labels["group"]: labels["role"]
            for series, labels, _ in samples
            if series == "switchyard:num_requests_running_by_group"
        }
        assert by_group == {group: role for group, (role, _) in groups.items()}
        (sent,) = [v for series, _, v in samples if series == "switchyard:kv_transfer_bytes_total"]
        blocks = sum(-(-len(prompt) // BLOCK_SIZE) for prompt in PROMPTS)
        assert sent == (blocks * TINY_BLOCK_BYTES if name == "pd" else 0)
        if layout == "split-pd":  # every series the dashboard shows, the disaggregated ones too
            check_metrics_against_the_dashboards(url)


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    """/metrics: (sample name, labels, value) of every sample."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    families = text_string_to_metric_families(text)
    return [(sample.name, sample.labels, sample.value) for f in families for sample in f.samples]
