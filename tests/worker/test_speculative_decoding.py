"""Speculative decoding through the real scheduler and worker: the tokens (and their log
probabilities) are those of decoding one token at a time, greedy or seeded sampling with
history-dependent penalties, while drafts are accepted and rejected."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from interfaces import SamplingParams, TextContext
from interfaces.scheduler_to_worker import NewRequestData, ScheduledStep
from tests.support.engine import Engine

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}'  # noqa: E501
TEXT = (
    "Trains leave the station at nine, at noon and at six. The nine o'clock train stops at "
    "every village; the noon train stops at the market town only; the six o'clock train "
    "does not stop at all."
)


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> dict[str, list[int]]:
    """A request to copy a text out (drafts mostly right) and an open question (mostly not)."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    chats = {
        "copy": f"Repeat this text exactly, word for word:\n\n{TEXT}",
        "question": "What should I see in Paris? Answer in two sentences.",
    }
    return {
        name: tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
        )
        for name, text in chats.items()
    }


def generate(model_dir, prompts, speculative, **options):
    engine = Engine(
        model_dir, num_blocks=64, max_model_len=512, budget=256, speculative_config=speculative
    )
    tokens = engine.generate(prompts, num_new_tokens=40, **options)
    return engine, tokens


def test_greedy_tokens_are_those_of_decoding_one_at_a_time(default_model_dir, prompts):
    _, plain = generate(default_model_dir, prompts, None)
    engine, speculative = generate(default_model_dir, prompts, NGRAM)
    assert speculative == plain
    counters = engine.scheduler.counters
    assert counters.spec_decode_num_accepted_tokens >= 10  # the copy is mostly drafted right
    assert counters.spec_decode_num_draft_tokens > counters.spec_decode_num_accepted_tokens
    # fewer steps than tokens: accepted drafts came several to a step
    decode_steps = [step for step in engine.steps if step.spec_token_ids]
    assert decode_steps and len(engine.steps) < 2 * 40


def test_seeded_sampling_with_penalties_is_unchanged_by_drafts(default_model_dir, prompts):
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=11, frequency_penalty=0.2)
    options = {"params": params, "logprobs": 2}
    plain_engine, plain = generate(default_model_dir, prompts, None, **options)
    engine, speculative = generate(default_model_dir, prompts, NGRAM, **options)
    assert speculative == plain
    assert engine.scheduler.counters.spec_decode_num_accepted_tokens > 0
    for request_id, tokens in plain.items():
        assert len(engine.logprobs[request_id]) == len(tokens)  # one per token, drafts too
        assert engine.logprobs[request_id] == pytest.approx(
            plain_engine.logprobs[request_id], abs=1e-4
        )


def test_drafts_for_a_request_that_is_not_decoding_fail_the_step(tiny_llama_dir):
    engine = Engine(tiny_llama_dir, num_blocks=16, max_model_len=128, budget=64)
    runner = engine.runner
    context = TextContext("a", [5, 6, 7, 8], 20, [2], SamplingParams(top_k=1))
    step = ScheduledStep(
        0,
        new_requests=[NewRequestData(context, [0], 0)],
        num_scheduled_tokens={"a": 3},  # its first three prompt tokens, as if two were drafts
        spec_token_ids={"a": [9, 9]},
    )
    with pytest.raises(ValueError, match="drafts for a request that is not decoding"):
        runner.next_token(step)
    assert runner.requests == {}  # released: nothing half-applied outlives the step
    bad_token = ScheduledStep(
        1,
        new_requests=[NewRequestData(context, [0], 3, output_token_ids=[])],
        num_scheduled_tokens={"a": 2},
        spec_token_ids={"a": [runner.vocab_size]},
    )
    with pytest.raises(ValueError, match="outside the vocabulary"):
        runner.next_token(bad_token)
