"""Requests waiting for a hybrid group to serve again, after the last one left.

When the last hybrid group leaves (its worker died, or it was fenced as stalled) with
``migration_limit`` and ``worker_return_timeout_s`` above 0, ``HybridPlacement`` does not fail
its requests: they wait here, and so do the requests that arrive meanwhile, for a group to serve
again (the same one restarted, or any other hybrid group). That group adopts them all
(``StrandedRequests.hand_over``); once ``worker_return_timeout_s`` has passed since the group
left, they fail with a 503 that names the bound (``fail_expired``).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

from interfaces import ErrorKind, SchedulerResult, TextContext
from scheduler.config import SchedulerConfig
from scheduler.placement import ServedGroup, return_timeout_error
from scheduler.request import Request
from scheduler.scheduler import ResultsByClient, Scheduler, TextResult

logger = logging.getLogger(__name__)

CANNOT_HOLD = "the worker group that serves now cannot hold this request"
"""What a request that arrived while no group served is told when the group that serves next
could never run it (a smaller KV pool or context, another model)."""
CONTINUED_FIELDS = ("model_name", "max_model_len", "vocab_size")
"""What the group that serves next must report as the departed one did to take its requests:
they were checked against these, and moved ones generated with that model. Its block size may
differ: the requests' block hashes are dropped when they are taken (``take_requests``) and
computed again at its size."""


class StrandedRequests:
    """The requests of the last hybrid group to leave, and those that arrived since (see the
    module); they count as waiting.

    Their queue is the departed group's ``Scheduler``, emptied of its blocks' holders: its
    limits (context length, KV pool size) and the queue bounds admit new requests as if it still
    served with nothing running. Moved requests are those with ``Request.left_group_time``.
    """

    def __init__(
        self,
        departed: ServedGroup,
        requests: list[Request],
        reason: str,
        cause: str,
        config: SchedulerConfig,
    ) -> None:
        """``requests``: taken from ``departed`` (``Scheduler.take_requests``), in order.
        ``reason``: what a moved request is told if it can never run on the group that serves
        next; ``cause``: why ``departed`` left (a ``MIGRATION_REASONS`` label)."""
        self.departed = departed
        self.reason = reason
        self.cause = cause
        self.timeout_s = config.worker_return_timeout_s
        self.deadline = time.monotonic() + self.timeout_s
        """When they fail (``time.monotonic()``), unless a group serves first."""
        for request in requests:
            self.queue.queue(request)

    @property
    def queue(self) -> Scheduler:
        return self.departed.scheduler

    def expired(self, now: float) -> bool:
        return now >= self.deadline

    def add_request(self, context: TextContext, client_id: bytes) -> TextResult | None:
        """Let a new request wait too, or return the result refusing it (as the departed
        group's ``Scheduler.add_request`` would)."""
        return self.queue.add_request(context, client_id)

    def fail_expired(self) -> ResultsByClient:
        """Fail every request: no group served within ``worker_return_timeout_s``."""
        error = return_timeout_error(self.timeout_s)
        logger.error(
            "group %r left and no worker group served within %g s: failing %d waiting request(s)",
            self.departed.name,
            self.timeout_s,
            len(self.queue.requests),
        )
        return self.queue.fail_all(error)

    def hand_over(self, group: ServedGroup) -> ResultsByClient:
        """``group`` serves now: queue every request there, the moved ones first (each
        counts one move), then the new ones in arrival order. Returns the failures (503) of
        those it could never run."""
        results: ResultsByClient = defaultdict(dict)
        moved: list[Request] = []
        continues = all(
            getattr(group.ready, name) == getattr(self.departed.ready, name)
            for name in CONTINUED_FIELDS
        )
        for request in self.queue.take_requests():
            is_moved = request.left_group_time is not None
            if not (continues and group.scheduler.can_adopt(request)):
                error = self.reason if is_moved else CANNOT_HOLD
                failure = SchedulerResult.cancelled(error, ErrorKind.UNAVAILABLE)
                results[request.client_id][request.request_id] = failure
            elif is_moved:
                moved.append(request)
            else:
                group.scheduler.queue(request)
        group.scheduler.adopt(moved, self.cause)
        logger.warning(
            "group %r serves the %d request(s) that waited since group %r left (%d could "
            "never run there)",
            group.name,
            len(group.scheduler.requests),
            self.departed.name,
            sum(len(by_request) for by_request in results.values()),
        )
        return results

    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` if the queue's bookkeeping is off (tests)."""
        self.queue.check_integrity()
        if self.queue.running or self.queue.reserved or self.queue.block_manager.num_used_blocks:
            raise RuntimeError("a request waiting for a group holds blocks or runs")
