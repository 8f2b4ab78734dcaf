"""The scheduler's event loop over real ZeroMQ sockets, with a fake worker and fake API servers."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from interfaces import (
    ErrorKind,
    GenerationStatus,
    ImageMetadata,
    SchedulerStatus,
    SharedMemoryArray,
)
from interfaces.api_to_scheduler import (
    MAX_API_MESSAGE_BYTES,
    AbortRequests,
    StatsRequest,
    SubmitRequest,
)
from interfaces.scheduler_to_api import MIGRATION_REASONS, GroupStats, SchedulerStats
from tests.support.hostile import hostile_frames
from tests.support.scheduler_sockets import (
    FakeWorkerThread,
    api_client,
    collect,
    ctx,
    encode,
    expected,
    receive,
    start_worker,
    stats,
)

NO_MIGRATIONS = dict.fromkeys(MIGRATION_REASONS, 0)
FAIL_FAST = {"worker_return_timeout_s": 0}
"""Requests of the last group that dies fail at once instead of waiting for it to return."""


def test_requests_from_two_api_servers_are_routed_back_to_their_owner(system):
    server, context, frontend, backend = system
    first, second = api_client(context, frontend), api_client(context, frontend)
    worker = start_worker(context, backend, first)
    first.send(encode(SubmitRequest(ctx("a", [1, 2, 3]))))
    second.send(encode(SubmitRequest(ctx("b", [4, 5]))))

    tokens_a, finals_a = collect(first, ["a"])
    tokens_b, finals_b = collect(second, ["b"])
    assert finals_b["b"].result.tokens == tokens_b["b"][-1:]
    assert tokens_a == {"a": expected([1, 2, 3], 5)}
    assert tokens_b == {"b": expected([4, 5], 5)}
    assert finals_a["a"].status is SchedulerStatus.COMPLETE
    assert finals_a["a"].result.final_status is GenerationStatus.MAXIMUM_LENGTH

    first.send(encode(StatsRequest()))
    stats = receive(first)
    # Each prompt once, then one token per request per later step; every step computed 1-8.
    assert stats.iteration_tokens_sum == 3 + 4 + 2 + 4
    counts = stats.iteration_tokens_counts
    assert sum(counts[2:]) == 0 and sum(counts) >= 5
    no_steps = [0] * len(counts)
    without_steps = msgspec.structs.replace(
        stats, iteration_tokens_counts=no_steps, iteration_tokens_sum=0
    )
    assert without_steps == SchedulerStats(
        0,
        0,
        64,
        0,
        workers_ready=True,
        prefix_cache_queries_total=5,
        prefix_cache_hits_total=0,
        num_requests_running_by_role={"hybrid": 0},
        num_requests_waiting_by_role={"hybrid": 0},
        request_migrations_total=NO_MIGRATIONS,
        groups=[GroupStats(stats.groups[0].name, "hybrid", 0, 0, 64, 0, 5, 0)],
    )
    server.stop()
    assert worker.got_shutdown.wait(5)


def test_without_a_worker_requests_are_refused_as_unavailable(system):
    _, context, frontend, _ = system
    client = api_client(context, frontend)
    client.send(encode(SubmitRequest(ctx("a", [1]))))
    refusal = receive(client).results["a"]
    assert (refusal.status, refusal.error_kind) == (
        SchedulerStatus.CANCELLED,
        ErrorKind.UNAVAILABLE,
    )
    assert refusal.error == "no worker is ready to serve requests"
    assert stats(client) == SchedulerStats(
        0, 0, 0, 0, workers_ready=False, request_migrations_total=NO_MIGRATIONS
    )


def test_abort_cancels_and_frees(system):
    _, context, frontend, backend = system
    client = api_client(context, frontend)
    start_worker(context, backend, client)
    client.send(encode(SubmitRequest(ctx("long", [1, 2], max_new_tokens=200))))
    first = receive(client)
    assert first.results["long"].status is SchedulerStatus.ACTIVE
    client.send(encode(AbortRequests(["long"])))
    _, finals = collect(client, ["long"])
    assert finals["long"].status is SchedulerStatus.CANCELLED
    assert finals["long"].error is None
    after = stats(client)
    assert (after.num_requests_running, after.num_kv_blocks_used) == (0, 0)


def test_worker_failure_fails_only_that_steps_requests_with_a_generic_error(system):
    """The worker's error text may name any request of the step: it goes to the logs only."""
    _, context, frontend, backend = system
    client = api_client(context, frontend)
    start_worker(context, backend, client, fail_request_ids={"bad"})
    client.send(encode(SubmitRequest(ctx("bad", [3, 3]))))
    _, finals = collect(client, ["bad"])
    assert finals["bad"].status is SchedulerStatus.CANCELLED
    assert finals["bad"].error == "the worker failed while running this request's batch"
    assert finals["bad"].error_kind is ErrorKind.INTERNAL
    client.send(encode(SubmitRequest(ctx("good", [5]))))
    tokens, _ = collect(client, ["good"])
    assert tokens == {"good": expected([5], 5)}


def test_too_long_request_is_rejected_with_an_error(system):
    _, context, frontend, backend = system
    client = api_client(context, frontend)
    start_worker(context, backend, client)
    client.send(encode(SubmitRequest(ctx("huge", [1] * 300))))
    _, finals = collect(client, ["huge"])
    assert "context length is 256" in finals["huge"].error
    assert finals["huge"].error_kind is ErrorKind.INVALID_REQUEST


def test_periodic_work_that_raises_is_logged_and_the_loop_serves_on(system, monkeypatch, caplog):
    """``check_timeouts``, run by the loop itself each iteration, raises once: the error is
    logged with its traceback, the loop goes on, and a request submitted after is served."""
    server, context, frontend, backend = system
    client = api_client(context, frontend)
    start_worker(context, backend, client)
    placement, raised = server.placement, threading.Event()
    check_timeouts = placement.check_timeouts

    def check_timeouts_raising_once(now=None):
        if not raised.is_set():
            raised.set()
            raise RuntimeError("a broken deadline")
        return check_timeouts(now)

    monkeypatch.setattr(placement, "check_timeouts", check_timeouts_raising_once)
    assert raised.wait(5)
    client.send(encode(SubmitRequest(ctx("after", [1, 2, 3]))))
    tokens, finals = collect(client, ["after"])
    assert tokens == {"after": expected([1, 2, 3], 5)}
    assert finals["after"].status is SchedulerStatus.COMPLETE
    assert server.placement is placement  # the same placement served it
    [record] = [r for r in caplog.records if r.exc_info is not None]
    assert (record.getMessage(), str(record.exc_info[1])) == (
        "_check_timeouts raised; serving on",
        "a broken deadline",
    )


def test_the_scheduler_process_never_imports_torch():
    code = (
        "import sys, scheduler.__main__, scheduler.server\n"
        "heavy = sorted({'torch', 'transformers'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)


def test_hostile_frames_on_both_sockets_are_dropped_and_nothing_runs(system, tmp_path, caplog):
    _, context, frontend, backend = system
    marker = tmp_path / "unpickled"
    intruder_api, intruder_worker = api_client(context, frontend), api_client(context, backend)
    client = api_client(context, frontend)
    for frame in hostile_frames(marker):
        intruder_api.send(frame)
        intruder_worker.send(frame)
    intruder_api.send_multipart([b"two", b"frames"])
    # Above the frontend's frame size limit (64 MiB): the link is dropped, nothing is read. (On
    # the backend, whose limit is 256 MiB, it was read, and its drop was counted or not
    # depending on whether it arrived before the request below finished.)
    intruder_api.send(bytes(MAX_API_MESSAGE_BYTES + (1 << 20)))
    start_worker(context, backend, client)
    client.send(encode(SubmitRequest(ctx("ok", [7, 8]))))
    tokens, _ = collect(client, ["ok"])
    assert tokens == {"ok": expected([7, 8], 5)}
    assert not marker.exists()
    drops = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dropped")]
    assert len(drops) == 2 * len(hostile_frames(marker)) + 1


@pytest.mark.parametrize("system", [FAIL_FAST], indirect=True)
def test_a_worker_that_dies_fails_every_request_and_new_ones_until_another_registers(system):
    _, context, frontend, backend = system
    client = api_client(context, frontend)
    worker = start_worker(context, backend, client, die_after_steps=3)
    client.send(encode(SubmitRequest(ctx("a", [1, 2], max_new_tokens=50))))
    client.send(encode(SubmitRequest(ctx("b", [3], max_new_tokens=50))))
    _, finals = collect(client, ["a", "b"])
    worker.join(5)
    for final in finals.values():
        assert (final.status, final.error_kind) == (
            SchedulerStatus.CANCELLED,
            ErrorKind.UNAVAILABLE,
        )
        assert final.error == "the worker serving this request died"
    after_death = stats(client)
    # No worker: nothing runs; the counters of the 3 steps taken outlive the worker (how many
    # tokens they held depends on whether "b" arrived in time for the first).
    assert sum(after_death.iteration_tokens_counts) == 3
    assert after_death.iteration_tokens_sum >= after_death.prefix_cache_queries_total >= 2
    assert msgspec.structs.replace(
        after_death,
        iteration_tokens_counts=[0] * 14,
        iteration_tokens_sum=0,
        prefix_cache_queries_total=0,
    ) == SchedulerStats(0, 0, 0, 0, workers_ready=False, request_migrations_total=NO_MIGRATIONS)
    client.send(encode(SubmitRequest(ctx("c", [4]))))
    assert receive(client).results["c"].error_kind is ErrorKind.UNAVAILABLE

    start_worker(context, backend, client)
    client.send(encode(SubmitRequest(ctx("d", [5]))))
    tokens, _ = collect(client, ["d"])
    assert tokens == {"d": expected([5], 5)}
    # "d" alone: its one prompt token, then one token in each of 4 more steps.
    assert stats(client).iteration_tokens_sum == after_death.iteration_tokens_sum + 1 + 4


def test_an_api_server_that_goes_away_has_its_requests_aborted_and_freed(system):
    _, context, frontend, backend = system
    survivor, doomed = api_client(context, frontend), api_client(context, frontend)
    start_worker(context, backend, survivor)
    doomed.send(encode(SubmitRequest(ctx("gone-1", [1, 2], max_new_tokens=200))))
    doomed.send(encode(SubmitRequest(ctx("gone-2", [3, 4], max_new_tokens=200))))
    assert receive(doomed).results  # running
    doomed.close(linger=0)
    for _ in range(100):
        after = stats(survivor)
        if after.num_requests_running == 0:
            break
        time.sleep(0.02)
    assert (after.num_requests_running, after.num_requests_waiting) == (0, 0)
    assert after.num_kv_blocks_used == 0
    survivor.send(encode(SubmitRequest(ctx("mine", [9]))))
    tokens, _ = collect(survivor, ["mine"])
    assert tokens == {"mine": expected([9], 5)}


@pytest.mark.parametrize("system", [FAIL_FAST], indirect=True)
def test_a_tensor_parallel_group_gets_every_step_and_ends_when_any_rank_dies(system):
    _, context, frontend, backend = system
    client = api_client(context, frontend)
    rank_1 = FakeWorkerThread(context, backend, die_after_steps=4, rank=1, tensor_parallel_size=2)
    rank_1.start()
    client.send(encode(SubmitRequest(ctx("early", [1]))))
    assert receive(client).results["early"].error_kind is ErrorKind.UNAVAILABLE  # rank 0 missing
    rank_0 = start_worker(context, backend, client, rank=0, tensor_parallel_size=2)

    client.send(encode(SubmitRequest(ctx("a", [1, 2], max_new_tokens=50))))
    tokens, finals = collect(client, ["a"])
    rank_1.join(5)
    assert finals["a"].error == "the worker serving this request died"
    assert rank_0.got_shutdown.wait(5)  # the group is over: the survivor is told to stop
    # Every step rank 1 lived to see went to rank 0 too, in the same order. The disconnect is
    # reported by a socket monitor, asynchronously, so rank 0 may get one more step before the
    # scheduler learns rank 1 is gone; that step's answer is dropped, never streamed.
    sent_to_both = len(rank_1.steps)
    assert sent_to_both == 4
    assert rank_0.steps[:sent_to_both] == rank_1.steps
    assert len(rank_0.steps) <= sent_to_both + 1
    assert 1 <= len(tokens["a"]) <= sent_to_both  # answered by rank 0 until rank 1 died
    assert not stats(client).workers_ready


def image_ctx(request_id, prompt, max_new_tokens=5):
    """``ctx`` with one image (a fresh shared-memory segment) over prompt positions 1-2."""
    pixels = SharedMemoryArray.create(np.full((3, 2, 2), len(request_id), dtype=np.float32))
    image = ImageMetadata(1, 3, pixels, image_hash=request_id)
    context = ctx(request_id, prompt, max_new_tokens)
    return msgspec.structs.replace(context, images=[image]), pixels


def segment_exists(segment: SharedMemoryArray) -> bool:
    return Path("/dev/shm", segment.name).exists()


def wait_until_gone(segment: SharedMemoryArray) -> bool:
    deadline = time.monotonic() + 5
    while segment_exists(segment) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not segment_exists(segment)


def test_the_scheduler_unlinks_a_requests_pixels_once_it_leaves_however_it_leaves(system):
    server, context, frontend, backend = system
    client, doomed = api_client(context, frontend), api_client(context, frontend)
    refused, refused_pixels = image_ctx("refused", [1, 2, 3])
    client.send(encode(SubmitRequest(refused)))  # no worker yet: refused, unlinked at once
    assert receive(client).results["refused"].status is SchedulerStatus.CANCELLED
    assert wait_until_gone(refused_pixels)

    worker = start_worker(context, backend, client)
    finished, finished_pixels = image_ctx("finished", [1, 2, 3, 4])
    client.send(encode(SubmitRequest(finished)))
    tokens, _ = collect(client, ["finished"])
    assert tokens == {"finished": expected([1, 2, 3, 4], 5)}
    assert wait_until_gone(finished_pixels)

    worker.step_delay_s = 0.05  # slow steps, so the next two are still running
    aborted, aborted_pixels = image_ctx("aborted", [5, 6, 7], max_new_tokens=50)
    orphan, orphan_pixels = image_ctx("orphan", [8, 9, 10], max_new_tokens=50)
    client.send(encode(SubmitRequest(aborted)))
    doomed.send(encode(SubmitRequest(orphan)))
    assert receive(client).results["aborted"].status is SchedulerStatus.ACTIVE
    assert receive(doomed).results["orphan"].status is SchedulerStatus.ACTIVE
    assert segment_exists(aborted_pixels) and segment_exists(orphan_pixels)  # still running
    client.send(encode(AbortRequests(["aborted"])))
    assert wait_until_gone(aborted_pixels)
    doomed.close()  # its API server went away: its requests are aborted
    assert wait_until_gone(orphan_pixels)

    worker.step_delay_s = 2.0
    running, running_pixels = image_ctx("in-a-step", [1, 2, 3], max_new_tokens=50)
    client.send(encode(SubmitRequest(running)))
    deadline = time.monotonic() + 5
    while not any("in-a-step" in step.num_scheduled_tokens for step in worker.steps):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    client.send(encode(AbortRequests(["in-a-step"])))
    time.sleep(0.3)
    assert segment_exists(running_pixels)  # the step the worker is running may still read it
    assert wait_until_gone(running_pixels)  # gone once that step is answered
    assert len(server.images) == 0
