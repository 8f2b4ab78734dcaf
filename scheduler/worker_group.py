"""The worker groups registered with the scheduler, each one worker or a tensor-parallel group.

Every rank registers with ``WorkerReady`` on its own connection, naming its group. A group
serves once all ``tensor_parallel_size`` ranks have registered alike (model, KV pool, role,
layout); steps then go to every rank and rank 0 (the driver) answers. ``WorkerGroups.register``
decides what each registration means, so the server only acts on the outcome; whether a complete
group fits beside the others (roles, KV layouts) is the coordinator's call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from interfaces.worker_to_scheduler import WorkerReady, WorkerRole

SHARED_FIELDS = ("model_name", "num_kv_blocks", "block_size", "max_model_len", "role", "kv_layout")
"""What every rank of a group must report alike."""


@dataclass
class WorkerGroup:
    """The ranks of one group registered so far, by rank; ``ready`` is the first registration."""

    ready: WorkerReady
    identities: dict[int, bytes] = field(default_factory=dict)
    transfer_addrs: dict[int, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.ready.group

    @property
    def role(self) -> WorkerRole:
        return self.ready.role

    @property
    def size(self) -> int:
        return self.ready.tensor_parallel_size

    @property
    def is_complete(self) -> bool:
        return len(self.identities) == self.size

    @property
    def driver(self) -> bytes:
        """Rank 0's identity: the only rank that answers steps."""
        return self.identities[0]

    @property
    def members(self) -> list[bytes]:
        return list(self.identities.values())

    @property
    def destinations(self) -> list[str]:
        """Where each rank receives KV transfers, by rank (a decode group's)."""
        return [self.transfer_addrs[rank] for rank in range(self.size)]

    def add(self, identity: bytes, ready: WorkerReady) -> None:
        self.identities[ready.rank] = identity
        self.transfer_addrs[ready.rank] = ready.transfer_addr

    def mismatch(self, ready: WorkerReady) -> str | None:
        """Why rank ``ready.rank`` cannot join this group, or None."""
        if ready.tensor_parallel_size != self.size:
            return f"tensor_parallel_size {ready.tensor_parallel_size} != {self.size}"
        for name in SHARED_FIELDS:
            if getattr(ready, name) != getattr(self.ready, name):
                return f"{name} {getattr(ready, name)!r} != {getattr(self.ready, name)!r}"
        return None


@dataclass(frozen=True)
class Registration:
    """What a ``WorkerReady`` (or a departure) did to group ``group``.

    ``retired`` lost their group: the scheduler tells these identities to shut down. When
    ``was_serving``, the group had been serving and is over: the scheduler fails its requests.
    ``now_serving`` is true when this registration completed the group. ``error`` says why a
    registration was refused or replaced a group (logged by the caller).
    """

    group: str
    retired: list[bytes]
    was_serving: bool
    now_serving: bool
    error: str | None = None


class WorkerGroups:
    """Every group forming or serving, by name, and the fate of their members."""

    def __init__(self) -> None:
        self.groups: dict[str, WorkerGroup] = {}
        self._group_of: dict[bytes, str] = {}

    def serving(self) -> list[WorkerGroup]:
        """The complete groups."""
        return [group for group in self.groups.values() if group.is_complete]

    def group_of(self, identity: bytes) -> WorkerGroup | None:
        name = self._group_of.get(identity)
        return self.groups.get(name) if name is not None else None

    def register(self, identity: bytes, ready: WorkerReady) -> Registration:
        """Add ``identity`` as rank ``ready.rank`` of group ``ready.group``.

        A rank that joins a forming group it matches is added. Otherwise the newest registration
        wins: one for a group that serves, from a rank the forming group already has (a
        restarted worker), or that does not match the forming group (``error`` says how)
        starts the group anew, and the old group's members are retired.
        """
        name = ready.group
        if not 0 <= ready.rank < ready.tensor_parallel_size:
            error = f"rank {ready.rank} is out of range"
            return Registration(name, [identity], False, False, error)
        group = self.groups.get(name)
        if group is not None and not group.is_complete and ready.rank not in group.identities:
            mismatch = group.mismatch(ready)
            if mismatch is None:
                group.add(identity, ready)
                self._group_of[identity] = name
                return Registration(name, [], False, group.is_complete)
            error = (
                f"worker rank {ready.rank} of group {name!r} does not match rank(s) "
                f"{sorted(group.identities)}: {mismatch}; retired them and started the group anew"
            )
        else:
            error = None
        retired = self.remove(name)
        was_serving = group is not None and group.is_complete
        new_group = WorkerGroup(ready)
        new_group.add(identity, ready)
        self.groups[name] = new_group
        self._group_of[identity] = name
        return Registration(
            name, [m for m in retired if m != identity], was_serving, new_group.is_complete, error
        )

    def leave(self, identity: bytes) -> Registration | None:
        """``identity`` disconnected. If it belonged to a group, the group is over: returns
        the members left to retire (and whether it was serving); else None."""
        group = self.group_of(identity)
        if group is None:
            return None
        survivors = [member for member in self.remove(group.name) if member != identity]
        return Registration(group.name, survivors, group.is_complete, False)

    def remove(self, name: str) -> list[bytes]:
        """Forget group ``name``; returns its members."""
        group = self.groups.pop(name, None)
        if group is None:
            return []
        for member in group.members:
            self._group_of.pop(member, None)
        return group.members
