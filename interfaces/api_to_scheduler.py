"""Messages an API server sends to the scheduler (DEALER → the scheduler's frontend ROUTER)."""

from __future__ import annotations

import msgspec

from interfaces.embeddings import EmbeddingsContext
from interfaces.handshake import ApiHello
from interfaces.lora import LoRARequest
from interfaces.requests import RequestID, TextContext

MAX_API_MESSAGE_BYTES = 64 << 20
"""The largest frame the scheduler takes from an API server (its ``ZMQ_MAXMSGSIZE``): a bigger
one drops that API server's connection, so the API server refuses such a request before sending
it (a prompt of a million tokens is about 5 MB; images travel by shared memory)."""


class SubmitRequest(msgspec.Struct, tag="submit", array_like=True):
    """Schedule ``context``; results stream back to the sending API server."""

    context: TextContext


class SubmitEmbeddings(msgspec.Struct, tag="embed", array_like=True):
    """Embed each of ``contexts`` on an embedding worker group; one result per context comes
    back (``SchedulerEmbeddingsResults``) to the sending API server."""

    contexts: list[EmbeddingsContext]


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """Stop these requests (client went away, stop string seen) and free their KV blocks."""

    request_ids: list[RequestID]


class StatsRequest(msgspec.Struct, tag="stats", array_like=True):
    """Ask for a ``SchedulerStats`` reply (health checks, metrics)."""


class LoRAOperationRequest(msgspec.Struct, tag="lora", array_like=True):
    """Carry out ``request`` on every worker group; a ``LoRAOperationResult`` with the same
    ``ticket`` answers (the sending API server numbers its requests)."""

    ticket: int
    request: LoRARequest


ApiToSchedulerMessage = (
    ApiHello
    | SubmitRequest
    | SubmitEmbeddings
    | AbortRequests
    | StatsRequest
    | LoRAOperationRequest
)
"""``ApiHello`` (``interfaces.handshake``) comes first, once per connection; an API server that
sends none is served too."""
