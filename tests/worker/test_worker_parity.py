"""Greedy parity: the worker's tokens equal transformers' generate() tokens, exactly.

The tests play the scheduler by hand: new requests go in full once, then as diffs; prompts are
prefilled whole or in chunks while other requests decode; KV blocks come from a shuffled pool so
no request's blocks are contiguous.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from interfaces import SamplingParams, TextContext
from interfaces.scheduler_to_worker import CachedRequestData, NewRequestData, ScheduledStep
from worker.config import WorkerConfig
from worker.model_runner import ModelRunner

NUM_NEW_TOKENS = 32
QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about trains running through the mountains at night.",
    "List three prime numbers and explain briefly why each one is prime.",
)


@dataclass
class DrivenRequest:
    """The test scheduler's view of one request."""

    request_id: str
    prompt: list[int]
    prefill_chunks: list[int]
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    outputs: list[int] = field(default_factory=list)
    sent: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.outputs)


class FakeScheduler:
    """Runs requests to NUM_NEW_TOKENS outputs each, all requests in every step."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.free_blocks = list(range(runner.num_kv_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.step_id = 0

    def generate(self, requests: list[DrivenRequest]) -> dict[str, list[int]]:
        running, finished = list(requests), []
        while running:
            output = self._step(running, finished)
            finished = [r.request_id for r in running if len(r.outputs) == NUM_NEW_TOKENS]
            running = [r for r in running if len(r.outputs) < NUM_NEW_TOKENS]
            assert set(output) <= {r.request_id for r in requests}
        self.runner.next_token(ScheduledStep(self.step_id, finished_request_ids=finished))
        assert self.runner.requests == {}
        return {r.request_id: r.outputs for r in requests}

    def _step(self, running: list[DrivenRequest], finished: list[str]) -> dict:
        new, cached, num_scheduled = [], [], {}
        for request in running:
            count = request.prefill_chunks.pop(0) if request.prefill_chunks else 1
            new_blocks = self._allocate(request, request.num_computed_tokens + count)
            if request.sent:
                cached.append(
                    CachedRequestData(request.request_id, new_blocks, request.num_computed_tokens)
                )
            else:
                new.append(self._new_request_data(request))
            num_scheduled[request.request_id] = count
        output = self.runner.next_token(
            ScheduledStep(self.step_id, new, cached, num_scheduled, finished)
        )
        self.step_id += 1
        for request in running:
            request.num_computed_tokens += num_scheduled[request.request_id]
            reached_end = request.num_computed_tokens == request.num_tokens
            assert (request.request_id in output) == reached_end
            if reached_end:
                request.outputs.extend(output[request.request_id].tokens)
        return {k: v.tokens for k, v in output.items()}

    def _allocate(self, request: DrivenRequest, num_tokens: int) -> list[int]:
        block_size = self.runner.block_size
        num_needed = -(-num_tokens // block_size) - len(request.block_ids)
        new_blocks = [self.free_blocks.pop() for _ in range(max(num_needed, 0))]
        request.block_ids.extend(new_blocks)
        return new_blocks

    def _new_request_data(self, request: DrivenRequest) -> NewRequestData:
        request.sent = True
        context = TextContext(
            request_id=request.request_id,
            prompt_token_ids=request.prompt,
            max_length=len(request.prompt) + NUM_NEW_TOKENS,
            eos_token_ids=[2],
            sampling_params=SamplingParams(top_k=1),
        )
        return NewRequestData(context, list(request.block_ids), request.num_computed_tokens)


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
        input_ids = torch.tensor([prompt])
        generated = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=NUM_NEW_TOKENS,
        )
        outputs.append(generated[0, len(prompt) :].tolist())
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


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
VARIANTS = {
    "llama3-rope-bias-tied": (
        "LlamaConfig",
        {"rope_parameters": LLAMA3_ROPE, "attention_bias": True, "tie_word_embeddings": True},
    ),
    "qwen2": ("Qwen2Config", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "mistral-head-dim": ("MistralConfig", {"head_dim": 32, "sliding_window": None}),
}


def _random_variant(variant: str, model_dir: Path) -> torch.nn.Module:
    """Save a seeded random tiny model of ``variant`` to ``model_dir`` and return it."""
    import transformers

    config_name, overrides = VARIANTS[variant]
    config = getattr(transformers, config_name)(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        **overrides,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:  # biases start at 0 and norms at 1: make them matter
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(model_dir)
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_architecture_variants_match_transformers(variant, tmp_path):
    """Rope scaling, q/k/v bias, tied embeddings and an explicit head_dim, on tiny models."""
    model = _random_variant(variant, tmp_path)
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
