"""A hybrid group that dies while another serves: its requests move there and complete with
exactly the tokens they would have had (``HybridPlacement.remove_group``), within
``--migration-limit`` moves each; over real ZeroMQ sockets with fake worker groups."""

from __future__ import annotations

import time

import pytest

from interfaces import ErrorKind, GenerationStatus, SchedulerStatus
from interfaces.api_to_scheduler import SubmitRequest
from interfaces.handshake import PROTOCOL_VERSION
from interfaces.worker_to_scheduler import WorkerOutput, WorkerReady
from scheduler.config import SchedulerConfig
from scheduler.counters import SchedulerCounters
from scheduler.hybrid import HybridPlacement
from scheduler.worker_group import WorkerGroups
from tests.support.fake_worker import FakeTokenGenerator
from tests.support.scheduler_sockets import (
    FakeWorkerThread,
    api_client,
    collect,
    ctx,
    encode,
    expected,
    receive,
    stats,
)

DIED = "the worker serving this request died"
PROMPTS = {"r0": [1, 2, 3], "r1": [4, 5], "r2": [6, 7, 8, 9], "r3": [10]}
"""Spread over groups a and b in turn: the least loaded takes each, the first on a tie."""


def start_group(context, backend, monitor, name, num_groups, **options) -> FakeWorkerThread:
    """A fake hybrid group ``name``, once it is the ``num_groups``-th serving (64 blocks each),
    as ``monitor``, a client that reads nothing but stats, sees it."""
    worker = FakeWorkerThread(context, backend, group=name, **options)
    worker.start()
    deadline = time.monotonic() + 5
    while stats(monitor).num_kv_blocks_total != 64 * num_groups:
        assert time.monotonic() < deadline, f"group {name!r} did not register"
        time.sleep(0.02)
    return worker


def spread_over_two_groups(system, die_after_steps):
    """Groups a (slow; it dies after ``die_after_steps`` steps) and b, and ``PROMPTS`` of 30
    tokens each submitted; returns (client, monitor, a, b)."""
    _, context, frontend, backend = system
    client, monitor = api_client(context, frontend), api_client(context, frontend)
    doomed = start_group(context, backend, monitor, "a", 1, die_after_steps=die_after_steps)
    doomed.step_delay_s = 0.05
    survivor = start_group(context, backend, monitor, "b", 2)
    for request_id, prompt in PROMPTS.items():
        client.send(encode(SubmitRequest(ctx(request_id, prompt, max_new_tokens=30))))
    return client, monitor, doomed, survivor


def first_steps_of(worker: FakeWorkerThread) -> dict[str, list[int]]:
    """The output tokens each request arrived with in its first step on ``worker``."""
    firsts: dict[str, list[int]] = {}
    for step in worker.steps:
        for new in step.new_requests:
            firsts.setdefault(new.context.request_id, list(new.output_token_ids))
    return firsts


def test_a_dead_groups_requests_complete_on_the_survivor_with_exactly_their_tokens(system):
    client, monitor, doomed, survivor = spread_over_two_groups(system, die_after_steps=5)
    tokens, finals = collect(client, list(PROMPTS))
    doomed.join(5)

    assert tokens == {rid: expected(prompt, 30) for rid, prompt in PROMPTS.items()}
    for final in finals.values():
        assert final.status is SchedulerStatus.COMPLETE
        assert final.result.final_status is GenerationStatus.MAXIMUM_LENGTH
    on_a = first_steps_of(doomed)
    assert sorted(on_a) == ["r0", "r2"]  # a held r0 and r2, b r1 and r3
    # Each moved request reached b as a new one carrying the tokens a had produced (1 to 4 of
    # them: a answered at most 4 steps), to be recomputed there, then continued.
    moved = {rid: outputs for rid, outputs in first_steps_of(survivor).items() if rid in on_a}
    assert sorted(moved) == ["r0", "r2"]
    for rid, outputs in moved.items():
        assert 1 <= len(outputs) <= 4
        assert outputs == expected(PROMPTS[rid], len(outputs))
    after = stats(monitor)
    assert (after.num_requests_running, after.num_requests_waiting) == (0, 0)
    assert (after.num_kv_blocks_used, after.num_kv_blocks_total) == (0, 64)
    assert after.workers_ready


@pytest.mark.parametrize("system", [{"migration_limit": 0}], indirect=True)
def test_with_a_migration_limit_of_0_a_dead_groups_requests_fail_as_before(system):
    client, monitor, doomed, _ = spread_over_two_groups(system, die_after_steps=5)
    tokens, finals = collect(client, list(PROMPTS))
    doomed.join(5)

    for rid in ("r0", "r2"):
        assert (finals[rid].status, finals[rid].error_kind, finals[rid].error) == (
            SchedulerStatus.CANCELLED,
            ErrorKind.UNAVAILABLE,
            DIED,
        )
        assert 1 <= len(tokens[rid]) <= 4
        assert tokens[rid] == expected(PROMPTS[rid], len(tokens[rid]))
    for rid in ("r1", "r3"):
        assert tokens[rid] == expected(PROMPTS[rid], 30)
        assert finals[rid].status is SchedulerStatus.COMPLETE
    assert stats(monitor).num_kv_blocks_used == 0


@pytest.mark.parametrize("system", [{"migration_limit": 1}], indirect=True)
def test_a_request_that_would_move_past_the_limit_fails_as_before(system):
    _, context, frontend, backend = system
    client, monitor = api_client(context, frontend), api_client(context, frontend)
    first = start_group(context, backend, monitor, "a", 1, die_after_steps=5)
    first.step_delay_s = 0.2  # a lives about a second: long enough to start b and c
    client.send(encode(SubmitRequest(ctx("x", [1, 2], max_new_tokens=50))))
    started = receive(client).results["x"]
    assert started.status is SchedulerStatus.ACTIVE
    second = start_group(context, backend, monitor, "b", 2, die_after_steps=3)
    start_group(context, backend, monitor, "c", 3)

    tokens, finals = collect(client, ["x"])  # a dies: x moves to b; b dies: x fails
    first.join(5)
    second.join(5)
    assert "x" in first_steps_of(second)  # it did move once
    assert (finals["x"].status, finals["x"].error_kind, finals["x"].error) == (
        SchedulerStatus.CANCELLED,
        ErrorKind.UNAVAILABLE,
        DIED,
    )
    streamed = started.result.tokens + tokens["x"]
    assert 4 <= len(streamed) <= 6  # 4 from a, then b answered at most 2 steps before dying
    assert streamed == expected([1, 2], len(streamed))

    client.send(encode(SubmitRequest(ctx("y", [3]))))  # c serves on
    tokens, _ = collect(client, ["y"])
    assert tokens == {"y": expected([3], 5)}


def test_a_parked_request_moves_and_one_too_big_for_the_survivor_fails():
    """In the placement alone: a request waiting for its grammar moves like the others (and
    samples on the survivor from where it was); one whose context the survivor's smaller KV
    pool could never hold fails with the 503."""
    placement = HybridPlacement(SchedulerConfig(max_num_batched_tokens=64), SchedulerCounters())
    workers = WorkerGroups()

    def serve(name: str, num_blocks: int) -> None:
        ready = WorkerReady(PROTOCOL_VERSION, "fake", num_blocks, 4, 256, group=name)
        assert workers.register(name.encode(), ready).now_serving
        assert placement.add_group(workers.groups[name]) is None

    serve("a", 64)
    dying = FakeTokenGenerator(block_size=4)
    assert placement.add_request(ctx("parked", [1, 2, 3], max_new_tokens=10), b"api") is None
    assert placement.add_request(ctx("big", [4] * 10, max_new_tokens=40), b"api") is None
    tokens = {"parked": [], "big": []}
    for deferred in ([], ["parked"]):  # a token each, then "parked" waits for its grammar
        [(_, step)] = placement.schedule(["a"])
        outputs = dying.next_token(step)
        for request_id in deferred:
            del outputs[request_id]
        output = WorkerOutput(step.step_id, outputs, deferred=deferred)
        results = placement.update_from_output("a", output)
        for request_id, result in results[b"api"].items():
            tokens[request_id] += result.result.tokens
    assert placement.groups["a"].scheduler.requests["parked"].waiting_for_grammar
    assert [len(tokens["parked"]), len(tokens["big"])] == [1, 2]

    serve("b", 8)  # 32 tokens: "big" may need 50
    failed = placement.remove_group("a", DIED)
    assert list(failed[b"api"]) == ["big"]
    assert (failed[b"api"]["big"].error, failed[b"api"]["big"].error_kind) == (
        DIED,
        ErrorKind.UNAVAILABLE,
    )
    survivor = FakeTokenGenerator(block_size=4)
    final = None
    while final is None:
        [(_, step)] = placement.schedule(["b"])
        output = WorkerOutput(step.step_id, survivor.next_token(step))
        results = placement.update_from_output("b", output)
        placement.check_integrity()
        result = results[b"api"].get("parked")
        if result is not None:
            tokens["parked"] += result.result.tokens
            final = result if result.stop_stream else None
    assert tokens["parked"] == expected([1, 2, 3], 10)
    assert final.status is SchedulerStatus.COMPLETE
    assert placement.groups["b"].scheduler.block_manager.num_used_blocks == 0
