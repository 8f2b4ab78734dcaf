"""The workers the scheduler serves: one worker, or the ranks of one tensor-parallel group.

Every rank registers with ``WorkerReady`` on its own connection. The group serves once all
``tensor_parallel_size`` ranks have registered with the same model and KV pool; steps then go to
every rank and rank 0 (the driver) answers. ``WorkerGroups.register`` decides what each
registration means, so the server only acts on the outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from interfaces.worker_to_scheduler import WorkerReady

SHARED_FIELDS = ("model_name", "num_kv_blocks", "block_size", "max_model_len")
"""What every rank of a group must report alike."""


@dataclass
class WorkerGroup:
    """The ranks of one group registered so far, by rank; ``ready`` is the first registration."""

    ready: WorkerReady
    identities: dict[int, bytes] = field(default_factory=dict)

    @property
    def is_complete(self) -> bool:
        return len(self.identities) == self.ready.tensor_parallel_size

    @property
    def driver(self) -> bytes:
        """Rank 0's identity: the only rank that answers steps."""
        return self.identities[0]

    @property
    def members(self) -> list[bytes]:
        return list(self.identities.values())

    def mismatch(self, ready: WorkerReady) -> str | None:
        """Why rank ``ready.rank`` cannot join this group, or None."""
        if ready.tensor_parallel_size != self.ready.tensor_parallel_size:
            return (
                f"tensor_parallel_size {ready.tensor_parallel_size} != "
                f"{self.ready.tensor_parallel_size}"
            )
        for name in SHARED_FIELDS:
            if getattr(ready, name) != getattr(self.ready, name):
                return f"{name} {getattr(ready, name)!r} != {getattr(self.ready, name)!r}"
        return None


@dataclass(frozen=True)
class Registration:
    """What a ``WorkerReady`` did. ``retired`` lost their group: the scheduler fails the old
    group's requests (if it was serving) and tells these identities to shut down.
    ``now_serving`` is true when this registration completed the group. ``error`` says why
    a registration was refused (logged by the caller)."""

    retired: list[bytes]
    was_serving: bool
    now_serving: bool
    error: str | None = None


class WorkerGroups:
    """The group that is forming or serving (at most one), and its members' fate."""

    def __init__(self) -> None:
        self.group: WorkerGroup | None = None

    @property
    def serving(self) -> WorkerGroup | None:
        """The complete group, or None while none is."""
        group = self.group
        return group if group is not None and group.is_complete else None

    def is_member(self, identity: bytes) -> bool:
        return self.group is not None and identity in self.group.identities.values()

    def register(self, identity: bytes, ready: WorkerReady) -> Registration:
        """Add ``identity`` as rank ``ready.rank``.

        A rank that joins a forming group it matches is added. Otherwise the newest registration
        wins: one while a group serves, from a rank the forming group already has (a restarted
        worker), or that does not match the forming group (``error`` says how) starts a new
        group, and the old group's members are retired.
        """
        group, was_serving = self.group, self.serving is not None
        if not 0 <= ready.rank < ready.tensor_parallel_size:
            return Registration([identity], False, False, f"rank {ready.rank} is out of range")
        if group is None or was_serving or ready.rank in group.identities:
            retired = [m for m in group.members if m != identity] if group is not None else []
            self.group = WorkerGroup(ready, {ready.rank: identity})
            return Registration(retired, was_serving, self.group.is_complete)
        mismatch = group.mismatch(ready)
        if mismatch is not None:
            self.group = WorkerGroup(ready, {ready.rank: identity})
            error = (
                f"worker rank {ready.rank} does not match rank(s) {sorted(group.identities)}: "
                f"{mismatch}; retired them and started a new group"
            )
            return Registration(group.members, False, self.group.is_complete, error)
        group.identities[ready.rank] = identity
        return Registration([], False, group.is_complete)

    def leave(self, identity: bytes) -> Registration | None:
        """``identity`` disconnected. If it belonged to the group, the group is over: returns
        the members left to retire (and whether it was serving); else None."""
        group = self.group
        if group is None or identity not in group.identities.values():
            return None
        self.group = None
        survivors = [member for member in group.members if member != identity]
        return Registration(survivors, group.is_complete, False)
