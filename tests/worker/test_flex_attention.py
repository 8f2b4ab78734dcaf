"""FlexAttention over the paged cache (worker/flex_attention.py), checked on the CPU.

On the CPU FlexAttention runs eagerly: it applies ``mask_mod`` densely and ignores which blocks
the block mask names, so the mask is checked here against the gathered path and the tiles'
block lists on their own. The compiled CUDA kernel, which reads only the named blocks, is
checked against the gathered path in tests/worker/test_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.paged_batches import MIXED_REQUESTS, attention_outputs, shared_prefix_batch
from worker import flex_attention
from worker.attention import AttentionKind, build_batch_layout, choose_attention_kind
from worker.flex_layout import QUERY_TILE, _tile_blocks, build_flex_layout

CPU = torch.device("cpu")
FLEX_AND_GATHERED = (AttentionKind.FLEX, AttentionKind.GATHERED)


@pytest.mark.parametrize(
    ("requests", "shape", "block_size"),
    [
        (MIXED_REQUESTS, (9, 3, 64), 16),
        (MIXED_REQUESTS, (4, 4, 32), 32),
        ([(40, 1)], (9, 3, 64), 16),  # one decode: a batch of one row, then a padding row
        ([(40, 5)], (9, 3, 64), 16),  # a short chunk: its tile, then a tile of padding alone
    ],
)
def test_the_flex_mask_equals_the_gathered_path(requests, shape, block_size):
    flex, gathered = attention_outputs(
        requests, shape, block_size, CPU, torch.float32, FLEX_AND_GATHERED
    )
    torch.testing.assert_close(flex, gathered, rtol=1e-5, atol=2e-6)


def test_each_tile_names_the_blocks_its_queries_need_once():
    # Tile 0: request 0's 12 prompt tokens (positions 0-11: blocks 7, 10) and request 1's first
    # 4 of 20 tokens after a 30-token prefix (positions 30-33: blocks 3, 5, 9, 2, 8).
    # Tile 1: request 1's next 16 (positions 34-49: its blocks up to 49 // 8 = 6).
    # Tile 2: request 2 (a decode at 64, sharing request 1's first 3 blocks) and padding.
    tables = np.array([[7, 10, 0, 0, 0, 0, 0, 0, 0], [3, 5, 9, 2, 8, 6, 4, 0, 0]])
    tables = np.vstack([tables, [3, 5, 9, 11, 12, 13, 14, 15, 16]])
    requests = np.array([0] * 12 + [1] * 20 + [2] + [0] * 15)
    positions = np.concatenate([np.arange(12), np.arange(30, 50), [64], np.full(15, -1)])
    counts, indices = _tile_blocks(tables, requests, positions, 8)
    assert counts.tolist() == [7, 7, 9]
    assert indices.tolist() == [
        [2, 3, 5, 7, 8, 9, 10, 0, 0],
        [3, 5, 9, 2, 8, 6, 4, 0, 0],  # one request's blocks stay in its table's order
        [3, 5, 9, 11, 12, 13, 14, 15, 16],
    ]
    # A one-token prompt is padded to two tiles; the second visits nothing.
    counts, indices = _tile_blocks(tables, np.zeros(32, int), np.array([9] + [-1] * 31), 8)
    assert counts.tolist() == [2, 0] and indices.tolist() == [[7, 10], [0, 0]]
    # Two requests in one tile sharing their first block (a cached prefix) visit it once.
    shared = np.array([[4, 6], [4, 7]])
    positions = np.tile(np.arange(20, 28), 2)
    counts, indices = _tile_blocks(shared, np.repeat([0, 1], 8), positions, 16)
    assert counts.tolist() == [3] and indices.tolist() == [[4, 6, 7]]


def test_a_mixed_step_is_a_decode_batch_and_a_prefill_sequence():
    """Each decode is a batch row visiting its blocks; each prefill tile visits exactly the
    blocks its queries need, each once."""
    block_size = 16
    block_ids, num_blocks = shared_prefix_batch(MIXED_REQUESTS, block_size)
    starts, counts = (np.array(column) for column in zip(*MIXED_REQUESTS, strict=True))
    layout = build_batch_layout(
        starts, counts, block_ids, block_size, CPU, AttentionKind.FLEX, num_blocks
    )
    decodes, prefills = layout.metadata.flex.parts
    first_tokens = np.cumsum(counts) - counts
    decoding = np.flatnonzero(counts == 1)  # requests 1, 3, 4, 5
    assert decodes.decodes and decodes.num_rows == 4
    assert decodes.token_indices.tolist() == first_tokens[decoding].tolist()
    rows = [
        mask_row[0, 0, :n].tolist()
        for mask_row, n in zip(
            decodes.block_mask.kv_indices, decodes.block_mask.kv_num_blocks[:, 0, 0], strict=True
        )
    ]
    assert rows == [block_ids[r][: starts[r] // block_size + 1] for r in decoding]

    prefilling = np.flatnonzero(counts > 1)  # requests 0, 2, 6: 37 + 33 + 16 tokens
    assert not prefills.decodes and prefills.num_rows == 6 * QUERY_TILE
    assert prefills.token_indices.tolist() == [
        token for r in prefilling for token in range(first_tokens[r], first_tokens[r] + counts[r])
    ]
    kv_num_blocks = prefills.block_mask.kv_num_blocks[0, 0].tolist()
    kv_indices = prefills.block_mask.kv_indices[0, 0]
    tiles = [kv_indices[i, :n].tolist() for i, n in enumerate(kv_num_blocks)]
    needed = [set() for _ in tiles]
    part_token = 0
    for r in prefilling:
        for query in range(counts[r]):
            last_block = (starts[r] + query) // block_size
            needed[part_token // QUERY_TILE].update(block_ids[r][: last_block + 1])
            part_token += 1
    assert [sorted(tile) for tile in tiles] == [sorted(blocks) for blocks in needed]


def test_a_block_at_two_places_in_one_step_is_refused():
    """Ownership is read off each block's one place in the tables: a step that breaks that
    would hide keys, so it stops instead."""
    with pytest.raises(RuntimeError, match="a block of the step is at two places"):
        build_flex_layout(
            *(np.array([31, 31]), np.array([1, 1]), np.array([0, 1])),
            *(np.array([[3, 5], [5, 3]]), 16, 8, CPU),
        )
    with pytest.raises(ValueError, match="cache's number of blocks"):
        build_batch_layout([0], [3], [[1]], 16, CPU, AttentionKind.FLEX)


def test_the_worker_takes_its_models_kind_unless_told_or_the_block_does_not_tile():
    flex, cpu, gathered = AttentionKind.FLEX, AttentionKind.IN_PLACE_CPU, AttentionKind.GATHERED
    assert choose_attention_kind(flex, 16, "auto") is flex
    assert choose_attention_kind(flex, 8, "auto") is gathered
    assert choose_attention_kind(cpu, 8, "auto") is cpu
    assert choose_attention_kind(cpu, 16, "gathered") is gathered
    assert choose_attention_kind(flex, 16, "gathered") is gathered


def test_the_warm_up_runs_both_parts_and_reads_the_cache_only():
    """On the CPU the kernel is eager, so this checks the warm-up's steps, not a compile."""
    key_cache, value_cache = torch.randn(2, 4, 16, 3, 64).unbind(0)
    before = key_cache.clone(), value_cache.clone()
    flex_attention.warm_up(key_cache, value_cache, num_heads=9)
    flex_attention.warm_up(key_cache[:1], value_cache[:1], num_heads=9)  # one block: nothing
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])


def test_flex_runs_on_cuda_only_with_a_block_the_kernel_can_tile():
    assert not flex_attention.is_available(CPU)
    assert [flex_attention.supports_block_size(n) for n in (8, 16, 24, 64, 128, 256)] == [
        False,
        True,
        False,
        True,
        True,
        False,
    ]
