"""A two-host run on one machine: the scheduler and the API server on host A, a worker group of
two tensor-parallel ranks on host B, each host a network namespace joined to the other by a veth
pair (tests/support/netns.py), every ZeroMQ connection TCP with CURVE keys, each host holding
only its share of them. The worker reaches the scheduler only at A's address, the ranks meet at
B's, and greedy tokens equal transformers'."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.curve_keys import role_keys
from tests.support.engine import greedy_tokens
from tests.support.netns import Host, post_from, processes_in, two_hosts
from worker.parallel import GLOO_INTERFACE_VARIABLE, bind_gloo_toward, interface_with_address

NUM_NEW_TOKENS = 6
STARTUP_TIMEOUT_S = 60
FRONTEND_PORT, BACKEND_PORT, HTTP_PORT, MASTER_PORT = 5557, 5558, 8000, 29500
"""Fixed ports: nothing else runs in namespaces this test made."""
PROMPTS = [[1, 450, 7000, 12, 901, 33, 2048], [(37 * i) % 8000 + 3 for i in range(40)], [5, 6]]


@cache
def reference_model(model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model


def keys_by_role(tmp_path: Path) -> dict[str, Path]:
    """``switchyard keygen``'s keys, split into each process's share."""
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "switchyard", "keygen", "--output", keys], check=True)
    return {
        "scheduler": role_keys(keys, tmp_path, "scheduler"),
        "api_server": role_keys(keys, tmp_path, "API server"),
        "worker": role_keys(keys, tmp_path, "worker (hybrid, prefill or embedding)"),
    }


def role_commands(a: Host, b: Host, model: Path, keys: dict[str, Path]) -> dict:
    """(host, ``python -m`` argv) of each process, in the order they start."""
    frontend = f"tcp://{a.address}:{FRONTEND_PORT}"
    backend = f"tcp://{a.address}:{BACKEND_PORT}"
    rank = [
        *("--model", str(model), "--scheduler-addr", backend, "--device", "cpu"),
        *("--kv-cache-memory", "64MiB", "--max-model-len", "512", "--num-threads", "1"),
        *("--tensor-parallel-size", "2", "--master-addr", b.address),
        *("--master-port", str(MASTER_PORT), "--curve-keys-dir", str(keys["worker"])),
    ]
    return {
        "scheduler": (
            a,
            [
                *("scheduler", "--frontend-addr", frontend, "--backend-addr", backend),
                *("--allow-remote-bind", "--curve-keys-dir", str(keys["scheduler"])),
            ],
        ),
        "rank-1": (b, ["worker", *rank, "--rank", "1"]),
        "rank-0": (b, ["worker", *rank, "--rank", "0"]),
        "api_server": (
            a,
            [
                *("api_server", "--model", str(model), "--scheduler-addr", frontend),
                *("--port", str(HTTP_PORT), "--served-model-name", "tiny"),
                *("--max-model-len", "512", "--curve-keys-dir", str(keys["api_server"])),
            ],
        ),
    }


def completion(prompt: list[int]) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": NUM_NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
    }


def test_a_tensor_parallel_group_on_another_host_serves_with_greedy_parity(
    tiny_llama_dir, tmp_path
):
    keys = keys_by_role(tmp_path)
    with two_hosts() as (a, b):
        commands = role_commands(a, b, tiny_llama_dir, keys)
        with processes_in(commands, tmp_path) as (processes, logs):
            expected = [
                greedy_tokens(reference_model(tiny_llama_dir), prompt, NUM_NEW_TOKENS)
                for prompt in PROMPTS
            ]  # while the roles start
            bodies = [completion(prompt) for prompt in PROMPTS]
            url = f"http://127.0.0.1:{HTTP_PORT}"
            answers = post_from(a, url, bodies, STARTUP_TIMEOUT_S, processes, logs)

            assert [answer["status"] for answer in answers] == [200] * len(PROMPTS)
            tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
            for answer, tokens in zip(answers, expected, strict=True):
                (choice,) = answer["body"]["choices"]
                assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in tokens]
            group = f"hybrid@{b.address}:{MASTER_PORT}"
            scheduler_log = logs["scheduler"].read_text()
            assert f"serving group '{group}' (hybrid): {tiny_llama_dir.name} on 2 rank(s)" in (
                scheduler_log
            )
            # The ranks' rendezvous and gloo's connections on B's address, none on loopback.
            assert b.established_connections() == {
                (b.address, a.address),
                (b.address, b.address),
            }
            assert b.can_connect(a.address, BACKEND_PORT)
            assert not b.can_connect("127.0.0.1", BACKEND_PORT)


def test_gloo_binds_the_interface_toward_the_master_unless_the_operator_names_one(monkeypatch):
    # Empty counts as unset; set through monkeypatch, the variable bind_gloo_toward writes is
    # restored (here: removed) after the test, so no later test's workers inherit it.
    monkeypatch.setenv(GLOO_INTERFACE_VARIABLE, "")
    bind_gloo_toward("127.0.0.1", MASTER_PORT)
    assert os.environ[GLOO_INTERFACE_VARIABLE] == "lo"
    monkeypatch.setenv(GLOO_INTERFACE_VARIABLE, "eth7")
    bind_gloo_toward("127.0.0.1", MASTER_PORT)
    assert os.environ[GLOO_INTERFACE_VARIABLE] == "eth7"
    assert interface_with_address("::1") == "lo"
    assert interface_with_address("192.0.2.1") is None  # TEST-NET-1: no interface holds it
