"""Where each request runs: the worker groups being served.

Each serving group has its own ``Scheduler`` (block pool, queue, steps). Groups are either all
``hybrid`` (a request runs wholly on the least loaded one) or ``prefill`` and ``decode``
groups, at least one of each, whose requests ``scheduler.disaggregation`` moves from one to the
other. A group that cannot serve beside the others (another role mode, block size, context
length or KV layout) is refused with the reason.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from interfaces import ErrorKind, RequestID, SchedulerResult, TextContext
from interfaces.scheduler_to_api import SchedulerStats
from interfaces.scheduler_to_worker import KVTransfers, ScheduledStep
from interfaces.worker_to_scheduler import (
    GrammarsReady,
    KVReceived,
    WorkerOutput,
    WorkerReady,
    WorkerRole,
)
from scheduler.config import KVCacheConfig, SchedulerConfig
from scheduler.counters import SchedulerCounters
from scheduler.disaggregation import Disaggregation, Phase, merge
from scheduler.scheduler import ResultsByClient, Scheduler, TextResult, counter_stats
from scheduler.worker_group import WorkerGroup

logger = logging.getLogger(__name__)

NO_WORKER = "no worker is ready to serve requests"
WorkerMessage = ScheduledStep | KVTransfers
"""What the coordinator asks the server to send to every rank of a group."""


def new_scheduler(
    config: SchedulerConfig,
    kv_cache: KVCacheConfig,
    counters: SchedulerCounters | None = None,
    prefill_only: bool = False,
) -> Scheduler:
    """A ``Scheduler`` whose long-lived objects (one per KV block: tens of thousands) are moved
    out of the garbage collector's reach with ``gc.freeze()``, so full collections stay short
    and do not stall steps (they took 14-34 ms each with 16k blocks)."""
    scheduler = Scheduler(config, kv_cache, counters, prefill_only)
    gc.collect()
    gc.freeze()
    return scheduler


@dataclass(eq=False)
class ServedGroup:
    """A complete worker group and the scheduler of its blocks and steps."""

    name: str
    role: WorkerRole
    ready: WorkerReady
    size: int
    destinations: list[str]
    """Where its ranks receive KV transfers, by rank (a decode group's)."""
    scheduler: Scheduler

    @property
    def load(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)


class Coordinator:
    """Every placement decision across the served groups. One caller drives it."""

    def __init__(self, config: SchedulerConfig, counters: SchedulerCounters) -> None:
        self.config = config
        self.counters = counters
        self.groups: dict[str, ServedGroup] = {}
        self.disaggregation = Disaggregation(config, counters, self.groups)

    def _of_role(self, role: WorkerRole) -> list[ServedGroup]:
        return [group for group in self.groups.values() if group.role is role]

    @property
    def disaggregated(self) -> bool:
        return any(group.role is not WorkerRole.HYBRID for group in self.groups.values())

    @property
    def is_serving(self) -> bool:
        """Whether a request can run now: a hybrid group, or a prefill and a decode group."""
        if self._of_role(WorkerRole.HYBRID):
            return True
        return bool(self._of_role(WorkerRole.PREFILL) and self._of_role(WorkerRole.DECODE))

    # -- groups --------------------------------------------------------------------------------

    def add_group(self, group: WorkerGroup) -> str | None:
        """Serve a complete group; returns why it cannot serve beside the others, or None."""
        ready = group.ready
        problem = self._incompatibility(group)
        if problem is not None:
            return f"group {group.name!r} ({ready.role.value}) cannot serve: {problem}"
        kv_cache = KVCacheConfig(ready.num_kv_blocks, ready.block_size, ready.max_model_len)
        prefill_only = ready.role is WorkerRole.PREFILL
        scheduler = new_scheduler(self.config, kv_cache, self.counters, prefill_only)
        destinations = group.destinations if ready.role is WorkerRole.DECODE else []
        self.groups[group.name] = ServedGroup(
            group.name, ready.role, ready, group.size, destinations, scheduler
        )
        logger.info(
            "serving group %r (%s): %s on %d rank(s), %d KV blocks of %d tokens, context %d",
            group.name,
            ready.role.value,
            ready.model_name,
            group.size,
            ready.num_kv_blocks,
            ready.block_size,
            ready.max_model_len,
        )
        return None

    def _incompatibility(self, group: WorkerGroup) -> str | None:
        ready = group.ready
        if ready.role is not WorkerRole.HYBRID and ready.kv_layout is None:
            return "it did not report its KV layout, which KV transfers need"
        if ready.role is WorkerRole.DECODE and not all(group.destinations):
            return "a rank did not report the address it receives KV transfers at"
        others = list(self.groups.values())
        if not others:
            return None
        hybrid = ready.role is WorkerRole.HYBRID
        if hybrid == self.disaggregated:
            served = ", ".join(sorted(f"{g.name!r} ({g.role.value})" for g in others))
            return (
                "hybrid groups and prefill/decode groups cannot serve together; "
                f"{served} already serve"
            )
        other = others[0].ready
        for name in ("model_name", "block_size", "max_model_len"):
            mine, theirs = getattr(ready, name), getattr(other, name)
            if mine != theirs:
                return f"{name} {mine!r} differs from the served groups' {theirs!r}"
        if not hybrid and ready.kv_layout != other.kv_layout:
            return (
                f"its KV layout {ready.kv_layout} differs from the served {other.kv_layout}; "
                "KV blocks could not be transferred between them"
            )
        return None

    def remove_group(self, name: str, reason: str) -> ResultsByClient:
        """Group ``name`` is gone: fail every request it held (on every side), and the queued
        ones if no new request can run without it; requests running elsewhere go on."""
        group = self.groups.pop(name, None)
        if group is None:
            return {}
        results = merge(group.scheduler.fail_all(reason))
        disaggregation = self.disaggregation
        merge(disaggregation.drop_group(name, reason), results)
        if not self.is_serving:
            queued = disaggregation.drop_where(
                lambda p: p.phase is not Phase.QUEUED, reason, ErrorKind.UNAVAILABLE
            )
            merge(queued, results)
        return results

    # -- requests in and out -------------------------------------------------------------------

    def add_request(self, context: TextContext, client_id: bytes) -> TextResult | None:
        """Accept a request, or return the result refusing it (see ``Scheduler.add_request``)."""
        if not self.is_serving:
            return SchedulerResult.cancelled(NO_WORKER, ErrorKind.UNAVAILABLE)
        if self.knows(context.request_id):
            return SchedulerResult.rejected_request(
                f"request id {context.request_id!r} is already in use"
            )
        if not self.disaggregated:
            group = min(self._of_role(WorkerRole.HYBRID), key=lambda g: g.load)
            return group.scheduler.add_request(context, client_id)
        # The smallest pool decides whether a request can ever run (one group of each role
        # would do: each holds a whole context, the limit checked, and they share it).
        decode = min(
            self._of_role(WorkerRole.DECODE), key=lambda g: g.scheduler.block_manager.num_blocks
        )
        overload = self.disaggregation.overload(len(context.prompt_token_ids))
        refusal = decode.scheduler.refusal(context, overload)
        if refusal is None:
            self.disaggregation.add(context, client_id)
        return refusal

    def knows(self, request_id: RequestID) -> bool:
        """Whether request ``request_id`` is anywhere in the scheduler (waiting, transferring or
        running)."""
        return request_id in self.disaggregation.placements or any(
            request_id in group.scheduler.requests for group in self.groups.values()
        )

    def owner(self, request_id: RequestID) -> bytes | None:
        """The API server that submitted request ``request_id``; None if it is unknown."""
        placement = self.disaggregation.placements.get(request_id)
        if placement is not None:
            return placement.client_id
        for group in self.groups.values():
            request = group.scheduler.requests.get(request_id)
            if request is not None:
                return request.client_id
        return None

    def abort_requests(self, request_ids: list[RequestID]) -> ResultsByClient:
        """Drop requests wherever they are and free their blocks; unknown ids are ignored."""
        wanted = set(request_ids)
        results = self.disaggregation.drop_where(
            lambda p: p.request_id not in wanted, None, ErrorKind.INTERNAL
        )
        for group in self.groups.values():
            merge(group.scheduler.abort_requests(request_ids), results)
        return results

    def abort_client(self, client_id: bytes) -> int:
        """Drop every request of the API server ``client_id``; returns how many."""
        dropped = self.disaggregation.drop_where(
            lambda p: p.client_id != client_id, None, ErrorKind.INTERNAL
        )
        num_dropped = len(dropped.get(client_id, {}))
        return num_dropped + sum(g.scheduler.abort_client(client_id) for g in self.groups.values())

    def fail_all(self, error: str, kind: ErrorKind = ErrorKind.UNAVAILABLE) -> ResultsByClient:
        """Fail every unfinished request."""
        results = self.disaggregation.drop_where(lambda _: False, error, kind)
        for group in self.groups.values():
            merge(group.scheduler.fail_all(error, kind), results)
        return results

    def check_timeouts(self, now: float | None = None) -> ResultsByClient:
        """Fail the requests whose KV transfer outlived ``kv_transfer_timeout_s``."""
        return self.disaggregation.check_timeouts(time.monotonic() if now is None else now)

    # -- steps ---------------------------------------------------------------------------------

    def schedule(self, idle: Iterable[str]) -> list[tuple[str, WorkerMessage]]:
        """What to send now, in order: transfer news for decode groups, and the next step of
        each group in ``idle`` (those without a step in flight) that has work."""
        disaggregation = self.disaggregation
        disaggregation.dispatch()
        steps: list[tuple[str, WorkerMessage]] = []
        for name in idle:
            group = self.groups.get(name)
            if group is None or not group.scheduler.has_unfinished_requests():
                continue
            step = group.scheduler.schedule()
            if not step.num_scheduled_tokens:
                continue
            if group.role is WorkerRole.PREFILL:
                disaggregation.attach_sends(group, step)
            steps.append((name, step))
        news, disaggregation.messages = disaggregation.messages, []
        return [*news, *steps]

    def has_work(self, idle: Iterable[str]) -> bool:
        """Whether ``schedule(idle)`` may have anything to send."""
        disaggregation = self.disaggregation
        return bool(
            disaggregation.messages
            or disaggregation.queue
            or any(self.has_unfinished_requests(name) for name in idle)
        )

    def update_from_output(self, name: str, output: WorkerOutput) -> ResultsByClient:
        group = self.groups[name]
        results = group.scheduler.update_from_output(output)
        if group.role is WorkerRole.PREFILL:
            self.disaggregation.hand_off(group)
        self.disaggregation.settle(results)
        return results

    def fail_step(self, name: str, step: ScheduledStep, error: str) -> ResultsByClient:
        results = self.groups[name].scheduler.fail_step(step, error)
        self.disaggregation.settle(results)
        return results

    def on_grammars(self, name: str, news: GrammarsReady) -> ResultsByClient:
        """Group ``name``'s driver says which parked requests' grammars are ready or failed."""
        results = self.groups[name].scheduler.on_grammars(news)
        self.disaggregation.settle(results)
        return results

    def on_kv_received(self, name: str, report: KVReceived) -> None:
        self.disaggregation.on_kv_received(name, report)

    # -- state ---------------------------------------------------------------------------------

    def has_unfinished_requests(self, name: str) -> bool:
        group = self.groups.get(name)
        return group is not None and group.scheduler.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        running = dict.fromkeys((group.role.value for group in self.groups.values()), 0)
        waiting = dict(running)
        running_ids = self.disaggregation.transferring()
        for group in self.groups.values():
            running[group.role.value] += len(group.scheduler.running)
            waiting[group.role.value] += len(group.scheduler.waiting)
            running_ids.update(request.request_id for request in group.scheduler.running)
        if self.disaggregated:  # waiting for a decode reservation, then to be prefilled
            for role in (WorkerRole.PREFILL.value, WorkerRole.DECODE.value):
                running.setdefault(role, 0)
                waiting.setdefault(role, 0)
            waiting[WorkerRole.PREFILL.value] += len(self.disaggregation.queue)
        schedulers = [group.scheduler for group in self.groups.values()]
        return counter_stats(
            self.counters,
            num_requests_running=len(running_ids),
            num_requests_waiting=sum(waiting.values()),
            num_kv_blocks_total=sum(s.block_manager.num_blocks for s in schedulers),
            num_kv_blocks_used=sum(s.block_manager.num_used_blocks for s in schedulers),
            workers_ready=self.is_serving,
            num_requests_running_by_role=running,
            num_requests_waiting_by_role=waiting,
        )

    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` if any group's bookkeeping, or the placements', is off."""
        for group in self.groups.values():
            group.scheduler.check_integrity()
        self.disaggregation.check_integrity()
