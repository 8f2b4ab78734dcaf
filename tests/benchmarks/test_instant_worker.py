"""The benchmarks' instant worker honours the ScheduledStep contract as the checking fake does."""

from __future__ import annotations

from benchmarks.instant_worker import INSTANT_TOKEN_ID, InstantTokenGenerator
from interfaces import SamplingParams, TextContext
from interfaces.scheduler_to_worker import CachedRequestData, NewRequestData, ScheduledStep
from interfaces.worker_to_scheduler import WorkerOutput
from scheduler.config import KVCacheConfig, SchedulerConfig, WorkerLimits
from scheduler.scheduler import Scheduler
from scheduler.worker_group import ready_problem
from tests.support.fake_worker import FakeTokenGenerator
from worker.server import WorkerServer

CLIENT = b"api-0"


def context(request_id: str, prompt: list[int], max_new_tokens: int = 6) -> TextContext:
    return TextContext(
        request_id=request_id,
        prompt_token_ids=prompt,
        max_length=len(prompt) + max_new_tokens,
        eos_token_ids=[2],
        sampling_params=SamplingParams(ignore_eos=True),
    )


def new_generator() -> InstantTokenGenerator:
    return InstantTokenGenerator("instant", max_model_len=64, num_kv_blocks=16, block_size=4)


def test_tokens_come_at_the_end_of_known_tokens_and_released_ids_are_forgotten():
    generator = new_generator()
    first = ScheduledStep(
        0,
        new_requests=[NewRequestData(context("a", [5, 6, 7, 8, 9]), [0, 1], 0)],
        num_scheduled_tokens={"a": 3},
    )
    assert generator.next_token(first) == {}
    second = ScheduledStep(
        1, cached_requests=[CachedRequestData("a", [], 3)], num_scheduled_tokens={"a": 2}
    )
    assert [(o.request_id, o.tokens) for o in generator.next_token(second).values()] == [
        ("a", [INSTANT_TOKEN_ID])
    ]
    resumed = NewRequestData(context("b", [1, 2]), [2], 0, output_token_ids=[INSTANT_TOKEN_ID])
    third = ScheduledStep(
        2, new_requests=[resumed], num_scheduled_tokens={"b": 3}, finished_request_ids=["a"]
    )
    assert [(o.request_id, o.tokens) for o in generator.next_token(third).values()] == [
        ("b", [INSTANT_TOKEN_ID])
    ]
    assert list(generator.states) == ["b"]
    assert generator.take_refusals() == {}


def test_answers_the_same_requests_as_the_checking_fake_through_chunking_and_preemption():
    # Six requests of 9 + 6 tokens need 24 blocks of 4; 12 blocks force preemption, and a
    # budget of 16 tokens splits prompts into chunks.
    prompts = {f"r{index}": [100 + index + offset for offset in range(9)] for index in range(6)}
    schedulers, generators = [], [FakeTokenGenerator(4), new_generator()]
    for _ in generators:
        scheduler = Scheduler(SchedulerConfig(8, 16), KVCacheConfig(12, 4, 64))
        for request_id, prompt in prompts.items():
            assert scheduler.add_request(context(request_id, prompt), CLIENT) is None
        schedulers.append(scheduler)
    instant_tokens: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    for _ in range(200):
        if not schedulers[1].has_unfinished_requests():
            break
        steps = [scheduler.schedule() for scheduler in schedulers]
        assert steps[0].num_scheduled_tokens == steps[1].num_scheduled_tokens
        outputs = [gen.next_token(step) for gen, step in zip(generators, steps, strict=True)]
        assert outputs[0].keys() == outputs[1].keys()
        for scheduler, step, output in zip(schedulers, steps, outputs, strict=True):
            scheduler.update_from_output(WorkerOutput(step.step_id, output))
        for request_id, output in outputs[1].items():
            instant_tokens[request_id] += output.tokens
    assert not schedulers[0].has_unfinished_requests()
    assert schedulers[1].num_preemptions > 0
    assert instant_tokens == {request_id: [INSTANT_TOKEN_ID] * 6 for request_id in prompts}


def test_its_handshake_is_one_the_scheduler_believes():
    """benchmarks/frontend_bench.py runs it behind the real WorkerServer: the WorkerReady built
    from it must pass the scheduler's checks."""
    ready = WorkerServer(new_generator(), "ipc:///nonexistent")._ready()
    assert (ready.num_kv_blocks, ready.block_size, ready.max_model_len) == (16, 4, 64)
    assert (ready.vocab_size, ready.kv_layout) == (49152, None)
    assert ready_problem(ready, WorkerLimits()) is None
