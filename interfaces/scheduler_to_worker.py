"""Messages the scheduler sends to a worker: one ``SchedulerOutput`` per step.

A request appears in full (``NewRequestData``) in its first step and after it is resumed;
afterwards only as a diff (``CachedRequestData``). The worker caches request state by id and
drops it when the id shows up in ``finished_request_ids``.
"""

from __future__ import annotations

import msgspec

from interfaces.requests import RequestID, TextContext


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the worker has not seen (or has released): its whole state."""

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


class SchedulerOutput(msgspec.Struct, tag="step", array_like=True, omit_defaults=True):
    """One step: which requests run and how many of their tokens to compute.

    For each scheduled request the worker computes ``num_scheduled_tokens[id]`` tokens starting at
    ``num_computed_tokens``. When that reaches the end of the request's known tokens (prompt plus
    outputs so far), the worker samples one new token for it.
    """

    step_id: int
    new_requests: list[NewRequestData] = []
    cached_requests: list[CachedRequestData] = []
    num_scheduled_tokens: dict[RequestID, int] = {}
    finished_request_ids: list[RequestID] = []

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Ask the worker to exit cleanly."""


SchedulerToWorkerMessage = SchedulerOutput | Shutdown
