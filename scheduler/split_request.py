"""Where one disaggregated request is (``Phase``) and what its KV transfer has done
(``SplitRequest``), as ``scheduler.disaggregation.DisaggregatedPlacement`` tracks it; and how it
starts over when a group holding it leaves (``SplitRequest.queue_again``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec

from interfaces import RequestID, TextContext
from scheduler.request import Request


class Phase(enum.Enum):
    """Queued for a decode reservation; prefilling; its KV on its way; decoding."""

    QUEUED = "queued"
    PREFILL = "prefill"
    TRANSFER = "transfer"
    DECODE = "decode"


@dataclass(eq=False)
class SplitRequest:
    """A disaggregated request: where it is and what its transfer has done."""

    context: TextContext
    client_id: bytes
    phase: Phase = Phase.QUEUED
    prefill: str | None = None
    decode: str | None = None
    decode_block_ids: list[int] = field(default_factory=list)
    transfer_id: int | None = None
    first_token: int | None = None
    """The token its prefill sampled (its first, or its next after those it brought)."""
    handoff_time: float | None = None
    ranks_received: set[int] = field(default_factory=set)
    num_bytes: int = 0
    seconds: float = 0.0
    num_migrations: int = 0
    """How often it moved after a group holding it left (``migration_limit``)."""
    left_group_time: float | None = None
    """When a group holding it left (``time.monotonic()``), until its next token; else None."""

    @property
    def request_id(self) -> RequestID:
        return self.context.request_id

    def tokens_sent(self, decoding: Request | None) -> list[int]:
        """The tokens its client received: those its decode group's request ``decoding``
        generated once it decodes, else those it brought and the first token of its prefill."""
        if self.phase is Phase.DECODE and decoding is not None:
            return list(decoding.output_token_ids)
        tokens = list(self.context.generated_token_ids)
        if self.first_token is not None:
            tokens.append(self.first_token)
        return tokens

    def queue_again(self, tokens_sent: list[int], now: float) -> None:
        """Start over from the queue, computing its prompt and ``tokens_sent`` again (prompt
        log probabilities are not sent twice: they went with its first token)."""
        prompt_logprobs = None if tokens_sent else self.context.prompt_logprobs
        self.context = msgspec.structs.replace(
            self.context, generated_token_ids=tokens_sent, prompt_logprobs=prompt_logprobs
        )
        self.phase, self.prefill, self.decode = Phase.QUEUED, None, None
        self.decode_block_ids, self.transfer_id, self.first_token = [], None, None
        self.handoff_time, self.ranks_received = None, set()
        self.num_bytes, self.seconds = 0, 0.0
        self.num_migrations += 1
        if self.left_group_time is None:
            self.left_group_time = now
