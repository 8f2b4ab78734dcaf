"""KV shards that reach a decode rank before their transfer is announced (``worker.kv_transfer``).

The announcement (``KVReceive``) and the data travel different sockets, so a shard may come
first; it waits here for up to ``EARLY_SHARD_TTL_S``. Anyone who can reach the transfer socket
can send shards for transfers that will never be announced, so what waits is bounded: at most
``MAX_EARLY_SHARDS`` shards and ``MAX_EARLY_SHARD_BYTES`` bytes, except that one shard of any
size is kept when none waits (the receiver has already checked it fits the rank's pool). A
shard beyond the bounds is dropped; its transfer then fails by the scheduler's timeout, and
nobody else's memory or KV is touched. Transfers that ended here (finished or cancelled) are
remembered, the last ``NUM_ENDED_TRANSFERS_REMEMBERED`` of them, so their late shards are
dropped on sight rather than kept.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import zmq

from interfaces.worker_to_worker import KVShardHeader

EARLY_SHARD_TTL_S = 60.0
"""How long a shard whose ``KVReceive`` has not come yet is kept before it is dropped."""
MAX_EARLY_SHARDS = 64
MAX_EARLY_SHARD_BYTES = 1 << 30
NUM_ENDED_TRANSFERS_REMEMBERED = 4096


@dataclass(frozen=True)
class EarlyShard:
    arrived: float
    """``time.monotonic()`` when it was kept."""
    header: KVShardHeader
    payload: zmq.Frame


class EarlyShards:
    """The shards waiting for their announcement, by transfer id, and the transfers ended."""

    def __init__(self) -> None:
        self._by_transfer: dict[int, list[EarlyShard]] = {}
        self.num_bytes = 0
        self._ended: deque[int] = deque(maxlen=NUM_ENDED_TRANSFERS_REMEMBERED)
        self._ended_ids: set[int] = set()

    def __len__(self) -> int:
        """How many transfers have shards waiting."""
        return len(self._by_transfer)

    @property
    def transfer_ids(self) -> list[int]:
        return list(self._by_transfer)

    @property
    def num_shards(self) -> int:
        return sum(len(shards) for shards in self._by_transfer.values())

    def keep(self, header: KVShardHeader, payload: zmq.Frame) -> str | None:
        """Keep a shard; returns why it was not kept instead (the bounds), or None."""
        self.forget_stale()
        if self._by_transfer:
            if self.num_shards >= MAX_EARLY_SHARDS:
                return f"{MAX_EARLY_SHARDS} shards already wait for their announcement"
            if self.num_bytes + len(payload) > MAX_EARLY_SHARD_BYTES:
                return f"{self.num_bytes} bytes already wait for their announcement"
        early = EarlyShard(time.monotonic(), header, payload)
        self._by_transfer.setdefault(header.transfer_id, []).append(early)
        self.num_bytes += len(payload)
        return None

    def take(self, transfer_id: int) -> list[EarlyShard]:
        """The shards of ``transfer_id``, in arrival order, no longer kept here."""
        shards = self._by_transfer.pop(transfer_id, [])
        self.num_bytes -= sum(len(early.payload) for early in shards)
        return shards

    def forget_stale(self) -> None:
        """Drop the shards of transfers whose first shard waited ``EARLY_SHARD_TTL_S``."""
        now = time.monotonic()
        for transfer_id, shards in list(self._by_transfer.items()):
            if now - shards[0].arrived >= EARLY_SHARD_TTL_S:
                self.take(transfer_id)

    def end(self, transfer_id: int) -> None:
        """``transfer_id`` is over here: drop its shards, and any that come later."""
        self.take(transfer_id)
        if transfer_id in self._ended_ids:
            return
        if len(self._ended) == self._ended.maxlen:
            self._ended_ids.discard(self._ended[0])
        self._ended.append(transfer_id)
        self._ended_ids.add(transfer_id)

    def has_ended(self, transfer_id: int) -> bool:
        return transfer_id in self._ended_ids
