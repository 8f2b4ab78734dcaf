"""Attention over the paged KV cache in place on CUDA, with torch's FlexAttention.

The whole cache is one long key sequence: (num_blocks, block_size, kv_heads, head_dim) seen as
(1, kv_heads, num_blocks * block_size, head_dim), no copy. A ``BlockMask`` names the cache
blocks each query visits, and inside a visited block ``mask_mod`` keeps the keys at positions
up to the query's. A step's requests go in two parts, as the gathered path groups them:

- **Decodes** (one query each) are a batch: request b is batch row b with one query, and its
  row of the block mask is its block table. The kernel runs one program per request and head,
  so a step of 64 long decodes keeps the GPU busy.
- **Prefills** (whole prompts, chunks after a cached prefix) are one query sequence, their
  tokens concatenated. Each tile of ``QUERY_TILE`` consecutive queries visits the blocks, up to
  the tile's last position, of every request with a query in it; ``mask_mod`` also checks that
  a key's block belongs to the query's request. Ownership is one lookup, not a table over the
  cache: every block a step uses has one logical index (its place in its request's block table;
  prefix-cached blocks are shared only at the same place, since their hashes chain from the
  first block), so a block belongs to request r exactly when
  ``block_tables[r, logical_index[block]] == block``.

The kernel is FlexAttention's Triton kernel, compiled on first use (``torch.compile``) for
sizes that change step to step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

QUERY_TILE = 16
"""Queries per BlockMask row of a prefill part, and the kernel's BLOCK_M."""
MIN_SIZE = 2
"""Every size the kernel sees is at least 2 (batch rows, query tiles, table rows and columns
are padded): torch.compile specialises sizes 0 and 1, and each would compile again."""
COMPILED_SHAPES = 64
"""How many times the kernel may compile (torch.compile's recompile_limit): once per dtype,
head shape, part and gradient mode. A worker serves one model, so it needs a few; tests more."""


@dataclass(frozen=True)
class FlexPart:
    """One FlexAttention call per layer: ``block_mask`` over ``batch_size`` rows of
    ``num_query_rows`` queries each (decodes: ``batch_size`` rows of 1; prefills: 1 row of the
    concatenated tokens), the step's tokens then padding that sees no key. ``token_indices``
    are the part's tokens in the step's flat batch, None when it is every token in order."""

    block_mask: BlockMask
    decodes: bool
    num_rows: int
    token_indices: torch.Tensor | None


@dataclass(frozen=True)
class FlexLayout:
    """What every layer's FlexAttention calls of one step share: one part or two."""

    parts: tuple[FlexPart, ...]


def is_available(device: torch.device) -> bool:
    """Whether FlexAttention's compiled kernel can run on ``device`` (CUDA with Triton)."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def supports_block_size(block_size: int) -> bool:
    """Whether the kernel's key tile can be one cache block: a power of two from 16 (Triton's
    smallest matrix-product tile) to 128."""
    return 16 <= block_size <= 128 and block_size & (block_size - 1) == 0


def build_flex_layout(
    starts: np.ndarray,
    query_lens: np.ndarray,
    query_starts: np.ndarray,
    block_ids: Sequence[Sequence[int]],
    block_size: int,
    num_cache_blocks: int,
    device: torch.device,
) -> FlexLayout:
    """The parts of requests computing positions [starts, starts + query_lens) each, whose
    queries start at ``query_starts`` in the flat batch. ``block_ids[i]`` covers request i."""
    num_blocks = -(-(starts + query_lens) // block_size)
    tables = np.zeros((len(block_ids), max(int(num_blocks.max()), MIN_SIZE)), dtype=np.int64)
    logical_index = np.zeros(num_cache_blocks, dtype=np.int64)
    for i, (ids, count) in enumerate(zip(block_ids, num_blocks, strict=True)):
        tables[i, :count] = ids[:count]
        logical_index[tables[i, :count]] = np.arange(count)
    cache = _CacheView(_tensor(logical_index, device), block_size, num_cache_blocks, device)
    is_decode = query_lens == 1
    groups = [np.flatnonzero(is_decode), np.flatnonzero(~is_decode)]
    parts = []
    for decodes, members in zip((True, False), groups, strict=True):
        if not len(members):
            continue
        token_indices = None
        if len(members) < len(query_lens):
            indices = np.concatenate(
                [np.arange(query_starts[r], query_starts[r] + query_lens[r]) for r in members]
            )
            token_indices = _tensor(indices, device)
        if decodes:
            parts.append(_decode_part(cache, starts[members], tables[members], token_indices))
        else:
            parts.append(
                _prefill_part(
                    cache, starts[members], query_lens[members], tables[members], token_indices
                )
            )
    return FlexLayout(tuple(parts))


@dataclass(frozen=True)
class _CacheView:
    """What both parts' masks need of the cache: each used block's place in its table."""

    logical_index: torch.Tensor
    block_size: int
    num_blocks: int
    device: torch.device


def _decode_part(
    cache: _CacheView,
    starts: np.ndarray,
    tables: np.ndarray,
    token_indices: torch.Tensor | None,
) -> FlexPart:
    """Request b (one query, at position ``starts[b]``) is batch row b; its blocks are its
    row of the block mask, in table order."""
    batch_size = max(len(starts), MIN_SIZE)
    counts = np.zeros(batch_size, dtype=np.int32)
    counts[: len(starts)] = starts // cache.block_size + 1
    indices = np.zeros((batch_size, tables.shape[1]), dtype=np.int32)
    indices[: len(starts)] = tables
    positions = np.full(batch_size, -1, dtype=np.int64)
    positions[: len(starts)] = starts
    indices_tensor = _tensor(indices, cache.device)
    block_mask = BlockMask.from_kv_blocks(
        _tensor(counts, cache.device)[:, None, None],  # (batch_size, 1, 1)
        indices_tensor[:, None, None],  # (batch_size, 1, 1, max_blocks)
        BLOCK_SIZE=(QUERY_TILE, cache.block_size),
        mask_mod=_decode_mask(cache, indices_tensor, _tensor(positions, cache.device)),
        seq_lengths=(1, cache.num_blocks * cache.block_size),
        compute_q_blocks=False,
    )
    return FlexPart(block_mask, True, batch_size, token_indices)


def _prefill_part(
    cache: _CacheView,
    starts: np.ndarray,
    query_lens: np.ndarray,
    tables: np.ndarray,
    token_indices: torch.Tensor | None,
) -> FlexPart:
    """The requests' tokens, concatenated, are one query sequence tiled by ``QUERY_TILE``."""
    num_tokens = int(query_lens.sum())
    num_rows = max(-(-num_tokens // QUERY_TILE), MIN_SIZE) * QUERY_TILE
    token_requests = np.zeros(num_rows, dtype=np.int64)
    token_positions = np.full(num_rows, -1, dtype=np.int64)  # padding queries see no key
    token_requests[:num_tokens] = np.repeat(np.arange(len(query_lens)), query_lens)
    first_tokens = np.cumsum(query_lens) - query_lens
    token_positions[:num_tokens] = (
        starts[token_requests[:num_tokens]]
        + np.arange(num_tokens)
        - first_tokens[token_requests[:num_tokens]]
    )
    if len(tables) < MIN_SIZE:
        tables = np.vstack([tables, np.zeros((MIN_SIZE - len(tables), tables.shape[1]), int)])
    kv_num_blocks, kv_indices = _tile_blocks(
        tables, token_requests, token_positions, cache.block_size
    )
    block_mask = BlockMask.from_kv_blocks(
        _tensor(kv_num_blocks, cache.device)[None, None],  # (1, 1, num_tiles)
        _tensor(kv_indices, cache.device)[None, None],  # (1, 1, num_tiles, max_blocks)
        BLOCK_SIZE=(QUERY_TILE, cache.block_size),
        mask_mod=_prefill_mask(
            cache,
            _tensor(tables, cache.device),
            _tensor(token_requests, cache.device),
            _tensor(token_positions, cache.device),
        ),
        seq_lengths=(num_rows, cache.num_blocks * cache.block_size),
        compute_q_blocks=False,
    )
    return FlexPart(block_mask, False, num_rows, token_indices)


def _tile_blocks(
    tables: np.ndarray, token_requests: np.ndarray, token_positions: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per query tile, the cache blocks its queries may see, each once:
    (num_tiles,) counts and (num_tiles, max count) block ids, 0-padded."""
    tile_requests = token_requests.reshape(-1, QUERY_TILE)
    tile_positions = token_positions.reshape(-1, QUERY_TILE)
    per_tile = []
    for requests, positions in zip(tile_requests, tile_positions, strict=True):
        live = positions >= 0
        if not live.any():  # a tile of padding alone visits no block
            per_tile.append(np.zeros(0, dtype=np.int64))
            continue
        members, first = np.unique(requests[live], return_index=True)
        # Positions rise within a request, so its last query in the tile has the highest one.
        last_positions = np.maximum.reduceat(positions[live], first)
        needed = last_positions // block_size + 1
        blocks = [tables[r, :n] for r, n in zip(members, needed, strict=True)]
        per_tile.append(np.unique(np.concatenate(blocks)) if len(blocks) > 1 else blocks[0])
    counts = np.array([len(blocks) for blocks in per_tile], dtype=np.int32)
    indices = np.zeros((len(per_tile), max(int(counts.max()), MIN_SIZE)), dtype=np.int32)
    for i, blocks in enumerate(per_tile):
        indices[i, : len(blocks)] = blocks
    return counts, indices


def _decode_mask(cache: _CacheView, tables: torch.Tensor, positions: torch.Tensor):
    """mask_mod of the decode part: row b's query sees the keys of its own blocks (``tables``
    row b) up to ``positions[b]``. The kernel visits only those blocks anyway; the ownership
    check keeps the mask exact where it is applied densely (eager, on the CPU)."""
    logical_index, block_size = cache.logical_index, cache.block_size

    def mask_mod(batch, head, q, kv):
        block = kv // block_size
        logical = logical_index[block]
        owned = tables[batch, logical] == block
        return owned & (logical * block_size + kv % block_size <= positions[batch])

    return mask_mod


def _prefill_mask(
    cache: _CacheView,
    tables: torch.Tensor,
    token_requests: torch.Tensor,
    token_positions: torch.Tensor,
):
    """mask_mod of the prefill part: query ``q`` sees cache slot ``kv`` when the slot's block is
    in q's request's table and the slot's position is at most q's."""
    logical_index, block_size = cache.logical_index, cache.block_size

    def mask_mod(batch, head, q, kv):
        block = kv // block_size
        logical = logical_index[block]
        owned = tables[token_requests[q], logical] == block
        return owned & (logical * block_size + kv % block_size <= token_positions[q])

    return mask_mod


def flex_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    layout: FlexLayout,
    scale: float,
) -> torch.Tensor:
    """Attend ``query`` (num_tokens, num_heads, head_dim) to the cache; same shape out."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    keys = key_cache.view(1, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
    values = value_cache.view(1, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
    # (1, num_kv_heads, num_blocks * block_size, head_dim): the cache as one sequence, no copy
    if len(layout.parts) == 1 and layout.parts[0].token_indices is None:
        return _part_attention(query, keys, values, layout.parts[0], scale)
    output = torch.empty_like(query)
    for part in layout.parts:
        part_query = query.index_select(0, part.token_indices)
        part_output = _part_attention(part_query, keys, values, part, scale)
        output.index_copy_(0, part.token_indices, part_output)
    return output


def _part_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    part: FlexPart,
    scale: float,
) -> torch.Tensor:
    """One part's attention: ``query`` (num_part_tokens, num_heads, head_dim), same shape out."""
    num_tokens = query.shape[0]
    rows = F.pad(query, (0, 0, 0, 0, 0, part.num_rows - num_tokens))
    # (num_rows, num_heads, head_dim): padding rows see no key
    # decodes: (batch_size, num_heads, 1, head_dim), one query per request;
    # prefills: (1, num_heads, num_rows, head_dim), one sequence
    rows = rows[:, :, None] if part.decodes else rows.transpose(0, 1)[None]
    output = _kernel(query.device.type)(
        rows,
        keys,
        values,
        block_mask=part.block_mask,
        scale=scale,
        enable_gqa=query.shape[1] != keys.shape[1],
        # The general kernel, one program per query tile and head: the decoding kernel
        # splits keys too, but needs a power-of-two head ratio and a fixed batch.
        kernel_options={
            "BLOCK_M": QUERY_TILE,
            "BLOCK_N": part.block_mask.BLOCK_SIZE[1],
            "FORCE_USE_FLEX_ATTENTION": True,
        },
    )
    if part.decodes:  # (batch_size, num_heads, 1, head_dim)
        return output[:num_tokens, :, 0]
    # (1, num_heads, num_rows, head_dim)
    return output[0, :, :num_tokens].transpose(0, 1)  # (num_tokens, num_heads, head_dim)


@cache
def _kernel(device_type: str):
    """The compiled kernel on CUDA; elsewhere (tests on the CPU) the eager reference, which
    applies the same block mask densely."""
    if device_type == "cuda":
        # Sizes change every step: compile for any size at once, and do not assume two sizes
        # stay equal because they were once (duck sizing), which would compile again.
        import torch.fx.experimental._config as shape_config

        shape_config.use_duck_shape = False
        torch._dynamo.config.recompile_limit = max(
            torch._dynamo.config.recompile_limit, COMPILED_SHAPES
        )
        return torch.compile(flex_attention, fullgraph=True, dynamic=True)
    return _eager


def _eager(query, keys, values, block_mask, scale, enable_gqa, kernel_options):
    return flex_attention(
        query, keys, values, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa
    )


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)
