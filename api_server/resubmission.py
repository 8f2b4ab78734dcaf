"""What an API server does for its text requests when the scheduler goes away and comes back.

``SchedulerReturn`` owns the wait: when the connection to the scheduler drops, text requests in
flight wait for it (``scheduler_return_timeout_s``; 0 fails them at once, as embeddings and
requests with images always are). Once a scheduler answers on the same address again and has a
worker serving, each is submitted again with the tokens it already received, and its stream
continues where it paused. New text requests wait meanwhile too (``wait_until_served``), and are
submitted then. One that the scheduler does not take back within the bound fails with
``SchedulerUnavailable``; so do all of them once the server stops waiting (``stop_waiting``).

``Resubmissions`` is what is kept for that. For each text request in flight it holds the context
as first submitted and the tokens it has received for it since, in order. It is submitted again
with ``TextContext.generated_token_ids`` set to those tokens: the scheduler and the worker take
them as the request's outputs (they count against its budget, feed its penalties and
``min_tokens``, set the seeded sampler's token index, and its grammar is replayed over them), so
generation goes on right after them and the client's stream pauses and continues with the tokens
it would have had.

A request is kept from before its submission is handed to the socket, so that no result can
arrive unrecorded, and is submitted again only if that submission left on an earlier connection
than the one now up (``connection``, counted up each time the connection drops): a submission
that waited out the outage in the socket's queue and left on the new connection is not sent
twice, nor one that never left. A request whose last result has arrived, or that was aborted, is
forgotten. Requests with images are not kept: their pixels' shared-memory segments were handed
to the scheduler that died.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec

from interfaces import RequestID, SchedulerResult, TextContext, TextGenerationOutput

logger = logging.getLogger(__name__)

RESUBMIT_POLL_S = 0.25
"""How often a scheduler that came back is asked whether a worker serves yet, before the
requests that waited for it are submitted again."""


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


class SchedulerReturn:
    """Keeps text requests in flight waiting for a scheduler that went away, and submits them
    again (``Resubmissions.due``) once one is back with a worker serving (see the module).

    ``EngineClient`` owns it and calls it on its event loop: ``lost`` when the connection drops,
    ``back`` when it is up again, ``fail_if_not_back`` from its heartbeat while it is down, and
    ``wait_until_served`` for each new text request while ``is_waiting`` (released once the
    requests in flight are submitted again, or failed with them), and ``refused`` or ``cancel``
    when the scheduler refused the server or the client closes. It acts through the client:
    ``has_worker_serving`` asks the scheduler (False when it does not answer), ``submit_again``
    sends a context, and ``fail`` ends requests in flight with ``SchedulerUnavailable`` and the
    reason given.
    """

    def __init__(
        self,
        resubmissions: Resubmissions,
        timeout_s: float,
        *,
        has_worker_serving: Callable[[], Awaitable[bool]],
        submit_again: Callable[[TextContext], None],
        fail: Callable[[list[RequestID], str], None],
    ) -> None:
        self.resubmissions = resubmissions
        self.timeout_s = timeout_s
        """``scheduler_return_timeout_s``: how long requests wait from the drop."""
        self.waits = timeout_s > 0
        """Whether requests wait for a scheduler that went away (``stop_waiting``)."""
        self._has_worker_serving = has_worker_serving
        self._submit_again = submit_again
        self._fail = fail
        self._lost_at = 0.0
        """When the connection last dropped (``time.monotonic()``)."""
        self._resubmitter: asyncio.Task[None] | None = None
        """Submits the requests that waited, once the scheduler is back with a worker."""
        self._served = asyncio.Event()
        """Set unless requests wait for the scheduler's return (``wait_until_served``)."""
        self._served.set()
        self._outcome: str | None = None
        """Why the last wait ended without a scheduler serving; None if one serves."""

    @property
    def is_waiting(self) -> bool:
        """Whether requests wait for the scheduler to come back with a worker serving."""
        return not self._served.is_set()

    async def wait_until_served(self) -> str | None:
        """For a new request while ``is_waiting``: wait until the scheduler is back with a
        worker serving; None then, or why the request cannot be submitted (the bound passed,
        the server stopped waiting)."""
        while not self._served.is_set():
            remaining = self._lost_at + self.timeout_s - time.monotonic()
            if remaining <= 0:
                if self._resubmitter is None or self._resubmitter.done():
                    return self._not_back()
                # The scheduler is back: its resubmitter decides (within a poll and a stats
                # request of the bound), with the reason if no worker served.
                remaining = RESUBMIT_POLL_S
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._served.wait(), remaining)
        return self._outcome

    def _end_wait(self, outcome: str | None) -> None:
        self._outcome = outcome
        self._served.set()

    def _not_back(self) -> str:
        return f"the scheduler did not come back within {self.timeout_s:g} s"

    def stop_waiting(self, in_flight: list[RequestID], lost_connection: str | None) -> None:
        """The server is shutting down: requests no longer wait for a scheduler that goes away
        (nothing will start it again for them); those waiting now fail: ``in_flight`` while the
        connection is lost (``lost_connection``, the reason), and new ones waiting in
        ``wait_until_served``."""
        self.waits = False
        if lost_connection is not None:
            self._fail(in_flight, lost_connection)
        if self.is_waiting:
            self._end_wait(lost_connection or "the server is shutting down")

    def lost(self, in_flight: list[RequestID], reason: str) -> None:
        """The connection dropped (``reason``): fail the requests of ``in_flight`` that cannot
        wait for the scheduler's return (all of them unless ``waits``); text requests wait."""
        self.resubmissions.lost_connection()
        self._lost_at = time.monotonic()
        if self.waits:
            self._outcome = None
            self._served.clear()
        waiting = set(self.resubmissions.waiting()) if self.waits else set()
        cannot_wait = [request_id for request_id in in_flight if request_id not in waiting]
        self._fail(cannot_wait, reason)
        if len(cannot_wait) < len(in_flight):
            logger.warning(
                "%d requests wait up to %g s for the scheduler to come back",
                len(in_flight) - len(cannot_wait),
                self.timeout_s,
            )

    def fail_if_not_back(self, now: float, in_flight: list[RequestID]) -> None:
        """While the connection is lost: fail every request of ``in_flight`` once the scheduler
        has stayed away for ``timeout_s``."""
        if now - self._lost_at > self.timeout_s:
            self._fail(in_flight, self._not_back())

    def back(self) -> None:
        """On a connection that came back: submit again the requests that waited for it, and
        let new ones go, once the scheduler has a worker serving (``_resubmit_when_served``)."""
        if self._resubmitter is not None:
            self._resubmitter.cancel()  # it served the connection before this one
        self._resubmitter = None
        if self.resubmissions.waiting() or self.is_waiting:
            self._resubmitter = asyncio.create_task(self._resubmit_when_served())

    def refused(self, reason: str) -> None:
        """The scheduler refused this server (``reason``): nothing waits for it any more."""
        self.waits = False
        if self.is_waiting:
            self._end_wait(reason)
        self.cancel()

    def cancel(self) -> list[asyncio.Task[None]]:
        """Stop submitting again (the client is closing: new requests that wait fail); the
        task to await, if one ran."""
        if self.is_waiting:
            self._end_wait("the API server is shutting down")
        task, self._resubmitter = self._resubmitter, None
        if task is None:
            return []
        task.cancel()
        return [task]

    async def _resubmit_when_served(self) -> None:
        """Once the scheduler has a worker serving, submit again every request that waited
        (``Resubmissions.due``) and release the new ones (``wait_until_served``). Ends if the
        connection drops again (the next one resubmits); fails them all if no worker serves
        within ``timeout_s`` of the drop."""
        try:
            await self._resubmit_once_served()
        except Exception:
            self._end_wait("the API server failed to submit the requests again")
            raise

    async def _resubmit_once_served(self) -> None:
        """``_resubmit_when_served`` but for an unexpected error."""
        connection = self.resubmissions.connection
        while time.monotonic() < self._lost_at + self.timeout_s:
            has_worker_serving = await self._has_worker_serving()
            if connection != self.resubmissions.connection:
                return
            if has_worker_serving:
                contexts = self.resubmissions.due()
                for context in contexts:
                    self._submit_again(context)
                if contexts:
                    logger.info("submitted %d requests again to the scheduler", len(contexts))
                self._end_wait(None)  # new requests go on too
                return
            await asyncio.sleep(RESUBMIT_POLL_S)
        if connection == self.resubmissions.connection:
            reason = f"the scheduler came back, but no worker served within {self.timeout_s:g} s"
            self._fail(self.resubmissions.waiting(), reason)
            self._end_wait(reason)
