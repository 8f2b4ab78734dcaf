"""Hybrid placement: every group runs requests from prompt to last token.

A request runs wholly on the group that holds the fewest requests (waiting or running) when it
arrives, and stays there; its group's ``Scheduler`` does the rest. When its group dies and
another serves, it moves (``remove_group``): up to ``SchedulerConfig.migration_limit`` times,
it is recomputed on the least loaded survivor from its prompt plus the tokens it already
produced, as a preempted request is, and its stream pauses and goes on.
"""

from __future__ import annotations

import logging
from collections import defaultdict

from interfaces import ErrorKind, SchedulerResult, TextContext
from interfaces.worker_to_scheduler import WorkerRole
from scheduler.placement import Placement, ServedGroup
from scheduler.request import Request
from scheduler.scheduler import ResultsByClient, TextResult

logger = logging.getLogger(__name__)


class HybridPlacement(Placement):
    """Requests over ``hybrid`` groups, each wholly on one group (see the module)."""

    roles = (WorkerRole.HYBRID,)

    @property
    def is_serving(self) -> bool:
        return bool(self.groups)

    def _place(self, context: TextContext, client_id: bytes) -> TextResult | None:
        group = min(self.groups.values(), key=lambda g: g.load)
        return group.scheduler.add_request(context, client_id)

    def remove_group(self, name: str, reason: str) -> ResultsByClient:
        """Group ``name`` is gone. With ``migration_limit`` > 0 and another group serving, each
        request it held (running, waiting, or waiting for its grammar) moves to the least
        loaded survivor, running ones first; a request that moved ``migration_limit`` times
        already, or that could never fit there, fails with ``reason`` (503), as every request
        does with no survivor or a limit of 0."""
        if name not in self.groups or len(self.groups) == 1 or not self.config.migration_limit:
            return super().remove_group(name, reason)
        dead = self.groups.pop(name)
        results: ResultsByClient = defaultdict(dict)
        moves: dict[str, list[Request]] = defaultdict(list)
        for request in dead.scheduler.take_requests():
            target = self._least_loaded(moves)
            if request.num_migrations >= self.config.migration_limit or not (
                target.scheduler.can_adopt(request)
            ):
                failure = SchedulerResult.cancelled(reason, ErrorKind.UNAVAILABLE)
                results[request.client_id][request.request_id] = failure
                continue
            moves[target.name].append(request)
            logger.warning(
                "moved request %s from dead group %r to group %r (move %d of at most %d)",
                request.request_id,
                name,
                target.name,
                request.num_migrations + 1,
                self.config.migration_limit,
                extra={"request_id": request.request_id},
            )
        for target_name, requests in moves.items():
            self.groups[target_name].scheduler.adopt(requests)
        return results

    def _least_loaded(self, moves: dict[str, list[Request]]) -> ServedGroup:
        """The serving group with the fewest requests, counting those about to move there."""
        return min(self.groups.values(), key=lambda g: g.load + len(moves.get(g.name, ())))
