"""Pairing ``SchedulerStats`` replies with the ``StatsRequest``s that asked for them, and
sharing them between the unauthenticated routes that ask.

A stats reply carries no request id, and the API server sends StatsRequests for two reasons:
``EngineClient.stats()`` calls (health, metrics) and heartbeat pings. A caller must not be handed
the reply to an older ping (sent, say, before an abort that the caller wants to see reflected).

/health, /ready and /metrics need no API key, so anyone may call them as often as they like;
``SchedulerStatsCache`` keeps that from turning into as many scheduler round trips.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
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


STATS_MAX_AGE_S = 0.5
"""How long /health, /ready and /metrics reuse one stats reply. Well inside the 2 s in which
/health reports a dead worker (docs/reliability.md)."""


class SchedulerStatsCache:
    """The scheduler's stats for /health, /ready and /metrics, at most one round trip per
    ``max_age_s`` however many callers ask.

    ``fetch`` makes one round trip (``EngineClient.stats``). A reply is reused for ``max_age_s``
    from when its request was sent, and callers arriving while a request is out wait for that
    one, unless ``num_local_changes()`` moved since it was sent: this API server took, started
    or finished a request (``ServerMetrics.num_request_changes``), so a client that saw its own
    request end never reads stats from before. So probes cost at most one round trip per
    ``max_age_s`` plus one per such change. A failed round trip is not kept: the next caller
    asks again. One instance per event loop.
    """

    def __init__(
        self,
        fetch: Callable[[], Awaitable[SchedulerStats]],
        num_local_changes: Callable[[], int],
        max_age_s: float = STATS_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetch = fetch
        self._num_local_changes = num_local_changes
        self.max_age_s = max_age_s
        self._clock = clock
        self._round_trip: asyncio.Future[SchedulerStats] | None = None
        self._sent_at = 0.0
        self._sent_after_changes = -1

    async def get(self) -> SchedulerStats:
        """The stats of a round trip at most ``max_age_s`` old (see the class doc); raises
        what ``fetch`` raises (``SchedulerUnavailable``)."""
        if not self._can_share():
            self._sent_at = self._clock()
            self._sent_after_changes = self._num_local_changes()
            self._round_trip = asyncio.ensure_future(self._fetch())
            self._round_trip.add_done_callback(_consume_exception)
        # Shielded: a caller that goes away (a probe that timed out) leaves the round trip to
        # the others.
        return await asyncio.shield(self._round_trip)

    def _can_share(self) -> bool:
        round_trip = self._round_trip
        if round_trip is None or self._sent_after_changes != self._num_local_changes():
            return False
        if not round_trip.done():
            return True
        if round_trip.cancelled() or round_trip.exception() is not None:
            return False
        return self._clock() - self._sent_at < self.max_age_s


def _consume_exception(round_trip: asyncio.Future[SchedulerStats]) -> None:
    """Mark a failed round trip's exception as seen: every caller may have gone already."""
    if not round_trip.cancelled():
        round_trip.exception()
