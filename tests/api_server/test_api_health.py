"""The API server's life around generation: client disconnects, failed requests, a silent
scheduler, /health and /metrics (real HTTP against the fake scheduler)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from api_server.engine_client import SchedulerUnavailable
from api_server.stats_tickets import SchedulerStatsCache
from interfaces.scheduler_to_api import GroupAway, SchedulerStats
from tests.support.fake_scheduler import ApiHarness, sse_events

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(autouse=True)
def fresh_scheduler(api: ApiHarness) -> None:
    api.scheduler.reset()
    api.scheduler.reply = api.tokenizer.encode_now("Hello there, friend", add_special_tokens=False)
    api.scheduler.eos_token_id = 2


def test_client_disconnect_mid_stream_aborts(api: ApiHarness, client: httpx.Client) -> None:
    api.scheduler.repeat = True
    api.scheduler.step_interval_s = 0.01
    request = {"messages": MESSAGES, "stream": True, "max_tokens": 200}
    with client.stream("POST", "/v1/chat/completions", json=request) as response:
        lines = response.iter_lines()
        first = json.loads(next(line for line in lines if line).removeprefix("data: "))
        next(line for line in lines if line)
        assert api.scheduler.stats().num_requests_running == 1
        assert api.scheduler.stats().num_kv_blocks_used >= 1
    request_id = api.scheduler.submitted[-1].request_id
    assert request_id.startswith(first["id"])
    assert api.scheduler.wait_for(lambda: request_id in api.scheduler.aborted)
    assert api.scheduler.stats().num_requests_running == 0
    metrics = client.get("/metrics").text
    assert 'switchyard:kv_cache_usage_perc{model_name="smollm2-test"} 0.0' in metrics
    assert 'switchyard:num_requests_running{model_name="smollm2-test"} 0.0' in metrics


def test_client_disconnect_during_a_non_streaming_request_aborts(api: ApiHarness) -> None:
    api.scheduler.repeat = True
    api.scheduler.step_interval_s = 0.01
    timeout = httpx.Timeout(10.0, read=0.3)
    with (
        httpx.Client(base_url=api.url, timeout=timeout) as impatient,
        pytest.raises(httpx.ReadTimeout),
    ):
        impatient.post("/v1/completions", json={"prompt": "x", "max_tokens": 200})
    request_id = api.scheduler.submitted[-1].request_id
    assert api.scheduler.wait_for(lambda: request_id in api.scheduler.aborted)
    assert api.scheduler.wait_for(lambda: api.scheduler.stats().num_requests_running == 0)


def test_request_failed_by_the_system(api: ApiHarness, client: httpx.Client) -> None:
    api.scheduler.fail_with = "a worker died"
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert response.status_code == 500
    assert response.json() == {
        "error": {
            "message": "a worker died",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    }
    streamed = client.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True})
    assert streamed.status_code == 500  # it failed before the first token: a real status


@pytest.mark.parametrize("stream", [False, True])
def test_request_the_scheduler_rejects_gets_a_400(
    api: ApiHarness, client: httpx.Client, stream: bool
) -> None:
    api.scheduler.reject_with = "the request may need 9000 tokens of KV cache, more than 4096"
    body = {"messages": MESSAGES, "stream": stream}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "the request may need 9000 tokens of KV cache, more than 4096",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


def test_cache_salt_reaches_the_scheduler(api: ApiHarness, client: httpx.Client) -> None:
    body = {"messages": MESSAGES, "cache_salt": "tenant-7"}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert api.scheduler.submitted[-1].cache_salt == "tenant-7"
    body = {"prompt": "x", "cache_salt": ""}
    assert client.post("/v1/completions", json=body).status_code == 400


def test_request_failed_mid_stream_sends_an_error_event(
    api: ApiHarness, client: httpx.Client
) -> None:
    api.scheduler.fail_with = "out of KV cache"
    api.scheduler.fail_after_tokens = 3
    response = client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert response.status_code == 200
    events = sse_events(response)
    assert json.loads(events[-1])["error"]["message"] == "out of KV cache"
    assert json.loads(events[-1])["error"]["type"] == "server_error"


def test_silent_scheduler_fails_requests_instead_of_hanging(
    api: ApiHarness, client: httpx.Client
) -> None:
    api.scheduler.silent = True
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "service_unavailable_error"
    assert "has not answered" in response.json()["error"]["message"]


def test_health_and_ready(api: ApiHarness, client: httpx.Client) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json() == {"status": "ready"}
    api.scheduler.workers_ready = False
    try:
        # Probes share one stats reply for up to STATS_MAX_AGE_S (0.5 s): well within the 2 s
        # in which /health promises to report a dead worker.
        assert api.scheduler.wait_for(lambda: client.get("/health").status_code == 503, 2.0)
        for path in ("/health", "/ready"):
            response = client.get(path)
            assert response.status_code == 503
            message = response.json()["error"]["message"]
            assert message == "the scheduler is up but its workers are not ready"
    finally:
        api.scheduler.workers_ready = True
        assert api.scheduler.wait_for(lambda: client.get("/ready").status_code == 200, 2.0)


def stats_with(api: ApiHarness, workers_ready: bool, groups_away: list[GroupAway]):
    """What the fake scheduler answers StatsRequest with from now on (set with monkeypatch)."""
    real_stats = api.scheduler.stats

    def stats() -> SchedulerStats:
        answer = real_stats()
        answer.workers_ready, answer.groups_away = workers_ready, groups_away
        return answer

    return stats


AWAY_CASES = [
    # A group died while another serves: requests moved; ready, and the launcher restarts it.
    (True, [GroupAway("b", "worker_died", 3.24)], 200, "restarting", 200),
    # The only group died: none serves, its requests wait for it to come back.
    (False, [GroupAway("a", "worker_died", 0.04)], 200, "restarting", 503),
    # One group fenced as stalled and one dead: "stalled" wins.
    (
        False,
        [GroupAway("a", "worker_stalled", 31.06), GroupAway("b", "worker_died", 12.0)],
        200,
        "stalled",
        503,
    ),
]


@pytest.mark.parametrize(("workers_ready", "away", "health", "status", "ready"), AWAY_CASES)
def test_health_names_the_groups_away_and_stays_200_while_their_requests_wait(
    api: ApiHarness,
    client: httpx.Client,
    monkeypatch: pytest.MonkeyPatch,
    workers_ready: bool,
    away: list[GroupAway],
    health: int,
    status: str,
    ready: int,
) -> None:
    monkeypatch.setattr(api.scheduler, "stats", stats_with(api, workers_ready, away))
    # Probes share one stats reply for up to STATS_MAX_AGE_S (0.5 s).
    assert api.scheduler.wait_for(lambda: client.get("/health").json() != {"status": "ok"}, 2.0)
    response = client.get("/health")
    assert response.status_code == health
    assert response.json() == {
        "status": status,
        "groups_away": [
            {"group": group.name, "reason": group.reason, "seconds": round(group.seconds, 1)}
            for group in away
        ],
    }
    readiness = client.get("/ready")
    assert readiness.status_code == ready
    if ready == 503:
        message = readiness.json()["error"]["message"]
        assert message == "the scheduler is up but its workers are not ready"
    monkeypatch.undo()
    assert api.scheduler.wait_for(lambda: client.get("/health").json() == {"status": "ok"}, 2.0)


def test_health_is_503_when_no_group_serves_and_none_is_expected_back(
    api: ApiHarness, client: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``--worker-return-timeout`` the scheduler forgets the group: nothing can progress."""
    monkeypatch.setattr(api.scheduler, "stats", stats_with(api, False, []))
    assert api.scheduler.wait_for(lambda: client.get("/health").status_code == 503, 2.0)
    response = client.get("/health")
    assert response.headers["Retry-After"] == "1"
    assert response.json()["error"]["message"] == (
        "the scheduler is up but its workers are not ready"
    )
    monkeypatch.undo()
    assert api.scheduler.wait_for(lambda: client.get("/health").status_code == 200, 2.0)


def test_a_draining_server_is_alive_but_not_ready(api: ApiHarness, client: httpx.Client) -> None:
    state = api.app.state.server
    state.draining = True
    try:
        assert client.get("/health").json() == {"status": "ok"}
        response = client.get("/ready")
        assert response.status_code == 503
        assert response.json()["error"]["message"] == "the server is shutting down"
    finally:
        state.draining = False


def test_the_request_id_names_the_completion_and_comes_back(
    api: ApiHarness, client: httpx.Client
) -> None:
    given = client.post(
        "/v1/chat/completions", json={"messages": MESSAGES}, headers={"X-Request-Id": "trace-42"}
    )
    assert given.headers["X-Request-Id"] == "trace-42"
    assert given.json()["id"] == "chatcmpl-trace-42"
    assert api.scheduler.submitted[-1].request_id.startswith("chatcmpl-trace-42-")

    made = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert made.json()["id"] == f"cmpl-{made.headers['X-Request-Id']}"
    assert len(made.headers["X-Request-Id"]) == 32
    assert client.get("/health").headers["X-Request-Id"]


def test_a_malformed_request_id_is_refused(client: httpx.Client) -> None:
    for bad in ("has space", "x" * 129, "a/b"):
        response = client.post(
            "/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": bad}
        )
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "X-Request-Id"
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_reused_request_id_still_gives_each_request_its_own_scheduler_id(
    api: ApiHarness, client: httpx.Client
) -> None:
    """Retrying proxies resend their X-Request-Id while the first try may still run."""
    api.scheduler.repeat = True
    api.scheduler.step_interval_s = 0.01
    body = {"prompt": "x", "stream": True, "max_tokens": 200}
    headers = {"X-Request-Id": "same"}
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as first:
        lines = first.iter_lines()  # kept: dropping it would close the connection
        next(line for line in lines if line)
        second = client.post(
            "/v1/completions", json={**body, "max_tokens": 3, "stream": False}, headers=headers
        )
        assert second.status_code == 200
        assert second.json()["id"] == "cmpl-same"
        first_id, second_id = (context.request_id for context in api.scheduler.submitted[-2:])
        assert first_id != second_id
        assert first_id.startswith("cmpl-same-") and second_id.startswith("cmpl-same-")


def test_metrics(api: ApiHarness, client: httpx.Client) -> None:
    api.scheduler.repeat = True
    api.scheduler.step_interval_s = 0.05
    request = {"prompt": "x", "stream": True, "max_tokens": 200}
    with client.stream("POST", "/v1/completions", json=request) as response:
        lines = response.iter_lines()  # kept: dropping it would close the connection
        next(line for line in lines if line)
        metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert 'switchyard:num_requests_running{model_name="smollm2-test"} 1.0' in text
    assert 'switchyard:num_requests_waiting{model_name="smollm2-test"} 0.0' in text
    assert 'switchyard:kv_cache_usage_perc{model_name="smollm2-test"} 0.015625' in text


def test_a_scheduler_that_goes_away_fails_requests_at_once(default_model_dir, tmp_path) -> None:
    """Not the 1 s heartbeat timeout: the dropped connection itself ends the request, /health
    says why, and new requests get 503 at once."""
    harness = ApiHarness(default_model_dir, tmp_path, scheduler_timeout_s=30.0)
    try:
        harness.scheduler.reply = [19556]
        harness.scheduler.repeat = True
        harness.scheduler.step_interval_s = 0.05
        request = {"messages": MESSAGES, "stream": True, "max_tokens": 200}
        with httpx.Client(base_url=harness.url, timeout=10) as http:
            with http.stream("POST", "/v1/chat/completions", json=request) as response:
                lines = response.iter_lines()
                assert next(line for line in lines if line).startswith("data: {")
                harness.scheduler.stop()
                started = time.monotonic()
                events = [line for line in lines if line.startswith("data: ")]
            assert time.monotonic() - started < 1.0
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert error["code"] == "service_unavailable"
            assert error["message"].startswith("lost the connection to the scheduler at ipc://")
            assert events[-1] == "data: [DONE]"
            health = http.get("/health")
            assert health.status_code == 503 and health.headers["Retry-After"] == "1"
            assert health.json()["error"]["message"] == error["message"]
            started = time.monotonic()
            late = http.post("/v1/chat/completions", json={"messages": MESSAGES})
            assert late.status_code == 503 and time.monotonic() - started < 0.5
    finally:
        harness.scheduler = None  # stopped above
        harness.close()


def test_client_disconnect_during_an_embeddings_request_aborts_its_inputs(
    default_model_dir, tmp_path
) -> None:
    from interfaces.embeddings import default_embedding_model_dir

    harness = ApiHarness(
        default_model_dir, tmp_path, embedding_model_dir=default_embedding_model_dir()
    )
    timeout = httpx.Timeout(10.0, read=0.3)
    try:
        with (
            httpx.Client(base_url=harness.url, timeout=timeout) as impatient,
            pytest.raises(httpx.ReadTimeout),
        ):
            body = {"model": default_embedding_model_dir().name, "input": ["one", "two"]}
            impatient.post("/v1/embeddings", json=body)  # the fake never answers embeddings
        scheduler = harness.scheduler
        assert [context.token_ids[1:-1] for context in scheduler.embeddings_submitted] == [
            [2028], [2048]
        ]  # fmt: skip
        request_ids = {context.request_id for context in scheduler.embeddings_submitted}
        assert scheduler.wait_for(lambda: request_ids <= set(scheduler.aborted))
    finally:
        harness.close()


class StatsRoundTrips:
    """A stand-in for ``EngineClient.stats``: counts its calls, each answered when ``release``
    is set with the call's number as ``num_requests_running`` (or failed with ``failure``)."""

    def __init__(self) -> None:
        self.num_calls = 0
        self.release = asyncio.Event()
        self.failure: Exception | None = None
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    async def fetch(self) -> SchedulerStats:
        self.num_calls += 1
        number = self.num_calls
        await self.release.wait()
        if self.failure is not None:
            raise self.failure
        return SchedulerStats(number, 0, 64, 0, workers_ready=True)


def test_stats_probes_share_one_round_trip_per_interval() -> None:
    async def probe() -> None:
        trips, changes = StatsRoundTrips(), [0]
        cache = SchedulerStatsCache(trips.fetch, lambda: changes[0], 0.5, trips.clock)
        waiting = [asyncio.ensure_future(cache.get()) for _ in range(100)]
        await asyncio.sleep(0)
        trips.release.set()
        assert {stats.num_requests_running for stats in await asyncio.gather(*waiting)} == {1}
        trips.now = 0.49
        assert (await cache.get()).num_requests_running == 1
        trips.now = 0.5  # the reply is as old as the interval: ask again
        assert (await cache.get()).num_requests_running == 2
        changes[0] += 1  # this API server took, started or finished a request since
        assert (await cache.get()).num_requests_running == 3
        assert (await cache.get()).num_requests_running == 3
        assert trips.num_calls == 3

    asyncio.run(probe())


def test_a_failed_stats_round_trip_is_shared_but_not_kept() -> None:
    async def probe() -> None:
        trips = StatsRoundTrips()
        cache = SchedulerStatsCache(trips.fetch, lambda: 0, 0.5, trips.clock)
        trips.failure = SchedulerUnavailable("the scheduler did not answer")
        waiting = [asyncio.ensure_future(cache.get()) for _ in range(10)]
        await asyncio.sleep(0)
        trips.release.set()
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert [str(result) for result in results] == ["the scheduler did not answer"] * 10
        assert trips.num_calls == 1
        trips.failure = None
        assert (await cache.get()).num_requests_running == 2  # at once, not after 0.5 s

    asyncio.run(probe())


def test_a_probe_that_gives_up_leaves_the_round_trip_to_the_others() -> None:
    async def probe() -> None:
        trips = StatsRoundTrips()
        cache = SchedulerStatsCache(trips.fetch, lambda: 0, 0.5, trips.clock)
        impatient = asyncio.ensure_future(cache.get())
        patient = asyncio.ensure_future(cache.get())
        await asyncio.sleep(0)
        impatient.cancel()
        trips.release.set()
        assert (await patient).num_requests_running == 1
        assert impatient.cancelled() and trips.num_calls == 1

    asyncio.run(probe())
