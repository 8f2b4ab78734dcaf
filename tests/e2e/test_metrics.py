"""/metrics against real processes: every request counted exactly once, whichever of several API
server processes serves it or is scraped, token counters equal to the responses' ``usage``, and
the scheduler's gauges back at 0 after clients abort. Parsed with prometheus-client's own parser."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from api_server.metrics import (
    FINISHED_REASONS,
    HTTP_METHODS,
    ITL_BUCKETS,
    OTHER_METHOD,
    SCHEDULER_METRIC_NAMES,
    BatchedObservations,
    ServerMetrics,
    method_label,
)
from api_server.stats_tickets import STATS_MAX_AGE_S
from interfaces.scheduler_to_api import (
    MAX_GROUP_STATS,
    MIGRATION_PAUSE_SECONDS_BUCKETS,
    GroupStats,
    SchedulerStats,
)
from tests.support.clients import wait_until
from tests.support.metrics import Samples, parse_samples, scrape
from tests.support.serve_process import DEFAULT_MODEL_NAME, ServeProcess, chat_messages, long_chat

MODEL = DEFAULT_MODEL_NAME
LABEL = {"model_name": MODEL}
PER_REQUEST_HISTOGRAMS = (
    "time_to_first_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
)


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(f"switchyard:{name}", frozenset({**LABEL, **labels}.items()))]


def http_count(samples: Samples, handler: str, status: str) -> float:
    labels = frozenset({"handler": handler, "method": "POST", "status": status}.items())
    return samples.get(("http_requests_total", labels), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (f"switchyard:{name}", frozenset({**LABEL, **labels}.items()))
    return after[key] - before.get(key, 0.0)


@pytest.fixture(scope="module")
def server(default_model_dir):
    serve = ServeProcess("--api-servers", "2")
    yield serve
    serve.kill()


def ten_requests() -> list[tuple[str, dict]]:
    """Chat and completions, streamed and not, ending by length and by EOS."""
    chat = "/v1/chat/completions"
    completions = "/v1/completions"
    requests = []
    for index in range(4):
        body = {"messages": chat_messages(f"Name a color ({index})."), "max_tokens": 6 + index}
        requests.append((chat, body))
    for index in range(3):
        body = {
            "messages": chat_messages(f"Count to {index + 3}."),
            "max_tokens": 12,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        requests.append((chat, body))
    for index in range(3):
        body = {"prompt": f"The capital of France is{'.' * index}", "max_tokens": 5 + index}
        requests.append((completions, body))
    for _, body in requests:
        body.update(model=MODEL, temperature=0)
    return requests


def send(base_url: str, path: str, body: dict) -> dict:
    """The request's usage (from the body, or the stream's usage chunk)."""
    url = f"{base_url}{path}"
    if not body.get("stream"):
        response = httpx.post(url, json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["usage"]
    usage = None
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line.removeprefix("data: ")).get("usage") or usage
    assert usage is not None
    return usage


def test_ten_requests_are_counted_exactly_once_on_every_api_server(server):
    before = scrape(server.base_url)
    requests = ten_requests()
    with ThreadPoolExecutor(len(requests)) as pool:
        usages = list(pool.map(lambda item: send(server.base_url, *item), requests))
    prompt_tokens = sum(usage["prompt_tokens"] for usage in usages)
    completion_tokens = sum(usage["completion_tokens"] for usage in usages)
    # The scheduler's series are a snapshot up to STATS_MAX_AGE_S old: let those taken before the
    # last steps expire on both API servers.
    time.sleep(STATS_MAX_AGE_S + 0.1)

    for _ in range(6):  # the shared port hands each scrape to either process
        after = scrape(server.base_url)
        for name in PER_REQUEST_HISTOGRAMS:
            assert delta(before, after, f"{name}_count") == 10, name
        finished = sum(
            delta(before, after, "request_success_total", finished_reason=reason)
            for reason in FINISHED_REASONS
        )
        assert finished == 10
        assert delta(before, after, "prompt_tokens_total") == prompt_tokens
        assert delta(before, after, "generation_tokens_total") == completion_tokens
        assert delta(before, after, "request_generation_tokens_sum") == completion_tokens
        assert delta(before, after, "inter_token_latency_seconds_count") == sum(
            usage["completion_tokens"] - 1 for usage in usages
        )
        # The scheduler computed each prompt (less what the prefix cache held), then one token
        # per later step of each request; nothing was preempted.
        computed = (
            prompt_tokens
            - delta(before, after, "prefix_cache_hits_total")
            + completion_tokens
            - len(usages)
        )
        assert delta(before, after, "num_preemptions_total") == 0
        assert delta(before, after, "iteration_tokens_total_sum") == computed
        assert delta(before, after, "prefix_cache_queries_total") == prompt_tokens
        assert (
            http_count(after, "/v1/chat/completions", "200")
            - http_count(before, "/v1/chat/completions", "200")
            == 7
        )
        assert (
            http_count(after, "/v1/completions", "200")
            - http_count(before, "/v1/completions", "200")
            == 3
        )


def test_the_scheduler_series_are_the_schedulers_own_on_every_api_server(server):
    samples = scrape(server.base_url)
    names = {
        name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
        for name, _ in samples
        if name.startswith("switchyard:")
    }
    assert set(SCHEDULER_METRIC_NAMES) <= names
    blocks = value(samples, "kv_cache_usage_perc")
    assert 0 <= blocks <= 1
    assert value(samples, "iteration_tokens_total_count") == value(
        samples, "iteration_tokens_total_bucket", le="+Inf"
    )


def test_after_clients_abort_running_and_waiting_return_to_zero(server):
    before = scrape(server.base_url)
    body = long_chat()
    streaming = threading.Barrier(7)
    release = threading.Event()

    def abandon() -> None:
        with httpx.stream(
            "POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60
        ) as response:
            lines = response.iter_lines()  # kept: dropping it would close the connection
            next(line for line in lines if line.startswith("data: {"))
            streaming.wait(60)
            release.wait(30)
        # Leaving the block closes the connection mid-stream.

    threads = [threading.Thread(target=abandon) for _ in range(6)]
    for thread in threads:
        thread.start()
    streaming.wait(60)
    # the gauge follows the scheduler's stats, which may trail the streams by a step
    running = lambda: value(scrape(server.base_url), "num_requests_running")  # noqa: E731
    wait_until(lambda: running() == 6, 10, interval_s=0.1)
    assert running() == 6
    release.set()
    for thread in threads:
        thread.join(30)

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = scrape(server.base_url)
        idle = value(after, "num_requests_running") == value(after, "num_requests_waiting") == 0
        if idle and delta(before, after, "request_success_total", finished_reason="abort") == 6:
            break
        time.sleep(0.2)
    assert value(after, "num_requests_running") == 0
    assert value(after, "num_requests_waiting") == 0
    assert value(after, "kv_cache_usage_perc") == 0
    assert delta(before, after, "request_success_total", finished_reason="abort") == 6
    assert delta(before, after, "time_to_first_token_seconds_count") == 6


RECORD_ONE_REQUEST = """
import sys, time
from api_server.metrics import ServerMetrics
from interfaces.scheduler_to_api import SchedulerStats
metrics = ServerMetrics("m")
metrics.update_scheduler(SchedulerStats(3, 1, 64, 16, workers_ready=True))
request = metrics.request(time.monotonic(), 7)
request.started(None)
request.generated(1)
request.generated(2)
request.finished(sys.argv[1])
sys.stdout.buffer.write(metrics.render())
"""


def test_processes_sharing_a_multiprocess_directory_add_up(tmp_path):
    """prometheus-client's multiprocess mode, as the launcher sets it up for API servers: each
    process's /metrics shows all of them, and the scheduler's series once."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    outputs = [
        subprocess.run(
            [sys.executable, "-c", RECORD_ONE_REQUEST, reason],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        for reason in ("stop", "length", "stop")
    ]
    samples = parse_samples(outputs[-1])
    label = frozenset({"model_name": "m"}.items())

    def of(name: str, **labels: str) -> float:
        return samples[(f"switchyard:{name}", frozenset({"model_name": "m", **labels}.items()))]

    assert of("prompt_tokens_total") == 21
    assert of("generation_tokens_total") == 9
    assert of("request_success_total", finished_reason="stop") == 2
    assert of("request_success_total", finished_reason="length") == 1
    assert of("time_to_first_token_seconds_count") == 3
    assert of("inter_token_latency_seconds_count") == 3
    assert samples[("switchyard:num_requests_running", label)] == 3  # once, not once a process


def test_batched_observations_add_what_observing_one_by_one_adds():
    amounts = [0.0, 0.0005, 0.001, 0.0011, 0.02, 0.5, 3.0, 79.9, 80.0, 1e9]
    registries = {}
    for way in ("one by one", "batched"):
        registry = CollectorRegistry()
        histogram = Histogram("latency", "", buckets=ITL_BUCKETS, registry=registry)
        if way == "batched":
            batch = BatchedObservations(histogram)
            for amount in amounts[:4]:
                batch.observe(amount)
            batch.flush()
            for amount in amounts[4:]:
                batch.observe(amount)
            batch.flush()
            batch.flush()  # nothing new: adds nothing
        else:
            for amount in amounts:
                histogram.observe(amount)
        registries[way] = registry

    def samples(registry: CollectorRegistry) -> dict:
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in registry.collect()
            for sample in family.samples
        }

    batched, one_by_one = samples(registries["batched"]), samples(registries["one by one"])
    assert batched.pop(("latency_sum", ())) == pytest.approx(one_by_one.pop(("latency_sum", ())))
    assert batched == one_by_one  # every bucket and the count exactly
    assert registries["batched"].get_sample_value("latency_count") == len(amounts)


def test_a_missing_multiprocess_directory_is_a_clear_startup_error(tmp_path):
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "missing")}
    completed = subprocess.run(
        [sys.executable, "-c", "from api_server.metrics import ServerMetrics; ServerMetrics('m')"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 1
    assert "PROMETHEUS_MULTIPROC_DIR=" in completed.stderr
    assert "is not a directory" in completed.stderr


def test_made_up_methods_share_one_label_across_processes(server):
    """In multiprocess mode every label value is a file entry of every process: none may come
    from the request line."""
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        for index in range(60):
            assert client.request(f"BREW{index}", "/v1/models").status_code == 405
        text = client.get("/metrics").text
    methods = {
        sample.labels["method"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "http_requests_total"
    }
    assert OTHER_METHOD in methods and methods <= HTTP_METHODS | {OTHER_METHOD}
    assert "BREW" not in text


@pytest.mark.parametrize(
    ("method", "label"),
    [
        ("GET", "GET"),
        ("POST", "POST"),
        ("OPTIONS", "OPTIONS"),
        ("DELETE", "DELETE"),
        ("get", OTHER_METHOD),
        ("PROPFIND", OTHER_METHOD),
        ("X" * 1000, OTHER_METHOD),
    ],
)
def test_http_method_labels_take_fixed_values(method: str, label: str) -> None:
    assert method_label(method) == label


def test_each_request_taken_started_and_finished_is_a_change_for_the_stats_cache() -> None:
    metrics = ServerMetrics("m")
    request = metrics.request(time.monotonic(), 3)
    assert metrics.num_request_changes == 1
    request.started(None)
    request.generated(2)
    assert metrics.num_request_changes == 2
    request.finished("stop")
    request.finished("stop")  # only the first counts
    assert metrics.num_request_changes == 3


def test_the_migration_series_render_every_reason_and_leave_the_other_series_as_they_were():
    """Every reason is a series from the start (0 included); the pause is a histogram over
    ``MIGRATION_PAUSE_SECONDS_BUCKETS``; no other series changes when requests move."""
    quiet = SchedulerStats(
        3,
        1,
        64,
        16,
        workers_ready=True,
        num_preemptions_total=2,
        num_requests_running_by_role={"hybrid": 3},
        num_requests_waiting_by_role={"hybrid": 1},
        groups=[GroupStats("hybrid", "hybrid", 3, 1, 64, 16, 40, 8)],
    )
    counts = [0] * (len(MIGRATION_PAUSE_SECONDS_BUCKETS) + 1)
    counts[2], counts[-1] = 2, 1  # two pauses of (0.25, 0.5] s, one above every bound
    moved = msgspec.structs.replace(
        quiet,
        request_migrations_total={"worker_died": 3, "worker_stalled": 1},
        worker_restarts_total=2,
        migration_pause_seconds_counts=counts,
        migration_pause_seconds_sum=300.75,
    )
    rendered = {}
    for name, stats in (("quiet", quiet), ("moved", moved)):
        metrics = ServerMetrics("m")
        metrics.update_scheduler(stats)
        rendered[name] = parse_samples(metrics.render().decode())

    def sample(name: str, which: str = "moved", **labels: str) -> float:
        return rendered[which][
            (f"switchyard:{name}", frozenset({"model_name": "m", **labels}.items()))
        ]

    for reason, count in (("worker_died", 3), ("worker_stalled", 1), ("scheduler_restarted", 0)):
        assert sample("request_migrations_total", reason=reason) == count
        assert sample("request_migrations_total", "quiet", reason=reason) == 0
    assert (sample("worker_restarts_total"), sample("worker_restarts_total", "quiet")) == (2, 0)
    buckets = [sample("migration_pause_seconds_bucket", le=str(b)) for b in (0.1, 0.5, 120.0)]
    assert buckets == [0, 2, 2]
    assert sample("migration_pause_seconds_bucket", le="+Inf") == 3
    assert sample("migration_pause_seconds_count") == 3
    assert sample("migration_pause_seconds_sum") == 300.75
    assert sample("migration_pause_seconds_count", "quiet") == 0

    new = {f"switchyard:{name}" for name in ("request_migrations_total", "worker_restarts_total")}
    new.add("switchyard:migration_pause_seconds")

    def others(samples: Samples) -> Samples:
        return {key: v for key, v in samples.items() if family_of(key[0]) not in new}

    assert others(rendered["moved"]) == others(rendered["quiet"])
    scheduler_families = {
        family_of(name)
        for name, _ in rendered["quiet"]
        if family_of(name) in SCHEDULER_METRIC_NAMES
    }
    assert scheduler_families == set(SCHEDULER_METRIC_NAMES)
    assert sample("num_preemptions_total", "quiet") == 2


def test_each_serving_group_has_its_series_and_the_totals_count_each_request_once():
    """Per-group series carry ``group`` and ``role``; the unlabelled totals are the scheduler's
    own (each request once), not a sum rendered again; no more than ``MAX_GROUP_STATS``."""
    groups = [
        GroupStats("prefill-0", "prefill", 2, 5, 100, 25, 900, 300),
        GroupStats("decode-0", "decode", 7, 0, 200, 150),
    ]
    stats = SchedulerStats(
        7, 5, 300, 175, workers_ready=True, prefix_cache_queries_total=900, groups=groups
    )
    metrics = ServerMetrics("m")
    metrics.update_scheduler(stats)
    samples = parse_samples(metrics.render().decode())

    def sample(name: str, **labels: str) -> float:
        return samples[(f"switchyard:{name}", frozenset({"model_name": "m", **labels}.items()))]

    prefill, decode = (
        {"group": "prefill-0", "role": "prefill"},
        {"group": "decode-0", "role": "decode"},
    )
    assert (
        sample("num_requests_running_by_group", **prefill),
        sample("num_requests_running_by_group", **decode),
    ) == (2, 7)
    assert (
        sample("num_requests_waiting_by_group", **prefill),
        sample("num_requests_waiting_by_group", **decode),
    ) == (5, 0)
    assert sample("kv_cache_usage_perc_by_group", **prefill) == 0.25
    assert sample("kv_cache_usage_perc_by_group", **decode) == 0.75
    assert sample("prefix_cache_queries_by_group_total", **prefill) == 900
    assert sample("prefix_cache_hits_by_group_total", **prefill) == 300
    assert sample("prefix_cache_hits_by_group_total", **decode) == 0
    assert (sample("num_requests_running"), sample("num_requests_waiting")) == (7, 5)

    many = [GroupStats(f"g{i}", "hybrid", 1, 0, 10, 1) for i in range(MAX_GROUP_STATS + 5)]
    metrics.update_scheduler(msgspec.structs.replace(stats, groups=many))
    rendered = parse_samples(metrics.render().decode())
    per_group = [key for key in rendered if key[0] == "switchyard:num_requests_running_by_group"]
    assert len(per_group) == MAX_GROUP_STATS


def family_of(sample_name: str) -> str:
    return sample_name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
