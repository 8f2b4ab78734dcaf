"""Disaggregated requests: prefilled on a prefill group, decoded on a decode group.

A request goes:

1. queued here, in arrival order, until a decode group can reserve blocks for its prompt and
   first token (so no prompt is computed that nobody can decode);
2. prefilled on the least loaded prefill group, in chunks and with its prefix cache, like any
   prompt; the step that computes the prompt's end also sends its KV blocks (``KVSend``), after
   the decode group was told to expect them (``KVTransfers``);
3. handed off with its first token (which streams to the client at once); the prefill side's
   blocks stay in its prefix cache;
4. decoded once every decode rank reported its share received (``KVReceived``), from the first
   token on, as a request whose prompt is already computed.

A transfer that does not finish within ``kv_transfer_timeout_s`` of the hand-off fails its
request. A request that ends anywhere (finished, aborted, failed, its group gone) is dropped on
every side: blocks freed, a pending transfer cancelled on the decode group ahead of any step
that could reuse its blocks.
"""

from __future__ import annotations

import enum
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from interfaces import ErrorKind, RequestID, SchedulerResult, SchedulerStatus, TextContext
from interfaces.scheduler_to_worker import KVReceive, KVSend, KVTransfers, ScheduledStep
from interfaces.worker_to_scheduler import KVReceived, WorkerRole
from scheduler.admission import queue_overload
from scheduler.config import SchedulerConfig
from scheduler.counters import SchedulerCounters
from scheduler.scheduler import ResultsByClient

if TYPE_CHECKING:
    from scheduler.coordinator import ServedGroup

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    QUEUED = "queued"
    PREFILL = "prefill"
    TRANSFER = "transfer"
    DECODE = "decode"


@dataclass(eq=False)
class Placement:
    """A disaggregated request: where it is and what its transfer has done."""

    context: TextContext
    client_id: bytes
    phase: Phase = Phase.QUEUED
    prefill: str | None = None
    decode: str | None = None
    decode_block_ids: list[int] = field(default_factory=list)
    transfer_id: int | None = None
    first_token: int | None = None
    handoff_time: float | None = None
    ranks_received: set[int] = field(default_factory=set)
    num_bytes: int = 0
    seconds: float = 0.0

    @property
    def request_id(self) -> RequestID:
        return self.context.request_id


class Disaggregation:
    """Every disaggregated request and KV transfer, over the coordinator's ``groups``."""

    def __init__(
        self,
        config: SchedulerConfig,
        counters: SchedulerCounters,
        groups: dict[str, ServedGroup],
    ) -> None:
        self.config = config
        self.counters = counters
        self.groups = groups
        """The coordinator's, shared: groups come and go there."""
        self.queue: deque[Placement] = deque()
        self.placements: dict[RequestID, Placement] = {}
        self.messages: list[tuple[str, KVTransfers]] = []
        """Transfer news for decode groups, to send before any later step."""
        self._transfers: dict[int, RequestID] = {}
        """Transfers in flight, by id: 64 random bits each (``new_transfer_id``), so a process
        that can reach a decode worker's transfer socket cannot name one to overwrite its KV."""

    def _of_role(self, role: WorkerRole) -> list[ServedGroup]:
        return [group for group in self.groups.values() if group.role is role]

    # -- requests in ---------------------------------------------------------------------------

    def add(self, context: TextContext, client_id: bytes) -> None:
        """Queue an accepted request until a decode group can reserve its blocks."""
        placement = Placement(context, client_id)
        self.placements[context.request_id] = placement
        self.queue.append(placement)

    def overload(self, num_prompt_tokens: int) -> str | None:
        """The queue bounds over the queue here and the prefill groups' queues."""
        prefill = [group.scheduler for group in self._of_role(WorkerRole.PREFILL)]
        num_queued = len(self.queue) + sum(len(s.waiting) for s in prefill)
        if not num_queued:
            return None
        num_tokens = sum(len(p.context.prompt_token_ids) for p in self.queue)
        num_tokens += sum(s.num_waiting_tokens for s in prefill)
        return queue_overload(self.config, num_queued, num_tokens, num_prompt_tokens)

    def dispatch(self) -> None:
        """Move queued requests, in order, to a prefill group once a decode group reserved
        blocks for them."""
        decode = self._of_role(WorkerRole.DECODE)
        while self.queue:
            # Prompts go on to a prefill group while its queue holds less than a step's budget:
            # blocks are reserved for them on a decode group no sooner than needed.
            budget = self.config.max_num_batched_tokens
            prefill = [
                g
                for g in self._of_role(WorkerRole.PREFILL)
                if g.scheduler.num_waiting_tokens < budget
            ]
            placement = self.queue[0]
            num_prompt = len(placement.context.prompt_token_ids)
            ready = [g for g in decode if g.scheduler.can_reserve(num_prompt)]
            if not prefill or not ready:
                return
            target = max(ready, key=lambda g: g.scheduler.block_manager.num_free_blocks)
            source = min(prefill, key=lambda g: g.load)
            # The decode side computes no prompt position: prompt logprobs come from the prefill.
            decode_context = msgspec.structs.replace(placement.context, prompt_logprobs=None)
            block_ids = target.scheduler.reserve(decode_context, placement.client_id)
            source.scheduler.accept(placement.context, placement.client_id)
            self.queue.popleft()
            placement.phase = Phase.PREFILL
            placement.prefill, placement.decode = source.name, target.name
            placement.decode_block_ids = block_ids

    # -- the transfer --------------------------------------------------------------------------

    def attach_sends(self, group: ServedGroup, step: ScheduledStep) -> None:
        """Send the KV of every request whose prompt this step completes, and tell its decode
        group to expect it (that message goes out first)."""
        for request_id in step.num_scheduled_tokens:
            placement = self.placements.get(request_id)
            request = group.scheduler.requests.get(request_id)
            if placement is None or placement.transfer_id is not None or request is None:
                continue
            if request.num_computed_tokens < request.num_tokens:
                continue  # a chunk; the prompt ends in a later step
            if request.max_new_tokens <= 1:
                continue  # its first token is its last: nothing to decode
            transfer_id = self.new_transfer_id()
            placement.transfer_id = transfer_id
            self._transfers[transfer_id] = request_id
            decode = self.groups[placement.decode]
            num_blocks = len(placement.decode_block_ids)
            step.kv_sends.append(
                KVSend(transfer_id, request_id, request.block_ids[:num_blocks], decode.destinations)
            )
            receive = KVReceive(transfer_id, request_id, placement.decode_block_ids, group.size)
            self.messages.append((decode.name, KVTransfers(receive=[receive])))

    def new_transfer_id(self) -> int:
        """An unguessable id no transfer in flight has."""
        while True:
            transfer_id = secrets.randbits(64)
            if transfer_id not in self._transfers:
                return transfer_id

    def hand_off(self, group: ServedGroup) -> None:
        """Take the requests prefill group ``group`` finished after their first token."""
        now = time.monotonic()
        for request in group.scheduler.take_handoffs():
            placement = self.placements[request.request_id]
            placement.first_token = request.all_token_ids[-1]
            placement.handoff_time = now
            placement.phase = Phase.TRANSFER
            self._maybe_start_decoding(placement)

    def on_kv_received(self, name: str, report: KVReceived) -> None:
        """A decode rank holds its share of a transfer; decoding starts once all do and the
        first token is known. Reports of cancelled transfers are ignored."""
        request_id = self._transfers.get(report.transfer_id)
        placement = self.placements.get(request_id) if request_id is not None else None
        if placement is None or placement.decode != name:
            return
        placement.ranks_received.add(report.rank)
        placement.num_bytes += report.num_bytes
        placement.seconds = max(placement.seconds, report.seconds)
        if len(placement.ranks_received) == self.groups[name].size:
            self.counters.observe_kv_transfer(placement.num_bytes, placement.seconds)
            self._maybe_start_decoding(placement)

    def _maybe_start_decoding(self, placement: Placement) -> None:
        decode = self.groups[placement.decode]
        if placement.first_token is None or len(placement.ranks_received) < decode.size:
            return
        decode.scheduler.start_decoding(placement.request_id, placement.first_token)
        placement.phase = Phase.DECODE
        del self._transfers[placement.transfer_id]

    def check_timeouts(self, now: float) -> ResultsByClient:
        """Fail the requests whose KV transfer outlived ``kv_transfer_timeout_s``."""
        timeout = self.config.kv_transfer_timeout_s
        results: ResultsByClient = {}
        for placement in list(self.placements.values()):
            if placement.phase is Phase.TRANSFER and now - placement.handoff_time > timeout:
                error = (
                    f"the KV cache transfer from prefill group {placement.prefill!r} to decode "
                    f"group {placement.decode!r} did not finish within {timeout:g} s"
                )
                logger.error("request %s: %s", placement.request_id, error)
                merge(self.drop(placement, error, ErrorKind.UNAVAILABLE), results)
        return results

    # -- requests out --------------------------------------------------------------------------

    def settle(self, results: ResultsByClient) -> None:
        """Drop every side of the requests that ``results`` ended."""
        for by_request in results.values():
            for request_id, result in by_request.items():
                placement = self.placements.get(request_id)
                if placement is not None and result.status is not SchedulerStatus.ACTIVE:
                    self.drop(placement, None, ErrorKind.INTERNAL)

    def drop_group(self, name: str, reason: str) -> ResultsByClient:
        """Group ``name`` is gone: drop what it held. A decode group's requests all go; a
        prefill group's only until they decode (a transfer it had not finished sending is
        lost with it). Its pending transfer news is dropped too."""
        self.messages = [(group, news) for group, news in self.messages if group != name]

        def survives(placement: Placement) -> bool:
            if placement.decode == name:
                return False
            return placement.prefill != name or placement.phase is Phase.DECODE

        return self.drop_where(survives, reason, ErrorKind.UNAVAILABLE)

    def drop_where(
        self, keep: Callable[[Placement], bool], error: str | None, kind: ErrorKind
    ) -> ResultsByClient:
        """Drop the placements ``keep(placement)`` is false for; their cancelling results."""
        results: ResultsByClient = {}
        for placement in list(self.placements.values()):
            if not keep(placement):
                merge(self.drop(placement, error, kind), results)
        return results

    def drop(self, placement: Placement, error: str | None, kind: ErrorKind) -> ResultsByClient:
        """End ``placement`` on every side: free its blocks, cancel its transfer; the result
        that cancels it with ``error`` (ignored by callers that have a final result)."""
        request_id = placement.request_id
        del self.placements[request_id]
        if placement.phase is Phase.QUEUED:
            self.queue.remove(placement)
        for name in (placement.prefill, placement.decode):
            group = self.groups.get(name) if name is not None else None
            if group is not None and request_id in group.scheduler.requests:
                group.scheduler.cancel([request_id], error, kind)
        if self._transfers.pop(placement.transfer_id, None) is not None:
            decode = self.groups.get(placement.decode)
            if decode is not None:
                self.messages.append((decode.name, KVTransfers(cancel=[placement.transfer_id])))
        result = SchedulerResult.cancelled(error, kind)
        return {placement.client_id: {request_id: result}}

    # -- state ---------------------------------------------------------------------------------

    def transferring(self) -> set[RequestID]:
        """Requests whose KV is on its way (running nowhere, but not waiting either)."""
        return {p.request_id for p in self.placements.values() if p.phase is Phase.TRANSFER}

    def check_integrity(self) -> None:
        for placement in self.placements.values():
            if placement.phase is Phase.QUEUED:
                continue
            decode = self.groups[placement.decode].scheduler
            if placement.request_id not in decode.requests:
                raise RuntimeError(f"request {placement.request_id} lost its decode blocks")
        if len(self.queue) != sum(p.phase is Phase.QUEUED for p in self.placements.values()):
            raise RuntimeError("the queue and the placements disagree")


def merge(results: ResultsByClient, into: ResultsByClient | None = None) -> ResultsByClient:
    """Add ``results`` to ``into`` (a fresh dict if None); a request's first result stays."""
    into = {} if into is None else into
    for client_id, by_request in results.items():
        mine = into.setdefault(client_id, {})
        for request_id, result in by_request.items():
            mine.setdefault(request_id, result)
    return into
