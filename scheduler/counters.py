"""Counters the scheduler keeps for /metrics, for the life of the scheduler process.

A new ``Scheduler`` is made each time a worker registers; the counters outlive it, so that
Prometheus sees them only grow while the scheduler process runs.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from interfaces.scheduler_to_api import (
    ITERATION_TOKENS_BUCKETS,
    KV_TRANSFER_SECONDS_BUCKETS,
    MIGRATION_PAUSE_SECONDS_BUCKETS,
    MIGRATION_REASONS,
)
from interfaces.scheduler_to_worker import MAX_DRAFT_TOKENS


@dataclass
class GroupCounters:
    """One worker group's prefix-cache counters (``SchedulerCounters`` counts every group's),
    kept by name across the group's restarts."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass
class SchedulerCounters:
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    """Tokens looked up in the prefix cache when requests were admitted."""
    prefix_cache_hits: int = 0
    """Of those, tokens found already cached."""
    iteration_tokens_counts: list[int] = field(
        default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    )
    """Steps per bucket of ``ITERATION_TOKENS_BUCKETS`` (not cumulative; the last: above all)."""
    iteration_tokens_sum: int = 0
    kv_transfer_bytes: int = 0
    """Bytes of KV blocks that decode groups received from prefill groups."""
    kv_transfer_seconds_counts: list[int] = field(
        default_factory=lambda: [0] * (len(KV_TRANSFER_SECONDS_BUCKETS) + 1)
    )
    kv_transfer_seconds_sum: float = 0.0
    request_migrations: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(MIGRATION_REASONS, 0)
    )
    """Moves of a request to another group (or the same one back), by why its group left."""
    worker_restarts: int = 0
    """Groups that served, left, and served again under the same name."""
    migration_pause_seconds_counts: list[int] = field(
        default_factory=lambda: [0] * (len(MIGRATION_PAUSE_SECONDS_BUCKETS) + 1)
    )
    """Moved requests per bucket of ``MIGRATION_PAUSE_SECONDS_BUCKETS`` of the time from their
    group leaving to their next token (not cumulative; the last: above all)."""
    migration_pause_seconds_sum: float = 0.0
    spec_decode_num_drafts: int = 0
    """Requests' steps that carried draft tokens (speculative decoding)."""
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(
        default_factory=lambda: [0] * MAX_DRAFT_TOKENS
    )
    """Entry i: drafts accepted at position i (the i + 1-th draft of a step)."""

    def observe_drafts(self, num_drafts: int, num_accepted: int) -> None:
        """Count one request's step that verified ``num_drafts`` drafts, the first
        ``num_accepted`` of them accepted."""
        self.spec_decode_num_drafts += 1
        self.spec_decode_num_draft_tokens += num_drafts
        self.spec_decode_num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.spec_decode_num_accepted_tokens_per_pos[position] += 1

    def observe_kv_transfer(self, num_bytes: int, seconds: float) -> None:
        """Count one finished transfer of a request's blocks."""
        self.kv_transfer_bytes += num_bytes
        index = bisect.bisect_left(KV_TRANSFER_SECONDS_BUCKETS, seconds)
        self.kv_transfer_seconds_counts[index] += 1
        self.kv_transfer_seconds_sum += seconds

    def count_migration(self, cause: str) -> None:
        """Count one request moved because its group left with ``cause`` (a
        ``MIGRATION_REASONS`` label)."""
        self.request_migrations[cause] += 1

    def observe_migration_pause(self, seconds: float) -> None:
        """Count a moved request's first token after the move, ``seconds`` after its group
        left."""
        index = bisect.bisect_left(MIGRATION_PAUSE_SECONDS_BUCKETS, seconds)
        self.migration_pause_seconds_counts[index] += 1
        self.migration_pause_seconds_sum += seconds

    def observe_step(self, num_tokens: int) -> None:
        """Count one step that computed ``num_tokens`` tokens."""
        self.iteration_tokens_counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
        self.iteration_tokens_sum += num_tokens
