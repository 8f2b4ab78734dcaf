"""Greedy parity: the worker's tokens equal transformers' generate() tokens, exactly.

The tests play the scheduler by hand: new requests go in full once, then as diffs; prompts are
prefilled whole or in chunks while other requests decode; KV blocks come from a shuffled pool so
no request's blocks are contiguous.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.engine import greedy_tokens
from tests.support.parity_scheduler import NUM_NEW_TOKENS, DrivenRequest, FakeScheduler
from tests.support.tiny_models import VARIANTS, random_variant
from worker.config import WorkerConfig
from worker.model_runner import ModelRunner
from worker.models import tile_gemm

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about trains running through the mountains at night.",
    "List three prime numbers and explain briefly why each one is prime.",
)


@pytest.fixture(scope="module", params=["tiny_llama_dir", "default_model_dir"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = []
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
    return prompts


@pytest.fixture(scope="module")
def expected(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens, with end-of-sequence stopping off (the scheduler stops)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    outputs = []
    for prompt in prompts:
        outputs.append(greedy_tokens(model, prompt, NUM_NEW_TOKENS))
    assert all(len(tokens) == NUM_NEW_TOKENS for tokens in outputs)
    return outputs


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> ModelRunner:
    config = WorkerConfig(
        model_dir, device="cpu", kv_cache_memory=64 << 20, max_model_len=512, seed=0
    )
    return ModelRunner(config)


def test_one_request_at_a_time(runner, prompts, expected):
    scheduler = FakeScheduler(runner)
    for i, prompt in enumerate(prompts):
        request = DrivenRequest(f"solo-{i}", prompt, [len(prompt)])
        assert scheduler.generate([request]) == {f"solo-{i}": expected[i]}


def test_all_requests_batched(runner, prompts, expected):
    requests = [DrivenRequest(f"batch-{i}", p, [len(p)]) for i, p in enumerate(prompts)]
    outputs = FakeScheduler(runner, seed=1).generate(requests)
    assert outputs == {f"batch-{i}": tokens for i, tokens in enumerate(expected)}


def test_chunked_prefill_mixed_with_decode(runner, prompts, expected):
    """Prompt 0 prefills at once and decodes while prompts 1 and 2 prefill in 3 and 2 chunks."""
    first, second, third = (len(p) for p in prompts)
    chunks = [[first], [5, second // 2 - 5, second - second // 2], [third - 7, 7]]
    requests = [DrivenRequest(f"chunked-{i}", p, chunks[i]) for i, p in enumerate(prompts)]
    outputs = FakeScheduler(runner, seed=2).generate(requests)
    assert outputs == {f"chunked-{i}": tokens for i, tokens in enumerate(expected)}


@pytest.fixture(scope="module")
def high_precision_runner(model_dir: Path) -> ModelRunner:
    """The worker with --float32-matmul-precision high: decoder layers in tile form where the
    CPU has AMX-BF16 (worker.models.tile_gemm)."""
    if not tile_gemm.available():
        pytest.skip("no AMX-BF16 tile unit here")
    config = WorkerConfig(
        model_dir,
        device="cpu",
        kv_cache_memory=64 << 20,
        max_model_len=512,
        seed=0,
        float32_matmul_precision="high",
    )
    before = torch.get_float32_matmul_precision()
    try:
        runner = ModelRunner(config)
    finally:
        torch.set_float32_matmul_precision(before)  # read when packing, at load: done
    assert runner.model.model.layers[0].self_attn.qkv_proj.packing == "tiles"
    return runner


def test_high_precision_products_keep_greedy_parity(high_precision_runner, prompts, expected):
    """Products through bfloat16 halves (relative error ~5e-6) still give transformers' float32
    greedy tokens, prompts prefilled whole and in chunks beside decodes."""
    first, second, third = (len(p) for p in prompts)
    chunks = [[first], [5, second // 2 - 5, second - second // 2], [third - 7, 7]]
    requests = [DrivenRequest(f"high-{i}", p, chunks[i]) for i, p in enumerate(prompts)]
    outputs = FakeScheduler(high_precision_runner, seed=3).generate(requests)
    assert outputs == {f"high-{i}": tokens for i, tokens in enumerate(expected)}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_architecture_variants_match_transformers(variant, tmp_path):
    """Rope scaling, q/k/v bias, tied embeddings and an explicit head_dim, on tiny models."""
    model = random_variant(variant, tmp_path)
    prompts = [torch.randint(3, 512, (length,)).tolist() for length in (23, 41)]
    expected = {}
    for i, prompt in enumerate(prompts):
        generated = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=NUM_NEW_TOKENS
        )
        expected[f"{variant}-{i}"] = generated[0, len(prompt) :].tolist()
    config = WorkerConfig(tmp_path, device="cpu", kv_cache_memory=4 << 20, max_model_len=256)
    runner = ModelRunner(config)
    requests = [
        DrivenRequest(f"{variant}-0", prompts[0], [23]),
        DrivenRequest(f"{variant}-1", prompts[1], [10, 31]),
    ]
    assert FakeScheduler(runner).generate(requests) == expected
