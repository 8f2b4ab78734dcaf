"""Which group a request goes to (``scheduler.group_choice``): by cache and load, exactly."""

from __future__ import annotations

import msgspec
import pytest

from interfaces.handshake import PROTOCOL_VERSION
from interfaces.scheduler_to_worker import ScheduledStep
from interfaces.worker_to_scheduler import WorkerReady, WorkerRole
from scheduler.config import KVCacheConfig, PlacementPolicy, SchedulerConfig
from scheduler.group_choice import (
    BALANCE_RATIO,
    BALANCE_SLACK,
    choose_decode_group,
    choose_group,
    context_block_hashes,
    placement_cost,
    work_before_first_token,
)
from scheduler.placement import ServedGroup
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.support.placement_cluster import PlacementCluster
from tests.support.scheduler_sockets import ctx

BLOCK_SIZE = 4
CACHE_AWARE, LEAST_LOADED = PlacementPolicy.CACHE_AWARE, PlacementPolicy.LEAST_LOADED
SYSTEM = list(range(100, 164))
"""A 64-token shared prefix (16 blocks)."""


def group(name: str, num_blocks: int = 256, role: WorkerRole = WorkerRole.HYBRID) -> ServedGroup:
    config = SchedulerConfig(max_num_batched_tokens=64)
    ready = WorkerReady(PROTOCOL_VERSION, "fake", num_blocks, BLOCK_SIZE, 1024, group=name)
    scheduler = Scheduler(config, KVCacheConfig(num_blocks, BLOCK_SIZE, 1024))
    return ServedGroup(name, role, ready, 1, [], scheduler)


def cache(served: ServedGroup, tokens: list[int]) -> None:
    """Leave ``tokens``' full blocks in ``served``'s prefix cache, held by no request (as a
    finished request leaves them)."""
    block_manager = served.scheduler.block_manager
    request = Request(ctx("warm", tokens), b"api", 1024)
    assert block_manager.allocate_slots(request, len(tokens)) is not None
    request.num_computed_tokens = len(tokens)
    block_manager.cache_full_blocks(request)
    block_manager.free(request)


def queue(served: ServedGroup, request_id: str, tokens: list[int]) -> None:
    assert served.scheduler.add_request(ctx(request_id, tokens), b"api") is None


def test_a_follow_up_turn_goes_where_its_history_is_cached_though_that_group_holds_more():
    a, b = group("a"), group("b")
    history = [*SYSTEM, *range(1, 41)]
    cache(b, history)
    queue(b, "other", [7] * 8)  # b holds one request more than a
    follow_up = ctx("turn-2", [*history, 500, 501, 502])

    assert choose_group([a, b], follow_up, CACHE_AWARE) is b
    assert choose_group([a, b], follow_up, LEAST_LOADED) is a
    hashes = context_block_hashes(follow_up, BLOCK_SIZE)
    num_tokens = len(follow_up.prompt_token_ids)
    assert work_before_first_token(a.scheduler, num_tokens, hashes) == num_tokens
    # b computes the 8 queued tokens and the 3 new ones past the 104 cached: 11 (one step)
    assert work_before_first_token(b.scheduler, num_tokens, hashes) == 8 + 3


def test_a_request_follows_its_cache_unless_the_queue_there_is_twice_what_the_cache_saves():
    """b holds 40 tokens of the request's history; a longer queue at b costs the request more
    wait than recomputing them at a would (60 > 40), but recomputing them is work a adds for
    everyone after it too: it stays with its cache until b's queue is over 80 tokens longer."""
    history = list(range(1, 41))
    request = ctx("turn", [*history, 77, 78, 79, 80])  # 44 tokens, 40 cached at b
    for num_queued, expected in ((60, "b"), (76, "b"), (84, "a")):
        a, b = group("a"), group("b")
        cache(b, history)
        queue(a, "other", [5] * 4)
        queue(b, "long", [6] * (num_queued + 4))
        hashes = context_block_hashes(request, BLOCK_SIZE)
        costs = [placement_cost(g.scheduler, 44, hashes) for g in (a, b)]
        assert costs == [4 + 44 + 44, 4 + num_queued + 4 + 4], num_queued
        assert choose_group([a, b], request, CACHE_AWARE).name == expected, num_queued


def test_with_nothing_cached_the_request_goes_where_the_least_work_is_queued():
    a, b = group("a"), group("b")
    queue(a, "long", [1] * 200)
    for i in range(2):
        queue(b, f"short{i}", [2] * 10)
    request = ctx("new", [3] * 20)

    assert choose_group([a, b], request, CACHE_AWARE) is b  # 20 tokens queued, not 200
    assert choose_group([a, b], request, LEAST_LOADED) is a  # 1 request, not 2


def test_queued_requests_count_only_the_tokens_not_cached_when_they_were_queued():
    """A group holding a hot prefix and requests queued behind it that share it does not look
    busier than it is: each queued request counts its uncached tokens, not all of them."""
    home, other = group("home"), group("other")
    cache(home, SYSTEM)
    for i in range(2):
        queue(home, f"q{i}", [*SYSTEM, 900 + i, 901, 902, 903])  # 4 tokens past the prefix each
    assert home.scheduler.num_tokens_ahead() == 2 * 4
    assert home.scheduler.num_waiting_tokens == 2 * 68
    follow_up = ctx("next", [*SYSTEM, 1, 2, 3, 4])
    assert choose_group([home, other], follow_up, CACHE_AWARE) is home
    logprobs = msgspec.structs.replace(follow_up, prompt_logprobs=0)  # finds nothing cached
    hashes = context_block_hashes(logprobs, BLOCK_SIZE)
    assert work_before_first_token(home.scheduler, 68, hashes) == 8 + 4
    assert choose_group([home, other], logprobs, CACHE_AWARE) is other


def test_running_requests_count_one_token_per_step_until_the_first_token():
    a, b = group("a"), group("b")
    for i in range(3):
        queue(a, f"r{i}", [1, 2])
    a.scheduler.schedule()  # all three run: each decodes a token in every later step
    hashes = context_block_hashes(ctx("x", [5] * 100), BLOCK_SIZE)
    # 100 new tokens take 2 steps of 64; each step decodes 3 running requests' tokens too
    assert work_before_first_token(a.scheduler, 100, hashes) == 100 + 3 * 2
    assert work_before_first_token(b.scheduler, 100, hashes) == 100


def test_a_group_without_free_blocks_for_the_prompt_costs_the_blocks_it_must_free_first():
    small, large = group("small", num_blocks=8), group("large")
    queue(small, "holder", [1] * 24)
    small.scheduler.schedule()  # 24 tokens in 6 of its 8 blocks, plus one for the next
    hashes = context_block_hashes(ctx("x", [9] * 16), BLOCK_SIZE)
    num_short = 4 - small.scheduler.block_manager.num_free_blocks
    assert num_short > 0
    expected = 16 + 1 + num_short * BLOCK_SIZE  # the prompt, the holder's decode, the blocks
    assert work_before_first_token(small.scheduler, 16, hashes) == expected
    assert choose_group([small, large], ctx("x", [9] * 16), CACHE_AWARE) is large


def test_a_hot_prefix_cached_on_one_group_does_not_draw_every_request_there():
    """Requests sharing a prefix cached on a go there until a holds more than the balance
    bound; then b takes one, caches the prefix too, and the two stay balanced."""
    a, b = group("a"), group("b")
    cache(a, SYSTEM)
    placed = {"a": 0, "b": 0}
    for i in range(40):
        request = ctx(f"q{i}", [*SYSTEM, 1000 + i, 2000 + i])
        chosen = choose_group([a, b], request, CACHE_AWARE)
        queue(chosen, request.request_id, list(request.prompt_token_ids))
        placed[chosen.name] += 1
        if chosen is b and not b.scheduler.block_manager.num_cached_blocks:
            cache(b, SYSTEM)  # its first request's prompt computed
        least = min(a.load, b.load)
        assert max(a.load, b.load) <= max(least * BALANCE_RATIO, least + BALANCE_SLACK) + 1
    assert max(placed.values()) <= 1.5 * min(placed.values())
    assert placed["b"] >= 1


def test_the_first_of_several_groups_is_chosen_alone_and_one_group_always_serves():
    only = group("only")
    assert choose_group([only], ctx("x", [1, 2, 3]), CACHE_AWARE) is only


@pytest.mark.parametrize("policy", [CACHE_AWARE, LEAST_LOADED])
def test_decode_groups_are_chosen_by_free_blocks_within_the_balance_bound(policy):
    roomy, busy = group("roomy", 512, WorkerRole.DECODE), group("busy", 256, WorkerRole.DECODE)
    for i in range(6):
        queue(roomy, f"r{i}", [1, 2])
    chosen = choose_decode_group([roomy, busy], policy)
    # Least-loaded takes the most free blocks; cache-aware first keeps loads within the bound
    # (roomy holds 6 requests, busy none).
    assert chosen is (busy if policy is CACHE_AWARE else roomy)


def first_groups(cluster: PlacementCluster) -> dict[str, str]:
    """The group whose step first computed each request (for a split request: its prefill)."""
    firsts: dict[str, str] = {}
    for name, message in cluster.sent:
        if isinstance(message, ScheduledStep):
            for new in message.new_requests:
                firsts.setdefault(new.context.request_id, name)
    return firsts


@pytest.mark.parametrize(
    "roles",
    [
        {"h0": WorkerRole.HYBRID, "h1": WorkerRole.HYBRID},
        {"p0": WorkerRole.PREFILL, "p1": WorkerRole.PREFILL, "d": WorkerRole.DECODE},
    ],
    ids=["hybrid", "disaggregated"],
)
def test_each_sessions_next_turn_is_computed_where_its_history_is_cached(roles):
    """Four chat sessions' first turns spread over the two groups; every second turn (the
    first turn, its answer and a new message) goes back to its first turn's group and finds
    the history there, and the per-group stats count those hits."""
    cluster = PlacementCluster(roles, num_blocks=256)
    first_turns = {f"s{i}": [50 * i + j for j in range(1, 22)] for i in range(4)}
    for session, prompt in first_turns.items():
        cluster.submit(f"{session}-1", prompt)
    tokens = cluster.run()
    for session, prompt in first_turns.items():
        cluster.submit(f"{session}-2", [*prompt, *tokens[f"{session}-1"], 7, 8, 9])
    cluster.run()

    firsts = first_groups(cluster)
    assert {firsts[f"{session}-1"] for session in first_turns} == set(roles) - {"d"}
    for session in first_turns:
        assert firsts[f"{session}-2"] == firsts[f"{session}-1"]
    # Two sessions each, whose second turns of 30 tokens find the first turns' full blocks: a
    # hybrid group computed the prompt and 5 of the 6 answer tokens (24 tokens in full
    # blocks), a prefill group the prompt alone (20; the answer was decoded elsewhere).
    num_cached = 20 if "d" in roles else 24
    stats = {group.name: group for group in cluster.placement.stats().groups}
    for name in set(roles) - {"d"}:
        assert stats[name].prefix_cache_hits_total == 2 * num_cached
