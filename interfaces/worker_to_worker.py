"""What a prefill worker's rank sends a decode worker's rank: KV blocks (``worker.kv_transfer``).

One shard is one ZeroMQ message of two frames: this header, msgpack-encoded, and the blocks'
raw bytes, laid out (num_layers, 2 [keys, values], num_blocks, block_size,
head_stop - head_start, head_dim) in the dtype of both groups' ``KVLayout``.
"""

from __future__ import annotations

import msgspec


class KVShardHeader(msgspec.Struct, array_like=True):
    """Which transfer the bytes belong to, and which global key-value heads they hold."""

    transfer_id: int
    source_rank: int
    head_start: int
    head_stop: int
    num_blocks: int
    started_at: float
    """``time.time()`` when the sender began gathering (``KVReceived.seconds`` runs from it)."""
