"""The scheduler's mutable state for one request."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from interfaces import GenerationStatus, RequestID, TextContext
from scheduler.block_hash import BlockHash
from scheduler.speculative import SpecDecodingState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    RESERVED = "reserved"
    """Holding blocks for KV computed elsewhere, not yet running (disaggregation)."""
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One request as the scheduler tracks it.

    ``num_computed_tokens`` counts tokens whose KV is (or, once the in-flight step lands, will be)
    in the cache. It catches up to ``num_tokens``; prefill, chunked prefill, decode, prefix-cache
    hits and recompute after preemption are all that one mechanism. ``client_id`` is the ZeroMQ
    identity of the API server that owns the request and receives its results.
    ``num_cached_blocks`` of its leading blocks are registered in the prefix cache;
    ``block_hashes`` grows as its blocks fill.
    ``waiting_for_grammar``: running, but the worker deferred its token until its grammar
    compiles (``WorkerOutput.deferred``); it is not scheduled until ``GrammarsReady`` names it.
    ``stop_token_ids`` and ``eos_token_ids`` are sets: every generated token is looked up in
    them, and a request may bring millions of stop ids.
    """

    context: TextContext
    client_id: bytes
    max_model_len: int
    all_token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    max_new_tokens: int = field(init=False)
    """The most tokens this request may generate, bounded by the model's context."""
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_queued_work: int = 0
    """Tokens it was to compute when it was last queued: those not in the prefix cache then
    (``Scheduler.num_tokens_ahead``)."""
    status: RequestStatus = RequestStatus.WAITING
    worker_has_state: bool = False
    num_preemptions: int = 0
    num_migrations: int = 0
    """How often it moved to another group (or the same one back) after its group left."""
    left_group_time: float | None = None
    """When the group it ran on left (``time.monotonic()``), until its first token after the
    move (``migration_pause_seconds``); None otherwise."""
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    """When the request was first admitted to the batch (``time.monotonic()``)."""
    waiting_for_grammar: bool = False
    spec: SpecDecodingState | None = None
    """Its speculative decoding state, from its first draft lookup (``scheduler.speculative``);
    None without speculative decoding."""
    stop_token_ids: frozenset[int] = field(init=False)
    eos_token_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        params = self.context.sampling_params
        self.stop_token_ids = frozenset(params.stop_token_ids or ())
        self.eos_token_ids = frozenset(() if params.ignore_eos else self.context.eos_token_ids)
        self.all_token_ids = [*self.context.prompt_token_ids, *self.context.generated_token_ids]
        self.num_prompt_tokens = len(self.context.prompt_token_ids)
        max_length = min(self.context.max_length, self.max_model_len)
        self.max_new_tokens = max_length - self.num_prompt_tokens

    @property
    def request_id(self) -> RequestID:
        return self.context.request_id

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what the KV cache must eventually hold."""
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def append_token(self, token_id: int) -> GenerationStatus:
        """Record a sampled token and decide whether the request is done."""
        self.all_token_ids.append(token_id)
        if self.spec is not None:
            self.spec.extend((token_id,))
        params = self.context.sampling_params
        num_output = self.num_output_tokens
        if num_output >= params.min_new_tokens and (
            token_id in self.stop_token_ids or token_id in self.eos_token_ids
        ):
            return GenerationStatus.END_OF_SEQUENCE
        if num_output >= self.max_new_tokens:
            return GenerationStatus.MAXIMUM_LENGTH
        return GenerationStatus.ACTIVE
