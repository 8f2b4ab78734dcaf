"""Prometheus metrics served at /metrics, named as vLLM's with the ``switchyard:`` prefix.

Two sources, each counted once however many API server processes there are:

- Per-request metrics (token counters, finished requests, latency histograms) are recorded by
  the API server process that owns the request. When several processes serve one port, the
  launcher points them all at one ``PROMETHEUS_MULTIPROC_DIR`` and every process's /metrics adds
  up all of them (prometheus-client's multiprocess mode), so any process shows the whole server.
- Scheduler-side metrics (running, waiting, KV cache usage, preemptions, prefix cache,
  iteration tokens, KV transfers, request migrations, worker restarts) are the scheduler's own
  numbers, fetched at scrape time: every API server
  shows the same values, never a sum of them.

HTTP request counts and latencies come from prometheus-fastapi-instrumentator
(``http_requests_total``, ``http_request_duration_seconds``), as vLLM exposes them. Their labels
take fixed values only, whatever a client sends (unauthenticated clients included): ``method``
one of ``HTTP_METHODS`` or "OTHER", ``handler`` a route's template or "none", ``status`` a status
code this server answers.
Every ``switchyard:`` metric carries a ``model_name`` label.
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Callable, Iterator

import prometheus_client
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from prometheus_fastapi_instrumentator import Instrumentator
from prometheus_fastapi_instrumentator import metrics as http_metrics

from interfaces import RequestTimings, envs
from interfaces.lora import MAX_LORAS
from interfaces.scheduler_to_api import (
    ITERATION_TOKENS_BUCKETS,
    KV_TRANSFER_SECONDS_BUCKETS,
    MAX_GROUP_STATS,
    MIGRATION_PAUSE_SECONDS_BUCKETS,
    MIGRATION_REASONS,
    GroupStats,
    SchedulerStats,
)
from interfaces.scheduler_to_worker import MAX_DRAFT_TOKENS

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST
FINISHED_REASONS = ("stop", "length", "abort", "error")
"""``request_success_total``'s ``finished_reason`` values: the OpenAI finish reasons, "abort"
(the client went away, or the server drained), and "error" (the system failed the request)."""

# vLLM's buckets; inter-token latency gets two finer ones, reachable on small models.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
HTTP_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
    320.0, 640.0, 1280.0, 2560.0,
)  # fmt: skip
"""``http_request_duration_seconds``: up to the longest generation a request may take (the
instrumentator's own top bucket, 10 s, held every longer request's p99 at 10 s)."""
TOKEN_COUNT_BUCKETS = (
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000,
)  # fmt: skip

SCHEDULER_METRIC_NAMES = (
    "switchyard:num_requests_running",
    "switchyard:num_requests_waiting",
    "switchyard:kv_cache_usage_perc",
    "switchyard:num_preemptions_total",
    "switchyard:prefix_cache_queries_total",
    "switchyard:prefix_cache_hits_total",
    "switchyard:iteration_tokens_total",
    "switchyard:num_requests_running_by_role",
    "switchyard:num_requests_waiting_by_role",
    "switchyard:kv_transfer_bytes_total",
    "switchyard:kv_transfer_seconds",
    "switchyard:request_migrations_total",
    "switchyard:worker_restarts_total",
    "switchyard:spec_decode_num_drafts_total",
    "switchyard:spec_decode_num_draft_tokens_total",
    "switchyard:spec_decode_num_accepted_tokens_total",
    "switchyard:spec_decode_num_accepted_tokens_per_pos_total",
    "switchyard:migration_pause_seconds",
    "switchyard:num_requests_running_by_group",
    "switchyard:num_requests_waiting_by_group",
    "switchyard:kv_cache_usage_perc_by_group",
    "switchyard:prefix_cache_queries_by_group_total",
    "switchyard:prefix_cache_hits_by_group_total",
)
"""The scheduler's series (histogram series add _bucket, _sum, _count): the same on every API
server of one scheduler. deploy/prometheus/prometheus.yml scrapes them from one replica only."""

HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
OTHER_METHOD = "OTHER"
"""The ``method`` label of any method not in ``HTTP_METHODS`` (uvicorn's h11 parser takes any
token as a method: 300 made-up ones would otherwise make 300 series)."""

# `_created` series would differ between the in-process and multiprocess modes (the latter has
# none) and vLLM does not expose them either.
prometheus_client.disable_created_metrics()


class ServerMetrics:
    """Every metric one API server process serves, and its /metrics rendering."""

    def __init__(self, model_name: str) -> None:
        """``ValueError`` when ``PROMETHEUS_MULTIPROC_DIR`` names no directory."""
        self.model_name = model_name
        self.num_request_changes = 0
        """Requests this process took, started or finished so far: stats fetched before a
        change may not show it (api_server.stats_tickets.SchedulerStatsCache)."""
        self.registry = CollectorRegistry()
        self._multiprocess_dir = envs.prometheus_multiproc_dir()
        if self._multiprocess_dir is not None and not os.path.isdir(self._multiprocess_dir):
            raise ValueError(
                f"{envs.PROMETHEUS_MULTIPROC_DIR_VARIABLE}={self._multiprocess_dir} is not a "
                "directory; create it (empty) or unset the variable"
            )
        self._scheduler = SchedulerCollector(model_name)
        label = {"model_name": model_name}

        def counter(name: str, documentation: str) -> Counter:
            metric = Counter(name, documentation, ["model_name"], registry=self.registry)
            return metric.labels(**label)

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(
                name, documentation, ["model_name"], buckets=buckets, registry=self.registry
            )
            return metric.labels(**label)

        self.prompt_tokens = counter(
            "switchyard:prompt_tokens", "Prompt tokens of requests that started generating."
        )
        self.generation_tokens = counter("switchyard:generation_tokens", "Generated tokens.")
        success = Counter(
            "switchyard:request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.request_success = {
            reason: success.labels(model_name=model_name, finished_reason=reason)
            for reason in FINISHED_REASONS
        }
        self.time_to_first_token = histogram(
            "switchyard:time_to_first_token_seconds",
            "From the API server taking the request to its first generated token.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "switchyard:inter_token_latency_seconds",
            "Between successive generated tokens of one request.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "switchyard:e2e_request_latency_seconds",
            "From the API server taking the request to its end.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_queue_time = histogram(
            "switchyard:request_queue_time_seconds",
            "Waiting in the scheduler's queue before first scheduled.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "switchyard:request_prefill_time_seconds",
            "From first scheduled to the first generated token.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_decode_time = histogram(
            "switchyard:request_decode_time_seconds",
            "From the first generated token to the last.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "switchyard:request_prompt_tokens",
            "Prompt tokens per request.",
            TOKEN_COUNT_BUCKETS,
        )
        self.request_generation_tokens = histogram(
            "switchyard:request_generation_tokens",
            "Generated tokens per finished request.",
            TOKEN_COUNT_BUCKETS,
        )
        if self._multiprocess_dir is None:
            self.registry.register(self._scheduler)

    def instrument(self, app: FastAPI) -> None:
        """Count and time every HTTP request ``app`` serves (except /metrics itself)."""
        instrumentator = Instrumentator(
            should_group_status_codes=False,
            excluded_handlers=["/metrics"],
            registry=self.registry,
        )
        count = http_metrics.requests(registry=self.registry)
        observe_latency = http_metrics.latency(buckets=HTTP_LATENCY_BUCKETS, registry=self.registry)

        def record(info: http_metrics.Info) -> None:
            info.method = method_label(info.method)
            count(info)
            observe_latency(info)

        instrumentator.add(record)
        instrumentator.instrument(app)

    def update_scheduler(self, stats: SchedulerStats | None) -> None:
        """The scheduler's latest numbers; None when it did not answer (its series are left
        out: stale or zero counters, scraped from one process after fresher ones from another,
        would read as a counter reset)."""
        self._scheduler.stats = stats

    def render(self) -> bytes:
        """The Prometheus text exposition: this process's metrics (all processes' in
        multiprocess mode) and the scheduler's latest numbers."""
        if self._multiprocess_dir is None:
            return prometheus_client.generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, self._multiprocess_dir)
        registry.register(self._scheduler)
        return prometheus_client.generate_latest(registry)

    def request(self, arrival_time: float, num_prompt_tokens: int) -> RequestMetrics:
        """The recorder of one request (one choice) that arrived at ``arrival_time``
        (``time.monotonic()``); its ``num_prompt_tokens`` are counted once it starts
        generating (0: counted by a sibling choice already)."""
        self.num_request_changes += 1
        return RequestMetrics(self, arrival_time, num_prompt_tokens)


def method_label(method: str) -> str:
    """The ``method`` label for an HTTP request line's method: itself if it is a standard one,
    else ``OTHER_METHOD``."""
    return method if method in HTTP_METHODS else OTHER_METHOD


class RequestMetrics:
    """What one request adds to the metrics, recorded as its results arrive.

    Counts what the response's ``usage`` counts: a prompt's tokens once however many choices it
    has, and each choice's generated tokens. The per-token values (generated tokens, inter-token
    latencies) are gathered here and added to the shared metrics at most every
    ``FLUSH_INTERVAL_S`` and at the end: in multiprocess mode each ``inc`` or ``observe`` writes
    a shared file under a lock, which per token cost a third of the API server's time.
    """

    FLUSH_INTERVAL_S = 1.0

    def __init__(self, metrics: ServerMetrics, arrival_time: float, num_prompt_tokens: int):
        self._metrics = metrics
        self._arrival_time = arrival_time
        self._num_prompt_tokens = num_prompt_tokens
        self._first_token_time: float | None = None
        self._last_token_time: float | None = None
        self._num_generated = 0
        self._unflushed_tokens = 0
        self._inter_token_latencies = BatchedObservations(metrics.inter_token_latency)
        self._flushed_at = arrival_time
        self._finished = False

    def started(self, timings: RequestTimings | None) -> None:
        """The first result with output arrived (its tokens may be counted separately)."""
        now = time.monotonic()
        self._first_token_time = self._last_token_time = self._flushed_at = now
        metrics = self._metrics
        metrics.num_request_changes += 1
        metrics.time_to_first_token.observe(now - self._arrival_time)
        metrics.prompt_tokens.inc(self._num_prompt_tokens)
        if self._num_prompt_tokens:
            metrics.request_prompt_tokens.observe(self._num_prompt_tokens)
        if timings is not None:
            metrics.request_queue_time.observe(timings.queued_s)
            metrics.request_prefill_time.observe(timings.prefill_s)

    def generated(self, num_tokens: int) -> None:
        """``num_tokens`` more tokens reached the client's count (``usage``)."""
        if not num_tokens:
            return
        now = time.monotonic()
        if self._num_generated and self._last_token_time is not None:
            self._inter_token_latencies.observe(now - self._last_token_time)
        self._last_token_time = now
        self._num_generated += num_tokens
        self._unflushed_tokens += num_tokens
        if now - self._flushed_at >= self.FLUSH_INTERVAL_S:
            self._flush(now)

    def finished(self, reason: str) -> None:
        """The request ended with ``reason`` (one of ``FINISHED_REASONS``); only the first call
        counts."""
        if self._finished:
            return
        self._finished = True
        now = time.monotonic()
        self._flush(now)
        metrics = self._metrics
        metrics.num_request_changes += 1
        metrics.request_success[reason].inc()
        metrics.e2e_request_latency.observe(now - self._arrival_time)
        if self._first_token_time is not None and self._last_token_time is not None:
            metrics.request_decode_time.observe(self._last_token_time - self._first_token_time)
            metrics.request_generation_tokens.observe(self._num_generated)

    def _flush(self, now: float) -> None:
        if self._unflushed_tokens:
            self._metrics.generation_tokens.inc(self._unflushed_tokens)
            self._unflushed_tokens = 0
        self._inter_token_latencies.flush()
        self._flushed_at = now


class BatchedObservations:
    """Observations of one histogram gathered in plain lists, then added in one go.

    prometheus-client has no bulk observe, so ``flush`` adds to the histogram's bucket and sum
    values (``_buckets``, ``_sum``, ``_upper_bounds``: its layout since 2015), exactly what the
    same ``observe`` calls would have added; tests/e2e/test_metrics.py holds it to that.
    """

    def __init__(self, histogram: Histogram) -> None:
        self._histogram = histogram
        self._upper_bounds = list(histogram._upper_bounds)
        self._counts = [0] * len(self._upper_bounds)
        self._sum = 0.0
        self._pending = False

    def observe(self, amount: float) -> None:
        self._counts[bisect.bisect_left(self._upper_bounds, amount)] += 1
        self._sum += amount
        self._pending = True

    def flush(self) -> None:
        if not self._pending:
            return
        histogram = self._histogram
        for index, count in enumerate(self._counts):
            if count:
                histogram._buckets[index].inc(count)
                self._counts[index] = 0
        histogram._sum.inc(self._sum)
        self._sum = 0.0
        self._pending = False


class SchedulerCollector(Collector):
    """The scheduler's ``SchedulerStats`` of this scrape as metric families (none without)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: SchedulerStats | None = None

    def collect(self) -> Iterator[Metric]:
        stats, labels = self.stats, [self.model_name]
        if stats is None:
            return

        def family(kind, name: str, documentation: str, value: float) -> Metric:
            metric = kind(name, documentation, labels=["model_name"])
            metric.add_metric(labels, value)
            return metric

        yield family(
            GaugeMetricFamily,
            "switchyard:num_requests_running",
            "Requests in the scheduler's batch.",
            stats.num_requests_running,
        )
        yield family(
            GaugeMetricFamily,
            "switchyard:num_requests_waiting",
            "Requests waiting in the scheduler's queue.",
            stats.num_requests_waiting,
        )
        yield family(
            GaugeMetricFamily,
            "switchyard:kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (0 to 1).",
            stats.kv_cache_usage,
        )
        yield family(
            CounterMetricFamily,
            "switchyard:num_preemptions",
            "Requests preempted (KV blocks taken back, recomputed later).",
            stats.num_preemptions_total,
        )
        yield family(
            CounterMetricFamily,
            "switchyard:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries_total,
        )
        yield family(
            CounterMetricFamily,
            "switchyard:prefix_cache_hits",
            "Of those, tokens found cached.",
            stats.prefix_cache_hits_total,
        )
        yield self._histogram(
            "switchyard:iteration_tokens_total",
            "Tokens computed per scheduler step.",
            ITERATION_TOKENS_BUCKETS,
            stats.iteration_tokens_counts,
            stats.iteration_tokens_sum,
        )
        for state, by_role in (
            ("running", stats.num_requests_running_by_role),
            ("waiting", stats.num_requests_waiting_by_role),
        ):
            metric = GaugeMetricFamily(
                f"switchyard:num_requests_{state}_by_role",
                f"Requests {state} on the worker groups of each role (hybrid, prefill, decode).",
                labels=["model_name", "role"],
            )
            for role, value in sorted(by_role.items()):
                metric.add_metric([self.model_name, role], value)
            yield metric
        yield family(
            CounterMetricFamily,
            "switchyard:kv_transfer_bytes",
            "Bytes of KV cache blocks sent from prefill to decode worker groups.",
            stats.kv_transfer_bytes_total,
        )
        yield self._histogram(
            "switchyard:kv_transfer_seconds",
            "Seconds from a prefill group starting to send a request's KV blocks to its decode "
            "group holding them all.",
            KV_TRANSFER_SECONDS_BUCKETS,
            stats.kv_transfer_seconds_counts,
            stats.kv_transfer_seconds_sum,
        )
        yield from self._migrations(stats)
        yield from self._groups(stats)
        yield from self._speculative(stats)
        if stats.max_loras:
            yield self._lora_requests_info(stats)

    def _lora_requests_info(self, stats: SchedulerStats) -> Metric:
        """vLLM's ``lora_requests_info``: the adapters of running and of waiting requests
        (comma-separated names) and ``--max-loras`` as labels; the value is when it was
        read (seconds since the epoch)."""
        metric = GaugeMetricFamily(
            "switchyard:lora_requests_info",
            "Running stats on LoRA requests.",
            labels=["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        running = ",".join(stats.running_lora_adapters[:MAX_LORAS])
        waiting = ",".join(stats.waiting_lora_adapters[:MAX_LORAS])
        labels = [self.model_name, str(stats.max_loras), running, waiting]
        metric.add_metric(labels, time.time())
        return metric

    def _groups(self, stats: SchedulerStats) -> Iterator[Metric]:
        """Each serving text generation group's series, labelled by ``group`` and ``role``
        (every request counted once: on the group that holds it)."""
        groups = stats.groups[:MAX_GROUP_STATS]
        families: tuple[tuple[type, str, str, Callable[[GroupStats], float]], ...] = (
            (
                GaugeMetricFamily,
                "num_requests_running",
                "Requests in the group's batch.",
                lambda group: group.num_requests_running,
            ),
            (
                GaugeMetricFamily,
                "num_requests_waiting",
                "Requests waiting in the group's queue.",
                lambda group: group.num_requests_waiting,
            ),
            (
                GaugeMetricFamily,
                "kv_cache_usage_perc",
                "Fraction of the group's KV cache blocks in use (0 to 1).",
                lambda group: group.kv_cache_usage,
            ),
            (
                CounterMetricFamily,
                "prefix_cache_queries",
                "Prompt tokens looked up in the group's prefix cache.",
                lambda group: group.prefix_cache_queries_total,
            ),
            (
                CounterMetricFamily,
                "prefix_cache_hits",
                "Of those, tokens found cached there.",
                lambda group: group.prefix_cache_hits_total,
            ),
        )
        for kind, name, documentation, value in families:
            metric = kind(
                f"switchyard:{name}_by_group", documentation, labels=["model_name", "group", "role"]
            )
            for group in groups:
                metric.add_metric([self.model_name, group.name, group.role], value(group))
            yield metric

    def _speculative(self, stats: SchedulerStats) -> Iterator[Metric]:
        """Speculative decoding, as vLLM names it: drafts, draft tokens, accepted tokens, and
        accepted tokens by position (every position up to ``MAX_DRAFT_TOKENS``)."""
        for name, documentation, value in (
            ("drafts", "Request steps that verified drafts.", stats.spec_decode_num_drafts_total),
            ("draft_tokens", "Draft tokens verified.", stats.spec_decode_num_draft_tokens_total),
            ("accepted_tokens", "Drafts accepted.", stats.spec_decode_num_accepted_tokens_total),
        ):  # fmt: skip
            metric = CounterMetricFamily(
                f"switchyard:spec_decode_num_{name}", documentation, labels=["model_name"]
            )
            metric.add_metric([self.model_name], value)
            yield metric
        per_position = CounterMetricFamily(
            "switchyard:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position among a step's drafts (0: the first).",
            labels=["model_name", "position"],
        )
        counts = stats.spec_decode_num_accepted_tokens_per_pos_total[:MAX_DRAFT_TOKENS]
        counts += [0] * (MAX_DRAFT_TOKENS - len(counts))
        for position, value in enumerate(counts):
            per_position.add_metric([self.model_name, str(position)], value)
        yield per_position

    def _migrations(self, stats: SchedulerStats) -> Iterator[Metric]:
        """Requests moved to another worker group, by reason (every one of
        ``MIGRATION_REASONS``, 0 included), groups restarted, and the pause of moved requests."""
        migrations = CounterMetricFamily(
            "switchyard:request_migrations",
            "Requests moved to another worker group (or the same one restarted) and recomputed "
            "there, by why they moved.",
            labels=["model_name", "reason"],
        )
        for reason in MIGRATION_REASONS:
            value = stats.request_migrations_total.get(reason, 0)
            migrations.add_metric([self.model_name, reason], value)
        yield migrations
        restarts = CounterMetricFamily(
            "switchyard:worker_restarts",
            "Worker groups that left and registered again under the same name.",
            labels=["model_name"],
        )
        restarts.add_metric([self.model_name], stats.worker_restarts_total)
        yield restarts
        yield self._histogram(
            "switchyard:migration_pause_seconds",
            "Seconds from a moved request's worker group leaving to its next token.",
            MIGRATION_PAUSE_SECONDS_BUCKETS,
            stats.migration_pause_seconds_counts,
            stats.migration_pause_seconds_sum,
        )

    def _histogram(
        self,
        name: str,
        documentation: str,
        bounds: tuple[float, ...],
        counts: list[int],
        total: float,
    ) -> HistogramMetricFamily:
        """A histogram family from per-bucket (not cumulative) ``counts``, the last above
        every bound."""
        labels = [str(float(bound)) for bound in bounds] + ["+Inf"]
        cumulative, buckets = 0, []
        for bound, count in zip(labels, counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        metric = HistogramMetricFamily(name, documentation, labels=["model_name"])
        metric.add_metric([self.model_name], buckets, total)
        return metric
