"""Prefill/decode disaggregation end to end: real workers, real KV transfers, real HTTP.

Greedy tokens from disaggregated serving must equal transformers' (and therefore the hybrid
path's, which the parity tests hold to the same reference), with the prompts' blocks crossing
from the prefill group to the decode group, over groups of different tensor-parallel sizes too.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.clients import free_port
from tests.support.engine import greedy_tokens
from tests.support.metrics import scrape
from tests.support.serve_process import (
    DEFAULT_MODEL_NAME,
    ServeProcess,
    gauges_settle,
    role_processes,
    wait_until_ready,
)

NUM_NEW_TOKENS = 8
BLOCK_SIZE = 16


@cache
def reference_model(model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model


def complete(url: str, model: str, prompt: list[int], max_tokens: int = NUM_NEW_TOKENS) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body |= {"ignore_eos": True, "logprobs": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def assert_greedy_parity(url: str, model: str, model_dir: Path, prompts: list[list[int]]):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for prompt in prompts:
        tokens = complete(url, model, prompt)["choices"][0]["logprobs"]["tokens"]
        expected = greedy_tokens(reference_model(model_dir), prompt, NUM_NEW_TOKENS)
        assert tokens == [tokenizer.decode([token]) for token in expected], prompt


def test_a_two_rank_prefill_group_hands_off_to_a_one_rank_decode_group(tiny_llama_dir, tmp_path):
    """Every role alone, as on its own host: TCP everywhere, the prefill group's two ranks
    each sending their key-value heads to the decode group's single rank."""
    frontend = f"tcp://127.0.0.1:{free_port()}"
    backend = f"tcp://127.0.0.1:{free_port()}"
    http_port, master_port = free_port(), free_port()
    model = str(tiny_llama_dir)
    common = [
        *("--model", model, "--scheduler-addr", backend, "--device", "cpu"),
        *("--kv-cache-memory", "64MiB", "--max-model-len", "512", "--num-threads", "1"),
    ]
    prefill = [
        *common,
        *("--role", "prefill", "--group", "prefill-a", "--tensor-parallel-size", "2"),
        *("--master-addr", "127.0.0.1", "--master-port", str(master_port)),
    ]
    decode_addr = f"tcp://127.0.0.1:{free_port()}"
    commands = {
        "scheduler": [
            "scheduler",
            *("--frontend-addr", frontend, "--backend-addr", backend),
            *("--max-num-batched-tokens", "16"),  # long prompts prefill in chunks
        ],
        "prefill-1": ["worker", *prefill, "--rank", "1"],
        "prefill-0": ["worker", *prefill, "--rank", "0"],
        "decode": ["worker", *common, "--role", "decode", "--kv-transfer-addr", decode_addr],
        "api_server": [
            "api_server",
            *("--model", model, "--scheduler-addr", frontend, "--port", str(http_port)),
            *("--served-model-name", "tiny", "--max-model-len", "512"),
        ],
    }
    with role_processes(commands, tmp_path) as (processes, logs):
        url = f"http://127.0.0.1:{http_port}"
        wait_until_ready(url, processes, 120, logs)
        prompts = [[1, 450, 7000, 12, 901, 33, 2048], [(37 * i) % 8000 + 3 for i in range(45)]]
        assert_greedy_parity(url, "tiny", tiny_llama_dir, prompts)

        samples = scrape(url)
        blocks = sum(-(-len(prompt) // BLOCK_SIZE) for prompt in prompts)
        # The tiny model: 2 layers, 2 key-value heads of 16 dims, float32.
        block_bytes = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
        sent = samples[("switchyard:kv_transfer_bytes_total", frozenset({("model_name", "tiny")}))]
        assert sent == blocks * block_bytes
        scheduler_log = logs["scheduler"].read_text()
        assert "serving group 'prefill-a' (prefill): tiny-llama0 on 2 rank(s)" in scheduler_log
        assert "(decode): tiny-llama0 on 1 rank(s)" in scheduler_log
        assert f"receiving KV transfers at {decode_addr}" in logs["decode"].read_text()


@pytest.fixture(scope="module")
def disaggregated(default_model_dir):
    serve = ServeProcess(
        *("--prefill-workers", "1", "--decode-workers", "1", "--max-model-len", "2048"),
        *("--kv-cache-memory", "128MiB", "--max-num-batched-tokens", "64"),
    )
    yield serve
    serve.kill()


def test_the_default_model_disaggregated_matches_transformers(disaggregated, default_model_dir):
    prompts = [
        AutoTokenizer.from_pretrained(default_model_dir).encode("The capital of France is"),
        [(91 * i) % 40000 + 17 for i in range(150)],  # three chunks of prefill
    ]
    before = scrape(disaggregated.base_url)
    assert_greedy_parity(disaggregated.base_url, DEFAULT_MODEL_NAME, default_model_dir, prompts)
    after = scrape(disaggregated.base_url)
    key = ("switchyard:kv_transfer_bytes_total", frozenset({("model_name", DEFAULT_MODEL_NAME)}))
    # SmolLM2-135M: 30 layers, 3 key-value heads of 64 dims, float32 on the CPU.
    block_bytes = 2 * 30 * BLOCK_SIZE * 3 * 64 * 4
    blocks = sum(-(-len(prompt) // BLOCK_SIZE) for prompt in prompts)
    assert after[key] - before[key] == blocks * block_bytes
    label = frozenset({("model_name", DEFAULT_MODEL_NAME)})
    assert after[("switchyard:kv_transfer_seconds_count", label)] >= len(prompts)
    for role in ("prefill", "decode"):
        labels = frozenset({("model_name", DEFAULT_MODEL_NAME), ("role", role)})
        assert ("switchyard:num_requests_running_by_role", labels) in after


def test_a_stream_dropped_after_its_first_token_frees_every_block(disaggregated):
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "Tell me a long story about a dragon."}
    body |= {"max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
    for _ in range(3):
        with httpx.stream(
            "POST", f"{disaggregated.base_url}/v1/completions", json=body, timeout=60
        ) as response:
            assert response.status_code == 200
            next(line for line in response.iter_lines() if line.startswith("data: {"))
        # Closed mid-generation: the request is aborted on both groups.
    assert gauges_settle(disaggregated) == {
        "num_requests_running": 0.0,
        "num_requests_waiting": 0.0,
        "kv_cache_usage_perc": 0.0,
    }
