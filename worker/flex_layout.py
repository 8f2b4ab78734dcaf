"""One step's block masks for FlexAttention over the paged KV cache (``worker.flex_attention``).

The whole cache is one long key sequence (``num_blocks * block_size`` slots); a ``BlockMask``
names the cache blocks each query visits, and inside a visited block its ``mask_mod`` keeps a
key when the block is the query's request's and its position is at most the query's. A step's
requests go in two parts, as the gathered path groups them:

- **Decodes** (one query each) are a batch: request b is batch row b with one query, and its
  row of the block mask is its block table. The kernel runs one program per request and head,
  so a step of 64 long decodes keeps a GPU busy.
- **Prefills** (whole prompts, chunks after a cached prefix) are one query sequence, their
  tokens concatenated. Each tile of ``QUERY_TILE`` consecutive queries visits the blocks, up to
  the tile's last position, of every request with a query in it, each block once.

Ownership is one lookup, not a table over the cache: every block a step uses has one logical
index, its place in its request's block table (the block manager shares a block only as part
of a cached prefix, whose hashes chain from the first block, so always at the same place;
``build_flex_layout`` checks it), and a block belongs to request r exactly when
``tables[r, logical_index[block]] == block``.

Built on the host with numpy, once per step, for every layer. Every size is at least
``MIN_SIZE`` so that the compiled kernel sees no size it would specialise on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

QUERY_TILE = 16
"""Queries per BlockMask row of a prefill part, and the kernel's BLOCK_M."""
MIN_SIZE = 2
"""Every size the kernel sees is at least 2 (batch rows, query tiles, table rows and columns
are padded): torch.compile specialises sizes 0 and 1, and each would compile again."""


@dataclass(frozen=True)
class FlexPart:
    """One FlexAttention call per layer: ``block_mask`` over ``num_rows`` query rows, the
    part's tokens then padding that sees no key (decodes: ``num_rows`` batch rows of one query;
    prefills: one batch row of ``num_rows`` queries). ``token_indices`` are the part's tokens in
    the step's flat batch, None when the part is every token in order."""

    block_mask: BlockMask
    decodes: bool
    num_rows: int
    token_indices: torch.Tensor | None
    splits: int = 1
    """Decodes: block-mask rows per request, each over its own slice of the request's table
    (``decode_block_mask``), their outputs merged by their log-sum-exps."""


@dataclass(frozen=True)
class FlexLayout:
    """What every layer's FlexAttention calls of one step share: one part or two."""

    parts: tuple[FlexPart, ...]


def build_flex_layout(
    starts: np.ndarray,
    query_lens: np.ndarray,
    query_starts: np.ndarray,
    tables: np.ndarray,
    block_size: int,
    num_cache_blocks: int,
    device: torch.device,
) -> FlexLayout:
    """The parts of requests computing positions [starts, starts + query_lens) each, whose
    queries start at ``query_starts`` in the flat batch. ``tables`` (num_requests, max_blocks)
    holds each request's blocks up to its new end, 0-padded."""
    num_blocks = -(-(starts + query_lens) // block_size)
    if tables.shape[1] < MIN_SIZE:
        tables = np.pad(tables, ((0, 0), (0, MIN_SIZE - tables.shape[1])))
    logical_index = np.zeros(num_cache_blocks, dtype=np.int64)
    place_blocks(tables, num_blocks, logical_index)
    cache = _CacheView(to_device(logical_index, device), block_size, num_cache_blocks, device)
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
            token_indices = to_device(indices, device)
        if decodes:
            parts.append(_decode_part(cache, starts[members], tables[members], token_indices))
        else:
            parts.append(
                _prefill_part(
                    cache, starts[members], query_lens[members], tables[members], token_indices
                )
            )
    return FlexLayout(tuple(parts))


def place_blocks(
    tables: np.ndarray, num_blocks: np.ndarray, logical_index: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Set ``logical_index[block]`` to the block's place in its table for every block the
    requests use (request r: the first ``num_blocks[r]`` of ``tables[r]``); return those
    blocks and their places, request by request. ``RuntimeError`` when a block is at two
    places: it would hide keys from one of its requests, so the step is refused."""
    used = np.arange(tables.shape[1]) < num_blocks[:, None]  # (num_requests, max_blocks)
    used_blocks, used_places = tables[used], np.nonzero(used)[1]
    logical_index[used_blocks] = used_places
    if not np.array_equal(logical_index[used_blocks], used_places):
        raise RuntimeError("a block of the step is at two places in its requests' tables")
    return used_blocks, used_places


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
    block_mask = decode_block_mask(
        to_device(counts, cache.device),
        to_device(indices, cache.device),
        to_device(positions, cache.device),
        cache.logical_index,
        cache.block_size,
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
        to_device(kv_num_blocks, cache.device)[None, None],  # (1, 1, num_tiles)
        to_device(kv_indices, cache.device)[None, None],  # (1, 1, num_tiles, max_blocks)
        BLOCK_SIZE=(QUERY_TILE, cache.block_size),
        mask_mod=_prefill_mask(
            cache,
            to_device(tables, cache.device),
            to_device(token_requests, cache.device),
            to_device(token_positions, cache.device),
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


def decode_block_mask(
    counts: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    logical_index: torch.Tensor,
    block_size: int,
    splits: int = 1,
) -> BlockMask:
    """The decode part's block mask over a cache of ``len(logical_index)`` blocks: request b
    visits the first ``counts[b]`` (int32) blocks of ``tables[b]`` (int32) and sees their keys
    up to ``positions[b]`` (-1: none); ``logical_index`` holds each visited block's place in its
    table. The mask keeps these tensors, not copies, so a CUDA graph refills them between
    replays (``worker.cuda_graphs``).

    With ``splits`` > 1, request b is rows b * splits + s, row s visiting the s-th slice of
    b's table (``tables`` as wide as a multiple of ``splits``); ``counts`` then holds each
    row's count, (num_requests * splits,)."""
    num_rows = tables.shape[0] * splits
    return BlockMask.from_kv_blocks(
        counts[:, None, None],  # (num_rows, 1, 1)
        tables.view(num_rows, -1)[:, None, None],  # (num_rows, 1, 1, blocks per row)
        BLOCK_SIZE=(QUERY_TILE, block_size),
        mask_mod=_decode_mask(logical_index, block_size, tables, positions, splits),
        seq_lengths=(1, len(logical_index) * block_size),
        compute_q_blocks=False,
    )


def _decode_mask(
    logical_index: torch.Tensor,
    block_size: int,
    tables: torch.Tensor,
    positions: torch.Tensor,
    splits: int,
):
    """mask_mod of the decode part: a row of request b sees the keys of b's own blocks
    (``tables`` row b; split: of its slice of them) up to ``positions[b]``. The kernel visits
    only the row's blocks anyway; the ownership check keeps the mask exact where it is applied
    densely (eager, on the CPU)."""
    if splits == 1:

        def mask_mod(batch, head, q, kv):
            block = kv // block_size
            logical = logical_index[block]
            owned = tables[batch, logical] == block
            return owned & (logical * block_size + kv % block_size <= positions[batch])

        return mask_mod
    per_row = tables.shape[1] // splits

    def split_mask_mod(batch, head, q, kv):
        request = batch // splits
        block = kv // block_size
        logical = logical_index[block]
        owned = (tables[request, logical] == block) & (logical // per_row == batch % splits)
        return owned & (logical * block_size + kv % block_size <= positions[request])

    return split_mask_mod


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


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on ``device``, same dtype."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)
