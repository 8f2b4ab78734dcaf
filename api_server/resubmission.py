"""What an API server keeps to submit its requests again to a scheduler that restarted.

For each text request in flight it holds the context as first submitted and the tokens it has
received for it since, in order. When the connection to the scheduler drops and comes back,
``EngineClient`` submits each again with ``TextContext.generated_token_ids`` set to those tokens:
the scheduler and the worker take them as the request's outputs (they count against its
budget, feed its penalties and ``min_tokens``, set the seeded sampler's token index, and its
grammar is replayed over them), so generation goes on right after them and the client's
stream pauses and continues with the tokens it would have had.

A request is kept from before its submission is handed to the socket, so that no result can
arrive unrecorded, and is submitted again only if that submission left on an earlier connection
than the one now up (``connection``, counted up each time the connection drops): a submission
that waited out the outage in the socket's queue and left on the new connection is not sent
twice, nor one that never left. A request whose last result has arrived, or that was aborted, is
forgotten. Requests with images are not kept: their pixels' shared-memory segments were handed
to the scheduler that died.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from interfaces import RequestID, SchedulerResult, TextContext, TextGenerationOutput


@dataclass
class _Submitted:
    context: TextContext
    connection: int | None = None
    """The connection its latest submission left on; None until it has left."""
    generated: list[int] = field(default_factory=list)
    """Every token received for it, from its first submission on."""


class Resubmissions:
    """The text requests in flight that can be submitted again (see the module)."""

    def __init__(self) -> None:
        self._requests: dict[RequestID, _Submitted] = {}
        self.connection = 0
        """Counts the connection's drops: each submission is tagged with it."""

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: RequestID) -> bool:
        return request_id in self._requests

    def submitting(self, context: TextContext) -> None:
        """``context``'s submission is about to be handed to the socket: keep it (unless it has
        images) from now on, so that every token received for it is recorded."""
        if not context.images:
            self._requests[context.request_id] = _Submitted(context)

    def submitted(self, request_id: RequestID) -> None:
        """The submission of ``request_id`` left, on the connection up now."""
        submitted = self._requests.get(request_id)
        if submitted is not None:
            submitted.connection = self.connection

    def lost_connection(self) -> None:
        self.connection += 1

    def received(self, request_id: RequestID, result: SchedulerResult[TextGenerationOutput]):
        """Note the tokens of a result for ``request_id``; its last result forgets it."""
        submitted = self._requests.get(request_id)
        if submitted is None:
            return
        if result.stop_stream:
            del self._requests[request_id]
        elif result.result is not None:
            submitted.generated.extend(result.result.tokens)

    def forget(self, request_id: RequestID) -> None:
        self._requests.pop(request_id, None)

    def waiting(self) -> list[RequestID]:
        """The requests that wait to be submitted on the connection up now."""
        return [
            request_id
            for request_id, submitted in self._requests.items()
            if submitted.connection is not None and submitted.connection < self.connection
        ]

    def due(self) -> list[TextContext]:
        """The contexts to submit on the connection up now (``waiting``), with the tokens each
        received as ``generated_token_ids`` (and no prompt log probabilities once it has any:
        they came with its first token). They count as submitted on it from now on."""
        contexts = []
        for request_id in self.waiting():
            submitted = self._requests[request_id]
            submitted.connection = self.connection
            context = submitted.context
            if submitted.generated:
                context = msgspec.structs.replace(
                    context,
                    generated_token_ids=[*context.generated_token_ids, *submitted.generated],
                    prompt_logprobs=None,
                )
            contexts.append(context)
        return contexts
