"""Messages the scheduler sends to a worker: one ``ScheduledStep`` per step.

A request appears in full (``NewRequestData``) in its first step and after it is resumed;
afterwards only as a diff (``CachedRequestData``). The worker caches request state by id and
drops it when the id shows up in ``finished_request_ids``.
"""

from __future__ import annotations

import msgspec

from interfaces.embeddings import EmbeddingsContext
from interfaces.lora import LoRAOperation
from interfaces.requests import RequestID, TextContext

MAX_DRAFT_TOKENS = 16
"""The most draft tokens one request carries in one step (speculative decoding)."""


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the worker has not seen (or has released): its whole state. Its context's
    ``lora_id`` names the LoRA adapter it runs with (a ``LoRAUpdate`` loaded it); 0 is the base
    model."""

    context: TextContext
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = []


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the worker already holds: blocks added since its last step.

    One per running request per step, so instances are not tracked by the garbage collector
    (``gc=False``: they hold only strings, ints and a list, never a cycle).
    """

    request_id: RequestID
    new_block_ids: list[int]
    num_computed_tokens: int


class KVSend(msgspec.Struct, array_like=True, omit_defaults=True):
    """After the step, send the KV of ``block_ids`` (the request's prompt blocks, in order) to
    the decode group whose ranks receive at ``destinations`` (rank r at index r).

    Every rank of the prefill group sends the key-value heads it holds that some decode rank
    needs (``worker.kv_transfer.transfer_plan``)."""

    transfer_id: int
    request_id: RequestID
    block_ids: list[int]
    destinations: list[str]


class ScheduledStep(msgspec.Struct, tag="step", array_like=True, omit_defaults=True):
    """One step: which requests run and how many of their tokens to compute.

    For each scheduled request the worker computes ``num_scheduled_tokens[id]`` tokens starting at
    ``num_computed_tokens``. When that reaches the end of the request's known tokens (prompt plus
    outputs so far), the worker samples one new token for it.

    ``spec_token_ids[id]`` (speculative decoding) are up to ``MAX_DRAFT_TOKENS`` draft tokens
    that follow a decoding request's known tokens: it is scheduled for its last token and its
    drafts (1 + len(drafts) tokens), and the worker returns the drafts it accepted and one
    token sampled after them (``scheduler.speculative``).
    """

    step_id: int
    new_requests: list[NewRequestData] = []
    cached_requests: list[CachedRequestData] = []
    num_scheduled_tokens: dict[RequestID, int] = {}
    finished_request_ids: list[RequestID] = []
    kv_sends: list[KVSend] = []
    spec_token_ids: dict[RequestID, list[int]] = {}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class KVReceive(msgspec.Struct, array_like=True):
    """Expect transfer ``transfer_id`` from a prefill group of ``source_size`` ranks, into
    ``block_ids`` (reserved for the request until the transfer ends)."""

    transfer_id: int
    request_id: RequestID
    block_ids: list[int]
    source_size: int


class KVTransfers(msgspec.Struct, tag="kv_transfers", array_like=True, omit_defaults=True):
    """To every rank of a decode group, whenever the scheduler has news: transfers to expect,
    and transfers to give up (their blocks go back to the scheduler, so data that arrives
    later for them is dropped)."""

    receive: list[KVReceive] = []
    cancel: list[int] = []


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True, omit_defaults=True):
    """Ask the worker to exit: cleanly, or, with a ``reason``, because the scheduler refused
    it (the worker logs the reason and exits 1)."""

    reason: str | None = None


class EmbeddingsStep(msgspec.Struct, tag="embed_step", array_like=True):
    """One batch for an embedding worker group: embed every context."""

    step_id: int
    contexts: list[EmbeddingsContext]


class LoRAUpdate(msgspec.Struct, tag="lora_update", array_like=True, frozen=True):
    """Load adapter ``lora_name`` from ``lora_path`` under ``lora_id`` (> 0, never reused by
    the scheduler while it runs), or unload ``lora_id``. Sent to every rank of a group, in order
    with its steps: a step after a load may name the adapter. Rank 0 answers ``LoRAUpdated``
    once every rank has done it (or one failed, and none holds it)."""

    operation: LoRAOperation
    lora_id: int
    lora_name: str
    lora_path: str | None = None


SchedulerToWorkerMessage = ScheduledStep | EmbeddingsStep | KVTransfers | Shutdown | LoRAUpdate
