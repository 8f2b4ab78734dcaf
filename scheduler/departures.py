"""Worker groups that served and left, until they serve again: for ``/health``'s
``groups_away`` (the launcher restarts the groups it names) and ``worker_restarts_total``.

Text generation placements and the embedding groups each keep one ``Departures``; the scheduler
reports them together (``scheduler.server``).
"""

from __future__ import annotations

import time

from interfaces.scheduler_to_api import MAX_GROUPS_AWAY, MIGRATION_REASONS, GroupAway
from scheduler.config import SchedulerConfig

MAX_DEPARTURES = 1024
"""Departed groups remembered (the oldest is forgotten first), to count their restarts: enough
for every group of a unit, however many group names come and go. ``away`` reports the newest
``MAX_GROUPS_AWAY`` of them."""


class Departures:
    """Groups that left, by name: why (a ``MIGRATION_REASONS`` label) and when
    (``time.monotonic()``), oldest first."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.left: dict[str, tuple[str, float]] = {}

    def record(self, name: str, cause: str, now: float | None = None) -> None:
        """Group ``name`` left with ``cause`` (``ValueError`` for a label outside
        ``MIGRATION_REASONS``) at ``now`` (default: ``time.monotonic()``)."""
        if cause not in MIGRATION_REASONS:
            raise ValueError(f"unknown cause {cause!r}; expected one of {MIGRATION_REASONS}")
        self.left.pop(name, None)  # the newest departure goes last
        self.left[name] = (cause, time.monotonic() if now is None else now)
        if len(self.left) > MAX_DEPARTURES:
            del self.left[next(iter(self.left))]

    def remembers(self, name: str) -> bool:
        """Whether group ``name`` left and is still remembered (not yet forgotten for newer
        departures, nor served again)."""
        return name in self.left

    def returned(self, name: str) -> bool:
        """Group ``name`` serves (again); whether it had left (a restart to count)."""
        return self.left.pop(name, None) is not None

    def away(self, now: float | None = None) -> list[GroupAway]:
        """The groups that left less than ``worker_return_timeout_s`` before ``now`` (default:
        ``time.monotonic()``) and have not served since, the newest first, at most
        ``MAX_GROUPS_AWAY`` (what ``/health`` may list); none with a ``migration_limit`` of 0
        (nothing waits for a group then: /health fails as before)."""
        now = time.monotonic() if now is None else now
        if not self.config.migration_limit:
            return []
        timeout = self.config.worker_return_timeout_s
        away = [
            GroupAway(name, cause, now - left)
            for name, (cause, left) in reversed(self.left.items())
            if now - left < timeout
        ]
        return away[:MAX_GROUPS_AWAY]


def newest_away(*lists: list[GroupAway]) -> list[GroupAway]:
    """Groups away from several ``Departures.away``, the newest first, at most
    ``MAX_GROUPS_AWAY``."""
    merged = sorted((group for away in lists for group in away), key=lambda g: g.seconds)
    return merged[:MAX_GROUPS_AWAY]
