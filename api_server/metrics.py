"""Prometheus metrics served at /metrics, refreshed from the scheduler at scrape time.

The gauges describe the scheduler, so every API server process reports the same values; each
process keeps them in its own registry (tests run several apps in one process).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from interfaces.scheduler_to_api import SchedulerStats

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST


class SchedulerMetrics:
    """``switchyard:num_requests_running``, ``switchyard:num_requests_waiting`` and
    ``switchyard:kv_cache_usage_perc`` (a fraction from 0 to 1, as vLLM's gauge of that name),
    each labelled with ``model_name``."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._running = Gauge(
            "switchyard:num_requests_running",
            "Requests the scheduler is running (in the batch).",
            labels,
            registry=self.registry,
        ).labels(model_name=model_name)
        self._waiting = Gauge(
            "switchyard:num_requests_waiting",
            "Requests waiting in the scheduler's queue.",
            labels,
            registry=self.registry,
        ).labels(model_name=model_name)
        self._kv_cache_usage = Gauge(
            "switchyard:kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (0 to 1).",
            labels,
            registry=self.registry,
        ).labels(model_name=model_name)

    def update(self, stats: SchedulerStats) -> None:
        self._running.set(stats.num_requests_running)
        self._waiting.set(stats.num_requests_waiting)
        self._kv_cache_usage.set(stats.kv_cache_usage)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric in this registry."""
        return generate_latest(self.registry)
