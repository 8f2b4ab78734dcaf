"""Exact tests of the scheduler and block manager, driven by a model-free fake worker."""

from __future__ import annotations

import msgspec
import pytest

from interfaces import (
    ErrorKind,
    GenerationStatus,
    ImageMetadata,
    SchedulerStatus,
    SharedMemoryArray,
    TextContext,
    TextGenerationOutput,
)
from interfaces.worker_to_scheduler import GrammarsReady, RequestFailure, WorkerOutput
from scheduler.scheduler import MALFORMED_OUTPUT
from tests.support.fake_worker import FakeTokenGenerator
from tests.support.scheduler_steps import (
    CLIENT,
    context,
    expected_tokens,
    make_scheduler,
    run_step,
    run_to_completion,
)


def test_single_request_blocks_grow_one_at_a_time():
    scheduler, worker = make_scheduler(block_size=4), FakeTokenGenerator(4)
    assert scheduler.add_request(context("a", [5, 6, 7, 8, 9], max_new_tokens=4), CLIENT) is None

    step, results = run_step(scheduler, worker)
    assert [new.block_ids for new in step.new_requests] == [[0, 1]]
    assert step.new_requests[0].num_computed_tokens == 0
    assert step.num_scheduled_tokens == {"a": 5}
    assert results["a"].status is SchedulerStatus.ACTIVE

    new_block_ids = []
    for _ in range(3):
        step, results = run_step(scheduler, worker)
        assert step.num_scheduled_tokens == {"a": 1}
        new_block_ids.append(step.cached_requests[0].new_block_ids)
    # Positions 5, 6 and 7 still fit in blocks 0-1. The 4th output token ends the request
    # before any step computes its KV, so no block is ever added.
    assert new_block_ids == [[], [], []]
    assert results["a"].status is SchedulerStatus.COMPLETE
    assert results["a"].result.final_status is GenerationStatus.MAXIMUM_LENGTH
    assert scheduler.block_manager.num_used_blocks == 0


def test_blocks_are_added_when_a_decode_crosses_a_block_boundary():
    scheduler, worker = make_scheduler(block_size=4), FakeTokenGenerator(4)
    scheduler.add_request(context("a", [5, 6, 7], max_new_tokens=7), CLIENT)
    steps = run_to_completion(scheduler, worker)[1]
    assert steps[0].new_requests[0].block_ids == [0]
    # Decode steps compute positions 3..8: position 4 needs block 1, position 8 block 2.
    assert [s.cached_requests[0].new_block_ids for s in steps[1:]] == [[], [1], [], [], [], [2]]


def test_outputs_equal_the_fake_model_and_stop_at_max_tokens():
    scheduler, worker = make_scheduler(), FakeTokenGenerator(4)
    prompt = [11, 12, 13, 14, 15, 16]
    scheduler.add_request(context("a", prompt, max_new_tokens=5), CLIENT)
    finished, _ = run_to_completion(scheduler, worker)
    assert finished == {"a": (expected_tokens(prompt, 5), GenerationStatus.MAXIMUM_LENGTH)}


@pytest.mark.parametrize(
    ("sampling", "expected_count", "expected_status"),
    [
        ({}, 2, GenerationStatus.END_OF_SEQUENCE),
        ({"ignore_eos": True}, 6, GenerationStatus.MAXIMUM_LENGTH),
        ({"min_new_tokens": 3}, 6, GenerationStatus.MAXIMUM_LENGTH),
    ],
)
def test_eos_handling(sampling, expected_count, expected_status):
    scheduler, worker = make_scheduler(), FakeTokenGenerator(4)
    prompt = [1, 1, 1]
    second = expected_tokens(prompt, 2)[1]
    ctx = context("a", prompt, max_new_tokens=6, **sampling)
    ctx = TextContext(
        ctx.request_id, ctx.prompt_token_ids, ctx.max_length, [second], ctx.sampling_params
    )
    scheduler.add_request(ctx, CLIENT)
    finished, _ = run_to_completion(scheduler, worker)
    tokens, status = finished["a"]
    assert tokens == expected_tokens(prompt, expected_count)
    assert status is expected_status


def test_stop_token_ids_end_the_request():
    scheduler, worker = make_scheduler(), FakeTokenGenerator(4)
    prompt = [3, 4]
    third = expected_tokens(prompt, 3)[2]
    scheduler.add_request(context("a", prompt, stop_token_ids=[third]), CLIENT)
    finished, _ = run_to_completion(scheduler, worker)
    assert finished["a"] == (expected_tokens(prompt, 3), GenerationStatus.END_OF_SEQUENCE)


def test_chunked_prefill_runs_decodes_first_and_splits_long_prompts():
    scheduler, worker = make_scheduler(budget=4), FakeTokenGenerator(4)
    scheduler.add_request(context("short", [1, 2], max_new_tokens=5), CLIENT)
    run_step(scheduler, worker)
    long_prompt = list(range(20, 30))
    scheduler.add_request(context("long", long_prompt, max_new_tokens=2), CLIENT)
    scheduled, long_tokens = [], []
    for _ in range(4):
        step, results = run_step(scheduler, worker)
        scheduled.append(step.num_scheduled_tokens)
        long_tokens += results["long"].result.tokens if "long" in results else []
    assert scheduled == [
        {"short": 1, "long": 3},
        {"short": 1, "long": 3},
        {"short": 1, "long": 3},
        {"short": 1, "long": 1},
    ]
    assert long_tokens == expected_tokens(long_prompt, 1)
    finished, _ = run_to_completion(scheduler, worker)
    assert long_tokens + finished["long"][0] == expected_tokens(long_prompt, 2)
    assert finished["long"][1] is GenerationStatus.MAXIMUM_LENGTH


def test_preemption_recomputes_the_newest_request_with_unchanged_output():
    # 6 blocks of 2 tokens: two requests of 4 prompt tokens cannot both reach 8 tokens.
    scheduler, worker = make_scheduler(num_blocks=6, block_size=2, budget=64), FakeTokenGenerator(2)
    prompts = {"old": [1, 2, 3, 4], "new": [5, 6, 7, 8]}
    for request_id, prompt in prompts.items():
        scheduler.add_request(context(request_id, prompt, max_new_tokens=6), CLIENT)
    finished, steps = run_to_completion(scheduler, worker)
    assert scheduler.num_preemptions >= 1
    resumed = [new for step in steps[1:] for new in step.new_requests]
    assert [new.context.request_id for new in resumed] == ["new"] * len(resumed)
    assert all(new.output_token_ids for new in resumed)
    assert any("new" in step.finished_request_ids for step in steps)
    for request_id, prompt in prompts.items():
        assert finished[request_id] == (
            expected_tokens(prompt, 6),
            GenerationStatus.MAXIMUM_LENGTH,
        )
    assert scheduler.block_manager.num_used_blocks == 0


def test_abort_frees_blocks_and_tells_the_worker_next_step():
    scheduler, worker = make_scheduler(), FakeTokenGenerator(4)
    scheduler.add_request(context("a", [1, 2, 3, 4, 5], max_new_tokens=50), CLIENT)
    scheduler.add_request(context("b", [6, 7], max_new_tokens=50), CLIENT)
    run_step(scheduler, worker)
    assert scheduler.block_manager.num_used_blocks == 3

    results = scheduler.abort_requests(["a", "unknown"])
    assert list(results[CLIENT]) == ["a"]
    assert results[CLIENT]["a"].status is SchedulerStatus.CANCELLED
    assert results[CLIENT]["a"].error is None
    assert scheduler.block_manager.num_used_blocks == 1
    step, _ = run_step(scheduler, worker)
    assert step.finished_request_ids == ["a"]
    assert "a" not in worker.states


def test_abort_of_a_waiting_request():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(context("a", [1]), CLIENT)
    scheduler.add_request(context("b", [2]), CLIENT)
    scheduler.schedule()
    scheduler.abort_requests(["b"])
    assert [r.request_id for r in scheduler.waiting] == []
    assert scheduler.stats().num_requests_running == 1


def test_max_num_seqs_caps_the_running_set():
    scheduler = make_scheduler(max_num_seqs=2)
    for request_id in "abc":
        scheduler.add_request(context(request_id, [1, 2]), CLIENT)
    step = scheduler.schedule()
    assert list(step.num_scheduled_tokens) == ["a", "b"]
    stats = scheduler.stats()
    assert (stats.num_requests_running, stats.num_requests_waiting) == (2, 1)


def test_many_concurrent_requests_all_match_their_solo_output():
    # 12 requests of up to 17 cached tokens (5 blocks of 4 each); 20 blocks force preemption.
    scheduler = make_scheduler(num_blocks=20, block_size=4, budget=16)
    worker = FakeTokenGenerator(4)
    prompts = {f"r{i}": [i + 1] * (3 + i % 7) for i in range(12)}
    for request_id, prompt in prompts.items():
        scheduler.add_request(context(request_id, prompt, max_new_tokens=9), CLIENT)
    finished, _ = run_to_completion(scheduler, worker)
    assert scheduler.num_preemptions > 0
    assert finished == {
        rid: (expected_tokens(p, 9), GenerationStatus.MAXIMUM_LENGTH) for rid, p in prompts.items()
    }


@pytest.mark.parametrize(
    ("prompt_len", "max_new_tokens", "max_model_len", "message"),
    [
        (0, 4, 1024, "the prompt is empty"),
        (128, 4, 128, "no room is left to generate"),
        (10, 1000, 1024, "more than the 256 the pool holds"),
    ],
)
def test_requests_that_can_never_run_are_rejected(
    prompt_len, max_new_tokens, max_model_len, message
):
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_model_len=max_model_len)
    rejection = scheduler.add_request(context("x", [1] * prompt_len, max_new_tokens), CLIENT)
    assert rejection.status is SchedulerStatus.CANCELLED
    assert message in rejection.error
    assert not scheduler.has_unfinished_requests()


def test_duplicate_request_ids_are_rejected():
    scheduler = make_scheduler()
    assert scheduler.add_request(context("a", [1]), CLIENT) is None
    rejection = scheduler.add_request(context("a", [1]), CLIENT)
    assert "already in use" in rejection.error


def test_fail_all_cancels_everything_with_the_error():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(context("a", [1]), CLIENT)
    scheduler.add_request(context("b", [2]), b"api-1")
    scheduler.schedule()
    results = scheduler.fail_all("the worker died")
    assert {client: list(r) for client, r in results.items()} == {CLIENT: ["a"], b"api-1": ["b"]}
    assert results[b"api-1"]["b"].error == "the worker died"
    assert results[b"api-1"]["b"].error_kind is ErrorKind.UNAVAILABLE
    assert scheduler.block_manager.num_used_blocks == 0
    assert not scheduler.has_unfinished_requests()


def test_a_request_the_worker_refuses_fails_alone_as_rejected():
    scheduler, worker = make_scheduler(), FakeTokenGenerator(4)
    scheduler.add_request(context("good", [1, 2, 3]), CLIENT)
    scheduler.add_request(context("bad", [4, 5, 6]), CLIENT)
    step = scheduler.schedule()
    outputs = worker.next_token(step)
    worker.release("bad")
    del outputs["bad"]
    results = scheduler.update_from_output(
        WorkerOutput(step.step_id, outputs, refused={"bad": "invalid regex for structured output"})
    )[CLIENT]
    assert results["bad"].status is SchedulerStatus.CANCELLED
    assert (results["bad"].error, results["bad"].error_kind) == (
        "invalid regex for structured output",
        ErrorKind.INVALID_REQUEST,
    )
    assert results["good"].status is SchedulerStatus.ACTIVE
    scheduler.check_integrity()
    assert scheduler.stats().num_requests_running == 1
    next_step, _ = run_step(scheduler, worker)
    assert next_step.num_scheduled_tokens == {"good": 1}
    assert next_step.finished_request_ids == []


def test_a_refused_image_requests_blocks_from_its_image_on_are_not_reused():
    scheduler, worker = make_scheduler(), FakeTokenGenerator(4)
    prompt = [1, 2, 3, 4, 5, 9, 9, 9, 9, 9, 9, 6, 7, 8]  # the image's tokens at 5-10
    pixels = SharedMemoryArray("switchyard_00000000_" + "0" * 24, (3, 2, 2), "float32")
    image = ImageMetadata(5, 11, pixels, "cat")
    with_image = msgspec.structs.replace(context("bad", prompt), images=[image])
    scheduler.add_request(with_image, CLIENT)
    step = scheduler.schedule()
    outputs = worker.next_token(step)
    worker.release("bad")
    refusal = (
        "image 0's pixels are not in this host's shared memory (the request ended, "
        "or this worker runs on another host than the API server)"
    )
    scheduler.update_from_output(WorkerOutput(step.step_id, {}, refused={"bad": refusal}))
    scheduler.check_integrity()
    assert "bad" in outputs  # the worker computed its blocks, the image without its pixels

    again = msgspec.structs.replace(context("again", prompt), images=[image])
    scheduler.add_request(again, CLIENT)
    step = scheduler.schedule()
    assert step.new_requests[0].num_computed_tokens == 4  # only the block before the image
    assert step.num_scheduled_tokens == {"again": len(prompt) - 4}


def test_a_full_queue_refuses_requests_as_overloaded():
    scheduler = make_scheduler(max_num_seqs=1, max_queued_requests=2, max_queued_tokens=10)
    assert scheduler.add_request(context("a", [1] * 6), CLIENT) is None  # takes the free slot
    assert scheduler.add_request(context("b", [2] * 3), CLIENT) is None
    too_many_tokens = scheduler.add_request(context("c", [3] * 2), CLIENT)
    assert (too_many_tokens.error_kind, too_many_tokens.error) == (
        ErrorKind.OVERLOADED,
        "9 tokens are already waiting, and the queue holds at most 10; try again later",
    )
    assert scheduler.add_request(context("d", [4]), CLIENT) is None  # 10 tokens fit exactly
    scheduler.schedule()  # "a" runs (max_num_seqs=1); b and d wait
    scheduler.check_integrity()
    too_many_requests = scheduler.add_request(context("e", [5]), CLIENT)
    assert (too_many_requests.error_kind, too_many_requests.error) == (
        ErrorKind.OVERLOADED,
        "2 requests are already waiting; try again later",
    )
    assert (scheduler.stats().num_requests_waiting, scheduler.num_waiting_tokens) == (2, 4)


def test_a_full_queue_takes_a_request_submitted_again_but_refuses_a_new_one():
    """A request an API server submits again after a scheduler restart (it brings the tokens it
    generated, ``generated_token_ids``) was accepted once: the queue's bounds do not refuse it,
    and it counts its prompt and those tokens among the waiting ones. A new request is refused
    as overloaded (429)."""
    scheduler = make_scheduler(max_num_seqs=1, max_queued_requests=1, max_queued_tokens=10)
    assert scheduler.add_request(context("a", [1] * 6), CLIENT) is None  # takes the free slot
    assert scheduler.add_request(context("b", [2] * 4), CLIENT) is None  # the queue is full
    new = scheduler.add_request(context("c", [3]), CLIENT)
    assert (new.error_kind, new.error) == (
        ErrorKind.OVERLOADED,
        "1 requests are already waiting; try again later",
    )
    prompt = [4] * 5
    resubmitted = msgspec.structs.replace(
        context("d", prompt, max_new_tokens=6), generated_token_ids=expected_tokens(prompt, 3)
    )
    assert scheduler.add_request(resubmitted, CLIENT) is None
    scheduler.check_integrity()
    assert (len(scheduler.waiting), scheduler.num_waiting_tokens) == (3, 6 + 4 + 5 + 3)
    too_many_tokens = scheduler.add_request(context("e", [5]), CLIENT)
    assert too_many_tokens.error_kind is ErrorKind.OVERLOADED
    finals, _ = run_to_completion(scheduler, FakeTokenGenerator(4))
    assert finals["d"] == (expected_tokens(prompt, 6)[3:], GenerationStatus.MAXIMUM_LENGTH)
    assert sorted(finals) == ["a", "b", "d"]


def test_an_empty_queue_takes_a_prompt_bigger_than_the_token_bound():
    scheduler = make_scheduler(max_queued_tokens=4)
    assert scheduler.add_request(context("big", [1] * 20), CLIENT) is None
    assert scheduler.add_request(context("next", [1]), CLIENT).error_kind is ErrorKind.OVERLOADED


def test_preempted_requests_count_as_waiting_tokens():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    worker = FakeTokenGenerator(4)
    scheduler.add_request(context("a", [1] * 7, max_new_tokens=6), CLIENT)
    scheduler.add_request(context("b", [2] * 7, max_new_tokens=6), CLIENT)
    for _ in range(4):  # both run, then one is preempted when blocks run out
        run_step(scheduler, worker)  # checks the waiting-token count every step
    assert scheduler.num_preemptions >= 1
    assert scheduler.num_waiting_tokens == sum(r.num_tokens for r in scheduler.waiting) > 0


def test_abort_client_drops_only_that_api_servers_requests():
    scheduler, worker = make_scheduler(max_num_seqs=2), FakeTokenGenerator(4)
    scheduler.add_request(context("mine-1", [1, 2]), CLIENT)
    scheduler.add_request(context("theirs", [3, 4]), b"api-1")
    scheduler.add_request(context("mine-2", [5, 6]), CLIENT)  # waiting: only 2 run at once
    run_step(scheduler, worker)
    assert scheduler.abort_client(CLIENT) == 2
    scheduler.check_integrity()
    assert list(scheduler.requests) == ["theirs"]
    assert scheduler.stats().num_requests_waiting == 0
    step, _ = run_step(scheduler, worker)
    assert list(step.num_scheduled_tokens) == ["theirs"]
    assert sorted(step.finished_request_ids) == ["mine-1"]  # mine-2 never reached the worker


# -- one request's failure is its own -----------------------------------------------------------


def test_a_request_whose_sampling_failed_ends_alone_and_its_blocks_stay_cached():
    scheduler, worker = make_scheduler(), FakeTokenGenerator(4)
    scheduler.add_request(context("good", [1, 2, 3, 4, 5]), CLIENT)
    scheduler.add_request(context("bad", [6, 7, 8, 9, 10]), CLIENT)
    scheduler.add_request(context("odd", [6, 7, 8, 9, 11]), CLIENT)
    step = scheduler.schedule()
    outputs = worker.next_token(step)
    failed = {
        "bad": RequestFailure("no token could be sampled: every logit was -inf or NaN"),
        "odd": RequestFailure("the grammar failed: rejected token 7", invalid_request=True),
    }
    output = {"good": outputs["good"]}
    results = scheduler.update_from_output(WorkerOutput(step.step_id, output, failed=failed))
    scheduler.check_integrity()
    bad, odd = results[CLIENT]["bad"], results[CLIENT]["odd"]
    assert (bad.status, bad.error_kind, bad.error) == (
        SchedulerStatus.CANCELLED,
        ErrorKind.INTERNAL,
        "no token could be sampled: every logit was -inf or NaN",
    )
    assert (odd.error_kind, odd.error) == (
        ErrorKind.INVALID_REQUEST,
        "the grammar failed: rejected token 7",
    )
    assert results[CLIENT]["good"].status is SchedulerStatus.ACTIVE
    next_step, _ = run_step(scheduler, worker)
    assert next_step.num_scheduled_tokens == {"good": 1}
    assert sorted(next_step.finished_request_ids) == ["bad", "odd"]  # the worker kept them
    scheduler.add_request(context("again", [6, 7, 8, 9, 10]), CLIENT)
    step = scheduler.schedule()
    assert step.new_requests[0].num_computed_tokens == 4  # the failed request's block is kept


def test_the_workers_output_is_sent_on_completed_and_a_malformed_one_fails_alone():
    scheduler, worker = make_scheduler(), FakeTokenGenerator(4)
    for request_id in ("good", "none", "two", "other"):
        scheduler.add_request(context(request_id, [1, 2, 3], max_new_tokens=1), CLIENT)
    step = scheduler.schedule()
    good = worker.next_token(step)["good"]
    outputs = {
        "good": good,
        "none": TextGenerationOutput("none", []),
        "two": TextGenerationOutput("two", [5, 6]),
        "other": TextGenerationOutput("good", [5]),
    }
    results = scheduler.update_from_output(WorkerOutput(step.step_id, outputs))[CLIENT]
    scheduler.check_integrity()
    assert results["good"].result is good  # built once, by the worker
    assert good.final_status is GenerationStatus.MAXIMUM_LENGTH
    for request_id in ("none", "two", "other"):
        failed = results[request_id]
        assert (failed.status, failed.error_kind, failed.error) == (
            SchedulerStatus.CANCELLED,
            ErrorKind.INTERNAL,
            MALFORMED_OUTPUT,
        )
    assert scheduler.requests == {}
    scheduler.add_request(context("next", [4]), CLIENT)
    assert sorted(scheduler.schedule().finished_request_ids) == ["good", "none", "other", "two"]


def test_a_deferred_request_waits_outside_the_batch_until_its_grammar_is_ready():
    scheduler, worker = make_scheduler(), FakeTokenGenerator(4)
    scheduler.add_request(context("plain", [1, 2, 3]), CLIENT)
    scheduler.add_request(context("grammar", [4, 5, 6, 7, 8]), CLIENT)
    step = scheduler.schedule()
    outputs = worker.next_token(step)
    del outputs["grammar"]
    worker.states["grammar"].token_ids.pop()
    worker.states["grammar"].num_computed_tokens -= 1  # as the real worker gets told to
    results = scheduler.update_from_output(
        WorkerOutput(step.step_id, outputs, deferred=["grammar"])
    )
    assert list(results[CLIENT]) == ["plain"]
    for _ in range(3):
        step, results = run_step(scheduler, worker)
        assert step.num_scheduled_tokens == {"plain": 1}
    assert scheduler.stats().num_requests_running == 2
    assert scheduler.on_grammars(GrammarsReady(["grammar", "unknown"], {})) == {}
    step, results = run_step(scheduler, worker)
    assert step.num_scheduled_tokens == {"plain": 1, "grammar": 1}
    assert step.cached_requests[1].num_computed_tokens == 4  # its last token is recomputed
    assert results["grammar"].result.tokens == expected_tokens([4, 5, 6, 7, 8], 1)


def test_a_grammar_that_failed_rejects_its_parked_request_alone():
    scheduler, worker = make_scheduler(), FakeTokenGenerator(4)
    scheduler.add_request(context("grammar", [4, 5, 6]), CLIENT)
    scheduler.add_request(context("plain", [1, 2, 3]), CLIENT)
    step = scheduler.schedule()
    outputs = worker.next_token(step)
    del outputs["grammar"]
    scheduler.update_from_output(WorkerOutput(step.step_id, outputs, deferred=["grammar"]))
    reason = "compiling the grammar took longer than the limit of 30 s"
    results = scheduler.on_grammars(GrammarsReady([], {"grammar": reason, "unknown": "x"}))
    scheduler.check_integrity()
    failed = results[CLIENT]["grammar"]
    assert (failed.error_kind, failed.error) == (ErrorKind.INVALID_REQUEST, reason)
    assert list(scheduler.requests) == ["plain"]
    step, _ = run_step(scheduler, worker)
    assert step.finished_request_ids == ["grammar"]


def test_a_preempted_parked_request_starts_over_unparked():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    scheduler.add_request(context("a", [1] * 8, max_new_tokens=6), CLIENT)
    scheduler.add_request(context("parked", [2] * 8, max_new_tokens=6), CLIENT)
    step = scheduler.schedule()  # the two prompts fill the 4 blocks
    assert step.num_scheduled_tokens == {"a": 8, "parked": 8}
    token = TextGenerationOutput("a", [9])
    scheduler.update_from_output(WorkerOutput(step.step_id, {"a": token}, deferred=["parked"]))
    step = scheduler.schedule()  # "a" needs a third block: the newest request, parked, goes
    assert step.num_scheduled_tokens == {"a": 1}
    assert scheduler.num_preemptions == 1
    preempted = scheduler.requests["parked"]
    assert (preempted.waiting_for_grammar, preempted.num_computed_tokens) == (False, 0)
    scheduler.check_integrity()


def test_stop_token_ids_are_a_set_checked_per_token():
    scheduler, worker = make_scheduler(), FakeTokenGenerator(4)
    prompt = [1, 2, 3]
    stop = expected_tokens(prompt, 2)[1]
    many = [*range(2000, 202_000), stop]
    scheduler.add_request(context("a", prompt, stop_token_ids=many), CLIENT)
    assert scheduler.requests["a"].stop_token_ids == frozenset(many)
    finals, _ = run_to_completion(scheduler, worker)
    assert finals["a"] == (expected_tokens(prompt, 2), GenerationStatus.END_OF_SEQUENCE)


def test_a_request_submitted_again_with_its_tokens_continues_after_them():
    """After a scheduler restart an API server submits a request again with the tokens it
    received (``generated_token_ids``): they reach the worker as outputs, count against the
    budget, and the move is counted; the rest is the undisturbed stream."""
    prompt = [5, 6, 7, 8, 9]
    undisturbed = expected_tokens(prompt, 6)
    scheduler, worker = make_scheduler(block_size=4), FakeTokenGenerator(4)
    resumed = msgspec.structs.replace(
        context("a", prompt, max_new_tokens=6), generated_token_ids=undisturbed[:2]
    )
    assert scheduler.add_request(resumed, CLIENT) is None
    step, results = run_step(scheduler, worker)
    assert step.new_requests[0].output_token_ids == undisturbed[:2]
    assert step.num_scheduled_tokens == {"a": 7}
    finals, _ = run_to_completion(scheduler, worker)
    rest = [*results["a"].result.tokens, *finals["a"][0]]
    assert [*undisturbed[:2], *rest] == undisturbed
    assert finals["a"][1] is GenerationStatus.MAXIMUM_LENGTH
    assert scheduler.stats().request_migrations_total["scheduler_restarted"] == 1


def test_generated_tokens_are_checked_like_the_prompt():
    from scheduler.admission import context_problem

    scheduler = make_scheduler(block_size=4)
    outside = msgspec.structs.replace(context("a", [5, 6]), generated_token_ids=[1 << 40])
    assert context_problem(outside, 1000) == "generated token ids must be in [0, 1000)"
    full = msgspec.structs.replace(
        context("b", [5, 6], max_new_tokens=3), generated_token_ids=[11, 12, 13]
    )
    refused = scheduler.add_request(full, CLIENT)
    assert refused.error_kind is ErrorKind.INVALID_REQUEST
    assert "leave no room to generate" in refused.error
