"""Embedding requests: a queue in arrival order, batched onto the embedding worker groups.

Embedding is one forward pass per input, with no KV cache to manage, so the scheduler only
batches: each idle embedding group gets the next inputs up to ``max_num_batched_tokens``
tokens (always at least one), and every answer is final. Inputs are refused when no embedding
group serves, when an id is in use, or when the queue is full. When a group dies with a step in
flight while others serve, the step's inputs go back to the front of the queue, once: an input
that was running on two groups that died fails rather than taking down a third.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from interfaces import ErrorKind, RequestID, SchedulerResult
from interfaces.embeddings import EmbeddingsContext, EmbeddingsOutput
from interfaces.requests import MAX_REQUEST_ID_LENGTH
from interfaces.scheduler_to_api import WORKER_DIED, GroupAway
from interfaces.scheduler_to_worker import EmbeddingsStep
from interfaces.worker_to_scheduler import WorkerEmbeddingsOutput
from scheduler.admission import UNREPORTED_VOCAB_LIMIT
from scheduler.config import SchedulerConfig
from scheduler.counters import SchedulerCounters
from scheduler.departures import Departures

EmbeddingsResult = SchedulerResult[EmbeddingsOutput]
EmbeddingsByClient = dict[bytes, dict[RequestID, EmbeddingsResult]]
NO_EMBEDDING_WORKER = "no embedding model is being served"


@dataclass(frozen=True)
class _Input:
    client_id: bytes
    context: EmbeddingsContext
    retried: bool = False
    """Back in the queue after its group died."""


class Embeddings:
    """The embedding groups, their queue, and the step each group is running."""

    def __init__(self, config: SchedulerConfig, counters: SchedulerCounters | None = None) -> None:
        """``counters``: where a group back under its name counts (``worker_restarts``)."""
        self.config = config
        self.counters = counters if counters is not None else SchedulerCounters()
        self.departures = Departures(config)
        """The groups that served and left, for ``groups_away``."""
        self.groups: dict[str, int] = {}
        """Each serving group's step budget, in tokens."""
        self.queue: deque[_Input] = deque()
        self.in_flight: dict[str, tuple[EmbeddingsStep, list[_Input]]] = {}
        self._wanted: dict[RequestID, _Input] = {}
        """Every input queued or running and not aborted, by id (the submission itself, so an
        aborted input whose id was submitted again is told apart)."""
        self._next_step_id = 0

    def add_group(self, name: str, step_tokens: int = 0) -> None:
        """Serve group ``name``, with the step budget it suggests (``WorkerReady.step_tokens``)
        unless the config sets one."""
        if self.departures.returned(name):
            self.counters.worker_restarts += 1
        self.groups[name] = self.config.with_step_tokens(step_tokens).max_num_batched_tokens

    def remove_group(self, name: str, reason: str, cause: str = WORKER_DIED) -> EmbeddingsByClient:
        """Group ``name`` is gone (it left with ``cause``, a ``MIGRATION_REASONS`` label, until
        it serves again: ``groups_away``). Its step's inputs go back to the queue for another
        group (those already retried fail); with no group left, the queue fails."""
        if name in self.groups:
            self.departures.record(name, cause)
        self.groups.pop(name, None)
        _, batch = self.in_flight.pop(name, (None, []))
        failed = []
        for item in reversed(batch):  # to the front of the queue, in their order
            if not self._owns(item):
                continue  # aborted while the step ran
            if self.groups and not item.retried:
                retry = dataclasses.replace(item, retried=True)
                self._wanted[item.context.request_id] = retry
                self.queue.appendleft(retry)
            else:
                failed.append(item)
        results = self._fail_items(failed, reason, ErrorKind.UNAVAILABLE)
        if not self.groups:
            for item in list(self.queue):
                results[item.client_id][item.context.request_id] = _cancelled(reason)
                del self._wanted[item.context.request_id]
            self.queue.clear()
        return results

    def groups_away(self, now: float | None = None) -> list[GroupAway]:
        """``Departures.away`` of the embedding groups that left (the launcher restarts them)."""
        return self.departures.away(now)

    def submit(self, client_id: bytes, contexts: list[EmbeddingsContext]) -> EmbeddingsByClient:
        """Queue the inputs; returns the refusals (an empty dict when all were taken)."""
        refusals: EmbeddingsByClient = defaultdict(dict)
        limit = self.config.max_queued_requests
        if not self.groups:
            problem, kind = NO_EMBEDDING_WORKER, ErrorKind.UNAVAILABLE
        elif len(contexts) > limit:  # would never fit: not worth retrying
            problem = f"{len(contexts)} inputs at once; at most {limit} may wait to be embedded"
            kind = ErrorKind.INVALID_REQUEST
        elif len(self.queue) + len(contexts) > limit:
            problem = (
                f"{len(self.queue)} inputs are already waiting to be embedded; try again later"
            )
            kind = ErrorKind.OVERLOADED
        else:
            problem = None
        for context in contexts:
            request_id = context.request_id
            if problem is not None:
                refusals[client_id][request_id] = _cancelled(problem, kind)
            elif (invalid := input_problem(context)) is not None:
                refusals[client_id][request_id] = SchedulerResult.rejected_request(invalid)
            elif request_id in self._wanted:
                refusals[client_id][request_id] = SchedulerResult.rejected_request(
                    f"request id {request_id!r} is already in use"
                )
            else:
                item = _Input(client_id, context)
                self._wanted[request_id] = item
                self.queue.append(item)
        return refusals

    def abort(self, client_id: bytes, request_ids: Iterable[RequestID]) -> None:
        """Drop the inputs of ``request_ids`` that API server ``client_id`` submitted (one in
        a running step finishes; its result is not sent); other ids are ignored."""
        wanted = self._wanted
        dropped = {
            request_id
            for request_id in request_ids
            if request_id in wanted and wanted[request_id].client_id == client_id
        }
        if dropped:
            self.queue = deque(i for i in self.queue if i.context.request_id not in dropped)
            for request_id in dropped:
                del self._wanted[request_id]

    def abort_client(self, client_id: bytes) -> int:
        mine = [rid for rid, item in self._wanted.items() if item.client_id == client_id]
        self.abort(client_id, mine)
        return len(mine)

    def schedule(self, idle: Iterable[str]) -> list[tuple[str, EmbeddingsStep]]:
        """The next step of each idle embedding group, while inputs wait."""
        steps = []
        for name in idle:
            if name not in self.groups or name in self.in_flight or not self.queue:
                continue
            budget, batch = self.groups[name], []
            while self.queue and (not batch or len(self.queue[0].context.token_ids) <= budget):
                item = self.queue.popleft()
                budget -= len(item.context.token_ids)
                batch.append(item)
            step = EmbeddingsStep(self._next_step_id, [item.context for item in batch])
            self._next_step_id += 1
            self.in_flight[name] = (step, batch)
            steps.append((name, step))
        return steps

    def on_output(self, name: str, output: WorkerEmbeddingsOutput) -> EmbeddingsByClient:
        """The results of group ``name``'s step (for inputs not aborted meanwhile)."""
        _, batch = self.in_flight.pop(name)
        results: EmbeddingsByClient = defaultdict(dict)
        for item in batch:
            if not self._owns(item):
                continue  # aborted while the step ran
            request_id = item.context.request_id
            del self._wanted[request_id]
            vector = output.embeddings.get(request_id)
            if vector is not None:
                result = SchedulerResult.complete(EmbeddingsOutput(vector))
            else:
                reason = output.refused.get(request_id, "the worker returned no embedding")
                result = SchedulerResult.rejected_request(reason)
            results[item.client_id][request_id] = result
        return results

    def fail_step(self, name: str, error: str) -> EmbeddingsByClient:
        return self._fail_step(name, error, ErrorKind.INTERNAL)

    def _fail_step(self, name: str, error: str, kind: ErrorKind) -> EmbeddingsByClient:
        return self._fail_items(self.in_flight.pop(name, (None, []))[1], error, kind)

    def _fail_items(self, items: list[_Input], error: str, kind: ErrorKind) -> EmbeddingsByClient:
        """Fail ``items`` not aborted yet."""
        results: EmbeddingsByClient = defaultdict(dict)
        for item in filter(self._owns, items):
            del self._wanted[item.context.request_id]
            results[item.client_id][item.context.request_id] = _cancelled(error, kind)
        return results

    def _owns(self, item: _Input) -> bool:
        """``item`` is still wanted: not aborted (its id not reused by another client)."""
        return self._wanted.get(item.context.request_id) is item

    @property
    def num_waiting(self) -> int:
        return len(self.queue)


def input_problem(context: EmbeddingsContext) -> str | None:
    """Why an input's values cannot be embedded, or None (the worker checks its token ids
    against its vocabulary and its length against the model)."""
    if not 1 <= len(context.request_id) <= MAX_REQUEST_ID_LENGTH:
        return f"the request id must be 1 to {MAX_REQUEST_ID_LENGTH} characters"
    token_ids = context.token_ids
    if token_ids and not (min(token_ids) >= 0 and max(token_ids) < UNREPORTED_VOCAB_LIMIT):
        return f"token ids must be in [0, {UNREPORTED_VOCAB_LIMIT})"
    return None


def _cancelled(error: str, kind: ErrorKind = ErrorKind.UNAVAILABLE) -> EmbeddingsResult:
    return SchedulerResult.cancelled(error, kind)
