"""A hybrid group that dies while another serves: its requests move there and complete with
exactly the tokens they would have had (``HybridPlacement.remove_group``), within
``--migration-limit`` moves each; over real ZeroMQ sockets with fake worker groups."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

from interfaces import ErrorKind, GenerationStatus, SchedulerResult, SchedulerStatus
from interfaces.api_to_scheduler import SubmitRequest
from interfaces.handshake import PROTOCOL_VERSION
from interfaces.scheduler_to_api import MAX_GROUPS_AWAY, WORKER_DIED, WORKER_STALLED
from interfaces.scheduler_to_worker import ScheduledStep
from interfaces.worker_to_scheduler import WorkerOutput, WorkerReady
from scheduler.block_hash import extend_block_hashes
from scheduler.config import PlacementPolicy, SchedulerConfig
from scheduler.counters import SchedulerCounters
from scheduler.hybrid import HybridPlacement
from scheduler.placement import NO_WORKER
from scheduler.stranded import CANNOT_HOLD
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


ALTERNATING = {"placement": PlacementPolicy.LEAST_LOADED}
"""The placement ``spread_over_two_groups`` needs: requests alternate between the groups."""


def spread_over_two_groups(system, die_after_steps):
    """Groups a (slow; it dies after ``die_after_steps`` steps) and b, and ``PROMPTS`` of 30
    tokens each submitted, alternating (a system with ``ALTERNATING`` placement: r0 and r2 on
    a, r1 and r3 on b); returns (client, monitor, a, b)."""
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


@pytest.mark.parametrize("system", [ALTERNATING], indirect=True)
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


@pytest.mark.parametrize("system", [{"migration_limit": 0, **ALTERNATING}], indirect=True)
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


# -- the last group leaves: its requests wait for a group to serve again ------------------------


def lose_the_only_group(system):
    """Group a (it dies after 4 answered steps) with ``PROMPTS`` of 30 tokens each, then gone;
    returns (client, monitor) once the scheduler saw it go."""
    _, context, frontend, backend = system
    client, monitor = api_client(context, frontend), api_client(context, frontend)
    doomed = start_group(context, backend, monitor, "a", 1, die_after_steps=5)
    doomed.step_delay_s = 0.05
    for request_id, prompt in PROMPTS.items():
        client.send(encode(SubmitRequest(ctx(request_id, prompt, max_new_tokens=30))))
    doomed.join(5)
    deadline = time.monotonic() + 5
    while stats(monitor).workers_ready:
        assert time.monotonic() < deadline, "the scheduler did not see group a go"
        time.sleep(0.02)
    return client, monitor


@pytest.mark.parametrize("returning", ["a", "b"])
def test_the_only_groups_requests_and_new_ones_complete_on_the_group_that_serves_next(
    system, returning
):
    """Group a dies; its requests, and one submitted while no group serves, wait and then
    complete with exactly their tokens on a restarted a, or on a new group b."""
    _, context, _, backend = system
    client, monitor = lose_the_only_group(system)
    client.send(encode(SubmitRequest(ctx("late", [11, 12], max_new_tokens=30))))
    deadline = time.monotonic() + 5
    while (away := stats(monitor)).num_requests_waiting != 5:  # the 4 moved and the late one
        assert time.monotonic() < deadline, f"{away.num_requests_waiting} requests wait"
        time.sleep(0.02)
    assert (away.workers_ready, away.num_requests_running) == (False, 0)
    assert away.num_requests_waiting_by_role == {"hybrid": 5}
    assert [(g.name, g.reason) for g in away.groups_away] == [("a", "worker_died")]
    assert 0 <= away.groups_away[0].seconds < 60

    back = start_group(context, backend, monitor, returning, 1)
    prompts = {**PROMPTS, "late": [11, 12]}
    tokens, finals = collect(client, list(prompts))

    assert tokens == {rid: expected(prompt, 30) for rid, prompt in prompts.items()}
    assert {final.status for final in finals.values()} == {SchedulerStatus.COMPLETE}
    # Each moved request reached the group that serves now with the tokens a had produced (1
    # to 4: a answered 4 steps), to be recomputed there; the late one arrived with none.
    arrived = first_steps_of(back)
    assert sorted(arrived) == sorted(prompts) and arrived["late"] == []
    for rid, prompt in PROMPTS.items():
        assert 1 <= len(arrived[rid]) <= 4
        assert arrived[rid] == expected(prompt, len(arrived[rid]))
    after = stats(monitor)
    assert after.request_migrations_total == {
        "worker_died": 4,
        "worker_stalled": 0,
        "scheduler_restarted": 0,
    }
    assert sum(after.migration_pause_seconds_counts) == 4  # one pause per moved request
    assert after.migration_pause_seconds_sum > 0
    assert after.worker_restarts_total == (1 if returning == "a" else 0)
    assert [g.name for g in after.groups_away] == ([] if returning == "a" else ["a"])
    assert (after.num_requests_waiting, after.num_kv_blocks_used) == (0, 0)


@pytest.mark.parametrize("system", [{"worker_return_timeout_s": 1.0}], indirect=True)
def test_requests_no_group_comes_back_for_fail_naming_the_bound(system):
    client, monitor = lose_the_only_group(system)
    client.send(encode(SubmitRequest(ctx("late", [11, 12]))))
    tokens, finals = collect(client, [*PROMPTS, "late"])

    for final in finals.values():
        assert (final.status, final.error_kind, final.error) == (
            SchedulerStatus.CANCELLED,
            ErrorKind.UNAVAILABLE,
            "no worker group came back within 1 s",
        )
    assert tokens["late"] == []
    for rid, prompt in PROMPTS.items():  # what a streamed before it died, no more
        assert 1 <= len(tokens[rid]) <= 4
        assert tokens[rid] == expected(prompt, len(tokens[rid]))
    after = stats(monitor)
    assert (after.num_requests_waiting, after.groups_away) == (0, [])
    assert after.request_migrations_total["worker_died"] == 0  # none moved
    client.send(encode(SubmitRequest(ctx("later", [1]))))
    refusal = receive(client).results["later"]
    assert (refusal.error_kind, refusal.error) == (ErrorKind.UNAVAILABLE, NO_WORKER)


@pytest.mark.parametrize("system", [{"migration_limit": 0}], indirect=True)
def test_with_a_migration_limit_of_0_the_only_groups_requests_fail_at_once(system):
    client, monitor = lose_the_only_group(system)
    tokens, finals = collect(client, list(PROMPTS))
    for rid, final in finals.items():
        assert (final.status, final.error_kind, final.error) == (
            SchedulerStatus.CANCELLED,
            ErrorKind.UNAVAILABLE,
            DIED,
        )
        assert 1 <= len(tokens[rid]) <= 4
        assert tokens[rid] == expected(PROMPTS[rid], len(tokens[rid]))
    client.send(encode(SubmitRequest(ctx("late", [11, 12]))))
    refusal = receive(client).results["late"]
    assert (refusal.error_kind, refusal.error) == (ErrorKind.UNAVAILABLE, NO_WORKER)
    after = stats(monitor)
    assert (after.num_requests_waiting, after.groups_away) == (0, [])
    assert sum(after.request_migrations_total.values()) == 0


class PlacementDriver:
    """A ``HybridPlacement`` driven directly: groups served and steps answered by hand, each
    group's worker a fresh ``FakeTokenGenerator``; the results of client b"api" gathered.
    Requests alternate between groups (``ALTERNATING``) unless ``config`` says otherwise."""

    def __init__(self, **config) -> None:
        config = {"max_num_batched_tokens": 64, **ALTERNATING, **config}
        self.placement = HybridPlacement(SchedulerConfig(**config), SchedulerCounters())
        self.workers = WorkerGroups()
        self.generators: dict[str, FakeTokenGenerator] = {}
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finals: dict[str, SchedulerResult] = {}

    def serve(self, name: str, num_blocks: int = 64, block_size: int = 4) -> None:
        ready = WorkerReady(PROTOCOL_VERSION, "fake", num_blocks, block_size, 256, group=name)
        assert self.workers.register(name.encode(), ready).now_serving
        assert self.placement.add_group(self.workers.groups[name]) is None
        self.generators[name] = FakeTokenGenerator(block_size=block_size)

    def leave(self, name: str, cause: str) -> None:
        self.workers.remove(name)
        self.record(self.placement.remove_group(name, DIED, cause))

    def add(self, request_id: str, prompt: list[int], max_new_tokens: int, client=b"api"):
        return self.placement.add_request(ctx(request_id, prompt, max_new_tokens), client)

    def step(self, name: str) -> ScheduledStep:
        [(_, step)] = self.placement.schedule([name])
        output = WorkerOutput(step.step_id, self.generators[name].next_token(step))
        self.record(self.placement.update_from_output(name, output))
        self.placement.check_integrity()
        return step

    def record(self, results) -> None:
        for request_id, result in results.get(b"api", {}).items():
            if result.result is not None:
                self.tokens[request_id] += result.result.tokens
            if result.stop_stream:
                self.finals[request_id] = result


def test_while_no_group_serves_new_requests_wait_under_the_departed_groups_limits():
    driver = PlacementDriver(max_num_seqs=1, max_queued_requests=2)
    placement = driver.placement
    driver.serve("a")
    assert driver.add("r", [1, 2, 3], max_new_tokens=10) is None
    driver.step("a")
    driver.leave("a", "worker_stalled")
    assert driver.finals == {} and not placement.is_serving

    assert driver.add("w", [4, 5], max_new_tokens=5) is None
    assert driver.add("o", [6], max_new_tokens=5, client=b"other") is None
    too_long = driver.add("long", [7] * 256, max_new_tokens=1)  # a's context: 256
    assert (too_long.status, too_long.error_kind) == (
        SchedulerStatus.CANCELLED,
        ErrorKind.INVALID_REQUEST,
    )
    overloaded = driver.add("more", [8], max_new_tokens=5)  # 3 wait, 1 sequence slot
    assert overloaded.error_kind is ErrorKind.OVERLOADED
    in_use = driver.add("w", [9], max_new_tokens=5)
    assert in_use.error == "request id 'w' is already in use"
    assert placement.vocab_size == 0  # a's, unreported
    assert [placement.owner(rid) for rid in ("r", "w", "o", "long")] == [
        b"api",
        b"api",
        b"other",
        None,
    ]
    stats = placement.stats()
    assert (stats.num_requests_waiting, stats.num_requests_running) == (3, 0)
    assert (stats.num_requests_waiting_by_role, stats.workers_ready) == ({"hybrid": 3}, False)
    assert [(g.name, g.reason) for g in stats.groups_away] == [("a", "worker_stalled")]
    placement.check_integrity()

    assert placement.abort_client(b"other") == 1
    aborted = placement.abort_requests(["w", "unknown"])
    assert list(aborted[b"api"]) == ["w"]
    assert (aborted[b"api"]["w"].status, aborted[b"api"]["w"].error) == (
        SchedulerStatus.CANCELLED,
        None,
    )
    assert placement.stats().num_requests_waiting == 1

    now = time.monotonic()
    assert placement.check_timeouts(now + 59) == {}
    assert [g.name for g in placement.groups_away(now + 59)] == ["a"]
    failed = placement.check_timeouts(now + 61)
    assert list(failed[b"api"]) == ["r"]
    assert (failed[b"api"]["r"].error_kind, failed[b"api"]["r"].error) == (
        ErrorKind.UNAVAILABLE,
        "no worker group came back within 60 s",
    )
    assert placement.groups_away(now + 61) == []
    assert placement.owner("r") is None
    refused = driver.add("after", [1], max_new_tokens=5)
    assert (refused.error_kind, refused.error) == (ErrorKind.UNAVAILABLE, NO_WORKER)


@pytest.mark.parametrize("cause", ["worker_died", "worker_stalled"])
def test_moves_count_by_cause_and_the_group_that_serves_next_takes_what_it_can_hold(cause):
    """a leaves with ``cause``: m and big move to b at once. b, the last, dies: they moved as
    often as the limit allows and fail; s waits, with new_big that arrives meanwhile. c, with
    a smaller pool, serves next: s completes there with exactly its tokens, new_big fails."""
    driver = PlacementDriver(migration_limit=1)
    placement, counters = driver.placement, driver.placement.counters
    driver.serve("a")
    driver.serve("b")
    for request_id, prompt, max_new_tokens in (
        ("m", [1, 2], 10),
        ("s", [3], 10),
        ("big", [4] * 10, 30),
    ):
        assert driver.add(request_id, prompt, max_new_tokens) is None  # on a, b, a
    for name in ("a", "b"):
        driver.step(name)
    assert {rid: len(tokens) for rid, tokens in driver.tokens.items()} == {"m": 1, "s": 1, "big": 1}
    with pytest.raises(ValueError, match="unknown cause"):
        placement.remove_group("a", DIED, "bored")

    driver.leave("a", cause)
    assert counters.request_migrations == {
        "worker_died": 0,
        "worker_stalled": 0,
        "scheduler_restarted": 0,
    } | {cause: 2}
    driver.step("b")  # m and big recomputed there: their first tokens after the move
    assert sum(counters.migration_pause_seconds_counts) == 2
    assert counters.migration_pause_seconds_sum > 0

    driver.leave("b", "worker_died")
    assert {rid: driver.finals[rid].error for rid in driver.finals} == {"m": DIED, "big": DIED}
    assert driver.add("new_big", [5] * 10, max_new_tokens=30) is None  # fits b's pool
    driver.serve("c", num_blocks=8)  # 32 tokens: "new_big" may need 40
    driver.record(placement.check_timeouts())
    assert (driver.finals["new_big"].error_kind, driver.finals["new_big"].error) == (
        ErrorKind.UNAVAILABLE,
        CANNOT_HOLD,
    )
    while "s" not in driver.finals:
        driver.step("c")
    assert driver.tokens["s"] == expected([3], 10)
    assert driver.finals["s"].status is SchedulerStatus.COMPLETE
    moved_from_a = 2 if cause == "worker_died" else 0
    assert counters.request_migrations["worker_died"] == moved_from_a + 1  # s, adopted by c
    assert sum(counters.migration_pause_seconds_counts) == 3
    assert counters.worker_restarts == 0  # c is a new group
    assert [g.name for g in placement.groups_away()] == ["b", "a"]  # the newest first
    assert placement.groups["c"].scheduler.block_manager.num_used_blocks == 0

    driver.leave("c", "worker_died")
    driver.serve("c")
    assert counters.worker_restarts == 1
    assert [g.name for g in placement.stats().groups_away] == ["b", "a"]


def test_requests_that_wait_for_a_group_of_another_block_size_are_hashed_at_its_size():
    """The last group, with blocks of 4 tokens, leaves; the next to serve has blocks of 8. The
    moved requests' block hashes, of 4-token blocks, are dropped and computed again at 8: x and
    y, which share 8 prompt tokens, share one block there; z, which shares only 4 with them,
    none (under its old hashes it would take x's first block, whose last 4 tokens it does not
    have). Each completes with exactly its tokens, and a new request finds x's blocks."""
    driver = PlacementDriver()
    placement = driver.placement
    driver.serve("a")
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    prompts = {
        "x": [*shared, *range(20, 28)],
        "y": [*shared, *range(30, 38)],
        "z": [*shared[:4], *range(40, 52)],
    }
    for request_id, prompt in prompts.items():
        assert driver.add(request_id, prompt, max_new_tokens=10) is None
    driver.step("a")
    driver.step("a")
    driver.leave("a", "worker_died")

    driver.serve("c", block_size=8)
    first = driver.step("c")
    assert {new.context.request_id: new.num_computed_tokens for new in first.new_requests} == {
        "x": 0,
        "y": 8,
        "z": 0,
    }
    for request in placement.groups["c"].scheduler.requests.values():
        rehashed = []
        extend_block_hashes(rehashed, request.all_token_ids, 8, None)
        assert request.block_hashes == rehashed
    while len(driver.finals) < len(prompts):
        driver.step("c")
    assert driver.tokens == {rid: expected(prompt, 10) for rid, prompt in prompts.items()}
    assert {final.status for final in driver.finals.values()} == {SchedulerStatus.COMPLETE}

    assert driver.add("after", [*prompts["x"], 99], max_new_tokens=2) is None
    assert [new.num_computed_tokens for new in driver.step("c").new_requests] == [16]


def test_groups_away_are_the_newest_first_and_at_most_max_groups_away():
    """/health lists them and the launcher's parser takes at most ``MAX_GROUPS_AWAY``: the
    newest are reported (their departures remembered oldest first), none past the timeout."""
    placement = PlacementDriver().placement
    now = time.monotonic()
    placement.departures.record("expired", WORKER_DIED, now - 61)
    for index in range(MAX_GROUPS_AWAY + 10):
        cause = WORKER_STALLED if index % 2 else WORKER_DIED
        placement.departures.record(f"g{index}", cause, now - 30 + index / 100)
    away = placement.groups_away(now)
    assert [group.name for group in away] == [f"g{i}" for i in reversed(range(10, 266))]
    assert (away[0].reason, away[0].seconds) == (WORKER_STALLED, pytest.approx(30 - 2.65))
    reported = placement.stats().groups_away
    assert [(g.name, g.reason) for g in reported] == [(g.name, g.reason) for g in away]
