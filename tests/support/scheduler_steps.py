"""A Scheduler driven step by step in this process, with the fake token generator as its worker."""

from __future__ import annotations

from interfaces import (
    SamplingParams,
    TextContext,
)
from interfaces.worker_to_scheduler import WorkerOutput
from scheduler.config import KVCacheConfig, SchedulerConfig
from scheduler.scheduler import Scheduler
from tests.support.fake_worker import next_token_for

CLIENT = b"api-0"
EOS = 2


def make_scheduler(
    num_blocks=64,
    block_size=4,
    budget=64,
    max_num_seqs=8,
    max_model_len=128,
    enable_prefix_caching=True,
    **limits,
):
    config = SchedulerConfig(max_num_seqs, budget, enable_prefix_caching, **limits)
    return Scheduler(config, KVCacheConfig(num_blocks, block_size, max_model_len))


def context(request_id, prompt, max_new_tokens=8, **sampling):
    return TextContext(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        max_length=len(prompt) + max_new_tokens,
        eos_token_ids=[EOS],
        sampling_params=SamplingParams(**sampling),
    )


def run_step(scheduler, worker):
    """One scheduler step through the fake worker; returns (step, results for CLIENT)."""
    step = scheduler.schedule()
    outputs = worker.next_token(step)
    results = scheduler.update_from_output(WorkerOutput(step.step_id, outputs))
    scheduler.check_integrity()
    return step, results.get(CLIENT, {})


def run_to_completion(scheduler, worker, max_steps=500):
    """Drive until idle; returns {request_id: (tokens, final status)} and the steps taken."""
    tokens, finals, steps = {}, {}, []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return {rid: (tokens[rid], finals[rid]) for rid in finals}, steps
        step, results = run_step(scheduler, worker)
        steps.append(step)
        for request_id, result in results.items():
            tokens.setdefault(request_id, []).extend(result.result.tokens)
            if result.stop_stream:
                finals[request_id] = result.result.final_status
    raise AssertionError("scheduler did not go idle")


def expected_tokens(prompt, count):
    token_ids = list(prompt)
    for _ in range(count):
        token_ids.append(next_token_for(token_ids))
    return token_ids[len(prompt) :]
