"""Disaggregated placement: requests prefilled on a prefill group, decoded on a decode group.

``DisaggregatedPlacement`` is the ``scheduler.placement.Placement`` over at least one
``prefill`` and one ``decode`` group (each with its own ``Scheduler``). A request goes:

1. queued here, in arrival order, until a decode group can reserve blocks for its prompt (and
   the tokens it generated already, when it moved) and its next token (so no prompt is
   computed that nobody can decode); which one, ``SchedulerConfig.placement`` chooses among
   those that can (``scheduler.group_choice``);
2. prefilled on the prefill group ``SchedulerConfig.placement`` chooses (by default where its
   prompt is cached and the least work is queued), in chunks and with its prefix cache, like
   any prompt; the step that computes the prompt's end also sends its KV blocks (``KVSend``), after
   the decode group was told to expect them (``KVTransfers``);
3. handed off with its first token (which streams to the client at once); the prefill side's
   blocks stay in its prefix cache;
4. decoded once every decode rank reported its share received (``KVReceived``), from the first
   token on, as a request whose prompt is already computed.

A transfer that does not finish within ``kv_transfer_timeout_s`` of the hand-off fails its
request. A request that ends anywhere (finished, aborted, failed) is dropped on every side:
blocks freed, a pending transfer cancelled on the decode group ahead of any step that could
reuse its blocks.

When a group leaves (it died, or was fenced as stalled), each request whose prefill or decode it
held moves (``remove_group``): it is released on every side and queued again at the front, with
the tokens it streamed already as ``generated_token_ids``, so that a prefill group computes its
prompt and those tokens again, samples its next token, and hands it to a decode group, as at
first. Its stream pauses and goes on with the same tokens (the worker takes them as outputs:
penalties, ``min_tokens``, the seeded sampler's token index, the grammar replayed). Up to
``migration_limit`` moves each (0: they fail with the 503, as before). While no group of a role
serves, the queue (the moved requests and new ones) waits up to ``worker_return_timeout_s`` for
one to serve again.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import msgspec

from interfaces import ErrorKind, RequestID, SchedulerResult, SchedulerStatus, TextContext
from interfaces.scheduler_to_api import SCHEDULER_RESTARTED, WORKER_DIED
from interfaces.scheduler_to_worker import KVReceive, KVSend, KVTransfers, ScheduledStep
from interfaces.worker_to_scheduler import (
    GrammarsReady,
    KVReceived,
    WorkerOutput,
    WorkerReady,
    WorkerRole,
)
from scheduler.admission import num_context_tokens, queue_overload
from scheduler.config import SchedulerConfig
from scheduler.counters import SchedulerCounters
from scheduler.group_choice import choose_decode_group, choose_group
from scheduler.placement import (
    Placement,
    ServedGroup,
    WorkerMessage,
    merge,
    return_timeout_error,
)
from scheduler.request import Request
from scheduler.scheduler import ResultsByClient, TextResult
from scheduler.split_request import Phase, SplitRequest
from scheduler.worker_group import WorkerGroup

logger = logging.getLogger(__name__)


class DisaggregatedPlacement(Placement):
    """Requests over ``prefill`` and ``decode`` groups, and every KV transfer between them."""

    roles = (WorkerRole.PREFILL, WorkerRole.DECODE)

    def __init__(self, config: SchedulerConfig, counters: SchedulerCounters) -> None:
        super().__init__(config, counters)
        self.queue: deque[SplitRequest] = deque()
        self.requests: dict[RequestID, SplitRequest] = {}
        """Every request here, whatever its phase, by id."""
        self.messages: list[tuple[str, KVTransfers]] = []
        """Transfer news for decode groups, to send before any later step."""
        self._transfers: dict[int, RequestID] = {}
        """Transfers in flight, by id: 64 random bits each (``new_transfer_id``), so a process
        that can reach a decode worker's transfer socket cannot name one to overwrite its KV."""
        self._last_decode: ServedGroup | None = None
        """The last decode group to leave: its limits admit requests while none serves."""
        self._unserved_since: float | None = None
        """When the last group of a role left (``time.monotonic()``), while the queue waits
        for one to serve again; else None."""

    def _of_role(self, role: WorkerRole) -> list[ServedGroup]:
        return [group for group in self.groups.values() if group.role is role]

    @property
    def is_serving(self) -> bool:
        """Whether a prefill and a decode group serve."""
        return bool(self._of_role(WorkerRole.PREFILL) and self._of_role(WorkerRole.DECODE))

    @property
    def accepts_requests(self) -> bool:
        """Also while the queue waits for a group of a role that left to serve again."""
        return self.is_serving or self._waiting_since() is not None

    @property
    def vocab_size(self) -> int:
        """While no group serves, the last decode group's: requests are still accepted."""
        if self.groups or self._last_decode is None:
            return super().vocab_size
        return self._last_decode.ready.vocab_size

    def _waiting_since(self, now: float | None = None) -> float | None:
        """When the queue started to wait for a role's group, if it still may at ``now``
        (default: ``time.monotonic()``); else None."""
        since = self._unserved_since
        if since is None or self.is_serving:
            return None
        now = time.monotonic() if now is None else now
        return since if now - since < self.config.worker_return_timeout_s else None

    # -- groups --------------------------------------------------------------------------------

    def _role_problem(self, group: WorkerGroup, served: WorkerReady | None) -> str | None:
        ready = group.ready
        if ready.kv_layout is None:
            return "it did not report its KV layout, which KV transfers need"
        if ready.role is WorkerRole.DECODE and not all(group.destinations):
            return "a rank did not report the address it receives KV transfers at"
        if served is not None and ready.kv_layout != served.kv_layout:
            return (
                f"its KV layout {ready.kv_layout} differs from the served {served.kv_layout}; "
                "KV blocks could not be transferred between them"
            )
        return None

    def add_group(self, group: WorkerGroup) -> str | None:
        """``Placement.add_group``; once both roles serve, the queue stops waiting."""
        problem = super().add_group(group)
        if self.is_serving:
            self._unserved_since = None
        return problem

    def remove_group(self, name: str, reason: str, cause: str = WORKER_DIED) -> ResultsByClient:
        """Group ``name`` is gone, and so is every request's work it held: a decode group's
        requests all, a prefill group's until they decode (a transfer it had not finished
        sending is lost with it); its pending transfer news too.

        With ``migration_limit`` > 0 each of them moves (see the module): queued again at the
        front, in order, with the tokens it streamed; with no group of the role left, the
        queue waits up to ``worker_return_timeout_s`` for one (0: it fails as below). A
        request that moved ``migration_limit`` times already fails with ``reason`` (503), as
        each does with a limit of 0, and then, with no group of the role left, the queued ones
        too. ``cause`` is the label of why the group left (``Placement.remove_group``)."""
        was_serving = self.is_serving
        dead = self._depart(name, cause)
        self.messages = [(group, news) for group, news in self.messages if group != name]
        if dead is not None and dead.role is WorkerRole.DECODE:
            self._last_decode = dead
        waiting = was_serving or self._unserved_since is not None
        if waiting and not self.is_serving and self.config.migration_limit:
            # From the newest departure, as /health's groups_away counts.
            self._unserved_since = time.monotonic()
        held = [split for split in self.requests.values() if self._held_by(split, name)]
        results: ResultsByClient = {}
        if dead is None or not self.config.migration_limit or not self.accepts_requests:
            results = {} if dead is None else dead.scheduler.fail_all(reason)
            for split in held:
                merge(self._drop(split, reason, ErrorKind.UNAVAILABLE), results)
        else:
            moved = []
            for split in held:
                if split.num_migrations >= self.config.migration_limit:
                    merge(self._drop(split, reason, ErrorKind.UNAVAILABLE), results)
                else:
                    self._move(split, dead, cause)
                    moved.append(split)
            self.queue.extendleft(reversed(moved))  # at the front, in their order
            dead.scheduler.take_requests()  # its blocks and requests died with it
        if not self.accepts_requests:
            self._unserved_since = None
            queued = self._drop_where(lambda split: split.phase is not Phase.QUEUED, reason)
            merge(queued, results)
        return results

    @staticmethod
    def _held_by(split: SplitRequest, name: str) -> bool:
        """Whether group ``name`` held work ``split`` still needs: its decode group's blocks,
        or its prefill group's until it decodes."""
        if split.decode == name:
            return True
        return split.prefill == name and split.phase is not Phase.DECODE

    def _move(self, split: SplitRequest, dead: ServedGroup, cause: str) -> None:
        """Release ``split`` on the groups that serve on and make it start over with the
        tokens it streamed (see the module; the caller queues it); one more move, counted
        with ``cause``."""
        decoding = dead.scheduler.requests.get(split.request_id)
        tokens_sent = split.tokens_sent(decoding if split.decode == dead.name else None)
        self._release(split, None, ErrorKind.INTERNAL)
        split.queue_again(tokens_sent, time.monotonic())
        self.counters.count_migration(cause)
        logger.warning(
            "request %s queued again after %d token(s) (group %r left: %s; move %d of %d)",
            split.request_id,
            len(tokens_sent),
            dead.name,
            cause,
            split.num_migrations,
            self.config.migration_limit,
            extra={"request_id": split.request_id},
        )

    # -- requests in and out -------------------------------------------------------------------

    def _place(self, context: TextContext, client_id: bytes) -> TextResult | None:
        """Queue the request until a decode group can reserve its blocks, unless it can never
        run or the queues are full. One that brings tokens it generated already was submitted
        again after a scheduler restart: a move, counted as such."""
        # The smallest pool decides whether a request can ever run (one group of each role
        # would do: each holds a whole context, the limit checked, and they share it); while
        # none serves, the last one's.
        decode = min(
            self._of_role(WorkerRole.DECODE) or [self._last_decode],
            key=lambda g: g.scheduler.block_manager.num_blocks,
        )
        refusal = decode.scheduler.refusal(context, self._overload(context))
        if refusal is None:
            if context.generated_token_ids:
                self.counters.count_migration(SCHEDULER_RESTARTED)
            split = SplitRequest(context, client_id)
            self.requests[context.request_id] = split
            self.queue.append(split)
        return refusal

    def _overload(self, context: TextContext) -> str | None:
        """The queue bounds (``queue_overload``) over the queue here and the prefill groups'
        queues, each request counting its prompt and the tokens it generated already."""
        prefill = [group.scheduler for group in self._of_role(WorkerRole.PREFILL)]
        num_queued = len(self.queue) + sum(len(s.waiting) for s in prefill)
        if not num_queued:
            return None
        num_tokens = sum(num_context_tokens(split.context) for split in self.queue)
        num_tokens += sum(s.num_waiting_tokens for s in prefill)
        return queue_overload(self.config, num_queued, num_tokens, context)

    def contexts(self) -> Iterator[tuple[TextContext, bool]]:
        yield from super().contexts()
        for split in self.requests.values():
            yield split.context, split.phase is not Phase.QUEUED

    def owner(self, request_id: RequestID) -> bytes | None:
        split = self.requests.get(request_id)
        return split.client_id if split is not None else super().owner(request_id)

    def abort_requests(self, request_ids: list[RequestID]) -> ResultsByClient:
        wanted = set(request_ids)
        results = self._drop_where(
            lambda split: split.request_id not in wanted, None, ErrorKind.INTERNAL
        )
        return merge(super().abort_requests(request_ids), results)

    def abort_client(self, client_id: bytes) -> int:
        dropped = self._drop_where(
            lambda split: split.client_id != client_id, None, ErrorKind.INTERNAL
        )
        return len(dropped.get(client_id, {})) + super().abort_client(client_id)

    def fail_all(self, error: str, kind: ErrorKind = ErrorKind.UNAVAILABLE) -> ResultsByClient:
        results = self._drop_where(lambda _: False, error, kind)
        return merge(super().fail_all(error, kind), results)

    def check_timeouts(self, now: float | None = None) -> ResultsByClient:
        """Fail the requests whose KV transfer outlived ``kv_transfer_timeout_s``, and the
        queued ones once no group of a role served for ``worker_return_timeout_s``."""
        now = time.monotonic() if now is None else now
        results: ResultsByClient = {}
        if self._unserved_since is not None and self._waiting_since(now) is None:
            self._unserved_since = None
            if not self.is_serving and self.queue:
                error = return_timeout_error(self.config.worker_return_timeout_s)
                logger.error("%s: failing %d queued request(s)", error, len(self.queue))
                queued = self._drop_where(lambda split: split.phase is not Phase.QUEUED, error)
                merge(queued, results)
        timeout = self.config.kv_transfer_timeout_s
        for split in list(self.requests.values()):
            if split.phase is Phase.TRANSFER and now - split.handoff_time > timeout:
                error = (
                    f"the KV cache transfer from prefill group {split.prefill!r} to decode "
                    f"group {split.decode!r} did not finish within {timeout:g} s"
                )
                logger.error("request %s: %s", split.request_id, error)
                merge(self._drop(split, error, ErrorKind.UNAVAILABLE), results)
        return results

    # -- steps ---------------------------------------------------------------------------------

    def schedule(self, idle: Iterable[str]) -> list[tuple[str, WorkerMessage]]:
        """Queued requests go to a prefill group once a decode group reserved their blocks;
        then, in order: transfer news for decode groups, and the next step of each idle group
        (a prefill step sends the KV of the prompts it completes)."""
        self._dispatch()
        steps = super().schedule(idle)
        for name, step in steps:
            if self.groups[name].role is WorkerRole.PREFILL:
                self._attach_sends(self.groups[name], step)
        news, self.messages = self.messages, []
        return [*news, *steps]

    def update_from_output(self, name: str, output: WorkerOutput) -> ResultsByClient:
        results = super().update_from_output(name, output)
        group = self.groups[name]
        if group.role is WorkerRole.PREFILL:
            self._hand_off(group)
        self._settle(results)
        return results

    def fail_step(self, name: str, step: ScheduledStep, error: str) -> ResultsByClient:
        results = super().fail_step(name, step, error)
        self._settle(results)
        return results

    def on_grammars(self, name: str, news: GrammarsReady) -> ResultsByClient:
        results = super().on_grammars(name, news)
        self._settle(results)
        return results

    def _dispatch(self) -> None:
        """Move queued requests, in order, to a prefill group once a decode group reserved
        blocks for them."""
        decode = self._of_role(WorkerRole.DECODE)
        while self.queue:
            # Prompts go on to a prefill group while its queue holds less than a step's budget:
            # blocks are reserved for them on a decode group no sooner than needed.
            prefill = [
                g
                for g in self._of_role(WorkerRole.PREFILL)
                if g.scheduler.num_waiting_tokens < g.scheduler.config.max_num_batched_tokens
            ]
            # The head fits some decode group once blocks are free: it was admitted against the
            # smallest pool, every pool holds max_model_len tokens (the worker checks) and
            # every group has the same max_model_len (SHARED_FIELDS).
            split = self.queue[0]
            num_tokens = num_context_tokens(split.context)
            ready = [g for g in decode if g.scheduler.can_reserve(num_tokens)]
            if not prefill or not ready:
                return
            policy = self.config.placement
            target = choose_decode_group(ready, policy)
            source = choose_group(prefill, split.context, policy)
            # The decode side computes no prompt position: prompt logprobs come from the prefill.
            decode_context = msgspec.structs.replace(split.context, prompt_logprobs=None)
            block_ids = target.scheduler.reserve(decode_context, split.client_id)
            request = Request(split.context, split.client_id, source.ready.max_model_len)
            request.left_group_time = split.left_group_time  # its next token ends the pause
            source.scheduler.queue(request)
            self.queue.popleft()
            split.phase = Phase.PREFILL
            split.prefill, split.decode = source.name, target.name
            split.decode_block_ids = block_ids

    # -- the transfer --------------------------------------------------------------------------

    def _attach_sends(self, group: ServedGroup, step: ScheduledStep) -> None:
        """Send the KV of every request whose prompt this step completes, and tell its decode
        group to expect it (that message goes out first)."""
        for request_id in step.num_scheduled_tokens:
            split = self.requests.get(request_id)
            request = group.scheduler.requests.get(request_id)
            if split is None or split.transfer_id is not None or request is None:
                continue
            if request.num_computed_tokens < request.num_tokens:
                continue  # a chunk; the prompt ends in a later step
            if request.max_new_tokens - request.num_output_tokens <= 1:
                continue  # its next token is its last: nothing to decode
            transfer_id = self.new_transfer_id()
            split.transfer_id = transfer_id
            self._transfers[transfer_id] = request_id
            decode = self.groups[split.decode]
            num_blocks = len(split.decode_block_ids)
            step.kv_sends.append(
                KVSend(transfer_id, request_id, request.block_ids[:num_blocks], decode.destinations)
            )
            receive = KVReceive(transfer_id, request_id, split.decode_block_ids, group.size)
            self.messages.append((decode.name, KVTransfers(receive=[receive])))

    def new_transfer_id(self) -> int:
        """An unguessable id no transfer in flight has."""
        while True:
            transfer_id = secrets.randbits(64)
            if transfer_id not in self._transfers:
                return transfer_id

    def _hand_off(self, group: ServedGroup) -> None:
        """Take the requests prefill group ``group`` finished after their first token."""
        now = time.monotonic()
        for request in group.scheduler.take_handoffs():
            split = self.requests[request.request_id]
            split.first_token = request.all_token_ids[-1]
            split.handoff_time = now
            split.left_group_time = None
            split.phase = Phase.TRANSFER
            self._maybe_start_decoding(split)

    def on_kv_received(self, name: str, report: KVReceived) -> None:
        """Decoding starts once every rank of the decode group holds its share and the first
        token is known. Reports of cancelled transfers are ignored."""
        request_id = self._transfers.get(report.transfer_id)
        split = self.requests.get(request_id) if request_id is not None else None
        if split is None or split.decode != name:
            return
        split.ranks_received.add(report.rank)
        split.num_bytes += report.num_bytes
        split.seconds = max(split.seconds, report.seconds)
        if len(split.ranks_received) == self.groups[name].size:
            self.counters.observe_kv_transfer(split.num_bytes, split.seconds)
            self._maybe_start_decoding(split)

    def _maybe_start_decoding(self, split: SplitRequest) -> None:
        decode = self.groups[split.decode]
        if split.first_token is None or len(split.ranks_received) < decode.size:
            return
        decode.scheduler.start_decoding(split.request_id, split.first_token)
        split.phase = Phase.DECODE
        del self._transfers[split.transfer_id]

    # -- requests out --------------------------------------------------------------------------

    def _settle(self, results: ResultsByClient) -> None:
        """Drop every side of the requests that ``results`` ended."""
        for by_request in results.values():
            for request_id, result in by_request.items():
                split = self.requests.get(request_id)
                if split is not None and result.status is not SchedulerStatus.ACTIVE:
                    self._drop(split, None, ErrorKind.INTERNAL)

    def _drop_where(
        self,
        keep: Callable[[SplitRequest], bool],
        error: str | None,
        kind: ErrorKind = ErrorKind.UNAVAILABLE,
    ) -> ResultsByClient:
        """Drop the requests ``keep(split)`` is false for; their cancelling results."""
        results: ResultsByClient = {}
        for split in list(self.requests.values()):
            if not keep(split):
                merge(self._drop(split, error, kind), results)
        return results

    def _drop(self, split: SplitRequest, error: str | None, kind: ErrorKind) -> ResultsByClient:
        """End ``split`` on every side (``_release``); the result that cancels it with
        ``error`` (ignored by callers that have a final result)."""
        request_id = split.request_id
        del self.requests[request_id]
        if split.phase is Phase.QUEUED:
            self.queue.remove(split)
        self._release(split, error, kind)
        return {split.client_id: {request_id: SchedulerResult.cancelled(error, kind)}}

    def _release(self, split: SplitRequest, error: str | None, kind: ErrorKind) -> None:
        """Free ``split``'s blocks on the groups that hold them and cancel its transfer."""
        request_id = split.request_id
        for name in (split.prefill, split.decode):
            group = self.groups.get(name) if name is not None else None
            if group is not None and request_id in group.scheduler.requests:
                group.scheduler.cancel([request_id], error, kind)
        if self._transfers.pop(split.transfer_id, None) is not None:
            decode = self.groups.get(split.decode)
            if decode is not None:
                self.messages.append((decode.name, KVTransfers(cancel=[split.transfer_id])))

    # -- state ---------------------------------------------------------------------------------

    def _requests_by_role(self) -> tuple[dict[str, int], dict[str, int], set[RequestID]]:
        """Also while a role is missing; requests waiting for a decode reservation wait for
        prefill, and those whose KV is on its way run (in the total only)."""
        running, waiting, running_ids = super()._requests_by_role()
        if self.groups or self.queue:
            for role in self.roles:
                running.setdefault(role.value, 0)
                waiting.setdefault(role.value, 0)
            waiting[WorkerRole.PREFILL.value] += len(self.queue)
        running_ids.update(r for r, split in self.requests.items() if split.phase is Phase.TRANSFER)
        return running, waiting, running_ids

    def check_integrity(self) -> None:
        super().check_integrity()
        for split in self.requests.values():
            if split.phase is Phase.QUEUED:
                continue
            decode = self.groups[split.decode].scheduler
            if split.request_id not in decode.requests:
                raise RuntimeError(f"request {split.request_id} lost its decode blocks")
        if len(self.queue) != sum(s.phase is Phase.QUEUED for s in self.requests.values()):
            raise RuntimeError("the queue and the requests disagree")
