"""Messages the scheduler sends to an API server (frontend ROUTER → that server's DEALER)."""

from __future__ import annotations

import msgspec

from interfaces.embeddings import EmbeddingsOutput
from interfaces.handshake import HandshakeRefused
from interfaces.lora import LoRAAdapterInfo, LoRAResponse
from interfaces.outputs import SchedulerResult, TextGenerationOutput
from interfaces.requests import RequestID
from interfaces.scheduler_to_worker import MAX_DRAFT_TOKENS


class SchedulerResults(msgspec.Struct, tag="results", array_like=True):
    """This step's results for the requests the receiving API server owns."""

    results: dict[RequestID, SchedulerResult[TextGenerationOutput]]


ITERATION_TOKENS_BUCKETS: tuple[int, ...] = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)  # fmt: skip
"""Upper bounds (inclusive) of the ``iteration_tokens_total`` histogram's buckets, vLLM's."""


KV_TRANSFER_SECONDS_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds (inclusive) of the ``kv_transfer_seconds`` histogram's buckets."""


MIGRATION_PAUSE_SECONDS_BUCKETS: tuple[float, ...] = (
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
)  # fmt: skip
"""Upper bounds (inclusive) of the ``migration_pause_seconds`` histogram's buckets."""

WORKER_DIED = "worker_died"
"""A request moved because a worker of its group went away (and a group left for that)."""
WORKER_STALLED = "worker_stalled"
"""A request moved because its group was fenced for a step that ran past its stall bound."""
SCHEDULER_RESTARTED = "scheduler_restarted"
"""A request moved because the scheduler restarted and its API server submitted it again."""
MIGRATION_REASONS: tuple[str, ...] = (WORKER_DIED, WORKER_STALLED, SCHEDULER_RESTARTED)
"""Why a request moved (the ``reason`` label of ``request_migrations_total``)."""
MAX_GROUPS_AWAY = 256
"""The most ``SchedulerStats.groups_away`` entries reported (the newest), and so the most
``/health`` lists; the launcher's parser (``switchyard.groups_away``) accepts no more."""


class GroupAway(msgspec.Struct, array_like=True):
    """A worker group that served and left (it died, or was fenced as stalled), and has not
    served again: for ``/health`` and the launcher, which restarts it."""

    name: str
    reason: str
    """One of ``MIGRATION_REASONS``' worker reasons: ``WORKER_DIED`` or ``WORKER_STALLED``."""
    seconds: float
    """How long ago it left."""


MAX_GROUP_STATS = 256
"""The most ``SchedulerStats.groups`` entries reported: as many groups as serve at once (the
scheduler's ``MAX_GROUPS``); an API server renders no more."""


class GroupStats(msgspec.Struct, array_like=True):
    """One serving worker group's share of ``SchedulerStats``, for the per-group series.

    The prefix-cache counters count from the group's first registration with this scheduler
    process and carry on across its restarts under the same name."""

    name: str
    role: str
    """A ``WorkerRole`` value: hybrid, prefill or decode."""
    num_requests_running: int
    num_requests_waiting: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the group's KV blocks in use, 0.0 to 1.0."""
        return (
            self.num_kv_blocks_used / self.num_kv_blocks_total if self.num_kv_blocks_total else 0.0
        )


class SchedulerStats(msgspec.Struct, tag="stats", array_like=True):
    """A snapshot of the scheduler's state, in reply to ``StatsRequest``.

    The ``*_total`` fields are counters since the scheduler process started. Prefix-cache
    queries count the tokens looked up when requests were admitted; hits, the tokens found
    already cached. ``iteration_tokens_counts[i]`` counts the steps that computed at most
    ``ITERATION_TOKENS_BUCKETS[i]`` tokens (and more than the bound before it); the last entry,
    the steps above every bound. ``iteration_tokens_sum`` adds every step's tokens.

    With disaggregation, the ``*_by_role`` gauges split running and waiting requests by the role
    of the group holding them (requests waiting for a decode reservation count as waiting for
    prefill; a request whose KV is in transfer counts as running in the total only). The
    ``kv_transfer_*`` fields count the KV blocks sent from prefill to decode groups: bytes,
    and the transfers' durations as a histogram over ``KV_TRANSFER_SECONDS_BUCKETS``.
    """

    num_requests_running: int
    num_requests_waiting: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    workers_ready: bool
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    iteration_tokens_counts: list[int] = msgspec.field(
        default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    )
    iteration_tokens_sum: int = 0
    num_requests_running_by_role: dict[str, int] = {}
    num_requests_waiting_by_role: dict[str, int] = {}
    kv_transfer_bytes_total: int = 0
    kv_transfer_seconds_counts: list[int] = msgspec.field(
        default_factory=lambda: [0] * (len(KV_TRANSFER_SECONDS_BUCKETS) + 1)
    )
    kv_transfer_seconds_sum: float = 0.0
    embedding_workers_ready: bool = False
    """An embedding worker group serves /v1/embeddings."""
    request_migrations_total: dict[str, int] = {}
    """Moves of a request to another group (or the same group back), by reason
    (``MIGRATION_REASONS``)."""
    worker_restarts_total: int = 0
    """Groups that served, left, and registered again under the same name."""
    migration_pause_seconds_counts: list[int] = msgspec.field(
        default_factory=lambda: [0] * (len(MIGRATION_PAUSE_SECONDS_BUCKETS) + 1)
    )
    """From a moved request's departure from its group to its next token, over
    ``MIGRATION_PAUSE_SECONDS_BUCKETS``."""
    migration_pause_seconds_sum: float = 0.0
    groups_away: list[GroupAway] = []
    """Groups that left less than ``--worker-return-timeout`` ago and have not served again,
    the newest first, at most ``MAX_GROUPS_AWAY``."""
    groups: list[GroupStats] = []
    """Every serving text generation group, by name, at most ``MAX_GROUP_STATS``."""
    spec_decode_num_drafts_total: int = 0
    """Speculative decoding: requests' steps that carried draft tokens, the drafts, the drafts
    accepted, and those by position in the step (index 0: the first draft; at most
    ``MAX_DRAFT_TOKENS`` entries)."""
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_num_accepted_tokens_per_pos_total: list[int] = msgspec.field(
        default_factory=lambda: [0] * MAX_DRAFT_TOKENS
    )
    lora_adapters: list[LoRAAdapterInfo] = []
    """The LoRA adapters requests may name (at most ``MAX_LORAS``)."""
    max_loras: int = 0
    """Adapters the worker groups hold at once (0: LoRA is not enabled)."""
    running_lora_adapters: list[str] = []
    """Adapters of running requests, and of waiting ones (vLLM's ``lora_requests_info``)."""
    waiting_lora_adapters: list[str] = []

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use, 0.0 to 1.0."""
        return (
            self.num_kv_blocks_used / self.num_kv_blocks_total if self.num_kv_blocks_total else 0.0
        )


class SchedulerEmbeddingsResults(msgspec.Struct, tag="embeddings", array_like=True):
    """Embeddings (or why not) for inputs the receiving API server submitted."""

    results: dict[RequestID, SchedulerResult[EmbeddingsOutput]]


class LoRAOperationResult(msgspec.Struct, tag="lora_result", array_like=True):
    """The answer to the ``LoRAOperationRequest`` numbered ``ticket``."""

    ticket: int
    response: LoRAResponse


SchedulerToApiMessage = (
    SchedulerResults
    | SchedulerEmbeddingsResults
    | SchedulerStats
    | HandshakeRefused
    | LoRAOperationResult
)
"""``HandshakeRefused`` (``interfaces.handshake``) answers an ``ApiHello`` of another protocol
version, and nothing follows it."""
