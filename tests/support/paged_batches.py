"""Mixed steps over a random paged cache, for attention paths checked against the gathered one
(tests/worker/test_flex_attention.py on the CPU, tests/worker/test_gpu.py on CUDA)."""

from __future__ import annotations

import numpy as np
import torch

from worker.attention import AttentionKind, build_batch_layout, paged_attention

MIXED_REQUESTS = [(0, 37), (17, 1), (40, 33), (3, 1), (100, 1), (0, 1), (64, 16)]
"""(num_computed, num_new) each: a whole prompt, decodes, a chunk after a cached prefix, a
one-token prompt."""


def shuffled_blocks(requests, block_size, seed=0):
    """(block ids of each request [(num_computed, num_new)], shuffled over a pool; pool size)."""
    num_blocks = sum(-(-(start + count) // block_size) for start, count in requests) + 3
    pool = np.random.default_rng(seed).permutation(num_blocks).tolist()
    block_ids = []
    for start, count in requests:
        needed = -(-(start + count) // block_size)
        block_ids.append(pool[:needed])
        pool = pool[needed:]
    return block_ids, num_blocks


def shared_prefix_batch(requests, block_size, seed=0):
    """``shuffled_blocks``, but a fifth request shares the third's first two blocks (a
    prefix-cache hit; both must reach that far)."""
    block_ids, num_blocks = shuffled_blocks(requests, block_size, seed)
    if len(block_ids) >= 5:
        block_ids[4][:2] = block_ids[2][:2]
    return block_ids, num_blocks


def attention_outputs(requests, shape, block_size, device, dtype, kinds):
    """Each of ``kinds``'s outputs of one step of ``requests`` over a random cache of heads
    ``shape`` (num_heads, num_kv_heads, head_dim)."""
    num_heads, num_kv_heads, head_dim = shape
    block_ids, num_blocks = shared_prefix_batch(requests, block_size)
    generator = torch.Generator().manual_seed(1)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = (
        torch.randn(cache_shape, generator=generator).to(device, dtype) for _ in range(2)
    )
    starts, counts = zip(*requests, strict=True)
    query = torch.randn(sum(counts), num_heads, head_dim, generator=generator).to(device, dtype)
    outputs = []
    for kind in kinds:
        layout = build_batch_layout(
            starts, counts, block_ids, block_size, device, kind=kind, num_cache_blocks=num_blocks
        )
        assert (layout.metadata.flex is not None) == (kind is AttentionKind.FLEX)
        outputs.append(
            paged_attention(query, key_cache, value_cache, layout.metadata, head_dim**-0.5)
        )
    return outputs
