"""Each role started alone, as its container would start it, talking over tcp://127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from interfaces.envs import CURVE_KEYS_DIR_VARIABLE
from tests.support.clients import free_port
from tests.support.serve_process import wait_until_ready

STARTUP_TIMEOUT_S = 120


@pytest.fixture(params=["plain", "curve"])
def roles(request, tiny_llama_dir, tmp_path):
    """Scheduler, worker and API server as three separate ``python -m`` processes; with
    "curve", every connection is authenticated and encrypted with keys from
    ``switchyard keygen``, found through SWITCHYARD_CURVE_KEYS_DIR."""
    env = dict(os.environ)
    if request.param == "curve":
        keys = tmp_path / "keys"
        subprocess.run([sys.executable, "-m", "switchyard", "keygen", "--output", keys], check=True)
        env[CURVE_KEYS_DIR_VARIABLE] = str(keys)
    frontend = f"tcp://127.0.0.1:{free_port()}"
    backend = f"tcp://127.0.0.1:{free_port()}"
    http_port = free_port()
    model = str(tiny_llama_dir)
    commands = {
        "scheduler": ["scheduler", "--frontend-addr", frontend, "--backend-addr", backend],
        "worker": [
            "worker",
            "--model",
            model,
            "--scheduler-addr",
            backend,
            "--device",
            "cpu",
            "--kv-cache-memory",
            "64MiB",
        ],
        "api_server": [
            "api_server",
            "--model",
            model,
            "--scheduler-addr",
            frontend,
            "--port",
            str(http_port),
            "--served-model-name",
            "tiny",
        ],
    }
    processes = {
        name: subprocess.Popen([sys.executable, "-m", *argv], env=env)
        for name, argv in commands.items()
    }
    yield f"http://127.0.0.1:{http_port}", processes
    for process in processes.values():
        process.terminate()
    for process in processes.values():
        process.wait(timeout=30)


def test_three_roles_serve_a_chat_completion_over_tcp(roles):
    base_url, processes = roles
    wait_until_ready(base_url, processes, STARTUP_TIMEOUT_S)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200
    result = response.json()
    assert result["choices"][0]["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == 8
    assert result["model"] == "tiny"
    for process in processes.values():
        process.terminate()
    assert {name: p.wait(timeout=30) for name, p in processes.items()} == {
        "scheduler": 0,
        "worker": 0,
        "api_server": 0,
    }


def test_the_scheduler_binds_other_hosts_only_when_told(tmp_path):
    addresses = ["--frontend-addr", "tcp://0.0.0.0:0", "--backend-addr", f"ipc://{tmp_path}/b"]
    refused = subprocess.run(
        [sys.executable, "-m", "scheduler", *addresses],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1
    assert "refusing to bind tcp://0.0.0.0:0" in refused.stderr
    assert "--allow-remote-bind" in refused.stderr
