"""Continuous batching over a paged KV cache, with one token budget per step.

Every request has ``num_computed_tokens`` catching up to ``num_tokens`` (prompt plus output).
Each step, running requests are served first (so decodes never stall behind a long prompt), then
waiting requests are admitted while budget, sequence slots and KV blocks last. A prompt longer
than the remaining budget is computed in chunks over several steps. When a running request needs
a block and none is free, the newest running request is preempted: it gives its blocks back,
returns to the front of the queue, and is recomputed later with the same output.

With disaggregation the same class schedules each side. A ``prefill_only`` scheduler hands a
request off after its first token: the request leaves it (its blocks stay in the prefix cache)
and ``take_handoffs`` returns it. A decode group's scheduler ``reserve``s blocks for a request
before its prompt is computed elsewhere, and ``start_decoding`` runs it once its KV arrived;
the request starts on the worker with its prompt already computed.

One request's failure is its own: the worker reports a request whose token it could not sample
(``WorkerOutput.failed``) and the scheduler ends that request alone, keeping its blocks' prefix
cache entries (their KV was written). A request whose grammar still compiles when it must
sample is deferred by the worker: the scheduler parks it (``waiting_for_grammar``, its last token
to be recomputed) and skips it until ``on_grammars`` says its grammar is ready or failed.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict, deque

from interfaces import (
    ErrorKind,
    GenerationStatus,
    LogProbabilities,
    RequestID,
    RequestTimings,
    SchedulerResult,
    TextContext,
    TextGenerationOutput,
)
from interfaces.scheduler_to_api import SCHEDULER_RESTARTED, GroupAway, SchedulerStats
from interfaces.scheduler_to_worker import CachedRequestData, NewRequestData, ScheduledStep
from interfaces.worker_to_scheduler import GrammarsReady, RequestFailure, WorkerOutput
from scheduler.admission import admission_problem, queue_overload, refusal
from scheduler.block_manager import BlockManager
from scheduler.config import KVCacheConfig, SchedulerConfig
from scheduler.counters import GroupCounters, SchedulerCounters
from scheduler.request import Request, RequestStatus
from scheduler.speculative import MAX_TOKEN_ID, SpecDecodingState, propose_drafts

logger = logging.getLogger(__name__)

STEP_FAILED = "the worker failed while running this request's batch"
"""What every request of a step that failed as a whole is told (the worker's error, which may
name another request, goes to the logs only)."""
MALFORMED_OUTPUT = "the worker sent a malformed output for this request"
"""What a request is told whose output is not the tokens of its own it could have: one, or
with drafts 1 to 1 + drafts."""
TextResult = SchedulerResult[TextGenerationOutput]
ResultsByClient = dict[bytes, dict[RequestID, TextResult]]
"""Results to send, grouped by the ZeroMQ identity of the API server that owns each request."""


class Scheduler:
    """All scheduling decisions for one worker group. Not thread-safe; one caller drives it."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheConfig,
        counters: SchedulerCounters | None = None,
        prefill_only: bool = False,
        group_counters: GroupCounters | None = None,
    ) -> None:
        """``counters``: where to count preemptions, prefix-cache lookups and steps (kept
        across the schedulers of one process); ``group_counters``: where to count this group's
        own prefix-cache lookups (kept across its restarts); fresh sets by default."""
        self.prefill_only = prefill_only
        self.config = config.with_step_tokens(0)  # the group's budget, or the CPU's
        self.kv_cache = kv_cache
        self.block_manager = BlockManager(
            kv_cache.num_blocks, kv_cache.block_size, config.enable_prefix_caching
        )
        self.waiting: deque[Request] = deque()
        self.num_waiting_tokens = 0
        """Tokens (prompt plus output so far) of the requests in ``waiting``."""
        self.num_waiting_work = 0
        """Tokens the requests in ``waiting`` will compute: each one's ``num_queued_work``."""
        self.running: list[Request] = []
        self.reserved: dict[RequestID, Request] = {}
        """Requests holding blocks for KV that is on its way (a decode group's)."""
        self.requests: dict[RequestID, Request] = {}
        self._handoffs: list[Request] = []
        self.counters = counters if counters is not None else SchedulerCounters()
        self.group_counters = group_counters if group_counters is not None else GroupCounters()
        self._released_request_ids: list[RequestID] = []
        self._next_step_id = 0

    # -- requests in and out -------------------------------------------------------------------

    def add_request(self, context: TextContext, client_id: bytes) -> TextResult | None:
        """Queue a request. Returns a CANCELLED result with an error if it can never run
        (INVALID_REQUEST) or the queue is full (OVERLOADED; never for one an API server
        submitted again after a scheduler restart: ``queue_overload``)."""
        refusal = self.refusal(context, self._overload(context))
        if refusal is not None:
            return refusal
        self.accept(context, client_id)
        return None

    def refusal(self, context: TextContext, overload: str | None) -> TextResult | None:
        """The result refusing ``context`` (``scheduler.admission``): it can never run here, or
        ``overload`` says why the queue is full; None to accept it."""
        problem = None
        if context.request_id in self.requests:
            problem = f"request id {context.request_id!r} is already in use"
        else:
            problem = admission_problem(context, self.kv_cache.max_model_len, self.block_manager)
        return refusal(context, problem, overload)

    def accept(self, context: TextContext, client_id: bytes) -> None:
        """Queue a request that ``refusal`` accepted. One that brings tokens it generated
        already was submitted again after a scheduler restarted: a move, counted as such."""
        if context.generated_token_ids:
            self.counters.count_migration(SCHEDULER_RESTARTED)
        self.queue(Request(context, client_id, self.kv_cache.max_model_len))

    def queue(self, request: Request) -> None:
        """Queue ``request``, accepted already (by ``accept``, or while it waited for a group
        to serve: ``scheduler.stranded``), behind the others."""
        self.requests[request.request_id] = request
        self._enqueue(request)

    def take_requests(self) -> list[Request]:
        """Remove and return every request held here, running ones first (oldest first), then
        the queue in order, as preempted ones: their blocks freed, each to be recomputed from
        its prompt plus the tokens it generated so far. The group left, and they move to
        another (``adopt``). Nothing is released on the worker: it is gone.

        Their block hashes are dropped too: they were computed at this pool's block size, and
        the group that adopts them may have another (``StrandedRequests.hand_over``); its
        ``BlockManager`` hashes them again as their blocks fill."""
        requests = [*self.running, *self.waiting, *self.reserved.values()]
        for request in requests:
            self.block_manager.free(request)
            request.block_hashes = []
            request.num_computed_tokens = 0
            request.waiting_for_grammar = False
            request.worker_has_state = False
            request.status = RequestStatus.WAITING
            if request.spec is not None:
                request.spec.draft_tokens_to_verify = []
        self.running, self.waiting, self.reserved, self.requests = [], deque(), {}, {}
        self.num_waiting_tokens = self.num_waiting_work = 0
        return requests

    def adopt(self, requests: list[Request], cause: str) -> None:
        """Queue ``requests``, taken from a group that left with ``cause`` (a
        ``MIGRATION_REASONS`` label; ``take_requests``), at the front in this order: their KV
        blocks died with that group, so each is recomputed from its prompt plus the tokens it
        generated so far, which this group's worker receives as its outputs
        (``NewRequestData.output_token_ids``). Each counts one move, against its
        ``migration_limit`` and in ``request_migrations_total``. The queue's bounds do not
        apply: they were accepted once. The caller checked each with ``can_adopt``."""
        for request in reversed(requests):
            request.num_migrations += 1
            self.counters.count_migration(cause)
            self.requests[request.request_id] = request
            self._enqueue(request, at_front=True)

    def can_adopt(self, request: Request) -> bool:
        """Whether ``request`` could ever run here (its context fits this pool)."""
        max_model_len = self.kv_cache.max_model_len
        return admission_problem(request.context, max_model_len, self.block_manager) is None

    def can_reserve(self, num_context_tokens: int) -> bool:
        """Whether ``reserve`` would succeed now for a context of ``num_context_tokens`` (its
        prompt plus the tokens it generated already). Never while requests wait here
        (preempted ones, to be recomputed): freed blocks go to them first."""
        num_blocks = self.block_manager.num_blocks_for(num_context_tokens + 1)
        return (
            not self.waiting
            and len(self.running) + len(self.reserved) < self.config.max_num_seqs
            and num_blocks <= self.block_manager.num_free_blocks
        )

    def reserve(self, context: TextContext, client_id: bytes) -> list[int] | None:
        """Hold blocks for ``context``'s tokens (its prompt, and the tokens it generated
        already when it moved: ``generated_token_ids``) and its next output token, to be filled
        by a KV transfer; returns the block ids of its tokens, or None (nothing changed) if
        ``can_reserve`` is false."""
        request = Request(context, client_id, self.kv_cache.max_model_len)
        if not self.can_reserve(request.num_tokens):
            return None
        self.block_manager.allocate_slots(request, request.num_tokens + 1)
        request.status = RequestStatus.RESERVED
        self.requests[request.request_id] = request
        self.reserved[request.request_id] = request
        return request.block_ids[: self.block_manager.num_blocks_for(request.num_tokens)]

    def start_decoding(self, request_id: RequestID, next_token: int) -> None:
        """The reserved request's KV arrived and the prefill produced ``next_token`` (its
        first, or its next after the tokens it brought): it runs from the next step (a running
        request the worker does not know yet)."""
        request = self.reserved.pop(request_id)
        request.num_computed_tokens = request.num_tokens
        request.append_token(next_token)
        request.first_scheduled_time = time.monotonic()
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def take_handoffs(self) -> list[Request]:
        """Requests a ``prefill_only`` scheduler finished after the first token it sampled for
        them, since the last call (that token is their last in ``all_token_ids``)."""
        handoffs, self._handoffs = self._handoffs, []
        return handoffs

    def abort_requests(self, request_ids: list[RequestID]) -> ResultsByClient:
        """Drop requests wherever they are and free their blocks; unknown ids are ignored."""
        return self.cancel(request_ids, error=None)

    def abort_client(self, client_id: bytes) -> int:
        """Drop every request of the API server ``client_id`` (it went away); returns how many.

        No results are produced: there is nobody left to send them to.
        """
        request_ids = [r.request_id for r in self.requests.values() if r.client_id == client_id]
        self.cancel(request_ids, error=None)
        return len(request_ids)

    @property
    def num_preemptions(self) -> int:
        return self.counters.num_preemptions

    def num_tokens_ahead(self) -> int:
        """Tokens this group computes before it reaches a request queued now: the waiting
        requests' (each one's not cached when it was queued: ``num_queued_work``) and what
        running ones have left of their prompts (``scheduler.group_choice``)."""
        num_prefilling = 0
        # Prompt chunks run in admission order (``_schedule_running``), so the requests still
        # prefilling are the newest running ones (``check_integrity`` checks it): stop at the
        # first, from the end, that decodes.
        for request in reversed(self.running):
            if not _is_prefilling(request):
                break
            num_prefilling += request.num_tokens - request.num_computed_tokens
        return self.num_waiting_work + num_prefilling

    def has_unfinished_requests(self) -> bool:
        """Whether a step has anything to run (reserved requests wait for their KV)."""
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        return counter_stats(
            self.counters,
            num_requests_running=len(self.running),
            num_requests_waiting=len(self.waiting),
            num_kv_blocks_total=self.block_manager.num_blocks,
            num_kv_blocks_used=self.block_manager.num_used_blocks,
            workers_ready=True,
        )

    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` if the KV block or queue bookkeeping is inconsistent (tests)."""
        self.block_manager.check_integrity(holders=[*self.running, *self.reserved.values()])
        num_waiting_tokens = sum(request.num_tokens for request in self.waiting)
        if num_waiting_tokens != self.num_waiting_tokens:
            raise RuntimeError(
                f"{self.num_waiting_tokens} waiting tokens counted, {num_waiting_tokens} waiting"
            )
        if sum(request.num_queued_work for request in self.waiting) != self.num_waiting_work:
            raise RuntimeError("the waiting requests' work differs from the work counted")
        prefilling = [_is_prefilling(request) for request in self.running]
        if prefilling != sorted(prefilling):  # ``num_tokens_ahead`` relies on it
            raise RuntimeError("a running request prefills ahead of one that decodes")

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep:
        """Decide the next step. Advances ``num_computed_tokens`` of every scheduled request.

        Ids the worker should release ride along with the next step that schedules anything.
        """
        step = ScheduledStep(step_id=self._next_step_id)
        self._next_step_id += 1
        budget = self.config.max_num_batched_tokens
        budget, preempted = self._schedule_running(step, budget)
        if not preempted:
            self._schedule_waiting(step, budget)
        if step.num_scheduled_tokens:
            step.finished_request_ids = self._released_request_ids
            self._released_request_ids = []
            self.counters.observe_step(step.total_num_scheduled_tokens)
        return step

    def update_from_output(self, output: WorkerOutput) -> ResultsByClient:
        """Record the tokens a step produced; finish requests that hit a stop condition.

        Each produced ``TextGenerationOutput`` is completed (its ``final_status``) and sent on
        as it came; one that is not one token of its request fails that request alone. Requests
        the worker refused fail alone, as rejected (the client asked for something the
        worker cannot do); their blocks, computed in the step, stay valid in the prefix cache,
        except from a refused request's first image on (computed without its pixels). Requests
        whose sampling failed end alone too; deferred ones are parked (``_park``).
        """
        results: ResultsByClient = defaultdict(dict)
        now = time.monotonic()
        for request_id, failure in output.failed.items():
            request = self.requests.get(request_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                self._finish(request)  # the worker keeps its state until released
                results[request.client_id][request_id] = _failed(failure)
        for request_id in output.deferred:
            request = self.requests.get(request_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                self._park(request)
        for request_id, reason in output.refused.items():
            request = self.requests.get(request_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                request.worker_has_state = False  # the worker released it already
                if request.context.images:
                    self.block_manager.forget_from(request, request.context.images[0].start_idx)
                self._finish(request)
                results[request.client_id][request_id] = SchedulerResult.rejected_request(reason)
        for request_id, produced in output.outputs.items():
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            drafts = request.spec.draft_tokens_to_verify if request.spec is not None else []
            num_produced = len(produced.tokens)
            if not _produced_well(produced, request_id, drafts):
                self._finish(request)
                results[request.client_id][request_id] = _malformed(request_id, produced)
                continue
            if drafts:  # rewind past the rejected drafts: their KV is recomputed later
                request.num_computed_tokens -= 1 + len(drafts) - num_produced
                request.spec.draft_tokens_to_verify = []
                self.counters.observe_drafts(len(drafts), num_produced - 1)
            # The worker's output goes on to the API server, completed with the request's fate.
            produced.final_status = status = self._append_tokens(request, produced)
            self._observe_pause(request, now)
            timings = _first_token_timings(request, now) if request.num_output_tokens == 1 else None
            if status.is_done:
                self._finish(request)
                results[request.client_id][request_id] = SchedulerResult.complete(produced, timings)
            else:
                results[request.client_id][request_id] = SchedulerResult.active(produced, timings)
                if self.prefill_only:
                    self._finish(request)
                    self._handoffs.append(request)
        return results

    def _append_tokens(self, request: Request, produced: TextGenerationOutput) -> GenerationStatus:
        """Append ``produced``'s tokens to ``request`` up to the first that ends it; the ones
        after it (accepted drafts past a stop token, or past the length limit) are dropped from
        ``produced`` too. Returns the request's status after the last one kept."""
        for index, token_id in enumerate(produced.tokens):
            status = request.append_token(token_id)
            if status.is_done:
                del produced.tokens[index + 1 :]
                if produced.log_probabilities is not None:
                    _keep_logprobs(produced, index + 1)
                return status
        return status

    def on_grammars(self, news: GrammarsReady) -> ResultsByClient:
        """The worker's news about parked requests: ready ones are scheduled again (their last
        token recomputed and sampled), failed ones end alone, rejected with the reason. Ids
        that are not parked here (aborted, preempted meanwhile) are ignored."""
        results: ResultsByClient = defaultdict(dict)
        for request_id in news.ready:
            request = self.requests.get(request_id)
            if request is not None:
                request.waiting_for_grammar = False
        for request_id, reason in news.failed.items():
            request = self.requests.get(request_id)
            if request is not None and request.waiting_for_grammar:
                self._finish(request)
                results[request.client_id][request_id] = SchedulerResult.rejected_request(reason)
        return results

    def fail_step(self, step: ScheduledStep, error: str) -> ResultsByClient:
        """The worker could not run ``step``: fail every request in it with ``error`` (the
        same for all of them: a message that names none of them).

        Blocks were registered in the prefix cache when the step was scheduled; their contents
        may never have been written, so the whole prefix cache is dropped.
        """
        # A request of the step that waits now is another request under its id (a
        # disaggregated request that moved and came back to this group): it did not fail.
        running = [r for r in step.num_scheduled_tokens if self._is_running(r)]
        results = self.cancel(running, error)
        self.block_manager.reset_prefix_cache()
        for request in self.running:  # their blocks were computed in earlier steps: re-register
            request.num_cached_blocks = 0
            self.block_manager.cache_full_blocks(request)
        return results

    def fail_all(self, error: str, kind: ErrorKind = ErrorKind.UNAVAILABLE) -> ResultsByClient:
        """Fail every unfinished request (the worker group went away)."""
        return self.cancel(list(self.requests), error, kind)

    # -- helpers -------------------------------------------------------------------------------

    def cancel(
        self,
        request_ids: list[RequestID],
        error: str | None,
        kind: ErrorKind = ErrorKind.INTERNAL,
    ) -> ResultsByClient:
        """End ``request_ids`` wherever they are (unknown ids are ignored), freeing their
        blocks; each gets a CANCELLED result with ``error`` and ``kind``."""
        results: ResultsByClient = defaultdict(dict)
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status is RequestStatus.WAITING:
                self.waiting.remove(request)
                self.num_waiting_tokens -= request.num_tokens
                self.num_waiting_work -= request.num_queued_work
            elif request.status is RequestStatus.RESERVED:
                del self.reserved[request_id]
            self._finish(request)
            results[request.client_id][request_id] = SchedulerResult.cancelled(error, kind)
        return results

    def _is_running(self, request_id: RequestID) -> bool:
        request = self.requests.get(request_id)
        return request is not None and request.status is RequestStatus.RUNNING

    def _overload(self, context: TextContext) -> str | None:
        """Why the queue cannot take ``context`` now (``queue_overload``), or None."""
        if not self.waiting:
            return None
        # Requests that will start at the next step, into free sequence slots, are not queued.
        free_slots = self.config.max_num_seqs - len(self.running) - len(self.reserved)
        num_queued = len(self.waiting) - max(free_slots, 0)
        return queue_overload(self.config, num_queued, self.num_waiting_tokens, context)

    def _enqueue(self, request: Request, at_front: bool = False) -> None:
        if at_front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)
        self.num_waiting_tokens += request.num_tokens
        num_cached = 0
        if request.context.prompt_logprobs is None:  # as ``_schedule_waiting`` will look
            num_cached = (
                len(self.block_manager.find_cached_prefix(request)) * self.kv_cache.block_size
            )
        request.num_queued_work = request.num_tokens - num_cached
        self.num_waiting_work += request.num_queued_work

    def _schedule_running(self, step: ScheduledStep, budget: int) -> tuple[int, bool]:
        """Give running requests their next tokens, oldest first; preempt when blocks run out."""
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.waiting_for_grammar:
                index += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = self._drafts(request, budget) if num_new == 1 else []
            new_block_ids = None
            num_behind = len(self.running) - index - 1
            if drafts and self._blocks_to_spare(request, len(drafts), num_behind):
                new_block_ids = self.block_manager.allocate_slots(request, num_new + len(drafts))
            if new_block_ids is None:
                drafts = []
            if new_block_ids is None:
                new_block_ids = self._allocate_or_preempt(request, num_new)
            if new_block_ids is None:
                return budget, True
            if drafts:
                step.spec_token_ids[request.request_id] = drafts
                request.spec.draft_tokens_to_verify = drafts
                num_new += len(drafts)
            if request.worker_has_state:
                step.cached_requests.append(
                    CachedRequestData(
                        request.request_id, new_block_ids, request.num_computed_tokens
                    )
                )
            else:  # its KV was computed elsewhere (``start_decoding``)
                step.new_requests.append(self._new_request_data(request))
                request.worker_has_state = True
            self._commit(step, request, num_new)
            budget -= num_new
            index += 1
        return budget, False

    def _schedule_waiting(self, step: ScheduledStep, budget: int) -> None:
        """Admit waiting requests in arrival order while budget, slots and blocks last."""
        max_running = self.config.max_num_seqs - len(self.reserved)
        while self.waiting and budget > 0 and len(self.running) < max_running:
            request = self.waiting[0]
            cached_prefix = []
            if request.context.prompt_logprobs is None:  # cached positions get no logprobs
                cached_prefix = self.block_manager.find_cached_prefix(request)
            num_cached = len(cached_prefix) * self.kv_cache.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if self.block_manager.allocate_slots(request, num_new, cached_prefix) is None:
                return
            request.num_computed_tokens = num_cached
            self.counters.prefix_cache_queries += request.num_tokens
            self.counters.prefix_cache_hits += num_cached
            self.group_counters.prefix_cache_queries += request.num_tokens
            self.group_counters.prefix_cache_hits += num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.waiting.popleft()
            self.num_waiting_tokens -= request.num_tokens
            self.num_waiting_work -= request.num_queued_work
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.new_requests.append(self._new_request_data(request))
            request.worker_has_state = True
            self._commit(step, request, num_new)
            budget -= num_new

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            context=request.context,
            block_ids=list(request.block_ids),
            num_computed_tokens=request.num_computed_tokens,
            output_token_ids=list(request.output_token_ids),
        )

    def _allocate_or_preempt(self, request: Request, num_new: int) -> list[int] | None:
        """Allocate blocks for ``request``, preempting the newest running requests as needed.

        Returns None when ``request`` itself had to be preempted.
        """
        while (new_block_ids := self.block_manager.allocate_slots(request, num_new)) is None:
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return None
        return new_block_ids

    def _blocks_to_spare(self, request: Request, num_drafts: int, num_behind: int) -> bool:
        """Whether ``request``'s next token and ``num_drafts`` drafts may take the free blocks
        they need while one stays free for each of the ``num_behind`` running requests still
        to be scheduled this step: speculation never makes the scheduler preempt a request."""
        manager = self.block_manager
        num_tokens = request.num_computed_tokens + 1 + num_drafts
        needed = manager.num_blocks_for(num_tokens) - len(request.block_ids)
        return manager.num_free_blocks >= needed + num_behind

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """Draft tokens to verify with ``request``'s next token (``scheduler.speculative``),
        within the step's ``budget`` and the tokens it may still generate; none without
        speculative decoding, for a request that follows a grammar, or when nothing recurs."""
        config = self.config.speculative
        if config is None or self.prefill_only or request.context.structured_output is not None:
            return []  # a prefill group hands its request over after one token
        if request.num_output_tokens == 0:  # its first token may bring prompt log probabilities
            return []
        if request.spec is None:
            request.spec = SpecDecodingState()
            request.spec.extend(request.all_token_ids)
        # Verified drafts and the token sampled after them are all outputs: leave room for it.
        room = request.max_new_tokens - request.num_output_tokens - 1
        limit = min(config.num_speculative_tokens, budget - 1, room)
        return propose_drafts(request.spec, config, limit)

    def _park(self, request: Request) -> None:
        """The worker computed ``request``'s scheduled tokens but deferred its token until its
        grammar compiles: skip it until then, and recompute its last token (which the worker
        needs as the sampling position) when it runs again. Its blocks stay allocated."""
        request.num_computed_tokens -= 1
        request.waiting_for_grammar = True

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.waiting_for_grammar = False
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.counters.num_preemptions += 1
        self._release_on_worker(request)
        self._enqueue(request, at_front=True)
        logger.info(
            "preempted request %s (%d tokens)",
            request.request_id,
            request.num_tokens,
            extra={"request_id": request.request_id},
        )

    def _commit(self, step: ScheduledStep, request: Request, num_new: int) -> None:
        """Schedule ``num_new`` tokens of ``request`` and register the blocks they fill.

        Registering now, before the step runs, lets a request admitted later in this same step
        (a sibling of ``n > 1``) share them: the worker runs steps in order and, within each
        layer, writes the step's keys and values before any attention reads them.
        """
        step.num_scheduled_tokens[request.request_id] = num_new
        request.num_computed_tokens += num_new
        self.block_manager.cache_full_blocks(request)

    def _observe_pause(self, request: Request, now: float) -> None:
        """``request`` produced a token: its first after a move ends its pause."""
        if request.left_group_time is not None:
            self.counters.observe_migration_pause(max(now - request.left_group_time, 0.0))
            request.left_group_time = None

    def _finish(self, request: Request) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
        self._release_on_worker(request)
        del self.requests[request.request_id]

    def _release_on_worker(self, request: Request) -> None:
        if request.worker_has_state:
            self._released_request_ids.append(request.request_id)
            request.worker_has_state = False


def _is_prefilling(request: Request) -> bool:
    """Whether ``request`` has more than its next token to compute: a prompt, or the prompt
    and tokens it brought, still part computed (a decoding request computes one a step)."""
    return request.num_tokens - request.num_computed_tokens > 1


def counter_stats(
    counters: SchedulerCounters, **state: int | bool | dict[str, int] | list[GroupAway]
) -> SchedulerStats:
    """``SchedulerStats`` of ``counters`` and the scheduler's ``state`` (its gauges)."""
    return SchedulerStats(
        **state,
        num_preemptions_total=counters.num_preemptions,
        prefix_cache_queries_total=counters.prefix_cache_queries,
        prefix_cache_hits_total=counters.prefix_cache_hits,
        iteration_tokens_counts=list(counters.iteration_tokens_counts),
        iteration_tokens_sum=counters.iteration_tokens_sum,
        kv_transfer_bytes_total=counters.kv_transfer_bytes,
        kv_transfer_seconds_counts=list(counters.kv_transfer_seconds_counts),
        kv_transfer_seconds_sum=counters.kv_transfer_seconds_sum,
        request_migrations_total=dict(counters.request_migrations),
        worker_restarts_total=counters.worker_restarts,
        migration_pause_seconds_counts=list(counters.migration_pause_seconds_counts),
        migration_pause_seconds_sum=counters.migration_pause_seconds_sum,
        spec_decode_num_drafts_total=counters.spec_decode_num_drafts,
        spec_decode_num_draft_tokens_total=counters.spec_decode_num_draft_tokens,
        spec_decode_num_accepted_tokens_total=counters.spec_decode_num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos_total=list(
            counters.spec_decode_num_accepted_tokens_per_pos
        ),
    )


def _failed(failure: RequestFailure) -> TextResult:
    """The result of a request the worker could not sample: 400 when its own parameters caused
    it, else 500."""
    if failure.invalid_request:
        return SchedulerResult.rejected_request(failure.reason)
    return SchedulerResult.cancelled(failure.reason, ErrorKind.INTERNAL)


def _produced_well(
    produced: TextGenerationOutput, request_id: RequestID, drafts: list[int]
) -> bool:
    """Whether ``produced`` is what the worker may send for request ``request_id`` after a step
    that verified ``drafts``: its own, 1 to 1 + len(drafts) token ids, the drafts it kept
    unchanged (their KV was computed from them; anything else would enter the prefix cache
    under the wrong tokens)."""
    tokens = produced.tokens
    return (
        produced.request_id == request_id
        and 1 <= len(tokens) <= 1 + len(drafts)
        and all(0 <= token <= MAX_TOKEN_ID for token in tokens)
        and tokens[:-1] == drafts[: len(tokens) - 1]
    )


def _keep_logprobs(produced: TextGenerationOutput, num_tokens: int) -> None:
    """Cut ``produced``'s log probabilities to its first ``num_tokens`` tokens."""
    kept = []
    for entry in produced.log_probabilities:
        if num_tokens <= 0:
            break
        values, tops = entry.token_log_probabilities, entry.top_log_probabilities
        kept.append(LogProbabilities(values[:num_tokens], tops[:num_tokens]))
        num_tokens -= len(values)
    produced.log_probabilities = kept


def _malformed(request_id: RequestID, output: TextGenerationOutput) -> TextResult:
    """The result of a request whose output is not tokens of its own: one per request per
    step, or with drafts 1 to 1 + drafts (``worker.request_sampler``)."""
    logger.warning(
        "request %s: the worker sent %d tokens for request %r; failing it",
        request_id,
        len(output.tokens),
        output.request_id,
        extra={"request_id": request_id},
    )
    return SchedulerResult.cancelled(MALFORMED_OUTPUT, ErrorKind.INTERNAL)


def _first_token_timings(request: Request, now: float) -> RequestTimings:
    scheduled = request.first_scheduled_time if request.first_scheduled_time is not None else now
    return RequestTimings(
        queued_s=max(scheduled - request.arrival_time, 0.0), prefill_s=max(now - scheduled, 0.0)
    )
