"""Prefix caching through the scheduler, and a stress test with random aborts."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from interfaces import SchedulerStatus, TextContext
from interfaces.worker_to_scheduler import WorkerOutput
from tests.support.fake_worker import FakeTokenGenerator
from tests.support.scheduler_steps import (
    CLIENT,
    context,
    expected_tokens,
    make_scheduler,
    run_step,
    run_to_completion,
)


def test_a_repeated_prompt_computes_only_its_uncached_tail():
    scheduler, worker = make_scheduler(block_size=4), FakeTokenGenerator(4)
    prompt = list(range(10, 33))  # 23 tokens: 5 full blocks
    scheduler.add_request(context("first", prompt, max_new_tokens=3), CLIENT)
    first, _ = run_to_completion(scheduler, worker)

    scheduler.add_request(context("second", prompt, max_new_tokens=3), CLIENT)
    step, results = run_step(scheduler, worker)
    assert step.num_scheduled_tokens == {"second": 3}
    assert step.new_requests[0].num_computed_tokens == 20
    # The first request ran alone from an empty pool, so its five full blocks were 0..4.
    assert step.new_requests[0].block_ids[:5] == [0, 1, 2, 3, 4]
    second, _ = run_to_completion(scheduler, worker)
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries_total, stats.prefix_cache_hits_total) == (46, 20)
    second_tokens = results["second"].result.tokens + second["second"][0]
    assert first["first"][0] == second_tokens == expected_tokens(prompt, 3)


def test_siblings_submitted_together_share_the_prompt_within_one_step():
    scheduler, worker = make_scheduler(block_size=4), FakeTokenGenerator(4)
    prompt = list(range(10, 33))  # 23 tokens: 5 full blocks
    for request_id in ("n0", "n1", "n2"):
        scheduler.add_request(context(request_id, prompt, max_new_tokens=2), CLIENT)
    step, _ = run_step(scheduler, worker)
    assert step.num_scheduled_tokens == {"n0": 23, "n1": 3, "n2": 3}
    assert [new.block_ids for new in step.new_requests] == [
        [0, 1, 2, 3, 4, 5],
        [0, 1, 2, 3, 4, 6],
        [0, 1, 2, 3, 4, 7],
    ]
    finished, _ = run_to_completion(scheduler, worker)
    assert len({tuple(tokens) for tokens, _ in finished.values()}) == 1


def test_requests_asking_for_prompt_logprobs_compute_their_whole_prompt():
    scheduler, worker = make_scheduler(block_size=4), FakeTokenGenerator(4)
    prompt = list(range(10, 33))
    scheduler.add_request(context("first", prompt, max_new_tokens=1), CLIENT)
    run_to_completion(scheduler, worker)
    ctx = context("echo", prompt, max_new_tokens=1)
    ctx = TextContext(ctx.request_id, ctx.prompt_token_ids, ctx.max_length, prompt_logprobs=2)
    scheduler.add_request(ctx, CLIENT)
    step, _ = run_step(scheduler, worker)
    assert step.num_scheduled_tokens == {"echo": 23}


def test_a_failed_step_drops_the_prefix_cache():
    scheduler, worker = make_scheduler(block_size=4), FakeTokenGenerator(4)
    prompt = list(range(10, 33))
    scheduler.add_request(context("doomed", prompt, max_new_tokens=4), CLIENT)
    step = scheduler.schedule()
    results = scheduler.fail_step(step, "worker error: boom")
    assert results[CLIENT]["doomed"].error == "worker error: boom"
    assert scheduler.block_manager.num_cached_blocks == 0
    scheduler.add_request(context("next", prompt, max_new_tokens=1), CLIENT)
    step, _ = run_step(scheduler, worker)
    assert step.num_scheduled_tokens == {"next": 23}


def test_a_finished_conversation_turn_is_reused_by_the_next_turn():
    scheduler, worker = make_scheduler(block_size=4), FakeTokenGenerator(4)
    turn_one = list(range(1, 11))
    scheduler.add_request(context("t1", turn_one, max_new_tokens=6), CLIENT)
    finished, _ = run_to_completion(scheduler, worker)
    turn_two = turn_one + finished["t1"][0] + [7, 7, 7]
    scheduler.add_request(context("t2", turn_two, max_new_tokens=2), CLIENT)
    step, _ = run_step(scheduler, worker)
    # Turn one computed 15 of its 16 tokens (the last output was never fed back): 3 blocks.
    assert step.new_requests[0].num_computed_tokens == 12


def test_prefix_caching_off_recomputes_everything():
    scheduler = make_scheduler(block_size=4, enable_prefix_caching=False)
    worker = FakeTokenGenerator(4)
    prompt = list(range(10, 30))
    for request_id in ("a", "b"):
        scheduler.add_request(context(request_id, prompt, max_new_tokens=2), CLIENT)
        run_to_completion(scheduler, worker)
    assert scheduler.stats().prefix_cache_hits_total == 0


@dataclass
class Workload:
    """Requests with random lengths and shared prefixes; some to abort after N of their steps."""

    prompts: dict[str, list[int]] = field(default_factory=dict)
    max_new: dict[str, int] = field(default_factory=dict)
    abort_after: dict[str, int] = field(default_factory=dict)

    @classmethod
    def random(cls, rng: random.Random, num_requests: int) -> Workload:
        workload = cls()
        shared = [rng.randrange(10, 500) for _ in range(16)]
        for index in range(num_requests):
            own = [rng.randrange(10, 500) for _ in range(rng.randrange(1, 30))]
            workload.prompts[f"r{index}"] = shared[: rng.randrange(0, 17)] + own
            workload.max_new[f"r{index}"] = rng.randrange(1, 40)
            if rng.random() < 0.25:
                workload.abort_after[f"r{index}"] = rng.randrange(0, 30)
        return workload


def drive(scheduler, worker, workload, rng, max_steps=5000):
    """Feed requests in a few at a time, abort on schedule; returns (tokens, final results)."""
    pending, abort_after = list(workload.prompts), dict(workload.abort_after)
    tokens = {rid: [] for rid in workload.prompts}
    finals, steps_seen = {}, dict.fromkeys(workload.prompts, 0)
    for _ in range(max_steps):
        for rid in [pending.pop(0) for _ in range(min(rng.randrange(0, 4), len(pending)))]:
            ctx = context(rid, workload.prompts[rid], workload.max_new[rid])
            assert scheduler.add_request(ctx, CLIENT) is None
        if not pending and not scheduler.has_unfinished_requests():
            return tokens, finals
        aborting = [rid for rid, after in abort_after.items() if steps_seen[rid] >= after]
        finals.update(scheduler.abort_requests(aborting).get(CLIENT, {}))
        for rid in aborting:
            del abort_after[rid]
        step = scheduler.schedule()
        outputs = WorkerOutput(step.step_id, worker.next_token(step))
        for rid, result in scheduler.update_from_output(outputs).get(CLIENT, {}).items():
            tokens[rid] += result.result.tokens
            if result.stop_stream:
                finals[rid] = result
        scheduler.check_integrity()
        for rid in step.num_scheduled_tokens:
            steps_seen[rid] += 1
    raise AssertionError("the workload did not finish")


def test_stress_random_lengths_shared_prefixes_aborts_and_preemption():
    rng = random.Random(1234)
    workload = Workload.random(rng, num_requests=200)
    scheduler = make_scheduler(num_blocks=48, block_size=4, budget=40, max_num_seqs=16)
    tokens, finals = drive(scheduler, FakeTokenGenerator(4), workload, rng)

    assert scheduler.block_manager.num_used_blocks == 0
    scheduler.check_integrity()
    assert scheduler.num_preemptions > 0
    assert scheduler.stats().prefix_cache_hits_total > 0
    cancelled = [r for r, res in finals.items() if res.status is SchedulerStatus.CANCELLED]
    completed = [r for r, res in finals.items() if res.status is SchedulerStatus.COMPLETE]
    assert len(finals) == 200 and len(cancelled) >= 25
    for rid in completed:
        assert tokens[rid] == expected_tokens(workload.prompts[rid], workload.max_new[rid])
