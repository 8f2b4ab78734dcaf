"""Hostile HTTP from web pages and scrapers (issue 20, items 8 and 9), each sent beside an
innocent stream that must complete with the same text as alone.

A real `switchyard serve` (127.0.0.1, no API key: the default) takes a cross-origin-style POST,
a DNS-rebinding ``Host`` and 300 made-up methods; probes hammering /health, /ready and /metrics
run against the fake scheduler, which counts the stats round trips they cost.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from threading import Event

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api_server.metrics import HTTP_METHODS, OTHER_METHOD
from api_server.stats_tickets import STATS_MAX_AGE_S
from tests.support.fake_scheduler import ApiHarness
from tests.support.serve_process import DEFAULT_MODEL_NAME, ServeProcess, chat_messages

INNOCENT = {
    "model": DEFAULT_MODEL_NAME,
    "messages": chat_messages("Name three colors."),
    "max_tokens": 16,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}
HTTP_SERIES = ("http_requests_total", "http_request_duration_seconds_count")
"""A sample of each HTTP metric: one per series (label set) it has."""


@pytest.fixture(scope="module")
def served(hostile_serve) -> ServeProcess:
    """The server the hostile-input modules share (tests/e2e/conftest.py); its limits on stream
    backlog and grammar compile time do not come into play here."""
    return hostile_serve.get()


def stream_chat(base_url: str, body: dict, started: Event | None = None) -> tuple[str, str]:
    """The streamed text and finish reason of ``body``; ``started`` is set at its first text."""
    pieces, finish_reason = [], None
    url = f"{base_url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            pieces.append(choice["delta"].get("content") or "")
            finish_reason = choice["finish_reason"] or finish_reason
            if started is not None and "".join(pieces):
                started.set()
    return "".join(pieces), finish_reason


@pytest.fixture(scope="module")
def alone(served: ServeProcess) -> tuple[str, str]:
    """The innocent stream's text with nothing beside it."""
    text, finish_reason = stream_chat(served.base_url, INNOCENT)
    assert finish_reason == "length" and text
    return text, finish_reason


@contextlib.contextmanager
def beside_an_innocent_stream(base_url: str, body: dict, expected: tuple[str, str]):
    """Run the block while ``body`` streams (from its first text on); then check that the
    stream ended as ``expected`` and the server is healthy."""
    started = Event()
    with ThreadPoolExecutor(1) as pool:
        innocent = pool.submit(stream_chat, base_url, body, started)
        assert started.wait(60)
        yield
        assert innocent.result(timeout=120) == expected
    assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200


def test_posts_a_web_page_could_send_are_415_beside_an_innocent_stream(
    served: ServeProcess, alone: tuple[str, str]
) -> None:
    body = json.dumps({"model": DEFAULT_MODEL_NAME, "prompt": "x", "max_tokens": 1}).encode()
    sent_as = {
        "no Content-Type": {},
        "Content-Type 'text/plain'": {"Content-Type": "text/plain"},
        "Content-Type 'application/x-www-form-urlencoded'": {
            "Content-Type": "application/x-www-form-urlencoded"
        },
    }
    routes = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize")
    with (
        beside_an_innocent_stream(served.base_url, INNOCENT, alone),
        httpx.Client(base_url=served.base_url, timeout=10) as client,
    ):
        for route in (*routes, "/detokenize"):
            for named, headers in sent_as.items():
                response = client.post(route, content=body, headers=headers)
                assert (response.status_code, response.json()) == (
                    415,
                    {
                        "error": {
                            "message": f"The request has {named}; send the body as JSON with "
                            "'Content-Type: application/json'",
                            "type": "invalid_request_error",
                            "param": None,
                            "code": "unsupported_media_type",
                        }
                    },
                ), route
        json_type = {"Content-Type": "application/json; charset=utf-8"}
        tokenize = json.dumps({"prompt": "x"}).encode()
        assert client.post("/tokenize", content=tokenize, headers=json_type).status_code == 200


def test_a_rebinding_host_is_refused_beside_an_innocent_stream(
    served: ServeProcess, alone: tuple[str, str]
) -> None:
    port = httpx.URL(served.base_url).port
    refused = {
        "error": {
            "message": "Invalid Host header: this server listens on the loopback address "
            "127.0.0.1 and serves only requests for localhost, 127.0.0.1 or [::1] (any port), "
            "so that no web page can reach it by DNS rebinding",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_host",
        }
    }
    chat = {"model": DEFAULT_MODEL_NAME, "messages": chat_messages("Hi"), "max_tokens": 1}
    with (
        beside_an_innocent_stream(served.base_url, INNOCENT, alone),
        httpx.Client(base_url=served.base_url, timeout=10) as client,
    ):
        for host in (
            f"evil.example:{port}",
            "evil.example",
            f"127.0.0.1.evil.example:{port}",
            f"localhost.evil.example:{port}",
        ):
            for method, path, body in (
                ("GET", "/v1/models", None),
                ("POST", "/v1/chat/completions", chat),
                ("GET", "/health", None),
            ):
                response = client.request(method, path, json=body, headers={"Host": host})
                assert (response.status_code, response.json()) == (400, refused), (host, path)
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost", f"[::1]:{port}"):
            response = client.get("/v1/models", headers={"Host": host})
            assert response.status_code == 200, host


def http_series(metrics_text: str) -> set[tuple[str, str, str, str]]:
    """(metric, handler, method, status) of every HTTP request series."""
    return {
        (sample.name, sample.labels["handler"], sample.labels["method"], sample.labels["status"])
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if sample.name in HTTP_SERIES
    }


def test_made_up_methods_add_no_metric_series_beside_an_innocent_stream(
    served: ServeProcess, alone: tuple[str, str]
) -> None:
    with (
        beside_an_innocent_stream(served.base_url, INNOCENT, alone),
        httpx.Client(base_url=served.base_url, timeout=10) as client,
    ):
        before = http_series(client.get("/metrics").text)
        for index in range(300):
            method = f"MADEUP{index}"
            if index % 2:
                assert client.request(method, "/v1/models").status_code == 405
            else:
                assert client.request(method, f"/made/up/{index}").status_code == 404
        text = client.get("/metrics").text
    after = http_series(text)
    assert "MADEUP" not in text and "/made/up" not in text
    assert {method for _, _, method, _ in after} <= HTTP_METHODS | {OTHER_METHOD}
    assert after - before == {
        (metric, handler, OTHER_METHOD, status)
        for metric in HTTP_SERIES
        for handler, status in (("/v1/models", "405"), ("none", "404"))
    }


@pytest.fixture(scope="module")
def probed(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """An API server on the fake scheduler that pings it only rarely, so the stats requests the
    fake counts are the probes' round trips."""
    harness = ApiHarness(
        default_model_dir, tmp_path_factory.mktemp("api-probed"), heartbeat_interval_s=60.0
    )
    yield harness
    harness.close()


def test_probes_cost_one_stats_round_trip_per_interval_beside_an_innocent_stream(
    probed: ApiHarness,
) -> None:
    scheduler = probed.scheduler
    scheduler.reply = probed.tokenizer.encode_now("one two three four", add_special_tokens=False)
    scheduler.repeat = True
    scheduler.step_interval_s = 0.01
    body = {"messages": chat_messages("Hi"), "max_tokens": 200, "stream": True}
    expected_text = probed.tokenizer.decode_checked(scheduler.reply * 50)
    metrics = probed.app.state.server.metrics
    paths = ("/health", "/ready", "/metrics")
    with (
        beside_an_innocent_stream(probed.url, body, (expected_text, "length")),
        httpx.Client(base_url=probed.url, timeout=10) as client,
        ThreadPoolExecutor(8) as pool,
    ):
        num_requests_before = scheduler.num_stats_requests
        num_changes_before = metrics.num_request_changes
        started = time.monotonic()
        statuses = list(pool.map(lambda i: client.get(paths[i % 3]).status_code, range(300)))
        elapsed = time.monotonic() - started
        num_round_trips = scheduler.num_stats_requests - num_requests_before
        num_changes = metrics.num_request_changes - num_changes_before
    assert statuses == [200] * 300
    # One round trip per STATS_MAX_AGE_S (the first included), and at most one more after
    # each request this server took, started or finished: not one per probe.
    assert 1 <= num_round_trips <= math.ceil(elapsed / STATS_MAX_AGE_S) + 1 + num_changes
    assert num_changes <= 3
