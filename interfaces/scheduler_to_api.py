"""Messages the scheduler sends to an API server (frontend ROUTER → that server's DEALER)."""

from __future__ import annotations

import msgspec

from interfaces.outputs import SchedulerResult, TextGenerationOutput
from interfaces.requests import RequestID


class SchedulerResults(msgspec.Struct, tag="results", array_like=True):
    """This step's results for the requests the receiving API server owns."""

    results: dict[RequestID, SchedulerResult[TextGenerationOutput]]


class SchedulerStats(msgspec.Struct, tag="stats", array_like=True):
    """A snapshot of the scheduler's state, in reply to ``StatsRequest``.

    The ``*_total`` fields are counters since the scheduler started. Prefix-cache queries count
    the tokens looked up when requests were admitted; hits, the tokens found already cached.
    """

    num_requests_running: int
    num_requests_waiting: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    workers_ready: bool
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use, 0.0 to 1.0."""
        return (
            self.num_kv_blocks_used / self.num_kv_blocks_total if self.num_kv_blocks_total else 0.0
        )


SchedulerToApiMessage = SchedulerResults | SchedulerStats
