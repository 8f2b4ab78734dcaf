"""When a worker group counts as stalled: a step in flight far longer than its recent steps.

A worker that dies closes its connection and is noticed at once (``scheduler.peers``); one that
hangs (stopped, deadlocked, a collective waiting for a rank that will never come) stays
connected and answers nothing. ``StepTimes`` tells the two apart from healthy slowness by time
alone: it knows, per group, when the step in flight was sent and how long its last
``RECENT_STEPS`` steps took (from sending to answer, as the scheduler sees them), and a group
is stalled once its step has run longer than its bound,

    max(stall_timeout_s, STALL_FACTOR x the slowest of its recent steps).

Why these two terms:

- ``STALL_FACTOR`` (10) times the *slowest* recent step, not a typical one: steps differ by
  orders of magnitude in a healthy group (a chunk of a long prefill on two busy CPU cores takes
  seconds where a decode step takes milliseconds), and one of them must never look like a
  stall. A group whose chunked prefills take 4 s may take 40 s before it is fenced.
- The floor, ``--stall-timeout`` (30 s): a group's first steps have no history and include its
  warm-up (kernel compilation, first allocations), and a group that only decoded short
  requests has a small slowest step; neither may be fenced for taking a few seconds. A step
  holds at most ``--max-num-batched-tokens`` tokens (512 by default on a CPU; requests
  prefilled in one 1920-token step of the default model had their first token after 3.5-5.7 s
  on two CPU cores, docs/performance.md), so with the defaults the floor is far above a
  healthy step; raise it with a much larger budget on slow hardware.

A LoRA load runs in the worker's loop between steps, so a step sent behind one waits for it:
while a group has LoRA updates unanswered its step is not judged, the oldest update may take
``LORA_UPDATE_BOUND_S`` (a large adapter read from a network file system), and once the last is
answered the step in flight counts from then.

A step's time runs from sending to *reading* its answer, so the scheduler's own stalls (its
process stopped, starved of CPU, or swapped out) would count against its workers: an answer
that arrived meanwhile waits unread, and the first pass of the loop afterwards may judge the
step before it reads its socket. The server measures its loop's passes and credits the time
past ``LOOP_PAUSE_S`` to every step and update in flight (``StepTimes.paused``). Only the time
past it: a scheduler whose every pass were slow would otherwise never fence a hung group (with
passes of 2 s, a hung group is fenced after twice its bound).

Pure bookkeeping: the caller passes the time (``time.monotonic()`` in the scheduler, a fake
clock in tests) and decides what a stall costs (``scheduler.server`` fences the group).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

STALL_FACTOR = 10.0
"""A step may take this many times the group's slowest recent step (see the module)."""
RECENT_STEPS = 32
"""How many of a group's last step times its bound looks at."""
LORA_UPDATE_BOUND_S = 120.0
"""How long a group may take over a LoRA load or unload before it counts as stalled."""
LOOP_PAUSE_S = 1.0
"""A pass of the scheduler's loop (its poll of 100 ms included) longer than this is the
scheduler's own stall; the time past it is not counted against its workers (see the module)."""


@dataclass(frozen=True)
class Stall:
    """Group ``group`` has run step ``step_id`` for ``seconds``, past its bound ``bound_s``."""

    group: str
    step_id: int
    seconds: float
    bound_s: float
    lora_update: bool = False
    """It was a LoRA update, not a step, that ran past its bound."""

    def describe(self) -> str:
        """One line for the logs and the group's ``Shutdown``."""
        if self.lora_update:
            return (
                f"group {self.group!r} stalled: a LoRA adapter update has run "
                f"{self.seconds:.1f} s, past its bound of {self.bound_s:.1f} s"
            )
        return (
            f"group {self.group!r} stalled: step {self.step_id} has run {self.seconds:.1f} s, "
            f"past its bound of {self.bound_s:.1f} s (the larger of --stall-timeout and "
            f"{STALL_FACTOR:g} x its slowest recent step)"
        )


@dataclass
class _GroupSteps:
    recent_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    step_id: int | None = None
    """The step in flight, if any."""
    sent_at: float = 0.0
    updates_sent_at: list[float] = field(default_factory=list)
    """When each LoRA update it has not answered was sent, oldest first."""


class StepTimes:
    """Per group: the step in flight and the durations of recent ones (see the module)."""

    def __init__(self, stall_timeout_s: float) -> None:
        """``stall_timeout_s`` is the floor of every group's bound
        (``SchedulerConfig.stall_timeout_s``)."""
        self.stall_timeout_s = stall_timeout_s
        self._groups: dict[str, _GroupSteps] = {}

    def sent(self, group: str, step_id: int, now: float) -> None:
        """Group ``group`` was sent step ``step_id`` at ``now`` (it has at most one in flight)."""
        steps = self._groups.setdefault(group, _GroupSteps())
        steps.step_id, steps.sent_at = step_id, now

    def answered(self, group: str, now: float) -> None:
        """Group ``group`` answered its step in flight at ``now`` (output or failure); its
        duration joins the recent ones. Ignored when no step is in flight."""
        steps = self._groups.get(group)
        if steps is None or steps.step_id is None:
            return
        steps.recent_seconds.append(max(0.0, now - steps.sent_at))
        steps.step_id = None

    def lora_update_sent(self, group: str, now: float) -> None:
        """Group ``group`` was sent a LoRA update at ``now``."""
        self._groups.setdefault(group, _GroupSteps()).updates_sent_at.append(now)

    def lora_update_answered(self, group: str, now: float) -> None:
        """Group ``group`` answered its oldest LoRA update at ``now``; once none is left, its
        step in flight (which waited behind them) counts from ``now``."""
        steps = self._groups.get(group)
        if steps is None or not steps.updates_sent_at:
            return
        steps.updates_sent_at.pop(0)
        if not steps.updates_sent_at and steps.step_id is not None:
            steps.sent_at = max(steps.sent_at, now)

    def paused(self, seconds: float) -> None:
        """The scheduler read no answers for ``seconds`` (its own stall): every step and LoRA
        update in flight counts from that much later."""
        for steps in self._groups.values():
            if steps.step_id is not None:
                steps.sent_at += seconds
            steps.updates_sent_at = [sent_at + seconds for sent_at in steps.updates_sent_at]

    def forget(self, group: str) -> None:
        """Group ``group`` left: a group that registers again under its name starts afresh
        (its first steps have the floor alone, for its warm-up)."""
        self._groups.pop(group, None)

    def bound_s(self, group: str) -> float:
        """How long group ``group``'s step may run before the group counts as stalled."""
        steps = self._groups.get(group)
        slowest = max(steps.recent_seconds, default=0.0) if steps is not None else 0.0
        return max(self.stall_timeout_s, STALL_FACTOR * slowest)

    def stalled(self, now: float) -> list[Stall]:
        """The groups whose step in flight has run past its bound at ``now``."""
        stalls = []
        for name, steps in self._groups.items():
            if steps.updates_sent_at:
                seconds = now - steps.updates_sent_at[0]
                if seconds > LORA_UPDATE_BOUND_S:
                    step_id = -1 if steps.step_id is None else steps.step_id
                    stalls.append(Stall(name, step_id, seconds, LORA_UPDATE_BOUND_S, True))
                continue
            if steps.step_id is None:
                continue
            seconds = now - steps.sent_at
            bound_s = self.bound_s(name)
            if seconds > bound_s:
                stalls.append(Stall(name, steps.step_id, seconds, bound_s))
        return stalls
