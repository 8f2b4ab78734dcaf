"""A prefill or decode group that leaves costs its requests a pause, not an error: each one it
held is queued again with the tokens it streamed, computed again on a prefill group, and handed
to a decode group, and streams exactly the tokens it would have streamed undisturbed.

The groups are model-free (``FakeTokenGenerator``: the next token is a function of every token
so far), so a lost, repeated or reordered token changes every token after it.
"""

from __future__ import annotations

import time

import pytest

from interfaces import ErrorKind, SchedulerStatus, TextContext
from interfaces.scheduler_to_api import WORKER_DIED
from interfaces.scheduler_to_worker import KVTransfers
from interfaces.worker_to_scheduler import WorkerRole
from scheduler.placement import NO_WORKER
from scheduler.split_request import Phase
from tests.support.fake_worker import next_token_for
from tests.support.placement_cluster import VOCAB_SIZE, PlacementCluster

PREFILL, DECODE = WorkerRole.PREFILL, WorkerRole.DECODE
PROMPTS = {f"r{i}": [(7 * i + j) % 50 + 1 for j in range(5 + 6 * i)] for i in range(5)}
"""5 to 29 tokens: with 8 tokens a step, the longer ones prefill in chunks."""
MAX_NEW_TOKENS = 6
DIED = "the worker serving this request died"


def undisturbed(prompt: list[int], num_tokens: int = MAX_NEW_TOKENS) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(next_token_for(tokens))
    return tokens[len(prompt) :]


def submit_all(cluster: PlacementCluster) -> None:
    for request_id, prompt in PROMPTS.items():
        cluster.submit(request_id, prompt, MAX_NEW_TOKENS)


def phases(cluster: PlacementCluster) -> set[Phase]:
    return {split.phase for split in cluster.placement.requests.values()}


def assert_all_undisturbed(cluster: PlacementCluster) -> None:
    assert cluster.tokens == {r: undisturbed(prompt) for r, prompt in PROMPTS.items()}
    assert set(cluster.used_blocks().values()) == {0}
    assert cluster.placement.requests == {} and not cluster.placement.queue


@pytest.mark.parametrize("steps_before", range(8))
@pytest.mark.parametrize("dead", ["d", "p"])
def test_a_dead_groups_requests_finish_on_the_survivors_with_their_undisturbed_tokens(
    dead, steps_before
):
    """Killed after 0 to 7 rounds: requests queued, prefilling in chunks, transferring and
    decoding; each moves as often as it must and no request fails."""
    cluster = PlacementCluster({"p": PREFILL, "p2": PREFILL, "d": DECODE, "d2": DECODE})
    submit_all(cluster)
    for _ in range(steps_before):
        cluster.step()
    assert cluster.remove(dead) == {}
    cluster.placement.check_integrity()
    cluster.run()
    assert_all_undisturbed(cluster)


def test_requests_in_every_phase_move_and_the_counters_say_so():
    cluster = PlacementCluster({"p": PREFILL, "d": DECODE, "d2": DECODE})
    submit_all(cluster)
    cluster.step()
    cluster.deliver_transfers = False  # those handed off from now on stay in transfer
    cluster.step()
    assert phases(cluster) >= {Phase.PREFILL, Phase.TRANSFER, Phase.DECODE}
    held = [s.request_id for s in cluster.placement.requests.values() if s.decode == "d"]
    transferring = [
        s.transfer_id
        for s in cluster.placement.requests.values()
        if s.decode == "d2" and s.phase is Phase.TRANSFER
    ]
    assert held

    assert cluster.remove("d") == {}
    counters = cluster.placement.counters
    assert counters.request_migrations[WORKER_DIED] == len(held)
    queued = list(cluster.placement.queue)
    assert [split.request_id for split in queued[: len(held)]] == held  # at the front, in order
    assert all(split.num_migrations == 1 for split in queued[: len(held)])
    assert cluster.remove("p") == {}  # the prefill side dies too: transfers are lost
    news = [m for name, m in cluster.placement.messages if isinstance(m, KVTransfers)]
    assert sorted(t for m in news for t in m.cancel) == sorted(transferring)
    moved = {s.request_id for s in cluster.placement.requests.values() if s.num_migrations}
    assert moved > set(held)
    cluster.serve("p", PREFILL)
    cluster.deliver_transfers = True
    cluster.run()
    assert_all_undisturbed(cluster)
    assert counters.worker_restarts == 1
    assert sum(counters.migration_pause_seconds_counts) == len(moved)  # one pause each


def test_a_moved_request_brings_the_tokens_it_streamed_and_no_prompt_logprobs_again():
    cluster = PlacementCluster({"p": PREFILL, "d": DECODE, "d2": DECODE})
    context = TextContext("r", PROMPTS["r1"], len(PROMPTS["r1"]) + 10, prompt_logprobs=2)
    assert cluster.placement.add_request(context, b"client") is None
    while len(cluster.tokens.get("r", [])) < 4:
        cluster.step()
    split = cluster.placement.requests["r"]
    cluster.remove(split.decode)
    assert split.phase is Phase.QUEUED
    assert split.context.generated_token_ids == cluster.tokens["r"]
    assert split.context.prompt_logprobs is None
    cluster.run()
    assert cluster.tokens["r"] == undisturbed(PROMPTS["r1"], 10)


def test_the_only_decode_groups_requests_and_new_ones_wait_for_it_to_serve_again():
    cluster = PlacementCluster({"p": PREFILL, "d": DECODE})
    submit_all(cluster)
    for _ in range(4):
        cluster.step()
    assert cluster.remove("d") == {}
    assert not cluster.placement.is_serving and cluster.placement.accepts_requests
    late = [3, 1, 4, 1, 5]
    cluster.submit("late", late, MAX_NEW_TOKENS)  # waits with them
    stats = cluster.placement.stats()
    assert [group.name for group in stats.groups_away] == ["d"]
    assert stats.num_requests_waiting == len(PROMPTS) + 1
    for _ in range(3):
        assert cluster.step() == {}  # the prefill group computes nothing nobody can decode
    cluster.serve("d", DECODE)
    cluster.run()
    assert cluster.tokens.pop("late") == undisturbed(late)
    assert_all_undisturbed(cluster)
    assert cluster.placement.counters.worker_restarts == 1
    assert cluster.placement.check_timeouts(time.monotonic() + 3600) == {}


def test_requests_no_group_comes_back_for_fail_naming_the_bound():
    cluster = PlacementCluster({"p": PREFILL, "d": DECODE}, worker_return_timeout_s=5)
    submit_all(cluster)
    for _ in range(3):
        cluster.step()
    splits = cluster.placement.requests.values()
    decoding = {split.request_id for split in splits if split.phase is Phase.DECODE}
    assert cluster.remove("p") == {}  # ...those decoding go on meanwhile
    assert cluster.placement.check_timeouts(time.monotonic() + 1) == {}
    results = cluster.placement.check_timeouts(time.monotonic() + 5)[b"client"]
    failed = set(PROMPTS) - decoding
    assert set(results) == failed and failed
    assert {(r.status, r.error_kind, r.error) for r in results.values()} == {
        (SchedulerStatus.CANCELLED, ErrorKind.UNAVAILABLE, "no worker group came back within 5 s")
    }
    refused = cluster.placement.add_request(TextContext("new", [1, 2], 10), b"client")
    assert (refused.error_kind, refused.error) == (ErrorKind.UNAVAILABLE, NO_WORKER)
    cluster.run()
    assert {r: cluster.tokens[r] for r in decoding} == {
        r: undisturbed(PROMPTS[r]) for r in decoding
    }


def decode_group_of(cluster: PlacementCluster, request_id: str) -> str:
    """Step until ``request_id`` decodes; the name of its decode group."""
    for _ in range(50):
        split = cluster.placement.requests[request_id]
        if split.phase is Phase.DECODE:
            return split.decode
        cluster.step()
    raise AssertionError(f"{request_id} did not decode")


def test_a_request_that_would_move_past_the_limit_fails_and_the_others_move():
    cluster = PlacementCluster({"p": PREFILL, "d": DECODE, "d2": DECODE}, migration_limit=1)
    submit_all(cluster)
    first = decode_group_of(cluster, "r0")
    assert cluster.remove(first) == {}  # r0 moves once...
    cluster.serve(first, DECODE)
    second = decode_group_of(cluster, "r0")
    held = [s for s in cluster.placement.requests.values() if s.decode == second]
    moved_already = {split.request_id for split in held if split.num_migrations}
    results = cluster.remove(second)  # ...and not twice
    assert set(results) == moved_already and "r0" in moved_already
    assert {(r.status, r.error_kind, r.error) for r in results.values()} == {
        (SchedulerStatus.CANCELLED, ErrorKind.UNAVAILABLE, DIED)
    }
    for split in held:  # the others moved now
        assert split.request_id in results or split.num_migrations == 1
    cluster.run()
    for request_id in set(PROMPTS) - set(results):
        assert cluster.tokens[request_id] == undisturbed(PROMPTS[request_id])
    assert set(cluster.used_blocks().values()) == {0}


def test_a_stale_failed_step_does_not_fail_the_request_that_moved_back_to_its_group():
    """A prefill step in flight for ``r`` when ``r``'s decode group died: ``r`` is queued
    again and goes back to the same prefill group, where it waits; the old step then fails
    as a whole. Only requests that ran in it fail, not the new ``r``."""
    cluster = PlacementCluster({"p": PREFILL, "d": DECODE, "d2": DECODE})
    cluster.submit("r", PROMPTS["r4"], MAX_NEW_TOKENS)  # 29 tokens: 4 chunks of 8
    ((name, step),) = cluster.placement.schedule(["p"])
    assert name == "p" and list(step.num_scheduled_tokens) == ["r"]
    cluster.remove(cluster.placement.requests["r"].decode)
    assert cluster.placement.schedule([]) == []  # queued again on "p", behind its busy step
    assert cluster.placement.requests["r"].phase is Phase.PREFILL
    assert cluster.placement.fail_step("p", step, "the worker failed") == {}
    cluster.run()
    assert cluster.tokens["r"] == undisturbed(PROMPTS["r4"])


def test_while_no_group_serves_the_queue_is_checked_and_counted_as_before():
    cluster = PlacementCluster({"p": PREFILL, "d": DECODE})
    submit_all(cluster)
    cluster.remove("d")
    cluster.remove("p")
    placement = cluster.placement
    assert placement.accepts_requests and placement.vocab_size == VOCAB_SIZE
    stats = placement.stats()
    assert stats.num_requests_waiting == len(PROMPTS)
    assert stats.num_requests_waiting_by_role == {"prefill": len(PROMPTS), "decode": 0}
    assert {group.name for group in stats.groups_away} == {"d", "p"}


def test_with_no_time_to_wait_the_last_groups_requests_fail_as_before():
    cluster = PlacementCluster({"p": PREFILL, "d": DECODE}, worker_return_timeout_s=0)
    submit_all(cluster)
    cluster.step()
    results = cluster.remove("d")
    assert set(results) == set(PROMPTS)
    assert not any(cluster.placement.counters.request_migrations.values())
    assert not cluster.placement.accepts_requests and cluster.placement.requests == {}


def test_a_request_submitted_again_with_its_tokens_counts_one_scheduler_restart_and_moves():
    cluster = PlacementCluster({"p": PREFILL, "d": DECODE, "d2": DECODE})
    prompt, streamed = PROMPTS["r2"], undisturbed(PROMPTS["r2"], 3)
    # An API server submits it so after a scheduler restart.
    maximum = len(prompt) + MAX_NEW_TOKENS
    context = TextContext("again", prompt, maximum, generated_token_ids=streamed)
    assert cluster.placement.add_request(context, b"client") is None
    cluster.step()
    split = cluster.placement.requests["again"]
    cluster.remove(split.decode)
    cluster.run()
    assert streamed + cluster.tokens["again"] == undisturbed(prompt)
    migrations = cluster.placement.counters.request_migrations
    assert migrations == {"scheduler_restarted": 1, WORKER_DIED: 1, "worker_stalled": 0}
