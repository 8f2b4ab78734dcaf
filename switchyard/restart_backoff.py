"""When the launcher starts a dead API server again: exponential back-off, reset by a long run.

An API server that keeps dying is restarted ever more slowly (0.5 s, 1 s, 2 s, ... up to 30 s
after each exit) while the scheduler, the workers and the other API servers serve on; once it
has stayed up for a minute, its next exit counts as the first again. The launcher gives up (exits
1) only when no API server has stayed up for ``API_SERVER_OUTAGE_LIMIT_S``.
"""

from __future__ import annotations

from dataclasses import dataclass

INITIAL_DELAY_S = 0.5
MAX_DELAY_S = 30.0
STABLE_AFTER_S = 60.0
"""An API server that has run this long is healthy again: its next exit waits
``INITIAL_DELAY_S``."""
API_SERVER_OUTAGE_LIMIT_S = 300.0
"""When every API server has failed to stay up (``STABLE_AFTER_S``) for this long, the unit
serves nobody, and the launcher exits 1 so that its supervisor sees the outage."""


@dataclass
class RestartBackoff:
    """The restart schedule of one API server (its successive processes, under one name).

    The launcher calls ``started`` whenever it starts the process and ``crashed`` when it finds
    it exited; ``is_due`` says when to start it again. Times are ``time.monotonic()`` seconds.
    """

    initial_delay_s: float = INITIAL_DELAY_S
    max_delay_s: float = MAX_DELAY_S
    stable_after_s: float = STABLE_AFTER_S
    started_at: float = 0.0
    exits_in_a_row: int = 0
    """Exits since the last run of ``stable_after_s`` or longer (0: none)."""
    delay_s: float = 0.0
    """The wait before the pending restart (or the last one)."""
    restart_at: float | None = None
    """When to start the process again; None while it runs."""
    failing_since: float | None = None
    """The first of ``exits_in_a_row``; None while there are none."""

    def started(self, now: float) -> None:
        self.started_at = now
        self.restart_at = None

    def crashed(self, now: float) -> float:
        """Note that the process exited at ``now``; returns the wait before its restart."""
        if now - self.started_at >= self.stable_after_s:
            self.exits_in_a_row, self.failing_since = 0, None
        if self.exits_in_a_row == 0:
            self.delay_s, self.failing_since = self.initial_delay_s, now
        else:
            self.delay_s = min(self.delay_s * 2, self.max_delay_s)
        self.exits_in_a_row += 1
        self.restart_at = now + self.delay_s
        return self.delay_s

    @property
    def is_waiting(self) -> bool:
        """Whether the process has exited and waits for its restart."""
        return self.restart_at is not None

    def is_due(self, now: float) -> bool:
        return self.restart_at is not None and now >= self.restart_at

    def failing_for(self, now: float) -> float:
        """Seconds since this API server last stayed up (0 if it is up, or has never exited,
        or has run ``stable_after_s`` since its last exit)."""
        if self.failing_since is None:
            return 0.0
        if self.restart_at is None and now - self.started_at >= self.stable_after_s:
            return 0.0
        return now - self.failing_since
