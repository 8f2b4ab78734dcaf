"""The fault matrix (docs/reliability.md) with real processes: `switchyard serve` on the default
model, a part killed or signalled, and what clients, /health and the exit code show. Every wait
is bounded."""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil
import pytest

from tests.support.clients import SlowReader, health_status, in_background, wait_until
from tests.support.serve_process import ServeProcess, alive, gauges_settle, long_chat

pytestmark = pytest.mark.slow


@pytest.fixture
def serve_factory(default_model_dir):
    started: list[ServeProcess] = []

    def start(*flags: str) -> ServeProcess:
        started.append(ServeProcess(*flags))
        return started[-1]

    yield start
    for serve in started:
        serve.kill()


@pytest.mark.parametrize("role", ["switchyard-worker", "switchyard-scheduler"])
def test_killing_the_worker_or_scheduler_fails_requests_and_exits_non_zero(serve_factory, role):
    serve = serve_factory("--migration-limit", "0")  # fail-fast: no move, no worker restart
    children = [pid for pid, _ in serve.children()]
    stream, stream_thread = in_background(serve.base_url, long_chat())
    whole, whole_thread = in_background(serve.base_url, long_chat(stream=False))
    assert stream.first_event.wait(30) and stream.events
    time.sleep(0.5)  # the non-streaming request is surely running too

    (pid,) = serve.pids_of(role)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)

    assert wait_until(lambda: health_status(serve.base_url) != 200, 2.0)
    assert health_status(serve.base_url) == 503
    late = httpx.post(f"{serve.base_url}/v1/chat/completions", json=long_chat(8, False))
    assert late.status_code == 503
    assert late.json()["error"]["type"] == "service_unavailable_error"

    stream_thread.join(5)
    whole_thread.join(5)
    assert stream.ended_at - killed_at < 5 and whole.ended_at - killed_at < 5
    assert stream.status == 200 and "error" in stream.events[-1]
    assert stream.events[-1]["error"]["code"] == "service_unavailable"
    assert whole.status == 503 and whole.body["error"]["code"] == "service_unavailable"

    assert serve.process.wait(timeout=30) == 1
    assert wait_until(lambda: not any(alive(child) for child in children), 5)


RESTART_LINE = re.compile(
    r"(api-server-\d) exited with code -9 \((\d+) in a row\); starting it again in ([\d.]+) s"
)
API_SERVER_KILLS = 4
STREAM_TOKENS = 64
"""The survivor's streams: long enough to run through the first kills."""


def test_killing_one_of_two_api_servers_again_and_again_leaves_the_other_serving(
    default_model_dir, tmp_path
):
    """One API server killed as soon as it runs, 4 times in a row: the launcher starts it again
    after 0.5, 1, 2 and 4 s (a line each), doubling each time, while the other's streams
    complete and the scheduler, the worker and the unit live on. (Two more kills would only
    wait 8 and 16 s more for the same doubling; tests/switchyard/test_restart_backoff.py checks
    the whole schedule up to its 30 s cap.)"""
    log_path = tmp_path / "serve.log"
    serve = ServeProcess("--api-servers", "2", log_path=log_path)
    try:
        engine = serve.pids_of("switchyard-scheduler") + serve.pids_of("switchyard-worker")
        api_pids = serve.pids_of("switchyard-api-server")
        port = urlsplit(serve.base_url).port
        body = {
            **long_chat(max_tokens=STREAM_TOKENS),
            "stream_options": {"include_usage": True},
        }
        streams = open_streams_until_each_server_has_one(serve.base_url, api_pids, port, body)
        victim = api_pids[0]
        os.kill(victim, signal.SIGKILL)
        killed_at, waited = time.monotonic(), []  # waited: from each kill to the next process

        survivors = [(o, t) for o, t, pid in streams if pid != victim]
        for outcome, thread in [(o, t) for o, t, pid in streams if pid == victim]:
            thread.join(5)
            assert outcome.error is not None  # its connection died with it
        running = len(survivors)  # the scheduler aborted the dead server's requests
        assert wait_until(lambda: serve.gauges()["num_requests_running"] <= running, 5)

        for _ in range(API_SERVER_KILLS - 1):  # each new one, as soon as it shows
            victim = wait_for_a_new_api_server(serve, api_pids, timeout_s=60)
            waited.append(time.monotonic() - killed_at)
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            api_pids.append(victim)
            assert all(outcome.error is None for outcome, _ in survivors)

        for outcome, thread in survivors:
            thread.join(150)
            assert outcome.error is None and outcome.finish_reasons == ["length"]
            assert outcome.events[-1]["usage"]["completion_tokens"] == STREAM_TOKENS
        restarts = wait_for_restart_lines(log_path, API_SERVER_KILLS)
        assert [int(line[1]) for line in restarts] == list(range(1, API_SERVER_KILLS + 1))
        delays = [float(line[2]) for line in restarts]
        assert delays == [0.5, 1, 2, 4]
        assert all(w >= delay for w, delay in zip(waited, delays, strict=False))
        assert len({name for name, _, _ in restarts}) == 1  # always the same slot

        reply = httpx.post(
            f"{serve.base_url}/v1/chat/completions", json=long_chat(8, False), timeout=30
        )
        assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"
        assert health_status(serve.base_url) == 200
        assert serve.process.poll() is None
        assert all(alive(pid) for pid in engine)
        assert serve.pids_of("switchyard-scheduler") + serve.pids_of("switchyard-worker") == engine
    finally:
        serve.kill()


def wait_for_a_new_api_server(serve: ServeProcess, known: list[int], timeout_s: float) -> int:
    """The pid of an API server process not in ``known``, as soon as one shows."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        new = [pid for pid in serve.pids_of("switchyard-api-server") if pid not in known]
        if new:
            return new[0]
        time.sleep(0.02)
    raise AssertionError(f"no new API server within {timeout_s} s")


def wait_for_restart_lines(log_path: Path, count: int) -> list[tuple[str, str, str]]:
    """The launcher's first ``count`` restart lines: (name, exits in a row, delay) each."""
    wait_until(lambda: len(RESTART_LINE.findall(log_path.read_text())) >= count, 5)
    return RESTART_LINE.findall(log_path.read_text())[:count]


def open_streams_until_each_server_has_one(
    base_url: str, api_pids: list[int], port: int, body: dict
):
    """Streams of ``body``, opened one by one until every API server holds one; (outcome,
    thread, pid of the API server holding it) each."""
    streams = []
    for _ in range(12):
        before = {pid: client_ports(pid, port) for pid in api_pids}
        outcome, thread = in_background(base_url, body)
        assert outcome.first_event.wait(30) and outcome.events
        (holder,) = [pid for pid in api_pids if client_ports(pid, port) - before[pid]]
        streams.append((outcome, thread, holder))
        if {pid for _, _, pid in streams} == set(api_pids):
            return streams
    raise AssertionError("the kernel gave every stream to the same API server")


def client_ports(pid: int, port: int) -> set[int]:
    """Remote ports of the established connections to ``port`` that process ``pid`` serves."""
    return {
        connection.raddr.port
        for connection in psutil.Process(pid).net_connections("tcp")
        if connection.status == psutil.CONN_ESTABLISHED and connection.laddr.port == port
    }


def test_killing_the_launcher_takes_every_child_down(serve_factory):
    serve = serve_factory()
    children = [pid for pid, _ in serve.children()]
    assert len(children) == 3
    stream, _ = in_background(serve.base_url, long_chat())
    assert stream.first_event.wait(30)
    serve.process.kill()
    assert wait_until(lambda: not any(alive(child) for child in children), 5)


def test_sigterm_lets_requests_in_flight_finish(serve_factory):
    serve = serve_factory("--shutdown-timeout", "30")
    body = {**long_chat(max_tokens=60), "stream_options": {"include_usage": True}}
    stream, stream_thread = in_background(serve.base_url, body)
    assert stream.first_event.wait(30)
    serve.process.send_signal(signal.SIGTERM)
    assert wait_until(lambda: health_status(serve.base_url, "/ready") == 503, 2)
    assert health_status(serve.base_url) == 200  # draining, but alive
    late = httpx.post(f"{serve.base_url}/v1/chat/completions", json=long_chat(8, False))
    assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
    stream_thread.join(30)
    assert stream.finish_reasons == ["length"]
    assert stream.events[-1]["usage"]["completion_tokens"] == 60
    assert serve.process.wait(timeout=30) == 0


def test_sigterm_with_no_timeout_aborts_requests_in_flight(serve_factory):
    serve = serve_factory("--shutdown-timeout", "0")
    stream, stream_thread = in_background(serve.base_url, long_chat())
    whole, whole_thread = in_background(serve.base_url, long_chat(stream=False))
    assert stream.first_event.wait(30)
    time.sleep(0.5)
    signalled_at = time.monotonic()
    serve.process.send_signal(signal.SIGTERM)
    stream_thread.join(10)
    whole_thread.join(10)
    assert stream.finish_reasons == ["abort"]
    assert whole.status == 200 and whole.body["choices"][0]["finish_reason"] == "abort"
    assert serve.process.wait(timeout=15) == 0
    assert time.monotonic() - signalled_at < 10


# -- one server for the load cases -------------------------------------------------------------

MAX_NUM_SEQS = 8
MAX_QUEUED = 8


@pytest.fixture(scope="module")
def loaded(default_model_dir):
    serve = ServeProcess(
        *("--max-num-seqs", str(MAX_NUM_SEQS), "--max-queued-requests", str(MAX_QUEUED))
    )
    yield serve
    serve.kill()


def test_a_hundred_dropped_streams_free_everything(loaded):
    rng = random.Random(0)
    points = [rng.randrange(0, 12) for _ in range(100)]

    def drop_after(num_lines: int) -> None:
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", f"{loaded.base_url}/v1/chat/completions", json=long_chat()) as r,
        ):
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(num_lines):
                next(lines)

    errors = []

    def worker(share: list[int]) -> None:
        for num_lines in share:
            try:
                drop_after(num_lines)
            except Exception as error:  # collected and asserted below
                errors.append(repr(error))

    threads = [threading.Thread(target=worker, args=(points[i::6],)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    assert gauges_settle(loaded) == {
        "num_requests_running": 0.0,
        "num_requests_waiting": 0.0,
        "kv_cache_usage_perc": 0.0,
    }


def test_overload_gets_429_with_retry_after(loaded):
    num_clients = MAX_NUM_SEQS + MAX_QUEUED + 6
    # 100 tokens take seconds at a batch of 8: nothing finishes while the burst arrives.
    outcomes = [in_background(loaded.base_url, long_chat(100)) for _ in range(num_clients)]
    refused = lambda: [o for o, _ in outcomes if o.status == 429]  # noqa: E731
    assert wait_until(lambda: len(refused()) >= num_clients - MAX_NUM_SEQS - MAX_QUEUED, 10)
    assert wait_until(lambda: loaded.gauges()["num_requests_running"] == MAX_NUM_SEQS, 5)
    gauges = loaded.gauges()
    assert (gauges["num_requests_running"], gauges["num_requests_waiting"]) == (
        MAX_NUM_SEQS,
        MAX_QUEUED,
    )
    reply = httpx.post(f"{loaded.base_url}/v1/chat/completions", json=long_chat(8, False))
    assert reply.status_code == 429 and reply.headers["Retry-After"] == "1"
    assert reply.json()["error"] == {
        "message": f"{MAX_QUEUED} requests are already waiting; try again later",
        "type": "rate_limit_error",
        "param": None,
        "code": "server_overloaded",
    }
    for _, thread in outcomes:
        thread.join(60)
    unanswered = sum(o.status is None for o, _ in outcomes)
    assert unanswered == 0, f"{unanswered} clients had no answer within 60 s"
    statuses = sorted(o.status for o, _ in outcomes)
    assert statuses == [200] * (MAX_NUM_SEQS + MAX_QUEUED) + [429] * 6
    assert all(o.finish_reasons == ["length"] for o, _ in outcomes if o.status == 200)


def test_a_slow_reader_does_not_slow_other_clients(loaded):
    _, fast_stream = in_background(loaded.base_url, long_chat(200))
    baseline = timed_requests(loaded.base_url)
    fast_stream.join(60)
    slow = SlowReader(loaded.base_url, {**long_chat(200), "logprobs": True, "top_logprobs": 20})
    with_slow_reader = timed_requests(loaded.base_url)
    assert with_slow_reader <= 1.5 * baseline + 1.0, (with_slow_reader, baseline)
    events = slow.read_all()
    choices = [choice for event in events for choice in event["choices"]]
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
    assert sum(len(c["logprobs"]["content"]) for c in choices if c.get("logprobs")) == 200
    assert gauges_settle(loaded)["num_requests_running"] == 0


def timed_requests(base_url: str) -> float:
    """Seconds that three 24-token chat completions take, one after another."""
    started = time.monotonic()
    for _ in range(3):
        reply = httpx.post(f"{base_url}/v1/chat/completions", json=long_chat(24, False), timeout=60)
        assert reply.status_code == 200
    return time.monotonic() - started
