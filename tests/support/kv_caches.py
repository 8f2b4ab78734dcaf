"""Key-value caches to send and receive between worker groups, and the receiver's reports."""

from __future__ import annotations

import time

import torch

from interfaces.worker_to_scheduler import (
    KVLayout,
    KVReceived,
)
from worker.kv_cache import KVCache
from worker.kv_transfer import KVReceiver

BLOCK_SIZE = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float32")


def filled_cache(num_blocks: int, heads: tuple[int, int], seed: int) -> KVCache:
    """A cache holding global heads [heads) of a random full cache (the same for every seed)."""
    generator = torch.Generator().manual_seed(seed)
    full = torch.randn(2, LAYOUT.num_layers, num_blocks, BLOCK_SIZE, LAYOUT.num_kv_heads,
                       LAYOUT.head_dim, generator=generator)  # fmt: skip
    cache = empty_cache(num_blocks, heads[1] - heads[0])
    for layer in range(LAYOUT.num_layers):
        cache.key_caches[layer].copy_(full[0, layer, :, :, heads[0] : heads[1]])
        cache.value_caches[layer].copy_(full[1, layer, :, :, heads[0] : heads[1]])
    return cache


def empty_cache(num_blocks: int, num_heads: int) -> KVCache:
    return KVCache(LAYOUT.num_layers, num_blocks, BLOCK_SIZE, num_heads, LAYOUT.head_dim,
                   torch.float32, torch.device("cpu"))  # fmt: skip


def poll_reports(receiver: KVReceiver, timeout_s: float = 5.0) -> list[KVReceived]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if receiver.socket.poll(100):
            reports = receiver.receive()
            if reports:
                return reports
    raise AssertionError("no transfer completed")
