"""Decode steps through ``worker.cuda_graphs.DecodeGraphs`` beside the eager forward pass, over
one random paged cache (tests/worker/test_cuda_graphs.py on the CPU, tests/worker/test_gpu.py
with captured graphs on CUDA)."""

from __future__ import annotations

import torch

from tests.support.paged_batches import shared_prefix_batch
from worker.attention import AttentionKind, build_batch_layout
from worker.cuda_graphs import DecodeGraphs, capture_sizes
from worker.kv_cache import KVCache

BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
STEPS = [
    [37, 17, 40, 3, 100, 0, 64],  # seven decodes, one at a block's first slot, a prefix shared
    [5],  # a lone decode: padded to two rows
    [700],  # a lone long decode: the split graph of two rows, where keys are split
    [16, 31, 32, 47, 500, 1, 2, 900],  # a full bucket of eight, long contexts among them
    [20, 300, 41, 7, 8],  # fewer rows than the last step: its rows must not leak in
]
"""Each step's contexts (tokens already cached before the decoded one)."""


def random_cache(model, num_blocks: int, seed: int = 0) -> KVCache:
    """A cache of ``num_blocks`` random blocks for ``model``, on its device and dtype."""
    cache = KVCache.for_model(model, num_blocks, BLOCK_SIZE)
    generator = torch.Generator().manual_seed(seed)
    for tensor in cache.key_caches + cache.value_caches:
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return cache


def copy_cache(cache: KVCache) -> KVCache:
    copy = KVCache.__new__(KVCache)
    copy.num_blocks, copy.block_size = cache.num_blocks, cache.block_size
    copy.key_caches = [tensor.clone() for tensor in cache.key_caches]
    copy.value_caches = [tensor.clone() for tensor in cache.value_caches]
    return copy


def compare_decode_steps(
    model,
    reference_kind: AttentionKind,
    capture: bool,
    max_size: int = 8,
    processors: int | None = None,
):
    """Run ``STEPS`` through one ``DecodeGraphs`` (its graphs captured when ``capture``; keys
    split for ``processors``) and eagerly (attention ``reference_kind``) on two copies of one
    random cache; yield, per step, (graph logits, eager logits, graph cache, eager cache, spare
    block)."""
    requests = [(context, 1) for step in STEPS for context in step]
    block_ids, num_blocks = shared_prefix_batch(requests, BLOCK_SIZE)
    spare = num_blocks  # the cache has one block more than the requests' pool
    graph_cache = random_cache(model, num_blocks + 1)
    eager_cache = copy_cache(graph_cache)
    graphs = DecodeGraphs(
        model, graph_cache, spare, MAX_MODEL_LEN, capture_sizes(max_size), processors
    )
    if capture:
        graphs.capture()
        # The capture's warm-up wrote the spare block only: both caches agree elsewhere.
    generator = torch.Generator().manual_seed(2)
    first = 0
    for contexts in STEPS:
        step_blocks = block_ids[first : first + len(contexts)]
        first += len(contexts)
        token_ids = torch.randint(0, model.config.vocab_size, (len(contexts),), generator=generator)
        layout = build_batch_layout(
            contexts,
            [1] * len(contexts),
            step_blocks,
            BLOCK_SIZE,
            graph_cache.key_caches[0].device,
            kind=reference_kind,
            num_cache_blocks=num_blocks + 1,
        )
        device = graph_cache.key_caches[0].device
        with torch.inference_mode():
            eager = model(
                token_ids.to(device),
                layout.positions,
                eager_cache,
                layout.metadata,
                torch.arange(len(contexts), device=device),
            )
            logits = graphs.run(contexts, step_blocks, token_ids.tolist()).clone()
        yield logits, eager, graph_cache, eager_cache, spare
