"""When the launcher starts a worker group again, and when it gives up.

Once the unit has been ready, a worker group (every rank of a tensor-parallel group; a prefill,
decode or hybrid group; the embedding worker) whose process exits is started again whole: its
other ranks are stopped (SIGTERM, then SIGKILL after ``GROUP_STOP_TIMEOUT_S``: a rank may be
blocked in a collective that will never finish), and once all have exited, all its ranks are
started together, under the same group name (and on the same GPUs, ``switchyard.devices``),
so that the scheduler takes the group back when they register; the other groups serve on. A
group the scheduler reports away (``switchyard.groups_away``: it died or was fenced as stalled)
while its processes still run is killed (SIGKILL: a stopped process ignores SIGTERM) and
started again the same way.

A scheduler that dies is one fault and one restart
(``WorkerGroupRestarts.restart_with_scheduler``): the scheduler is started again, and the
one-process worker groups register with it again by themselves, keeping their model loaded
(``worker.server``). A tensor-parallel group's ranks exit when their scheduler goes away, so
such a group is stopped and started again with the scheduler, as above (stopping it at once is
quicker, and its exit then spends nothing).

Restarts are bounded by ``WorkerRestartBudget``: ``limit`` a minute for the whole unit, the
scheduler's restarts included (``WorkerGroupRestarts.allow``). One more within the minute, and
``check``, ``replace_away`` or ``restart_with_scheduler`` returns why the unit must stop (the
launcher exits 1, as it does with restarts off: ``limit`` 0).
"""

from __future__ import annotations

import logging
import signal
import subprocess
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from switchyard.groups_away import AwayReport

logger = logging.getLogger("switchyard")

RESTART_WINDOW_S = 60.0
"""The sliding window of ``--restart-limit``."""
GROUP_STOP_TIMEOUT_S = 3.0
"""How long the other ranks of a group that lost one get to exit after SIGTERM before SIGKILL."""
AWAY_MARGIN_S = 2.0
"""A group's processes must have been started this much before the scheduler reported the
group gone to count as the ones that left: /health's numbers are up to half a second old
(``api_server.stats_tickets.STATS_MAX_AGE_S``), and processes started after the group left are
its replacement, still loading."""


@dataclass
class WorkerRestartBudget:
    """At most ``limit`` restarts in any ``window_s`` seconds. Times are ``time.monotonic()``."""

    limit: int
    window_s: float = RESTART_WINDOW_S
    restarts: deque[float] = field(default_factory=deque)
    """When each restart in the window happened, oldest first."""

    def used(self, now: float) -> int:
        """Restarts within the window that ends at ``now``."""
        while self.restarts and self.restarts[0] <= now - self.window_s:
            self.restarts.popleft()
        return len(self.restarts)

    def allows(self, now: float) -> bool:
        return self.used(now) < self.limit

    def spend(self, now: float) -> None:
        self.restarts.append(now)


@dataclass
class WorkerGroupProcesses:
    """The processes of one worker group now (their names among the launcher's children)."""

    name: str
    children: tuple[str, ...]
    started_at: float
    stop_deadline: float | None = None
    """While the group is being stopped to start again: when to SIGKILL what still runs."""

    @property
    def is_stopping(self) -> bool:
        return self.stop_deadline is not None


class WorkerGroupRestarts:
    """The launcher's worker groups: it starts each (``start``) and, once the unit has been
    ready, calls ``check`` and ``replace_away`` from its watching loop, and
    ``restart_with_scheduler`` when the scheduler exited.

    ``children`` is the launcher's own dict of child processes by name; ``spawn(group)`` starts
    every process of ``group``, puts them into ``children`` and returns their names.
    """

    def __init__(
        self,
        children: dict[str, subprocess.Popen],
        spawn: Callable[[str], list[str]],
        limit: int,
    ) -> None:
        self._children = children
        self._spawn = spawn
        self.budget = WorkerRestartBudget(limit)
        self.groups: dict[str, WorkerGroupProcesses] = {}

    @property
    def enabled(self) -> bool:
        return self.budget.limit > 0

    def start(self, group: str, now: float) -> None:
        self.groups[group] = WorkerGroupProcesses(group, tuple(self._spawn(group)), now)

    def owns(self, child: str) -> bool:
        """Whether ``child`` is a process of a worker group."""
        return any(child in group.children for group in self.groups.values())

    def check(self, now: float) -> str | None:
        """Start again the groups whose processes have all exited after a restart began; begin
        a restart of each group a process of which exited. Returns why the unit must stop (a
        death past the budget), or None."""
        for group in self.groups.values():
            if group.is_stopping:
                self._finish_stopping(group, now)
                continue
            for child in group.children:
                code = self._children[child].poll()
                if code is not None:
                    failure = self._restart(group, f"{child} exited with code {code}", now)
                    if failure is not None:
                        return failure
                    break
        return None

    def replace_away(self, report: AwayReport, now: float) -> str | None:
        """Kill and start again each group ``report`` says left the scheduler while its
        processes, started before it left, still run. Returns why the unit must stop, or None."""
        for away in report.groups:
            group = self.groups.get(away.name)
            if group is None or group.is_stopping or not self._running(group):
                continue
            if report.fetched_at - group.started_at <= away.seconds + AWAY_MARGIN_S:
                continue  # started after it left (or too near to tell): its replacement
            why = (
                f"worker group {group.name!r} left the scheduler {away.seconds:.1f} s ago "
                f"({away.reason}) while its processes run"
            )
            failure = self._restart(group, why, now, signal.SIGKILL)
            if failure is not None:
                return failure
        return None

    def allow(self, why: str, now: float) -> str | None:
        """Spend one restart, needed because of ``why``, at ``now``; or return why the unit
        must stop instead (restarts off, or the budget spent)."""
        if not self.enabled:
            return why
        if not self.budget.allows(now):
            return (
                f"{why}; worker groups or the scheduler were restarted {self.budget.used(now)} "
                f"time(s) in the last {RESTART_WINDOW_S:g} s already (--restart-limit "
                f"{self.budget.limit})"
            )
        self.budget.spend(now)
        return None

    def _running(self, group: WorkerGroupProcesses) -> bool:
        return any(self._children[child].poll() is None for child in group.children)

    def restart_with_scheduler(
        self, why: str, now: float, start_scheduler: Callable[[], None]
    ) -> str | None:
        """The scheduler exited (``why``): spend one restart for the whole fault, call
        ``start_scheduler``, and stop every tensor-parallel group (more than one process) to
        start it again (``_stop``; a group already stopping goes on, and starts again once its
        processes exited); the others register with the new scheduler by themselves. Returns
        why the unit must stop instead (restarts off, or none left)."""
        failure = self.allow(why, now)
        if failure is not None:
            return failure
        restarted = [g for g in self.groups.values() if len(g.children) > 1 or g.is_stopping]
        logger.error(
            "%s; starting it again (%d of %d restarts a minute); %s; the API servers submit "
            "their streams again",
            *(why, self.budget.used(now), self.budget.limit),
            "the worker groups register with it again"
            if not restarted
            else "tensor-parallel worker groups start again with it, the others register again",
        )
        start_scheduler()
        for group in restarted:
            if not group.is_stopping:
                self._stop(group, now, signal.SIGTERM)
        return None

    def _restart(
        self,
        group: WorkerGroupProcesses,
        why: str,
        now: float,
        signum: signal.Signals = signal.SIGTERM,
    ) -> str | None:
        """Begin to restart ``group`` because of ``why`` (``_stop``); returns why the unit must
        stop instead (restarts off, or none left)."""
        failure = self.allow(why, now)
        if failure is not None:
            return failure
        logger.error(
            "%s; starting worker group %r again (%d of %d restarts a minute)",
            *(why, group.name, self.budget.used(now), self.budget.limit),
        )
        self._stop(group, now, signum)
        return None

    def _stop(self, group: WorkerGroupProcesses, now: float, signum: signal.Signals) -> None:
        """Signal ``group``'s running processes ``signum`` and start it again once all have
        exited (now, if they have; else from ``check``)."""
        for child in group.children:
            process = self._children[child]
            if process.poll() is None:
                process.send_signal(signum)
        group.stop_deadline = now + GROUP_STOP_TIMEOUT_S
        self._finish_stopping(group, now)

    def _finish_stopping(self, group: WorkerGroupProcesses, now: float) -> None:
        """Start ``group`` again once all its processes have exited; SIGKILL those that
        outstay ``stop_deadline``."""
        running = [c for c in group.children if self._children[c].poll() is None]
        if not running:
            self.start(group.name, now)
            logger.info("started worker group %r again: %s", group.name, ", ".join(group.children))
            return
        if now >= group.stop_deadline:
            for child in running:
                logger.warning("%s did not stop in time; killing it", child)
                self._children[child].kill()
