"""One model step over a KV cache of random keys and values, for the in-process benchmarks
(precision_bench.py, kernel_ab.py): every request the same numbers of cached and new tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.attention import BatchLayout, build_batch_layout
from worker.kv_cache import KVCache

BLOCK_SIZE = 16


@dataclass
class RandomStep:
    """A step's inputs: ``model(input_ids, layout.positions, cache, layout.metadata,
    last_rows)`` runs it."""

    cache: KVCache
    layout: BatchLayout
    input_ids: torch.Tensor
    last_rows: torch.Tensor

    def run(self, model) -> torch.Tensor:
        """The step's logits, one row per request."""
        layout = self.layout
        return model(self.input_ids, layout.positions, self.cache, layout.metadata, self.last_rows)


def random_step(
    model, requests: int, new: int, cached: int, shared: int = 0, shuffle: bool = False
) -> RandomStep:
    """``requests`` requests of ``new`` tokens after ``cached`` cached ones on the CPU; the first
    ``shared`` cached tokens (whole blocks) in the same blocks for all, as prefix caching leaves
    requests with one system prompt. Blocks lie in order, or shuffled over the pool as a busy
    server leaves them."""
    config = model.config
    per_request = -(-(cached + new) // BLOCK_SIZE)
    shared_blocks = shared // BLOCK_SIZE
    own = per_request - shared_blocks
    num_blocks = shared_blocks + own * requests
    cache = KVCache.for_model(model, num_blocks, BLOCK_SIZE)
    for tensor in (*cache.key_caches, *cache.value_caches):
        tensor.normal_()
    order = torch.randperm(num_blocks).tolist() if shuffle else list(range(num_blocks))
    tables = [
        order[:shared_blocks] + order[shared_blocks + i * own : shared_blocks + (i + 1) * own]
        for i in range(requests)
    ]
    layout = build_batch_layout(
        [cached] * requests,
        [new] * requests,
        tables,
        BLOCK_SIZE,
        torch.device("cpu"),
        kind=model.attention_kind,
        num_cache_blocks=num_blocks,
    )
    input_ids = torch.randint(100, config.vocab_size, (requests * new,))
    last_rows = torch.arange(requests) * new + new - 1
    return RandomStep(cache, layout, input_ids, last_rows)
