"""Deployment files are valid for the tools that read them (no Docker engine needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_docker_compose_matches_the_compose_spec():
    checker = Path(sys.executable).with_name("check-jsonschema")
    completed = subprocess.run(
        [str(checker), "--builtin-schema", "vendor.compose-spec", str(ROOT / "docker-compose.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_compose_runs_one_container_per_role_on_the_roles_own_entry_points():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    modules = {name: service["command"][2] for name, service in services.items()}
    assert modules == {"scheduler": "scheduler", "worker": "worker", "api-server": "api_server"}
    for service in services.values():
        assert service["build"]["dockerfile"] == "deploy/Dockerfile"
