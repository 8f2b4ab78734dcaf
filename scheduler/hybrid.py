"""Hybrid placement: every group runs requests from prompt to last token.

A request runs wholly on the group that ``SchedulerConfig.placement`` chooses when it arrives
(``scheduler.group_choice``: by default where its prompt is cached and the least work is queued,
within a bound of the least loaded group), and stays there; its group's ``Scheduler`` does the
rest. When its group leaves (it
died, or was fenced as stalled), it moves (``remove_group``): up to
``SchedulerConfig.migration_limit`` times, it is recomputed from its prompt plus the tokens it
already produced, as a preempted request is, and its stream pauses and goes on. It moves to the
least loaded survivor at once; with none, it waits for a group to serve again for up to
``worker_return_timeout_s``, and so do new requests meanwhile (``scheduler.stranded``).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterator

from interfaces import ErrorKind, RequestID, SchedulerResult, TextContext
from interfaces.scheduler_to_api import WORKER_DIED, SchedulerStats
from interfaces.worker_to_scheduler import WorkerRole
from scheduler.config import SchedulerConfig
from scheduler.counters import SchedulerCounters
from scheduler.group_choice import choose_group
from scheduler.placement import Placement, ServedGroup, merge
from scheduler.request import Request
from scheduler.scheduler import ResultsByClient, TextResult
from scheduler.stranded import StrandedRequests
from scheduler.worker_group import WorkerGroup

logger = logging.getLogger(__name__)


class HybridPlacement(Placement):
    """Requests over ``hybrid`` groups, each wholly on one group (see the module)."""

    roles = (WorkerRole.HYBRID,)

    def __init__(self, config: SchedulerConfig, counters: SchedulerCounters) -> None:
        super().__init__(config, counters)
        self.stranded: StrandedRequests | None = None
        """The requests waiting for a group to serve again, while none serves; else None."""
        self._unsent: ResultsByClient = {}
        """Failures decided by ``add_group`` (which returns none), for ``check_timeouts``."""

    @property
    def is_serving(self) -> bool:
        return bool(self.groups)

    @property
    def vocab_size(self) -> int:
        if self.groups or self.stranded is None:
            return super().vocab_size
        return self.stranded.departed.ready.vocab_size

    def add_group(self, group: WorkerGroup) -> str | None:
        """``Placement.add_group``; the first group to serve adopts the stranded requests."""
        problem = super().add_group(group)
        if problem is None and self.stranded is not None:
            stranded, self.stranded = self.stranded, None
            self._unsent = merge(stranded.hand_over(self.groups[group.name]), self._unsent)
        return problem

    def remove_group(self, name: str, reason: str, cause: str = WORKER_DIED) -> ResultsByClient:
        """Group ``name`` is gone. With ``migration_limit`` > 0, each request it held (running,
        waiting, or waiting for its grammar) moves to the least loaded survivor, running ones
        first, or, with no survivor and ``worker_return_timeout_s`` > 0, waits for a group to
        serve (``stranded``). A request that moved ``migration_limit`` times already, or that
        could never fit in the survivor's pool, fails with ``reason`` (503), as every request
        does with a limit of 0, or no survivor and no time to wait. ``reason`` is that error
        text; ``cause``, the label of why the group left (``Placement.remove_group``)."""
        config, dead = self.config, self.groups.get(name)
        last = len(self.groups) == 1 and not config.worker_return_timeout_s
        if dead is None or not config.migration_limit or last:
            return super().remove_group(name, reason, cause)
        self._depart(name, cause)
        requests, results = self._movable(dead, reason)
        if not self.groups:
            self.stranded = StrandedRequests(dead, requests, reason, cause, config)
            logger.warning(
                "the last group %r left (%s): %d request(s) wait up to %g s for a group to serve",
                name,
                cause,
                len(requests),
                config.worker_return_timeout_s,
            )
            return results
        moves: dict[str, list[Request]] = defaultdict(list)
        for request in requests:
            target = self._least_loaded(moves)
            if not target.scheduler.can_adopt(request):
                failure = SchedulerResult.cancelled(reason, ErrorKind.UNAVAILABLE)
                results[request.client_id][request.request_id] = failure
                continue
            moves[target.name].append(request)
            logger.warning(
                "moved request %s from group %r (%s) to group %r (move %d of at most %d)",
                request.request_id,
                name,
                cause,
                target.name,
                request.num_migrations + 1,
                config.migration_limit,
                extra={"request_id": request.request_id},
            )
        for target_name, moving in moves.items():
            self.groups[target_name].scheduler.adopt(moving, cause)
        return results

    def _movable(self, dead: ServedGroup, reason: str) -> tuple[list[Request], ResultsByClient]:
        """Take every request of ``dead``, each remembering when it left (unless it is still
        on its way from an earlier move); returns those that may move once more, and the
        failures of those that moved ``migration_limit`` times already."""
        now = time.monotonic()
        movable: list[Request] = []
        results: ResultsByClient = defaultdict(dict)
        for request in dead.scheduler.take_requests():
            if request.left_group_time is None:
                request.left_group_time = now
            if request.num_migrations < self.config.migration_limit:
                movable.append(request)
            else:
                failure = SchedulerResult.cancelled(reason, ErrorKind.UNAVAILABLE)
                results[request.client_id][request.request_id] = failure
        return movable, results

    def _least_loaded(self, moves: dict[str, list[Request]]) -> ServedGroup:
        """The serving group with the fewest requests, counting those about to move there."""
        return min(self.groups.values(), key=lambda g: g.load + len(moves.get(g.name, ())))

    # -- requests while stranded -----------------------------------------------------------------

    @property
    def accepts_requests(self) -> bool:
        """While requests wait for a group to serve, a new one may wait with them."""
        stranded = self.stranded
        return self.is_serving or (stranded is not None and not stranded.expired(time.monotonic()))

    def _place(self, context: TextContext, client_id: bytes) -> TextResult | None:
        """On the group ``SchedulerConfig.placement`` chooses (``scheduler.group_choice``);
        while none serves, with the stranded requests (or refused as by the group that
        left)."""
        if not self.groups:
            return self.stranded.add_request(context, client_id)
        group = choose_group(list(self.groups.values()), context, self.config.placement)
        return group.scheduler.add_request(context, client_id)

    def owner(self, request_id: RequestID) -> bytes | None:
        if self.stranded is not None:
            request = self.stranded.queue.requests.get(request_id)
            if request is not None:
                return request.client_id
        return super().owner(request_id)

    def contexts(self) -> Iterator[tuple[TextContext, bool]]:
        yield from super().contexts()
        if self.stranded is not None:
            for request in self.stranded.queue.requests.values():
                yield request.context, False

    def abort_requests(self, request_ids: list[RequestID]) -> ResultsByClient:
        results = super().abort_requests(request_ids)
        if self.stranded is not None:
            merge(self.stranded.queue.abort_requests(request_ids), results)
        return results

    def abort_client(self, client_id: bytes) -> int:
        num_stranded = 0 if self.stranded is None else self.stranded.queue.abort_client(client_id)
        return num_stranded + super().abort_client(client_id)

    def fail_all(self, error: str, kind: ErrorKind = ErrorKind.UNAVAILABLE) -> ResultsByClient:
        results = merge(self._take_unsent(), super().fail_all(error, kind))
        if self.stranded is not None:
            stranded, self.stranded = self.stranded, None
            merge(stranded.queue.fail_all(error, kind), results)
        return results

    def check_timeouts(self, now: float | None = None) -> ResultsByClient:
        """Fail the stranded requests once ``worker_return_timeout_s`` has passed since their
        group left with none serving again (and send what ``add_group`` failed)."""
        now = time.monotonic() if now is None else now
        results = self._take_unsent()
        if self.stranded is not None and self.stranded.expired(now):
            stranded, self.stranded = self.stranded, None
            merge(stranded.fail_expired(), results)
        return results

    def _take_unsent(self) -> ResultsByClient:
        unsent, self._unsent = self._unsent, {}
        return unsent

    def stats(self) -> SchedulerStats:
        stats = super().stats()
        if self.stranded is not None:
            num_stranded, role = len(self.stranded.queue.waiting), WorkerRole.HYBRID.value
            stats.num_requests_waiting += num_stranded
            by_role = stats.num_requests_waiting_by_role
            by_role[role] = by_role.get(role, 0) + num_stranded
        return stats

    def check_integrity(self) -> None:
        super().check_integrity()
        if self.stranded is not None:
            self.stranded.check_integrity()
