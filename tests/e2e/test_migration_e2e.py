"""A worker that dies or hangs under `switchyard serve` costs its streams a pause, not an error
(docs/reliability.md): mixed streams run once undisturbed, then again with the worker killed
(`kill -9`) or stopped (`kill -STOP`) once each has its first tokens; the launcher starts the
worker group again, the scheduler hands it the requests that waited, and every stream ends as
undisturbed. Past `--restart-limit`, serve exits 1. Every wait is bounded."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.support.clients import wait_until
from tests.support.metrics import scrape
from tests.support.serve_process import DEFAULT_MODEL_NAME, ServeProcess, alive, chat_messages

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
FIRST_TOKENS = 3
"""Tokens every stream has (or it has ended) before the fault."""
LOGPROB_TOLERANCE = 1e-3
"""Recomputed logits come from another batch shape and a prefill instead of decode steps."""
RESTART_LINE = re.compile(
    r"(\S+) exited with code -9; starting worker group 'hybrid' again \((\d+) of (\d+) restarts"
)
TOPICS = ("Paris", "the sea", "a dragon", "bread", "the moon", "trains", "a violin", "winter")
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def mixed_request(index: int) -> dict:
    """One of seven kinds by ``index``: greedy, seeded sampling, json_schema, n=2, logprobs with
    top_logprobs, a stop string, min_tokens; each asks about its own topic."""
    topic = TOPICS[index % len(TOPICS)]
    body = {
        "model": DEFAULT_MODEL_NAME,
        "messages": chat_messages(f"Tell me about {topic}."),
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    seeded = {"temperature": 0.8, "seed": 1000 + index}
    kind = index % 7
    if kind == 1:
        body |= seeded
    elif kind == 2:
        body |= seeded
        body["messages"] = chat_messages(f"Describe a person who likes {topic}, as JSON.")
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON},
        }
    elif kind == 3:
        body |= seeded | {"n": 2}
    elif kind == 4:
        body |= seeded | {"logprobs": True, "top_logprobs": 5}
    elif kind == 5:
        body["stop"] = [" and"]
    elif kind == 6:
        body["messages"] = chat_messages(f"Say only the word {topic}.")
        body["min_tokens"] = MAX_TOKENS - 4
    return body


@dataclass
class Stream:
    """What one streaming client saw: the data events with their arrival times."""

    status: int | None = None
    events: list[tuple[float, dict]] = field(default_factory=list)
    done: bool = False
    """It ended with ``data: [DONE]``."""
    error: str | None = None
    ended: threading.Event = field(default_factory=threading.Event)

    @property
    def num_tokens(self) -> int:
        return sum(
            1
            for _, event in self.events
            for choice in event.get("choices", [])
            if choice["delta"].get("content")
        )

    def summary(self) -> dict:
        """Per choice: text, finish reason, logprob tokens (and their values apart, compared
        within a tolerance); and the usage's completion tokens."""
        choices: dict[int, dict] = {}
        usage = None
        for _, event in self.events:
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                mine = choices.setdefault(
                    choice["index"], {"text": "", "finish_reason": None, "tokens": []}
                )
                mine["text"] += choice["delta"].get("content") or ""
                mine["finish_reason"] = choice["finish_reason"] or mine["finish_reason"]
                for entry in (choice.get("logprobs") or {}).get("content") or []:
                    top = [alternative["token"] for alternative in entry["top_logprobs"]]
                    mine["tokens"].append((entry["token"], top))
        completion_tokens = usage["completion_tokens"] if usage else None
        return {"choices": choices, "completion_tokens": completion_tokens}

    def logprob_values(self) -> list[float]:
        return [
            value
            for _, event in self.events
            for choice in event.get("choices", [])
            for entry in (choice.get("logprobs") or {}).get("content") or []
            for value in (entry["logprob"], *(a["logprob"] for a in entry["top_logprobs"]))
        ]


def open_stream(base_url: str, body: dict) -> Stream:
    stream = Stream()

    def run() -> None:
        try:
            with (
                httpx.Client(timeout=httpx.Timeout(10, read=180)) as http,
                http.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response,
            ):
                stream.status = response.status_code
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        stream.done = True
                    elif line.startswith("data: {"):
                        stream.events.append((time.monotonic(), json.loads(line[6:])))
        except httpx.HTTPError as error:
            stream.error = repr(error)
        finally:
            stream.ended.set()

    threading.Thread(target=run, daemon=True).start()
    return stream


def run_all(base_url: str, bodies: list[dict], timeout_s: float = 240) -> list[Stream]:
    streams = [open_stream(base_url, body) for body in bodies]
    assert all(stream.ended.wait(timeout_s) for stream in streams)
    return streams


def run_with_fault(
    base_url: str, bodies: list[dict], fault, timeout_s: float = 240
) -> tuple[list[Stream], float, list[bool]]:
    """``bodies`` streamed at once; ``fault()`` once every stream has ``FIRST_TOKENS`` tokens
    (or ended), after a random delay of up to half a second. Returns the streams, when the
    fault happened and which streams were still open then."""
    streams = [open_stream(base_url, body) for body in bodies]
    assert wait_until(
        lambda: all(s.num_tokens >= FIRST_TOKENS or s.ended.is_set() for s in streams), 120
    )
    time.sleep(random.uniform(0, 0.5))
    open_then = [not stream.ended.is_set() for stream in streams]
    faulted_at = time.monotonic()
    fault()
    assert all(stream.ended.wait(timeout_s) for stream in streams)
    return streams, faulted_at, open_then


def assert_same_as_undisturbed(streams: list[Stream], undisturbed: list[Stream]) -> None:
    for index, (stream, alone) in enumerate(zip(streams, undisturbed, strict=True)):
        assert (stream.status, stream.error, stream.done) == (200, None, True), index
        assert not any("error" in event for _, event in stream.events), stream.events[-1]
        assert stream.summary() == alone.summary(), index
        assert stream.logprob_values() == pytest.approx(
            alone.logprob_values(), abs=LOGPROB_TOLERANCE
        )


def pauses(streams: list[Stream], faulted_at: float, open_then: list[bool]) -> list[float]:
    """For each stream open at the fault: seconds from the fault to its next event."""
    return [
        min(at for at, _ in stream.events if at > faulted_at) - faulted_at
        for stream, was_open in zip(streams, open_then, strict=True)
        if was_open
    ]


def report(what: str, measured: list[float]) -> None:
    print(
        f"{what}: pause from the fault to the next token over {len(measured)} streams: "
        f"median {statistics.median(measured):.1f} s, max {max(measured):.1f} s"
    )


def only_worker(serve: ServeProcess, title: str = "switchyard-worker") -> int:
    (pid,) = serve.pids_of(title)
    return pid


def worker_restarts(serve: ServeProcess) -> float:
    """``switchyard:worker_restarts_total``: groups the scheduler took back under their name."""
    label = frozenset({("model_name", DEFAULT_MODEL_NAME)})
    return scrape(serve.base_url)[("switchyard:worker_restarts_total", label)]


def wait_for_health_ok(serve: ServeProcess) -> dict:
    def ok() -> bool:
        response = httpx.get(f"{serve.base_url}/health", timeout=5)
        return response.status_code == 200 and response.json() == {"status": "ok"}

    assert wait_until(ok, 60, interval_s=0.5)
    return httpx.get(f"{serve.base_url}/health", timeout=5).json()


def test_killing_the_worker_mid_stream_costs_32_mixed_streams_a_pause(default_model_dir, tmp_path):
    log_path = tmp_path / "serve.log"
    serve = ServeProcess(log_path=log_path)
    try:
        bodies = [mixed_request(index) for index in range(32)]
        undisturbed = run_all(serve.base_url, bodies)
        assert all(stream.done for stream in undisturbed)
        worker = only_worker(serve)

        streams, killed_at, open_then = run_with_fault(
            serve.base_url, bodies, lambda: os.kill(worker, signal.SIGKILL)
        )
        assert sum(open_then) >= len(bodies) // 2  # the kill came mid-stream
        assert_same_as_undisturbed(streams, undisturbed)
        report("kill -9 of the worker", pauses(streams, killed_at, open_then))

        assert serve.process.poll() is None
        assert RESTART_LINE.findall(log_path.read_text()) == [("worker", "1", "5")]
        assert only_worker(serve) != worker
        assert wait_for_health_ok(serve) == {"status": "ok"}
        assert worker_restarts(serve) == 1
    finally:
        serve.kill()


STOPPED_WORKER_BOUND_S = 90.0
"""From ``kill -STOP`` to the last token: ~3 s until the scheduler lets the group go (the
heartbeat timeout, or the stall bound if sooner), ~1 s until the launcher reads /health, the
model's reload (~5-20 s on two busy cores), then the rest of the streams."""


def test_a_stopped_worker_is_replaced_and_its_streams_complete(default_model_dir, tmp_path):
    """``kill -STOP``: the scheduler hears nothing from the worker (ZeroMQ heartbeats, 3 s, or
    the step past ``--stall-timeout``) and lets the group go; /health names it away; the
    launcher kills the stopped processes (SIGKILL) and starts the group again, which takes the
    requests back. The streams complete within ``STOPPED_WORKER_BOUND_S`` of the stop.

    ``--stall-timeout`` is 10 s, not less: the first step of a freshly started worker (the
    requests' recompute, in a process that has not run the model yet) took over 3 s on two
    busy cores, and a stall bound that fences it sends the requests round again."""
    log_path = tmp_path / "serve.log"
    serve = ServeProcess("--stall-timeout", "10", log_path=log_path)
    try:
        bodies = [mixed_request(index) for index in (0, 1, 4)]  # greedy, seeded, logprobs
        undisturbed = run_all(serve.base_url, bodies)
        worker = only_worker(serve)

        streams, stopped_at, open_then = run_with_fault(
            serve.base_url, bodies, lambda: os.kill(worker, signal.SIGSTOP)
        )
        ended_at = max(at for stream in streams for at, _ in stream.events)
        assert ended_at - stopped_at < STOPPED_WORKER_BOUND_S
        assert any(open_then)
        assert_same_as_undisturbed(streams, undisturbed)
        report("kill -STOP of the worker", pauses(streams, stopped_at, open_then))

        assert not alive(worker)
        assert re.search(
            r"worker group 'hybrid' left the scheduler [\d.]+ s ago \(worker_\w+\) while its "
            r"processes run; starting worker group 'hybrid' again \(1 of 5",
            log_path.read_text(),
        )
        assert wait_for_health_ok(serve) == {"status": "ok"}
        assert worker_restarts(serve) == 1
        assert serve.process.poll() is None
    finally:
        serve.kill()


def test_a_second_death_within_the_minute_past_the_limit_stops_serve(default_model_dir, tmp_path):
    log_path = tmp_path / "serve.log"
    serve = ServeProcess("--restart-limit", "1", log_path=log_path)
    try:
        children = [pid for pid, _ in serve.children()]
        first = only_worker(serve)
        os.kill(first, signal.SIGKILL)
        assert wait_until(lambda: serve.pids_of("switchyard-worker") not in ([], [first]), 30)
        second = only_worker(serve)
        os.kill(second, signal.SIGKILL)
        assert serve.process.wait(timeout=30) == 1
        log = log_path.read_text()
        assert RESTART_LINE.findall(log) == [("worker", "1", "1")]
        assert (
            "worker exited with code -9; worker groups or the scheduler were restarted 1 time(s) "
            "in the last 60 s already (--restart-limit 1); stopping Switchyard" in log
        )
        assert wait_until(lambda: not any(alive(child) for child in children), 5)
    finally:
        serve.kill()


def test_killing_one_tensor_parallel_rank_restarts_the_group_and_streams_complete(
    default_model_dir, tmp_path
):
    log_path = tmp_path / "serve.log"
    serve = ServeProcess("--tensor-parallel-size", "3", log_path=log_path)
    try:
        bodies = [mixed_request(index) for index in range(7)]
        undisturbed = run_all(serve.base_url, bodies)
        ranks = serve.pids_of("switchyard-worker tp")
        assert len(ranks) == 3
        rank_1 = only_worker(serve, "switchyard-worker tp1")

        streams, killed_at, open_then = run_with_fault(
            serve.base_url, bodies, lambda: os.kill(rank_1, signal.SIGKILL)
        )
        assert any(open_then)
        assert_same_as_undisturbed(streams, undisturbed)
        report("kill -9 of rank 1 of 3", pauses(streams, killed_at, open_then))

        assert RESTART_LINE.findall(log_path.read_text()) == [("worker-1", "1", "5")]
        assert not any(alive(rank) for rank in ranks)
        assert len(serve.pids_of("switchyard-worker tp")) == 3
        assert wait_for_health_ok(serve) == {"status": "ok"}
        assert worker_restarts(serve) == 1
    finally:
        serve.kill()


SCHEDULER_RESTART_LINE = re.compile(
    r"scheduler exited with code -9; starting it again \((\d+) of (\d+) restarts a minute\) "
    r"and every worker group with it"
)
RESUBMITTED_LINE = re.compile(r"submitted (\d+) requests again to the scheduler")
"""An API server's INFO line once it submitted its waiting requests to a new scheduler."""


def test_killing_the_scheduler_mid_stream_costs_the_streams_a_pause(default_model_dir, tmp_path):
    """``kill -9`` of the scheduler: the launcher starts it again and its worker group with
    it (its KV cache was the dead scheduler's), one restart for the fault, and each API
    server, which kept its streams open, submits every one again with the tokens it already
    sent (``generated_token_ids``) once the new scheduler has a worker. Every stream ends as
    undisturbed; the new scheduler counts the moves."""
    log_path = tmp_path / "serve.log"
    serve = ServeProcess("--log-level", "INFO", log_path=log_path)  # the resubmission lines
    try:
        bodies = [mixed_request(index) for index in range(8)]
        undisturbed = run_all(serve.base_url, bodies)
        (scheduler,) = serve.pids_of("switchyard-scheduler")

        streams, killed_at, open_then = run_with_fault(
            serve.base_url, bodies, lambda: os.kill(scheduler, signal.SIGKILL)
        )
        assert any(open_then)
        assert_same_as_undisturbed(streams, undisturbed)
        report("kill -9 of the scheduler", pauses(streams, killed_at, open_then))

        assert serve.process.poll() is None
        log = log_path.read_text()
        assert SCHEDULER_RESTART_LINE.findall(log) == [("1", "5")]
        assert "started worker group 'hybrid' again: worker" in log
        assert "starting worker group" not in log  # its exit spent no restart of its own
        assert serve.pids_of("switchyard-scheduler") != [scheduler]
        assert wait_for_health_ok(serve) == {"status": "ok"}
        label = frozenset({("model_name", DEFAULT_MODEL_NAME), ("reason", "scheduler_restarted")})
        # The new scheduler counts the requests submitted again that carry tokens: at least
        # one stream had its first tokens at the kill, and none beyond those submitted again.
        moved = scrape(serve.base_url)[("switchyard:request_migrations_total", label)]
        resubmitted = sum(int(count) for count in RESUBMITTED_LINE.findall(log))
        assert 1 <= moved <= resubmitted
    finally:
        serve.kill()
