"""LoRA adapters on the scheduler's side: their names and ids, and loads and unloads carried to
every text generation group.

An adapter is usable by name once every serving group has loaded it (``LoRAUpdated`` with
SUCCESS from each group's driver); a load that one group refuses is undone on the others and
the client gets that group's status. Each load gets a new ``lora_id``, never reused while the
scheduler runs, so a name loaded again never shares cached KV blocks
(``scheduler.block_hash.lora_root``) or worker slots with its predecessor.

Unloading takes the name away at once (new requests naming it get 404) but not the weights:
requests admitted with the adapter finish with it, and the groups unload it once none is left
(``release_drained``: the server asks every 0.25 s while one drains, and around each LoRA
operation). The slot it holds counts against ``--max-loras`` until then.

A group that starts serving later (a new one, or one restarted) is sent every loaded adapter
first; messages to a worker are ordered, so its first step already finds them. If it refuses
one, the error is logged and its requests for that adapter are refused by the worker, alone.
Adapters given with ``--lora-modules`` load the same way when the first group with LoRA
enabled serves. What was
loaded at run time is lost when the scheduler restarts (API servers' requests that name such an
adapter then get 404).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from interfaces.lora import (
    LoRAAdapterInfo,
    LoRAOperation,
    LoRARequest,
    LoRAResponse,
    LoRAStatus,
    lora_request_problem,
)
from interfaces.scheduler_to_worker import LoRAUpdate
from interfaces.worker_to_scheduler import LoRAUpdated

logger = logging.getLogger(__name__)

Client = tuple[bytes, int]
"""An API server's identity and the ticket of its ``LoRAOperationRequest``."""
Reply = tuple[Client, LoRAResponse]
Send = tuple[list[str], LoRAUpdate]
"""An update and the groups (by name) whose every rank gets it."""


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    lora_id: int


@dataclass
class Pending:
    """A load sent to groups that have not all answered. ``client`` is told the outcome (None:
    a ``--lora-modules`` load)."""

    adapter: Adapter
    client: Client | None
    waiting: set[str]
    succeeded: set[str] = field(default_factory=set)
    failure: LoRAResponse | None = None


class LoRAAdapters:
    """The scheduler's adapters. Its methods return what to send: ``Send``s to groups and
    ``Reply``s to API servers; the server does the sending."""

    def __init__(self, modules: Iterable[tuple[str, str]] = ()) -> None:
        self.loaded: dict[str, Adapter] = {}
        """Usable adapters, by name."""
        self.draining: dict[int, Adapter] = {}
        """Unloaded by name while requests still used them, by id."""
        self.pending: dict[int, Pending] = {}
        """Loads not yet answered by every group, by id."""
        self.resends: dict[int, set[str]] = {}
        """Adapters usable (or draining) already, sent to groups that started serving later
        and have not answered, by id: their answers only say whether that group holds it."""
        self.max_loras = 0
        """Adapters the groups hold at once: the least of the serving groups' (0: LoRA is not
        enabled, or no group serves)."""
        self._capacities: dict[str, int] = {}
        self._modules = list(modules)
        """``--lora-modules`` not loaded yet: they load when the first group with LoRA serves."""
        self._ids = itertools.count(1)

    def resolve(self, name: str) -> int | None:
        """The id of the usable adapter ``name``; None if there is none."""
        adapter = self.loaded.get(name)
        return adapter.lora_id if adapter is not None else None

    def infos(self) -> list[LoRAAdapterInfo]:
        """The usable adapters, by name."""
        return [LoRAAdapterInfo(a.name, a.path) for _, a in sorted(self.loaded.items())]

    # -- operations from API servers -----------------------------------------------------------

    def request(self, client: Client, request: LoRARequest) -> tuple[list[Reply], list[Send]]:
        """Start ``request`` (an API server's); an answer now, or updates to send."""
        problem = lora_request_problem(request)
        if problem is not None:
            status = (
                LoRAStatus.LOAD_ERROR
                if request.operation is LoRAOperation.LOAD
                else LoRAStatus.UNLOAD_ERROR
            )
            return [(client, LoRAResponse.of(status, problem))], []
        if request.operation is LoRAOperation.LOAD:
            return self._load(client, request.lora_name, request.lora_path or "")
        return self._unload(client, request.lora_name)

    def _load(self, client: Client | None, name: str, path: str) -> tuple[list[Reply], list[Send]]:
        refusal = self._load_refusal(name)
        if refusal is not None:
            if client is None:
                logger.error("could not load LoRA adapter %r: %s", name, refusal.message)
                return [], []
            return [(client, refusal)], []
        adapter = Adapter(name, path, next(self._ids))
        groups = sorted(self._capacities)
        self.pending[adapter.lora_id] = Pending(adapter, client, set(groups))
        return [], [(groups, _load_update(adapter))]

    def _load_refusal(self, name: str) -> LoRAResponse | None:
        loading = [pending.adapter.name for pending in self.pending.values()]
        if name in self.loaded or name in loading:
            return LoRAResponse.of(
                LoRAStatus.LOAD_NAME_EXISTS, f"The LoRA adapter '{name}' has already been loaded."
            )
        if not self._capacities:
            return LoRAResponse.of(
                LoRAStatus.UNSPECIFIED_ERROR, "no worker group serves yet; try again later"
            )
        if self.max_loras == 0:
            return LoRAResponse.of(
                LoRAStatus.LOAD_ERROR, "LoRA is not enabled (start the workers with --enable-lora)"
            )
        if self.num_slots_taken >= self.max_loras:
            return LoRAResponse.of(
                LoRAStatus.LOAD_ERROR,
                f"all --max-loras ({self.max_loras}) slots hold adapters; unload one first",
            )
        return None

    @property
    def num_slots_taken(self) -> int:
        """Adapters holding worker slots: usable, loading, or unloaded but still in use."""
        return len(self.loaded) + len(self.pending) + len(self.draining)

    def _unload(self, client: Client, name: str) -> tuple[list[Reply], list[Send]]:
        adapter = self.loaded.pop(name, None)
        if adapter is None:
            response = LoRAResponse.of(
                LoRAStatus.UNLOAD_NAME_NONEXISTENT, f"The LoRA adapter '{name}' cannot be found."
            )
            return [(client, response)], []
        self.draining[adapter.lora_id] = adapter
        message = f"LoRA adapter '{name}' unloaded; requests using it finish first."
        return [(client, LoRAResponse.of(LoRAStatus.SUCCESS, message))], []

    def release_drained(self, in_use: set[int]) -> list[Send]:
        """Unload from every group the drained adapters no request uses any more."""
        sends: list[Send] = []
        for lora_id in [i for i in self.draining if i not in in_use]:
            adapter = self.draining.pop(lora_id)
            logger.info("unloading LoRA adapter %r (id %d) from the workers", adapter.name, lora_id)
            sends.append((sorted(self._capacities), self._unload_update(adapter)))
        return sends

    @staticmethod
    def _unload_update(adapter: Adapter) -> LoRAUpdate:
        return LoRAUpdate(LoRAOperation.UNLOAD, adapter.lora_id, adapter.name)

    # -- the groups ----------------------------------------------------------------------------

    def group_joined(self, name: str, max_loras: int) -> tuple[list[Reply], list[Send]]:
        """Group ``name`` serves now, with room for ``max_loras`` adapters: send it every
        adapter usable, draining (its requests may move here) or loading, and, once groups
        with LoRA serve, ``--lora-modules``."""
        self._capacities[name] = max_loras
        self._update_max_loras()
        sends: list[Send] = []
        for adapter in [*self.loaded.values(), *self.draining.values()]:
            sends.append(([name], _load_update(adapter)))
            self.resends.setdefault(adapter.lora_id, set()).add(name)
        for pending in self.pending.values():
            if name not in pending.waiting:
                pending.waiting.add(name)
                sends.append(([name], _load_update(pending.adapter)))
        replies: list[Reply] = []
        modules = self._modules if self.max_loras else []
        self._modules = self._modules if not self.max_loras else []
        for module_name, path in modules:
            module_replies, module_sends = self._load(None, module_name, path)
            replies += module_replies
            sends += module_sends
        return replies, sends

    def group_left(self, name: str) -> tuple[list[Reply], list[Send]]:
        """Group ``name`` stopped serving: loads stop waiting for it."""
        self._capacities.pop(name, None)
        self._update_max_loras()
        replies: list[Reply] = []
        sends: list[Send] = []
        for lora_id in list(self.pending):
            pending = self.pending[lora_id]
            pending.waiting.discard(name)
            pending.succeeded.discard(name)
            if not pending.waiting:
                self._finish(lora_id, replies, sends)
        for lora_id in list(self.resends):
            self._resent(lora_id, name)
        return replies, sends

    def _resent(self, lora_id: int, group: str) -> None:
        """``group`` answered (or left) the load of adapter ``lora_id`` sent when it joined."""
        groups = self.resends.get(lora_id, set())
        groups.discard(group)
        if not groups:
            self.resends.pop(lora_id, None)

    def on_updated(self, group: str, updated: LoRAUpdated) -> tuple[list[Reply], list[Send]]:
        """Group ``group``'s driver answered a ``LoRAUpdate``."""
        replies: list[Reply] = []
        sends: list[Send] = []
        if updated.operation is LoRAOperation.UNLOAD:
            if not updated.response.ok:
                logger.error(
                    "group %r could not unload LoRA adapter id %d: %s",
                    group,
                    updated.lora_id,
                    updated.response.message,
                )
            return replies, sends
        if group in self.resends.get(updated.lora_id, ()):
            self._resent(updated.lora_id, group)
            if not updated.response.ok:  # its requests there are refused by the worker, alone
                logger.error(
                    "group %r could not load LoRA adapter id %d when it started serving: %s",
                    group,
                    updated.lora_id,
                    updated.response.message,
                )
            return replies, sends
        pending = self.pending.get(updated.lora_id)
        if pending is None or group not in pending.waiting:
            logger.warning("dropped an unexpected LoRAUpdated from group %r", group)
            return replies, sends
        pending.waiting.discard(group)
        if updated.response.ok:
            pending.succeeded.add(group)
        else:
            logger.error(
                "group %r could not load LoRA adapter %r: %s",
                group,
                pending.adapter.name,
                updated.response.message,
            )
            pending.failure = pending.failure or updated.response
        if not pending.waiting:
            self._finish(updated.lora_id, replies, sends)
        return replies, sends

    def _finish(self, lora_id: int, replies: list[Reply], sends: list[Send]) -> None:
        """Every group ``lora_id``'s load waited for has answered (or left)."""
        pending = self.pending.pop(lora_id)
        adapter = pending.adapter
        response = pending.failure
        if response is None and not pending.succeeded:
            response = LoRAResponse.of(
                LoRAStatus.UNSPECIFIED_ERROR, "the worker groups left before loading the adapter"
            )
        if response is None:
            self.loaded[adapter.name] = adapter
            logger.info("loaded LoRA adapter %r from %s (id %d)", adapter.name, adapter.path,
                        lora_id)  # fmt: skip
            response = LoRAResponse.of(
                LoRAStatus.SUCCESS, f"Success: LoRA adapter '{adapter.name}' added successfully."
            )
        elif pending.succeeded:
            sends.append((sorted(pending.succeeded), self._unload_update(adapter)))
        if pending.client is not None:
            replies.append((pending.client, response))

    def _update_max_loras(self) -> None:
        self.max_loras = min(self._capacities.values(), default=0)


def _load_update(adapter: Adapter) -> LoRAUpdate:
    return LoRAUpdate(LoRAOperation.LOAD, adapter.lora_id, adapter.name, adapter.path)
