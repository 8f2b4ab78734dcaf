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
import zmq

from interfaces import (
    ErrorKind,
    GenerationStatus,
    ImageMetadata,
    SchedulerStatus,
    SharedMemoryArray,
    TextContext,
    msgpack_numpy_decoder,
    msgpack_numpy_encoder,
)
from interfaces.api_to_scheduler import AbortRequests, StatsRequest, SubmitRequest
from interfaces.handshake import PROTOCOL_VERSION
from interfaces.scheduler_to_api import SchedulerResults, SchedulerStats, SchedulerToApiMessage
from interfaces.scheduler_to_worker import ScheduledStep, SchedulerToWorkerMessage, Shutdown
from interfaces.worker_to_scheduler import WorkerFailure, WorkerOutput, WorkerReady
from scheduler.config import SchedulerConfig
from scheduler.server import SchedulerServer
from tests.support.fake_worker import FakeTokenGenerator, next_token_for
from tests.support.hostile import hostile_frames

TIMEOUT_MS = 5000
encode = msgpack_numpy_encoder()
decode_api = msgpack_numpy_decoder(SchedulerToApiMessage)
decode_worker = msgpack_numpy_decoder(SchedulerToWorkerMessage)


class FakeWorkerThread(threading.Thread):
    """Registers, then answers every step with the fake generator; fails steps on request.
    As rank > 0 of a tensor-parallel group, it records steps and answers none."""

    def __init__(
        self,
        context: zmq.Context,
        address: str,
        fail_request_ids=(),
        die_after_steps=None,
        rank: int = 0,
        tensor_parallel_size: int = 1,
    ) -> None:
        super().__init__(daemon=True)
        self.die_after_steps = die_after_steps
        self.rank, self.tensor_parallel_size = rank, tensor_parallel_size
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.generator = FakeTokenGenerator(block_size=4)
        self.fail_request_ids = set(fail_request_ids)
        self.got_shutdown = threading.Event()
        self.steps: list[ScheduledStep] = []
        self.step_delay_s = 0.0
        """How long each step takes (settable while it runs)."""

    def run(self) -> None:
        try:
            self._serve()
        finally:
            self.socket.close()  # by its own thread, before the fixture destroys the context

    def _serve(self) -> None:
        ready = WorkerReady(
            PROTOCOL_VERSION, "fake", 64, 4, 256, self.rank, self.tensor_parallel_size
        )
        self.socket.send(encode(ready))
        while self.socket.poll(TIMEOUT_MS):
            message = decode_worker(self.socket.recv())
            if isinstance(message, Shutdown):
                self.got_shutdown.set()
                return
            self.steps.append(message)
            if len(self.steps) == self.die_after_steps:
                return  # closes the socket mid-step, as a killed process would
            if self.rank > 0:
                continue
            time.sleep(self.step_delay_s)
            if self.fail_request_ids & set(message.num_scheduled_tokens):
                self.socket.send(encode(WorkerFailure(message.step_id, "out of memory")))
                continue
            outputs = self.generator.next_token(message)
            self.socket.send(encode(WorkerOutput(message.step_id, outputs)))


@pytest.fixture
def system(tmp_path):
    """A running SchedulerServer plus a zmq context; yields (server, context, frontend, backend)."""
    frontend, backend = f"ipc://{tmp_path}/frontend", f"ipc://{tmp_path}/backend"
    server = SchedulerServer(SchedulerConfig(max_num_batched_tokens=32), frontend, backend)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    context = zmq.Context()
    yield server, context, frontend, backend
    server.stop()  # sends the fake worker Shutdown
    thread.join(timeout=5)
    assert not thread.is_alive()
    for worker in threading.enumerate():
        if isinstance(worker, FakeWorkerThread):
            worker.join(timeout=5)
    context.destroy(linger=0)


def api_client(context, address):
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return socket


def receive(socket):
    assert socket.poll(TIMEOUT_MS), "no reply from the scheduler"
    return decode_api(socket.recv())


def collect(socket, request_ids):
    """Read results until every request in ``request_ids`` has stopped streaming."""
    tokens = {rid: [] for rid in request_ids}
    finals = {}
    while len(finals) < len(request_ids):
        message = receive(socket)
        assert isinstance(message, SchedulerResults)
        for rid, result in message.results.items():
            if result.result is not None:
                tokens[rid] += result.result.tokens
            if result.stop_stream:
                finals[rid] = result
    return tokens, finals


def stats(client):
    """The scheduler's stats, skipping results of steps that were in flight."""
    client.send(encode(StatsRequest()))
    message = receive(client)
    while isinstance(message, SchedulerResults):
        message = receive(client)
    return message


def start_worker(context, backend, client, **options) -> FakeWorkerThread:
    """A fake worker, once the scheduler has registered it (stats say workers_ready)."""
    worker = FakeWorkerThread(context, backend, **options)
    worker.start()
    for _ in range(100):
        if stats(client).workers_ready:
            return worker
        time.sleep(0.02)
    raise AssertionError("the fake worker did not register")


def ctx(request_id, prompt, max_new_tokens=5):
    return TextContext(request_id, prompt, len(prompt) + max_new_tokens, eos_token_ids=[-1])


def expected(prompt, count):
    token_ids = list(prompt)
    for _ in range(count):
        token_ids.append(next_token_for(token_ids))
    return token_ids[len(prompt) :]


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
    assert stats(client) == SchedulerStats(0, 0, 0, 0, workers_ready=False)


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
    intruder_worker.send(bytes(65 << 20))  # above the frame size limit: the link is dropped
    start_worker(context, backend, client)
    client.send(encode(SubmitRequest(ctx("ok", [7, 8]))))
    tokens, _ = collect(client, ["ok"])
    assert tokens == {"ok": expected([7, 8], 5)}
    assert not marker.exists()
    drops = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dropped")]
    assert len(drops) == 2 * len(hostile_frames(marker)) + 1


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
    ) == SchedulerStats(0, 0, 0, 0, workers_ready=False)
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
