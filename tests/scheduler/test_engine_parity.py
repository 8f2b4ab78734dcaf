"""The real scheduler driving the real worker in one process: greedy parity with transformers
under chunked prefill, forced preemption and prefix-cache hits."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.engine import BLOCK_SIZE, NUM_NEW_TOKENS, Engine, greedy_tokens

QUESTIONS = (
    "What is the capital of France?",
    "Name two planets.",
    "Say something kind about trains.",
)


@pytest.fixture(scope="module", params=["tiny_llama_dir", "default_model_dir"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> dict[str, list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chats = [[{"role": "user", "content": question}] for question in QUESTIONS]
    return {
        f"q{i}": tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
        for i, chat in enumerate(chats)
    }


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    """transformers' greedy tokens for a prompt, end-of-sequence stopping off.

    The attention mask is explicit: chat prompts contain <|im_end|>, which is also the pad
    token, and generate() would otherwise mask those prompt tokens out.
    """
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None

    @cache
    def generate(prompt: tuple[int, ...]) -> list[int]:
        return greedy_tokens(model, list(prompt), NUM_NEW_TOKENS)

    return generate


def expected_for(reference, prompts):
    return {request_id: reference(tuple(prompt)) for request_id, prompt in prompts.items()}


def test_chunked_prefill_keeps_greedy_parity(model_dir, prompts, reference):
    engine = Engine(model_dir, num_blocks=32, max_model_len=256, budget=16)
    assert engine.generate(prompts) == expected_for(reference, prompts)
    first_chunks = engine.steps[0].num_scheduled_tokens
    assert sum(first_chunks.values()) == 16
    assert all(count < len(prompts[rid]) for rid, count in first_chunks.items())


def test_forced_preemption_keeps_greedy_parity(model_dir, prompts, reference):
    # 5 blocks of 16 tokens; each request needs up to 4 at its peak, three run at once.
    engine = Engine(model_dir, num_blocks=5, max_model_len=80, budget=256)
    assert engine.generate(prompts) == expected_for(reference, prompts)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_prefix_hit_computes_only_the_tail_and_keeps_the_output(model_dir, prompts, reference):
    engine = Engine(model_dir, num_blocks=32, max_model_len=256, budget=256)
    prompt = prompts["q0"] + prompts["q1"]  # long enough for several full blocks
    first = engine.generate({"first": prompt})
    num_first_steps = len(engine.steps)
    second = engine.generate({"second": prompt})

    num_cached = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert num_cached >= 2 * BLOCK_SIZE
    assert engine.steps[num_first_steps].num_scheduled_tokens == {
        "second": len(prompt) - num_cached
    }
    assert engine.scheduler.stats().prefix_cache_hits_total == num_cached
    assert first["first"] == second["second"] == reference(tuple(prompt))


def test_siblings_sharing_a_prompt_in_one_step_keep_parity(model_dir, prompts, reference):
    # Like n > 1: the later siblings reuse the first one's blocks in the very step that
    # computes them, which relies on each layer writing its keys/values before attention.
    engine = Engine(model_dir, num_blocks=32, max_model_len=256, budget=256)
    prompt = prompts["q0"] + prompts["q1"]
    outputs = engine.generate({"n0": prompt, "n1": prompt, "n2": prompt})
    num_cached = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    tail = len(prompt) - num_cached
    assert engine.steps[0].num_scheduled_tokens == {"n0": len(prompt), "n1": tail, "n2": tail}
    expected = reference(tuple(prompt))
    assert outputs == {"n0": expected, "n1": expected, "n2": expected}
