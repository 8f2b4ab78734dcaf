"""The worker groups registered with the scheduler, each one worker or a tensor-parallel group.

Every rank registers with ``WorkerReady`` on its own connection, naming its group. A group
serves once all ``tensor_parallel_size`` ranks have registered alike (model, KV pool, role,
layout); steps then go to every rank and rank 0 (the driver) answers. ``WorkerGroups.register``
decides what each registration means, so the server only acts on the outcome; whether a complete
group fits beside the others (roles, KV layouts) is the placement's call.

A handshake's values are checked before any of it is believed (``ready_problem``), and a place
in a group belongs to the connection that took it until that connection closes: another
connection naming a serving group, or a rank a forming group already has, is refused, so a
process that can reach the backend socket cannot retire the real workers and take their
traffic. A restarted worker takes its place once the scheduler saw its predecessor's
connection close (at once for a process that died on the same host; within the 3 s heartbeat
timeout for a host that vanished).

A group that stalls is fenced (``WorkerGroups.fence``): it is forgotten at once, and its
connections may not register again until they close, so a hung process that wakes up cannot
take back the place its restarted successor (a new connection) takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from interfaces.lora import MAX_LORA_RANK, MAX_LORAS
from interfaces.scheduler_to_api import MAX_GROUP_STATS
from interfaces.worker_to_scheduler import MAX_STEP_TOKENS, KVLayout, WorkerReady, WorkerRole
from scheduler.config import WorkerLimits

SHARED_FIELDS = (
    "model_name", "num_kv_blocks", "block_size", "max_model_len", "role", "kv_layout", "vocab_size",
    "max_loras", "max_lora_rank", "step_tokens",
)  # fmt: skip
"""What every rank of a group must report alike."""
MAX_NAME_LENGTH = 256
"""Of a group's and a model's name, and of a transfer address."""
MAX_TENSOR_PARALLEL_SIZE = 256
MAX_BLOCK_SIZE = 1024
MAX_MODEL_LEN = 1 << 24
MAX_VOCAB_SIZE = 1 << 24
MAX_LAYOUT_DIMENSION = 1 << 16
"""Of a KV layout's layers, key-value heads and head size."""
KV_DTYPES = ("float32", "bfloat16", "float16")
MAX_GROUPS = MAX_GROUP_STATS
"""Groups forming or serving at once (so ``SchedulerStats.groups`` lists every serving one)."""
KV_BLOCKS_HINT = (
    " (give the worker a larger --block-size or a smaller --kv-cache-memory, or the scheduler "
    "a larger --max-worker-kv-blocks)"
)


def ready_problem(ready: WorkerReady, limits: WorkerLimits) -> str | None:
    """Why a handshake's values cannot be believed, or None."""
    min_blocks = 0 if ready.role is WorkerRole.EMBEDDING else 1  # an encoder has no KV cache
    bounds = (
        ("tensor_parallel_size", ready.tensor_parallel_size, 1, MAX_TENSOR_PARALLEL_SIZE),
        ("rank", ready.rank, 0, ready.tensor_parallel_size - 1),
        ("num_kv_blocks", ready.num_kv_blocks, min_blocks, limits.max_kv_blocks),
        ("block_size", ready.block_size, 1, MAX_BLOCK_SIZE),
        ("max_model_len", ready.max_model_len, 1, MAX_MODEL_LEN),
        ("vocab_size", ready.vocab_size, 0, MAX_VOCAB_SIZE),
        ("max_loras", ready.max_loras, 0, MAX_LORAS),
        ("max_lora_rank", ready.max_lora_rank, 0, MAX_LORA_RANK),
        ("step_tokens", ready.step_tokens, 0, MAX_STEP_TOKENS),
    )
    for name, value, low, high in bounds:
        if not low <= value <= high:
            hint = KV_BLOCKS_HINT if name == "num_kv_blocks" and value > high else ""
            return f"{name} {value} is outside [{low}, {high}]{hint}"
    for name in ("group", "model_name", "transfer_addr"):
        value = getattr(ready, name)
        if len(value) > MAX_NAME_LENGTH or not value.isprintable():
            return f"{name} must be at most {MAX_NAME_LENGTH} printable characters"
    if ready.transfer_addr and not ready.transfer_addr.startswith(("tcp://", "ipc://")):
        return f"transfer_addr {ready.transfer_addr!r} is not a tcp:// or ipc:// address"
    return _layout_problem(ready.kv_layout) if ready.kv_layout is not None else None


def _layout_problem(layout: KVLayout) -> str | None:
    if layout.dtype not in KV_DTYPES:
        return f"kv_layout dtype {layout.dtype!r} is not one of {', '.join(KV_DTYPES)}"
    for name in ("num_layers", "num_kv_heads", "head_dim"):
        value = getattr(layout, name)
        if not 1 <= value <= MAX_LAYOUT_DIMENSION:
            return f"kv_layout {name} {value} is outside [1, {MAX_LAYOUT_DIMENSION}]"
    return None


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

    ``retired`` lost their group, or were refused one: the scheduler tells these identities to
    shut down (with ``error``, if any). When ``was_serving``, the group had been serving and is
    over: the scheduler fails its requests. ``now_serving`` is true when this registration
    completed the group. ``error`` says why a registration was refused (logged by the caller).
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
        self._fenced: dict[bytes, str] = {}
        """The connections of fenced groups, until they close, with their group's name."""

    def serving(self) -> list[WorkerGroup]:
        """The complete groups."""
        return [group for group in self.groups.values() if group.is_complete]

    def group_of(self, identity: bytes) -> WorkerGroup | None:
        name = self._group_of.get(identity)
        return self.groups.get(name) if name is not None else None

    def register(self, identity: bytes, ready: WorkerReady) -> Registration:
        """Add ``identity`` as rank ``ready.rank`` of group ``ready.group`` (a new group, or a
        forming one it matches).

        Anything else is refused and changes nothing (``error`` says why; the newcomer is
        ``retired``, unless it is a connection registered already): a connection of a fenced
        group, a rank out of range, a group that serves, a rank the forming group has, a rank
        that does not match the forming group, a group beyond ``MAX_GROUPS``. See the module
        docstring.
        """
        name = ready.group
        if identity in self._fenced:
            error = (
                f"this connection served group {self._fenced[identity]!r}, which was fenced as "
                "stalled; a worker may register again on a new connection"
            )
            return Registration(name, [identity], False, False, error)
        if identity in self._group_of:
            registered = self.group_of(identity)
            error = f"this connection already registered with group {registered.name!r}"
            return Registration(name, [], False, False, error)
        group = self.groups.get(name)
        error = self._refusal(ready, group)
        if error is not None:
            return Registration(name, [identity], False, False, error)
        if group is None:
            group = self.groups[name] = WorkerGroup(ready)
        group.add(identity, ready)
        self._group_of[identity] = name
        return Registration(name, [], False, group.is_complete)

    def _refusal(self, ready: WorkerReady, group: WorkerGroup | None) -> str | None:
        """Why rank ``ready.rank`` cannot join ``group`` (None: the group does not exist)."""
        where = f"worker rank {ready.rank} of group {ready.group!r}"
        if not 0 <= ready.rank < ready.tensor_parallel_size:
            return f"{where}: the rank is out of range"
        if group is None:
            if len(self.groups) >= MAX_GROUPS:
                return f"{where}: {MAX_GROUPS} groups are registered already"
            return None
        if group.is_complete:
            return (
                f"{where}: that group is serving; a worker may take its place once the old "
                "one has disconnected"
            )
        if ready.rank in group.identities:
            return f"{where}: another connection holds that rank while the group forms"
        mismatch = group.mismatch(ready)
        if mismatch is not None:
            return f"{where} does not match rank(s) {sorted(group.identities)}: {mismatch}"
        return None

    def leave(self, identity: bytes) -> Registration | None:
        """``identity`` disconnected. If it belonged to a group, the group is over: returns
        the members left to retire (and whether it was serving); else None (a fenced
        connection is forgotten: its group was over already)."""
        self._fenced.pop(identity, None)
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

    def fence(self, name: str) -> list[bytes]:
        """Forget group ``name`` (it stalled) and refuse its members any registration until
        each disconnects (``leave``); returns its members."""
        members = self.remove(name)
        for member in members:
            self._fenced[member] = name
        return members

    def fenced_group(self, identity: bytes) -> str | None:
        """The name of the fenced group connection ``identity`` served, or None."""
        return self._fenced.get(identity)
