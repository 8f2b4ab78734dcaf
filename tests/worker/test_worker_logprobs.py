"""Log probabilities of sampled tokens and of prompt tokens, checked against transformers.

The worker reports vLLM V1's default: log-softmax of the raw model logits, before penalties,
bias and temperature, so the reference is transformers' log-softmax at the same positions.
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from interfaces.scheduler_to_worker import NewRequestData, ScheduledStep
from tests.support.step_driver import DrivenRequest, StepDriver, context, small_runner
from worker.model_runner import ModelRunner

PROMPT = [1, 412, 1337, 95, 6012, 44, 23011, 7, 310, 2048, 17, 999, 4321, 5, 88, 1200, 31, 64, 3]


@pytest.fixture(scope="module")
def tiny_runner(tiny_llama_dir) -> ModelRunner:
    return small_runner(tiny_llama_dir)


@pytest.fixture(scope="module")
def reference_model(tiny_llama_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def _reference_logprobs(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax (len(token_ids), vocab_size) at every position."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _check_step(reference: torch.Tensor, token: int, sampled_lp: float, top: dict, k: int):
    """The sampled token's log probability and the top ``k`` match ``reference`` (vocab_size,)."""
    assert sampled_lp == pytest.approx(reference[token].item(), abs=1e-4)
    values, ids = reference.topk(k)
    assert list(top) == ids.tolist()
    assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-4)
    assert list(top.values()) == sorted(top.values(), reverse=True)


def test_greedy_logprobs_match_transformers(tiny_runner, reference_model):
    request = DrivenRequest(context("greedy", PROMPT, 6, logprobs=5))
    driven = StepDriver(tiny_runner).run([request])["greedy"]
    tokens = driven.output_token_ids
    reference = _reference_logprobs(reference_model, PROMPT + tokens)
    for step, output in enumerate(driven.outputs):
        (entry,) = output.log_probabilities
        (sampled_lp,) = entry.token_log_probabilities
        (top,) = entry.top_log_probabilities
        assert len(top) == 5 and next(iter(top)) == output.tokens[0]  # greedy: the likeliest
        _check_step(reference[len(PROMPT) - 1 + step], output.tokens[0], sampled_lp, top, 5)
        assert output.prompt_log_probabilities is None


def test_logprobs_are_raw_despite_penalties_and_temperature(tiny_runner, reference_model):
    """Sampled with temperature, penalties and bias; log probabilities ignore all of them."""
    request = DrivenRequest(
        context(
            "raw",
            PROMPT,
            5,
            logprobs=3,
            top_k=0,
            temperature=1.7,
            seed=11,
            repetition_penalty=1.3,
            frequency_penalty=1.0,
            logit_bias={300: 5.0},
        )
    )
    neighbour = DrivenRequest(context("plain", PROMPT[:7], 5))
    driven = StepDriver(tiny_runner).run([neighbour, request])
    reference = _reference_logprobs(reference_model, PROMPT + driven["raw"].output_token_ids)
    for step, output in enumerate(driven["raw"].outputs):
        (entry,) = output.log_probabilities
        _check_step(
            reference[len(PROMPT) - 1 + step],
            output.tokens[0],
            entry.token_log_probabilities[0],
            entry.top_log_probabilities[0],
            3,
        )
    assert all(output.log_probabilities is None for output in driven["plain"].outputs)


def test_zero_logprobs_gives_the_sampled_token_only(tiny_runner):
    driven = StepDriver(tiny_runner).run([DrivenRequest(context("zero", PROMPT, 2, logprobs=0))])
    for output in driven["zero"].outputs:
        (entry,) = output.log_probabilities
        assert entry.top_log_probabilities == [{}] and len(entry.token_log_probabilities) == 1
        assert entry.token_log_probabilities[0] < 0.0


def test_prompt_logprobs_over_two_chunks_match_transformers(tiny_runner, reference_model):
    """A request decoding first in the batch shifts the prompt rows of the flat batch."""
    decoding = DrivenRequest(context("first", [5, 6, 7], 4))
    request = DrivenRequest(context("prompt", PROMPT, 3, prompt_logprobs=4), [11, 8])
    driven = StepDriver(tiny_runner).run([decoding, request])["prompt"]
    first, *later = driven.outputs
    assert all(output.prompt_log_probabilities is None for output in later)
    prompt_lps = first.prompt_log_probabilities
    assert len(prompt_lps.token_log_probabilities) == len(PROMPT) - 1
    reference = _reference_logprobs(reference_model, PROMPT)
    for position, (lp, top) in enumerate(
        zip(prompt_lps.token_log_probabilities, prompt_lps.top_log_probabilities, strict=True)
    ):
        _check_step(reference[position], PROMPT[position + 1], lp, top, 4)
    assert first.log_probabilities is None


def test_one_token_prompt_has_empty_prompt_logprobs(tiny_runner):
    driven = StepDriver(tiny_runner).run([DrivenRequest(context("one", [9], 1, prompt_logprobs=2))])
    (output,) = driven["one"].outputs
    assert output.prompt_log_probabilities.token_log_probabilities == []
    assert output.prompt_log_probabilities.top_log_probabilities == []


def test_prompt_logprobs_refuse_a_prefix_cache_hit(tiny_runner):
    hit = NewRequestData(context("hit", PROMPT, 2, prompt_logprobs=1), [0, 1], 16)
    step = ScheduledStep(0, [hit], num_scheduled_tokens={"hit": len(PROMPT) - 16})
    with pytest.raises(ValueError, match="request 'hit' asks for prompt_logprobs but starts at"):
        tiny_runner.next_token(step)
    assert tiny_runner.requests == {}


def test_a_resumed_request_does_not_repeat_prompt_logprobs(tiny_runner):
    resumed = DrivenRequest(
        context("again", PROMPT, 3, prompt_logprobs=2), resumed_token_ids=[40, 41]
    )
    driven = StepDriver(tiny_runner).run([resumed])["again"]
    assert [output.prompt_log_probabilities for output in driven.outputs] == [None]


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprob_counts_above_twenty_are_refused(tiny_runner, field):
    bad = NewRequestData(context("many", [5, 6], 2, **{field: 21}), [0], 0)
    assert tiny_runner.next_token(ScheduledStep(0, [bad], num_scheduled_tokens={"many": 2})) == {}
    refusals = tiny_runner.take_refusals()
    assert list(refusals) == ["many"]
    assert re.match(rf"request 'many': {field} must be in \[0, 20\], got 21", refusals["many"])
    assert tiny_runner.requests == {}
