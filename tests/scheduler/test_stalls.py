"""Hangs are failures too: the stall bound (``scheduler.stalls``) with a fake clock, the fencing
of connections (``WorkerGroups.fence``), and, over real ZeroMQ sockets with fake worker groups,
a group that stops answering a step: it is fenced, its requests complete on another group with
exactly their tokens, and a new connection under its name serves again."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from interfaces import SchedulerStatus
from interfaces.api_to_scheduler import StatsRequest, SubmitEmbeddings, SubmitRequest
from interfaces.embeddings import EmbeddingsContext
from interfaces.handshake import PROTOCOL_VERSION
from interfaces.scheduler_to_api import WORKER_STALLED, SchedulerEmbeddingsResults
from interfaces.scheduler_to_worker import EmbeddingsStep, ScheduledStep, Shutdown
from interfaces.worker_to_scheduler import (
    WorkerEmbeddingsOutput,
    WorkerOutput,
    WorkerReady,
    WorkerRole,
)
from scheduler.config import WorkerLimits
from scheduler.stalls import (
    LORA_UPDATE_BOUND_S,
    RECENT_STEPS,
    STALL_FACTOR,
    Stall,
    StepTimes,
)
from scheduler.worker_group import WorkerGroups, ready_problem
from tests.support.scheduler_sockets import (
    FakeWorkerThread,
    api_client,
    collect,
    ctx,
    decode_api,
    decode_worker,
    encode,
    expected,
    receive,
    stats,
)

FLOOR_S = 30.0
STALL_TIMEOUT_S = 3.0
"""The floor of the stall bound in the socket tests: far above a fake step (milliseconds) on
a busy machine, below the 5 s the helpers wait for any one message."""
PROMPTS = {"r0": [1, 2, 3], "r1": [4, 5], "r2": [6, 7, 8, 9], "r3": [10]}
"""Spread over groups a and b in turn: the least loaded takes each, the first on a tie."""
PLACED_ON_A = ["r0", "r2"]
REFUSED = (
    "this connection served group 'a', which was fenced as stalled; a worker may register again "
    "on a new connection"
)
WAIT_S = 30.0
"""How long a held worker waits for anything (generous: the machine may be busy)."""


# -- the bound, with a fake clock ---------------------------------------------------------------


def run_steps(times: StepTimes, group: str, durations: list[float], start: float = 0.0) -> float:
    """Send and answer one step of each duration, one after another; returns the time after."""
    now = start
    for step_id, seconds in enumerate(durations):
        times.sent(group, step_id, now)
        now += seconds
        times.answered(group, now)
    return now


def test_a_groups_first_steps_have_the_floor_alone():
    times = StepTimes(FLOOR_S)
    assert times.bound_s("new") == FLOOR_S
    times.sent("new", 0, 100.0)  # its first step: warm-up, no history
    assert times.stalled(100.0 + FLOOR_S) == []  # exactly the bound is not past it
    assert times.stalled(100.0 + FLOOR_S + 0.5) == [Stall("new", 0, FLOOR_S + 0.5, FLOOR_S)]


def test_the_bound_is_the_factor_times_the_slowest_recent_step_above_the_floor():
    times = StepTimes(FLOOR_S)
    now = run_steps(times, "a", [0.02, 5.0, 0.01, 0.03])
    assert times.bound_s("a") == STALL_FACTOR * 5.0 == 50.0
    times.sent("a", 7, now)
    assert times.stalled(now + 49.0) == []
    assert times.stalled(now + 51.0) == [Stall("a", 7, 51.0, 50.0)]
    fast = StepTimes(FLOOR_S)
    run_steps(fast, "b", [0.5, 0.02])  # 10 x 0.5 s is below the floor
    assert fast.bound_s("b") == FLOOR_S


def test_a_step_behind_a_lora_load_counts_from_the_load_s_answer():
    times = StepTimes(FLOOR_S)
    times.lora_update_sent("a", 0.0)  # a large adapter, read between steps
    times.sent("a", 3, 1.0)  # queued behind it
    assert times.stalled(100.0) == []  # within the load's bound, not the step's
    times.lora_update_answered("a", 100.0)
    assert times.stalled(100.0 + FLOOR_S) == []
    assert times.stalled(100.5 + FLOOR_S) == [Stall("a", 3, FLOOR_S + 0.5, FLOOR_S)]
    times.lora_update_sent("b", 0.0)
    over = LORA_UPDATE_BOUND_S + 1
    [stall] = times.stalled(over)
    assert stall == Stall("b", -1, over, LORA_UPDATE_BOUND_S, lora_update=True)
    assert "a LoRA adapter update has run" in stall.describe()


def test_only_the_recent_steps_count():
    times = StepTimes(FLOOR_S)
    now = run_steps(times, "a", [8.0] + [0.01] * (RECENT_STEPS - 1))
    assert times.bound_s("a") == 80.0  # the slow step is the oldest of the recent ones
    run_steps(times, "a", [0.01], start=now)
    assert times.bound_s("a") == FLOOR_S  # and now it is gone


def test_a_long_prefill_after_short_decodes_is_not_a_stall():
    """Decode steps of 20 ms, then a chunk of a long prefill on two busy cores: 25 s is
    within the floor; after prefill chunks of 4 s, even 39 s is within 10 x 4 s."""
    times = StepTimes(FLOOR_S)
    now = run_steps(times, "a", [0.02] * 20)
    times.sent("a", 20, now)
    assert times.stalled(now + 25.0) == []
    now = run_steps(times, "a", [25.0, 4.0, 0.02], start=now + 25.0)
    assert times.bound_s("a") == 250.0
    times.sent("a", 30, now)
    assert times.stalled(now + 39.0) == []


def test_idle_groups_never_stall_and_a_group_that_left_starts_afresh():
    times = StepTimes(FLOOR_S)
    run_steps(times, "idle", [6.0])
    times.answered("idle", 1000.0)  # nothing in flight: ignored
    assert times.stalled(10_000.0) == []
    assert times.bound_s("idle") == 60.0
    times.forget("idle")  # it left; whoever registers under its name next starts afresh
    assert times.bound_s("idle") == FLOOR_S
    times.sent("a", 3, 0.0)
    times.sent("b", 9, 10.0)
    assert [stall.group for stall in times.stalled(FLOOR_S + 5.0)] == ["a"]
    times.forget("a")
    assert times.stalled(FLOOR_S + 5.0) == []


def test_the_schedulers_own_pause_is_not_counted_against_steps_in_flight():
    times = StepTimes(FLOOR_S)
    times.sent("a", 1, 0.0)
    times.lora_update_sent("b", 0.0)
    times.sent("c", 2, 0.0)
    times.answered("c", 0.5)  # nothing in flight on c: its history is untouched
    times.paused(40.0)  # the scheduler was stopped for 40 s from, say, t=10
    assert times.stalled(40.0 + FLOOR_S) == []
    assert times.stalled(40.5 + FLOOR_S) == [Stall("a", 1, FLOOR_S + 0.5, FLOOR_S)]
    assert [stall.group for stall in times.stalled(40.0 + LORA_UPDATE_BOUND_S)] == ["a"]
    assert [stall.group for stall in times.stalled(40.5 + LORA_UPDATE_BOUND_S)] == ["a", "b"]
    times.answered("a", 45.0)
    assert times.bound_s("a") == 50.0  # 5 s as the worker saw it: 10 x 5 s, not 10 x 45 s
    times.sent("c", 3, 50.0)
    assert times.stalled(50.5 + FLOOR_S)[-1] == Stall("c", 3, FLOOR_S + 0.5, FLOOR_S)


def test_a_stall_names_its_step_and_bound():
    assert Stall("a", 17, 31.25, 30.0).describe() == (
        "group 'a' stalled: step 17 has run 31.2 s, past its bound of 30.0 s (the larger of "
        "--stall-timeout and 10 x its slowest recent step)"
    )


def test_a_fenced_connection_may_not_register_again_until_it_disconnects():
    workers = WorkerGroups()
    ready = WorkerReady(PROTOCOL_VERSION, "fake", 64, 4, 256, group="a")
    assert ready_problem(ready, WorkerLimits()) is None
    assert workers.register(b"old", ready).now_serving
    assert workers.fence("a") == [b"old"]
    assert workers.groups == {} and workers.group_of(b"old") is None
    assert workers.fenced_group(b"old") == "a"
    refused = workers.register(b"old", ready)
    assert (refused.retired, refused.now_serving, refused.error) == ([b"old"], False, REFUSED)
    assert workers.register(b"new", ready).now_serving  # the restarted group
    assert workers.leave(b"old") is None  # the fenced connection closes: its group is not hurt
    assert workers.fenced_group(b"old") is None
    assert workers.group_of(b"new").name == "a"


# -- over real sockets ---------------------------------------------------------------------------


class HeldWorkerThread(FakeWorkerThread):
    """A worker rank that answers (as rank 0) its first ``num_answered`` steps, then holds the
    next one until ``release`` is set. Released, it sends the held step's answer late, reads
    what the scheduler sent meanwhile, and registers again on the same connection; every
    message it receives after the held step is in ``replies``. Rank > 0 answers nothing."""

    def __init__(
        self,
        context,
        address: str,
        group: str,
        num_answered: int,
        rank: int = 0,
        tensor_parallel_size: int = 1,
        role: WorkerRole = WorkerRole.HYBRID,
    ) -> None:
        super().__init__(
            context, address, rank=rank, tensor_parallel_size=tensor_parallel_size, group=group
        )
        self.ready = WorkerReady(
            PROTOCOL_VERSION, "fake", 64, 4, 256, rank, tensor_parallel_size, group=group,
            role=role,
        )  # fmt: skip
        self.num_answered = num_answered
        self.replies: list = []
        self.held = threading.Event()
        self.release = threading.Event()

    def _serve(self) -> None:
        self.socket.send(encode(self.ready))
        while len(self.steps) <= self.num_answered:
            message = self._receive()
            if not isinstance(message, ScheduledStep | EmbeddingsStep):
                return
            self.steps.append(message)
            if len(self.steps) <= self.num_answered and self.ready.rank == 0:
                self.socket.send(encode(self._answer(message)))
        self.held.set()
        if not self.release.wait(WAIT_S):
            return
        if self.ready.rank == 0:
            self.socket.send(encode(self._answer(self.steps[-1])))
        self.replies.append(self._receive())
        self.socket.send(encode(self.ready))
        self.replies.append(self._receive())

    def _receive(self):
        return decode_worker(self.socket.recv()) if self.socket.poll(WAIT_S * 1000) else None

    def _answer(
        self, step: ScheduledStep | EmbeddingsStep
    ) -> WorkerOutput | WorkerEmbeddingsOutput:
        if isinstance(step, EmbeddingsStep):
            vectors = {
                c.request_id: np.full(2, len(c.token_ids), np.float32) for c in step.contexts
            }
            return WorkerEmbeddingsOutput(step.step_id, vectors)
        return WorkerOutput(step.step_id, self.generator.next_token(step))


def wait_for_blocks(monitor, num_blocks: int) -> None:
    """Until the serving groups hold ``num_blocks`` KV blocks in all (64 each)."""
    deadline = time.monotonic() + 10
    while stats(monitor).num_kv_blocks_total != num_blocks:
        assert time.monotonic() < deadline, f"no {num_blocks} blocks served"
        time.sleep(0.02)


def first_steps_of(worker) -> dict[str, list[int]]:
    """The output tokens each request arrived with in its first step on ``worker``."""
    firsts: dict[str, list[int]] = {}
    for step in worker.steps:
        for new in step.new_requests:
            firsts.setdefault(new.context.request_id, list(new.output_token_ids))
    return firsts


def wait_for_log(caplog, text: str) -> None:
    deadline = time.monotonic() + 10
    while not any(record.getMessage() == text for record in caplog.records):
        assert time.monotonic() < deadline, f"never logged: {text}"
        time.sleep(0.02)


@pytest.mark.parametrize("system", [{"stall_timeout_s": STALL_TIMEOUT_S}], indirect=True)
def test_a_stalled_group_is_fenced_and_its_requests_complete_on_the_other(system, caplog):
    """Group a (two ranks) answers 3 steps and holds the 4th: past the bound it is fenced,
    while group b serves on. a's requests finish on b with exactly their tokens; both of a's
    ranks are told why; its late answer is dropped; its connection cannot register again,
    and a new connection under its name serves."""
    caplog.set_level(logging.WARNING, logger="scheduler.server")
    _, context, frontend, backend = system
    client, monitor = api_client(context, frontend), api_client(context, frontend)
    stalling = HeldWorkerThread(context, backend, "a", 3, tensor_parallel_size=2)
    rank_1 = HeldWorkerThread(context, backend, "a", 3, rank=1, tensor_parallel_size=2)
    stalling.start()
    rank_1.start()
    wait_for_blocks(monitor, 64)
    innocent = FakeWorkerThread(context, backend, group="b")
    innocent.start()
    wait_for_blocks(monitor, 128)
    for request_id, prompt in PROMPTS.items():
        client.send(encode(SubmitRequest(ctx(request_id, prompt, max_new_tokens=30))))

    tokens, finals = collect(client, list(PROMPTS))
    # Every result came while a still held its step: b's steps never waited for it.
    assert stalling.held.is_set() and not stalling.release.is_set()
    assert tokens == {rid: expected(prompt, 30) for rid, prompt in PROMPTS.items()}
    assert {final.status for final in finals.values()} == {SchedulerStatus.COMPLETE}
    assert "r0" in first_steps_of(stalling)  # r2 may have waited on a for a step
    moved = {
        rid: outputs for rid, outputs in first_steps_of(innocent).items() if rid in PLACED_ON_A
    }
    assert sorted(moved) == PLACED_ON_A
    assert 1 <= len(moved["r0"]) <= 3
    for rid, outputs in moved.items():  # what a produced in the 3 steps it answered
        assert len(outputs) <= 3
        assert outputs == expected(PROMPTS[rid], len(outputs))
    held_step = stalling.steps[-1].step_id
    assert len(stalling.steps) == len(rank_1.steps) == 4

    stalling.release.set()
    rank_1.release.set()
    stalling.join(WAIT_S)
    rank_1.join(WAIT_S)
    for rank in (stalling, rank_1):
        fenced, refused = rank.replies
        assert isinstance(fenced, Shutdown)
        assert fenced.reason.startswith(f"group 'a' stalled: step {held_step} has run ")
        assert fenced.reason.endswith(
            f"past its bound of {STALL_TIMEOUT_S:.1f} s (the larger of --stall-timeout and "
            "10 x its slowest recent step)"
        )
        assert refused == Shutdown(REFUSED)
    wait_for_log(caplog, "dropped a late WorkerOutput from fenced group 'a'")
    assert not client.poll(200)  # the late answer streamed nothing
    fences = [r for r in caplog.records if r.getMessage().startswith("group 'a' stalled")]
    assert [r.levelno for r in fences] == [logging.ERROR]  # one line per fence
    after = stats(monitor)
    assert (after.num_requests_running, after.num_requests_waiting) == (0, 0)
    assert (after.num_kv_blocks_used, after.num_kv_blocks_total) == (0, 64)
    assert [(away.name, away.reason) for away in after.groups_away] == [("a", "worker_stalled")]
    assert after.request_migrations_total["worker_stalled"] == len(PLACED_ON_A)
    assert after.request_migrations_total["worker_died"] == 0
    assert not innocent.got_shutdown.is_set()

    restarted = FakeWorkerThread(context, backend, group="a")
    restarted.start()
    wait_for_blocks(monitor, 128)
    client.send(encode(SubmitRequest(ctx("s0", [11, 12], max_new_tokens=20))))
    client.send(encode(SubmitRequest(ctx("s1", [13], max_new_tokens=20))))
    tokens, _ = collect(client, ["s0", "s1"])
    assert tokens == {"s0": expected([11, 12], 20), "s1": expected([13], 20)}
    assert sorted(first_steps_of(restarted)) == ["s1"]  # b took s0, the new a s1
    back = stats(monitor)
    assert (back.groups_away, back.worker_restarts_total) == ([], 1)


@pytest.mark.parametrize("system", [{"stall_timeout_s": STALL_TIMEOUT_S}], indirect=True)
def test_when_the_only_group_stalls_its_requests_finish_once_it_is_back(system):
    """``kill -STOP`` of the only worker: fenced past the bound, its request waits (for up to
    ``--worker-return-timeout``), and completes with exactly its tokens on the restarted group,
    a new connection under the same name."""
    _, context, frontend, backend = system
    client, monitor = api_client(context, frontend), api_client(context, frontend)
    stalling = HeldWorkerThread(context, backend, "a", 3)
    stalling.start()
    wait_for_blocks(monitor, 64)
    client.send(encode(SubmitRequest(ctx("x", [1, 2], max_new_tokens=20))))
    assert stalling.held.wait(10)
    deadline = time.monotonic() + 10
    while not (away := stats(monitor).groups_away):
        assert time.monotonic() < deadline, "the stalled group was not fenced"
        time.sleep(0.05)
    assert [(group.name, group.reason) for group in away] == [("a", "worker_stalled")]
    assert not stats(monitor).workers_ready

    restarted = FakeWorkerThread(context, backend, group="a")
    restarted.start()
    tokens, finals = collect(client, ["x"])
    assert tokens == {"x": expected([1, 2], 20)}
    assert finals["x"].status is SchedulerStatus.COMPLETE
    # It came back to the new group as a new request carrying a's 3 tokens, recomputed.
    assert first_steps_of(restarted) == {"x": expected([1, 2], 3)}
    back = stats(monitor)
    assert (back.groups_away, back.worker_restarts_total) == ([], 1)
    assert back.request_migrations_total["worker_stalled"] == 1
    stalling.release.set()
    stalling.join(WAIT_S)
    assert stalling.replies[1] == Shutdown(REFUSED)  # after the fence's own Shutdown


@pytest.mark.parametrize("system", [{"stall_timeout_s": STALL_TIMEOUT_S}], indirect=True)
def test_a_stalled_embedding_groups_inputs_run_on_the_other(system):
    _, context, frontend, backend = system
    client = api_client(context, frontend)
    stalling = HeldWorkerThread(context, backend, "e1", 0, role=WorkerRole.EMBEDDING)
    stalling.start()
    deadline = time.monotonic() + 10
    while not stats(client).embedding_workers_ready:
        assert time.monotonic() < deadline, "the embedding group did not register"
        time.sleep(0.02)
    client.send(encode(SubmitEmbeddings([EmbeddingsContext("x", [1, 2, 3])])))
    assert stalling.held.wait(10)  # it holds its first step
    innocent = HeldWorkerThread(context, backend, "e2", 10, role=WorkerRole.EMBEDDING)
    innocent.start()

    message = receive(client)  # past the bound, x runs on e2
    assert isinstance(message, SchedulerEmbeddingsResults)
    result = message.results["x"]
    assert result.status is SchedulerStatus.COMPLETE
    assert result.result.embeddings.tolist() == [3.0, 3.0]
    assert [step.contexts for step in innocent.steps] == [[EmbeddingsContext("x", [1, 2, 3])]]
    stalling.release.set()
    stalling.join(WAIT_S)
    fenced, refused = stalling.replies
    assert fenced.reason.startswith("group 'e1' stalled: step 0 has run ")
    assert refused.reason.startswith("this connection served group 'e1', which was fenced")
    assert not client.poll(200)  # its late answer is dropped
    # /health names it away, so that the launcher kills and restarts it.
    (away,) = stats(client).groups_away
    assert (away.name, away.reason) == ("e1", WORKER_STALLED)


@pytest.mark.parametrize("system", [{"stall_timeout_s": STALL_TIMEOUT_S}], indirect=True)
def test_a_stall_of_the_scheduler_itself_does_not_fence_a_worker_that_answered_meanwhile(
    system, caplog
):
    """The scheduler's loop stops for longer than the bound while a step is in flight (here one
    API message takes ``STALL_TIMEOUT_S`` + 1 s to handle, as a stopped or starved process
    would) and the worker answers meanwhile. The pass that follows must not judge the step
    before its answer is read: the group serves on and the stream completes with its tokens."""
    caplog.set_level(logging.WARNING, logger="scheduler.server")
    server, context, frontend, backend = system
    client, monitor = api_client(context, frontend), api_client(context, frontend)
    worker = FakeWorkerThread(context, backend, group="a")
    worker.start()
    wait_for_blocks(monitor, 64)
    worker.step_delay_s = 0.2  # in flight long enough to stall on; bound: the floor (10 x 0.2 s)
    handle, stalled_on = server._on_api_message, []

    def stalling_handle(client_id, payload):
        # Once: a step in flight whose answer has not come yet (else a later message tries).
        if not stalled_on and "a" in server._in_flight and not server._backend.poll(0):
            stalled_on.append(server._in_flight["a"].step_id)
            time.sleep(STALL_TIMEOUT_S + 1.0)  # the worker answers meanwhile
        handle(client_id, payload)

    server._on_api_message = stalling_handle  # (nothing is in flight at the submission)
    client.send(encode(SubmitRequest(ctx("x", [1, 2], max_new_tokens=8))))
    tokens: list[int] = []
    final, asked = None, 0
    deadline = time.monotonic() + 15
    while final is None:
        assert time.monotonic() < deadline, "the stream did not finish"
        if not client.poll(100):
            continue
        message = decode_api(client.recv())
        result = message.results["x"]
        tokens += result.result.tokens if result.result is not None else []
        final = result if result.stop_stream else None
        if not stalled_on and final is None:
            monitor.send(encode(StatsRequest()))  # a message for a pass to stall on
            asked += 1
    assert tokens == expected([1, 2], 8)
    assert final.status is SchedulerStatus.COMPLETE
    [step_id] = stalled_on
    assert any(step.step_id == step_id for step in worker.steps)
    assert not any("stalled: step" in r.getMessage() for r in caplog.records)
    assert any(r.getMessage().startswith("the scheduler's loop stalled") for r in caplog.records)
    for _ in range(asked):
        receive(monitor)  # the replies to the stats requests sent to stall on
    after = stats(monitor)
    assert after.groups_away == [] and after.workers_ready
    assert after.request_migrations_total["worker_stalled"] == 0
    assert not worker.got_shutdown.is_set()
