"""Pairing ``SchedulerStats`` replies with the ``StatsRequest``s that asked for them.

A stats reply carries no request id, and the API server sends StatsRequests for two reasons:
``EngineClient.stats()`` calls (health, metrics) and heartbeat pings. A caller must not be handed
the reply to an older ping (sent, say, before an abort that the caller wants to see reflected).
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass

from interfaces.scheduler_to_api import SchedulerStats


@dataclass
class StatsWaiter:
    """One ``EngineClient.stats()`` call waiting for the reply to its request (``ticket``)."""

    ticket: int
    future: asyncio.Future[SchedulerStats]
    newest_reply: SchedulerStats | None = None


class StatsTickets:
    """Pairs ``SchedulerStats`` replies with the ``StatsRequest``s that asked for them.

    Replies carry no id, but the scheduler answers in order, so a reply answers the oldest
    request still outstanding, and a waiter is never handed a reply to an older request (say, a
    heartbeat ping sent before an abort). A request outstanding for longer than
    ``lost_after_s`` while newer ones wait is taken as lost (a scheduler that restarted or
    dropped it), so one lost reply does not shift every later pairing.
    """

    MAX_OUTSTANDING = 64

    def __init__(self, lost_after_s: float) -> None:
        self.lost_after_s = lost_after_s
        self._num_sent = 0
        self._outstanding: collections.deque[tuple[int, float]] = collections.deque()

    def sent(self) -> int:
        """Record a request sent now; return its ticket (1, 2, 3, ...)."""
        self._num_sent += 1
        self._outstanding.append((self._num_sent, time.monotonic()))
        while len(self._outstanding) > self.MAX_OUTSTANDING:
            self._outstanding.popleft()
        return self._num_sent

    def answered(self) -> int:
        """Record a reply received now; return the ticket it answers (0 if none is outstanding:
        a reply to a request already written off)."""
        now = time.monotonic()
        while len(self._outstanding) > 1 and now - self._outstanding[0][1] > self.lost_after_s:
            self._outstanding.popleft()
        return self._outstanding.popleft()[0] if self._outstanding else 0
