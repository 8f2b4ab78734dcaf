"""Where each request runs: the one interface over the worker groups that generate text.

``Placement`` is everything the server asks of placement: serve a group or drop it, add a
request, schedule the idle groups, take a group's output (or its failure, or its grammar news),
a KV arrival, abort, stats. Each implementation owns its groups (no other object reads or writes
them), and each serving group has its own ``Scheduler`` (block pool, queue, steps):

- ``scheduler.hybrid.HybridPlacement``: every group runs requests from prompt to last token;
  a request runs wholly on the least loaded one;
- ``scheduler.disaggregation.DisaggregatedPlacement``: prefill groups compute prompts, decode
  groups generate the rest, and KV blocks move from one to the other.

Which one serves is decided by the first group to serve (``scheduler.server``). A group that
cannot serve beside the others (another role, model, block size, context length) is refused
with the reason. Not thread-safe; one caller drives it.
"""

from __future__ import annotations

import abc
import gc
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from interfaces import ErrorKind, RequestID, SchedulerResult, TextContext
from interfaces.scheduler_to_api import (
    MAX_GROUP_STATS,
    WORKER_DIED,
    GroupAway,
    GroupStats,
    SchedulerStats,
)
from interfaces.scheduler_to_worker import KVTransfers, ScheduledStep
from interfaces.worker_to_scheduler import (
    GrammarsReady,
    KVReceived,
    WorkerOutput,
    WorkerReady,
    WorkerRole,
)
from scheduler.config import KVCacheConfig, SchedulerConfig
from scheduler.counters import GroupCounters, SchedulerCounters
from scheduler.departures import Departures
from scheduler.request import RequestStatus
from scheduler.scheduler import ResultsByClient, Scheduler, TextResult, counter_stats
from scheduler.worker_group import WorkerGroup

logger = logging.getLogger(__name__)

NO_WORKER = "no worker is ready to serve requests"
SHARED_FIELDS = ("model_name", "block_size", "max_model_len")
"""What every group served together must report alike."""
WorkerMessage = ScheduledStep | KVTransfers
"""What a placement asks the server to send to every rank of a group."""


def return_timeout_error(timeout_s: float) -> str:
    """What a request that waited in vain for a group to serve again is told."""
    return f"no worker group came back within {timeout_s:g} s"


def new_scheduler(
    config: SchedulerConfig,
    kv_cache: KVCacheConfig,
    counters: SchedulerCounters | None = None,
    prefill_only: bool = False,
    group_counters: GroupCounters | None = None,
) -> Scheduler:
    """A ``Scheduler`` whose long-lived objects (one per KV block: tens of thousands) are moved
    out of the garbage collector's reach with ``gc.freeze()``, so full collections stay short
    and do not stall steps (they took 14-34 ms each with 16k blocks)."""
    scheduler = Scheduler(config, kv_cache, counters, prefill_only, group_counters)
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
        """Requests it holds: waiting, running, or (a decode group's) reserved."""
        scheduler = self.scheduler
        return len(scheduler.waiting) + len(scheduler.running) + len(scheduler.reserved)


class Placement(abc.ABC):
    """Every placement decision across the served groups of one kind (see the module)."""

    roles: tuple[WorkerRole, ...]
    """The roles of the groups it serves."""

    def __init__(self, config: SchedulerConfig, counters: SchedulerCounters) -> None:
        """``counters`` are shared by every group's ``Scheduler``, for the life of the process
        (so /metrics counters only grow when one placement replaces another)."""
        self.config = config
        self.counters = counters
        self.groups: dict[str, ServedGroup] = {}
        """The serving groups, by name: read them, never change them from outside."""
        self.departures = Departures(config)
        """Groups that served and left, until they serve again."""
        self.group_counters: dict[str, GroupCounters] = {}
        """Each group's own counters, by name, while it serves or ``departures`` remembers it
        (so they carry on when it serves again): at most ``MAX_GROUPS`` + ``MAX_DEPARTURES``."""

    @property
    @abc.abstractmethod
    def is_serving(self) -> bool:
        """Whether a new request can run now."""

    @property
    def accepts_requests(self) -> bool:
        """Whether a new request may be accepted now: it runs now (``is_serving``), or it may
        wait with the requests of a group that left for a group to serve again."""
        return self.is_serving

    @property
    def vocab_size(self) -> int:
        """The served model's vocabulary size (the smallest reported); 0 if none was."""
        sizes = (group.ready.vocab_size for group in self.groups.values())
        return min((size for size in sizes if size), default=0)

    # -- groups --------------------------------------------------------------------------------

    def add_group(self, group: WorkerGroup) -> str | None:
        """Serve a complete group; returns why it cannot serve beside the others, or None."""
        ready = group.ready
        problem = self._incompatibility(group)
        if problem is not None:
            return f"group {group.name!r} ({ready.role.value}) cannot serve: {problem}"
        kv_cache = KVCacheConfig(ready.num_kv_blocks, ready.block_size, ready.max_model_len)
        prefill_only = ready.role is WorkerRole.PREFILL
        group_counters = self.group_counters.setdefault(group.name, GroupCounters())
        scheduler = new_scheduler(
            self.config.with_step_tokens(ready.step_tokens),
            kv_cache,
            self.counters,
            prefill_only,
            group_counters,
        )
        if self.departures.returned(group.name):
            self.counters.worker_restarts += 1
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
        """Why ``group`` cannot serve beside the served groups, or None."""
        others = list(self.groups.values())
        if not others:
            return self._role_problem(group, None)
        if group.role not in self.roles:
            served = ", ".join(sorted(f"{g.name!r} ({g.role.value})" for g in others))
            return (
                "hybrid groups and prefill/decode groups cannot serve together; "
                f"{served} already serve"
            )
        served = others[0].ready
        for name in SHARED_FIELDS:
            mine, theirs = getattr(group.ready, name), getattr(served, name)
            if mine != theirs:
                return f"{name} {mine!r} differs from the served groups' {theirs!r}"
        return self._role_problem(group, served)

    def _role_problem(self, group: WorkerGroup, served: WorkerReady | None) -> str | None:
        """Why ``group`` cannot do its role's work beside the group that sent ``served`` (None:
        no group serves yet), beyond ``SHARED_FIELDS``; None if it can."""
        return None

    def remove_group(self, name: str, reason: str, cause: str = WORKER_DIED) -> ResultsByClient:
        """Group ``name`` is gone: fail every request it held (a hybrid placement may move them
        instead); requests running elsewhere go on.

        ``reason`` is the error text a failed request is told (the client sees it in its 503);
        ``cause`` is the label of why the group left, for metrics and ``groups_away``:
        ``WORKER_DIED``, or ``WORKER_STALLED`` when it was fenced for a step that took too long
        (``ValueError`` for a label outside ``MIGRATION_REASONS``)."""
        group = self._depart(name, cause)
        return {} if group is None else group.scheduler.fail_all(reason)

    def _depart(self, name: str, cause: str) -> ServedGroup | None:
        """Stop serving group ``name`` (None if it does not serve) and remember that it left
        with ``cause``, for ``groups_away`` and ``worker_restarts_total``."""
        group = self.groups.get(name)
        if group is not None:
            self.departures.record(name, cause)  # first: it refuses an unknown cause
            del self.groups[name]
            for other in [n for n in self.group_counters if n not in self.groups]:
                if not self.departures.remembers(other):  # forgotten: it counts anew
                    del self.group_counters[other]
        return group

    # -- requests in and out -------------------------------------------------------------------

    def add_request(self, context: TextContext, client_id: bytes) -> TextResult | None:
        """Accept a request, or return the result refusing it (see ``Scheduler.add_request``)."""
        if not self.accepts_requests:
            return SchedulerResult.cancelled(NO_WORKER, ErrorKind.UNAVAILABLE)
        if self.owner(context.request_id) is not None:
            return SchedulerResult.rejected_request(
                f"request id {context.request_id!r} is already in use"
            )
        return self._place(context, client_id)

    @abc.abstractmethod
    def _place(self, context: TextContext, client_id: bytes) -> TextResult | None:
        """``add_request`` for a new id while ``accepts_requests``."""

    def owner(self, request_id: RequestID) -> bytes | None:
        """The API server that submitted request ``request_id`` (waiting, running, or on its
        way between groups); None if it is unknown here."""
        for group in self.groups.values():
            request = group.scheduler.requests.get(request_id)
            if request is not None:
                return request.client_id
        return None

    def abort_requests(self, request_ids: list[RequestID]) -> ResultsByClient:
        """Drop requests wherever they are and free their blocks; unknown ids are ignored."""
        results: ResultsByClient = {}
        for group in self.groups.values():
            merge(group.scheduler.abort_requests(request_ids), results)
        return results

    def abort_client(self, client_id: bytes) -> int:
        """Drop every request of the API server ``client_id``; returns how many."""
        return sum(group.scheduler.abort_client(client_id) for group in self.groups.values())

    def fail_all(self, error: str, kind: ErrorKind = ErrorKind.UNAVAILABLE) -> ResultsByClient:
        """Fail every unfinished request."""
        results: ResultsByClient = {}
        for group in self.groups.values():
            merge(group.scheduler.fail_all(error, kind), results)
        return results

    def check_timeouts(self, now: float | None = None) -> ResultsByClient:
        """Fail the requests that outlived a deadline by ``now`` (default: ``time.monotonic()``).
        None has one here."""
        return {}

    # -- steps ---------------------------------------------------------------------------------

    def schedule(self, idle: Iterable[str]) -> list[tuple[str, WorkerMessage]]:
        """What to send now, in order: the next step of each group in ``idle`` (those without
        a step in flight) that has work, after any news those steps rely on."""
        steps: list[tuple[str, WorkerMessage]] = []
        for name in idle:
            group = self.groups.get(name)
            if group is None or not group.scheduler.has_unfinished_requests():
                continue
            step = group.scheduler.schedule()
            if step.num_scheduled_tokens:
                steps.append((name, step))
        return steps

    def update_from_output(self, name: str, output: WorkerOutput) -> ResultsByClient:
        """Group ``name`` answered its step."""
        return self.groups[name].scheduler.update_from_output(output)

    def fail_step(self, name: str, step: ScheduledStep, error: str) -> ResultsByClient:
        """Group ``name`` could not run ``step``: its requests fail with ``error``."""
        return self.groups[name].scheduler.fail_step(step, error)

    def on_grammars(self, name: str, news: GrammarsReady) -> ResultsByClient:
        """Group ``name``'s driver says which parked requests' grammars are ready or failed."""
        return self.groups[name].scheduler.on_grammars(news)

    def on_kv_received(self, name: str, report: KVReceived) -> None:
        """A rank of group ``name`` holds its share of a KV transfer (the server checked that
        the report is its sender's). Dropped where no transfer is expected."""
        logger.warning("dropped a KVReceived from group %r, which expects no KV", name)

    # -- state ---------------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        running, waiting, running_ids = self._requests_by_role()
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
            groups_away=self.groups_away(),
            groups=self.group_stats(),
        )

    def group_stats(self) -> list[GroupStats]:
        """Each serving group's ``GroupStats``, by name (at most ``MAX_GROUP_STATS``)."""
        stats = []
        for name in sorted(self.groups)[:MAX_GROUP_STATS]:
            group, scheduler = self.groups[name], self.groups[name].scheduler
            counters, block_manager = scheduler.group_counters, scheduler.block_manager
            stats.append(
                GroupStats(
                    name,
                    group.role.value,
                    num_requests_running=len(scheduler.running),
                    num_requests_waiting=len(scheduler.waiting),
                    num_kv_blocks_total=block_manager.num_blocks,
                    num_kv_blocks_used=block_manager.num_used_blocks,
                    prefix_cache_queries_total=counters.prefix_cache_queries,
                    prefix_cache_hits_total=counters.prefix_cache_hits,
                )
            )
        return stats

    def groups_away(self, now: float | None = None) -> list[GroupAway]:
        """``Departures.away`` of the groups that left."""
        return self.departures.away(now)

    def contexts(self) -> Iterator[tuple[TextContext, bool]]:
        """The context of every request held here (waiting, running, or on its way between
        groups), and whether it is running."""
        for group in self.groups.values():
            for request in group.scheduler.requests.values():
                yield request.context, request.status is RequestStatus.RUNNING

    def _requests_by_role(self) -> tuple[dict[str, int], dict[str, int], set[RequestID]]:
        """How many requests run and wait, by the role of the group holding them (every served
        role counted), and the ids of those running."""
        running = dict.fromkeys((group.role.value for group in self.groups.values()), 0)
        waiting = dict(running)
        running_ids: set[RequestID] = set()
        for group in self.groups.values():
            running[group.role.value] += len(group.scheduler.running)
            waiting[group.role.value] += len(group.scheduler.waiting)
            running_ids.update(request.request_id for request in group.scheduler.running)
        return running, waiting, running_ids

    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` if any group's bookkeeping is off (tests)."""
        for group in self.groups.values():
            group.scheduler.check_integrity()


def merge(results: ResultsByClient, into: ResultsByClient | None = None) -> ResultsByClient:
    """Add ``results`` to ``into`` (a fresh dict if None); a request's first result stays."""
    into = {} if into is None else into
    for client_id, by_request in results.items():
        mine = into.setdefault(client_id, {})
        for request_id, result in by_request.items():
            mine.setdefault(request_id, result)
    return into
