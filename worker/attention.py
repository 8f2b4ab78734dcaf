"""Attention over the paged KV cache for a flat, mixed batch of tokens.

A step's tokens are all requests' scheduled tokens concatenated (varlen). A request may prefill
many tokens (a whole prompt, or a chunk starting after tokens already cached) while another
decodes one. Every layer writes the new keys/values into their cache slots, then each request's
queries attend to its cached keys through its block table. Three ways (``AttentionKind``), chosen
once per model (``LlamaForCausalLM.attention_kind``):

- **In place on the CPU** (float32): ``worker.models.cpu_ops.paged_attention`` reads each
  request's blocks where they lie, for decodes and prefills alike; the layout is one block table
  per request and where each request's queries start.
- **In place on CUDA**: torch's FlexAttention over the whole cache seen as one key sequence, a
  block mask naming the blocks each tile of queries visits (``worker.flex_attention``).
- **Gathered** (elsewhere, and the reference): the blocks are gathered into a padded batch and one
  ``scaled_dot_product_attention`` call serves a whole group of requests, with a causal mask on
  absolute positions hiding both future tokens and padding. Requests are grouped by kind,
  decodes (one query token) apart from prefills, so a step that mixes 64 decodes with one
  448-token prefill chunk does not pad every decode to 448 queries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch
import torch.nn.functional as F

from worker import flex_attention
from worker.flex_layout import FlexLayout, build_flex_layout, to_device
from worker.kv_cache import slot_mapping
from worker.models import cpu_ops


class AttentionKind(Enum):
    """How a model's attention reads the paged cache (module docstring)."""

    IN_PLACE_CPU = "in_place_cpu"
    FLEX = "flex"
    GATHERED = "gathered"


def choose_attention_kind(
    model_kind: AttentionKind, block_size: int, backend: str
) -> AttentionKind:
    """A worker's attention: its model's (in place where the device has a kernel for its heads,
    ``LlamaForCausalLM.finish_loading``), unless ``backend`` is "gathered" or FlexAttention
    cannot tile ``block_size``."""
    if backend == "gathered":
        return AttentionKind.GATHERED
    if model_kind is AttentionKind.FLEX and not flex_attention.supports_block_size(block_size):
        return AttentionKind.GATHERED
    return model_kind


@dataclass(frozen=True)
class AttentionGroup:
    """Requests whose queries are padded together (all decodes, or all prefills).

    ``token_indices`` (num_group_tokens,): the group's tokens in the flat batch, request by request.
    ``block_tables`` (num_requests, max_num_blocks): each request's blocks, padded with block 0
    (padding is masked out, so any valid block id would do).
    ``token_request_indices`` / ``token_query_indices`` (num_group_tokens,): the request (within
    the group) each token belongs to, and its index among that request's scheduled tokens.
    ``attention_mask`` (num_requests, 1, max_query_len, max_num_blocks * block_size): True where
    a query may attend to a key: the key's position is at most the query's position.
    """

    token_indices: torch.Tensor
    block_tables: torch.Tensor
    token_request_indices: torch.Tensor
    token_query_indices: torch.Tensor
    attention_mask: torch.Tensor


@dataclass(frozen=True)
class AttentionMetadata:
    """Where a step's tokens sit, shared by every layer. Built once per step on the device.

    ``slot_mapping`` (num_tokens,): cache slot each new token's key/value is written to.
    In place: ``block_tables`` (num_requests, max_num_blocks), each request's blocks padded
    with 0; ``query_starts`` (num_requests + 1,), each request's first token in the flat batch
    and then num_tokens; ``context_starts`` (num_requests,), each request's first position.
    Flex: ``flex``, the step's block mask (None otherwise).
    Gathered: ``groups``, one or two ``AttentionGroup``s that together hold every token once
    (empty otherwise, and the three in-place tensors above are then None).
    """

    slot_mapping: torch.Tensor
    groups: tuple[AttentionGroup, ...]
    block_tables: torch.Tensor | None = None
    query_starts: torch.Tensor | None = None
    context_starts: torch.Tensor | None = None
    flex: FlexLayout | None = None

    @property
    def in_place_cpu(self) -> bool:
        """Whether this step reads the cache in place (``cpu_ops.paged_attention``)."""
        return self.block_tables is not None


@dataclass(frozen=True)
class BatchLayout:
    """A step's flat token layout: ``positions`` (num_tokens,), each token's absolute position,
    and the attention metadata. (Which rows give logits the runner works out on the host.)"""

    positions: torch.Tensor
    metadata: AttentionMetadata


def build_batch_layout(
    num_computed_tokens: Sequence[int],
    num_scheduled_tokens: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
    kind: AttentionKind = AttentionKind.GATHERED,
    num_cache_blocks: int = 0,
) -> BatchLayout:
    """Lay out requests that compute [num_computed, num_computed + num_scheduled) tokens each,
    for attention of ``kind`` (module docstring); flex needs the cache's ``num_cache_blocks``.

    ``block_ids[i]`` must cover request i's tokens up to its new end; the caller checks that.
    """
    starts = np.asarray(num_computed_tokens, dtype=np.int64)
    query_lens = np.asarray(num_scheduled_tokens, dtype=np.int64)
    ends = starts + query_lens
    token_requests, token_queries = _token_indices(query_lens)
    positions = starts[token_requests] + token_queries
    slots = [
        slot_mapping(ids, start, end, block_size)
        for ids, start, end in zip(block_ids, starts, ends, strict=True)
    ]
    query_starts = np.cumsum(query_lens) - query_lens
    slot_tensor = to_device(np.concatenate(slots), device)
    if kind is AttentionKind.IN_PLACE_CPU:
        metadata = AttentionMetadata(
            slot_tensor,
            groups=(),
            block_tables=to_device(_block_tables(block_ids, -(-ends // block_size)), device),
            query_starts=to_device(np.append(query_starts, len(positions)), device),
            context_starts=to_device(starts, device),
        )
    elif kind is AttentionKind.FLEX:
        if num_cache_blocks < 1:
            raise ValueError("FlexAttention's layout needs the cache's number of blocks")
        tables = _block_tables(block_ids, -(-ends // block_size))
        flex = build_flex_layout(
            starts, query_lens, query_starts, tables, block_size, num_cache_blocks, device
        )
        metadata = AttentionMetadata(slot_tensor, groups=(), flex=flex)
    else:
        is_decode = query_lens == 1
        groups = tuple(
            _group(members, starts, query_lens, query_starts, block_ids, block_size, device)
            for members in (np.flatnonzero(is_decode), np.flatnonzero(~is_decode))
            if len(members)
        )
        metadata = AttentionMetadata(slot_tensor, groups)
    return BatchLayout(to_device(positions, device), metadata)


def _group(
    members: np.ndarray,
    starts: np.ndarray,
    query_lens: np.ndarray,
    query_starts: np.ndarray,
    block_ids: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
) -> AttentionGroup:
    """The padded attention layout of requests ``members`` (indices into the step's requests)."""
    starts, query_lens = starts[members], query_lens[members]
    token_requests, token_queries = _token_indices(query_lens)
    token_indices = query_starts[members][token_requests] + token_queries
    ends = starts + query_lens
    block_tables = _block_tables([block_ids[i] for i in members], -(-ends // block_size))
    query_positions = np.zeros((len(members), int(query_lens.max())), dtype=np.int64)
    query_positions[token_requests, token_queries] = starts[token_requests] + token_queries
    mask = _causal_mask(query_positions, block_tables.shape[1] * block_size)
    return AttentionGroup(
        token_indices=to_device(token_indices, device),
        block_tables=to_device(block_tables, device),
        token_request_indices=to_device(token_requests, device),
        token_query_indices=to_device(token_queries, device),
        attention_mask=to_device(mask, device),
    )


def _token_indices(query_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each flat-batch token: its request's index, and its index among that request's tokens."""
    token_requests = np.repeat(np.arange(len(query_lens)), query_lens)
    query_starts = np.cumsum(query_lens) - query_lens
    return token_requests, np.arange(int(query_lens.sum())) - query_starts[token_requests]


def _causal_mask(query_positions: np.ndarray, max_context: int) -> np.ndarray:
    """(num_requests, 1, max_query_len, max_context): key position <= query position.

    ``query_positions`` (num_requests, max_query_len) holds 0 in padding rows, so they see one
    key and never form a fully masked row (which would turn into NaNs); their outputs are dropped.
    """
    mask = np.arange(max_context)[None, None, :] <= query_positions[:, :, None]
    # (num_requests, max_query_len, max_context)
    return mask[:, None]  # (num_requests, 1, max_query_len, max_context)


def _block_tables(block_ids: Sequence[Sequence[int]], num_blocks: np.ndarray) -> np.ndarray:
    """(num_requests, max(num_blocks)) array of each request's first num_blocks blocks, 0-padded."""
    tables = np.zeros((len(block_ids), int(num_blocks.max())), dtype=np.int64)
    for i, (ids, count) in enumerate(zip(block_ids, num_blocks, strict=True)):
        tables[i, :count] = ids[:count]
    return tables


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Store ``key``/``value`` (num_tokens, num_kv_heads, head_dim) at cache ``slots``."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    flat_shape = (num_blocks * block_size, num_kv_heads, head_dim)
    # (num_blocks * block_size, num_kv_heads, head_dim): one row per slot
    key_cache.view(flat_shape).index_copy_(0, slots, key)
    value_cache.view(flat_shape).index_copy_(0, slots, value)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attend ``query`` (num_tokens, num_heads, head_dim) to cached keys; same shape out.

    The step's own keys/values must already be written (``write_kv``).
    """
    if metadata.flex is not None:
        keys, values = flex_attention.cache_as_sequence(key_cache, value_cache)
        return _by_group(
            query,
            metadata.flex.parts,
            lambda part_query, part: flex_attention.part_attention(
                part_query, keys, values, part, scale
            ),
        )
    if metadata.in_place_cpu:
        return cpu_ops.paged_attention(
            query,
            key_cache,
            value_cache,
            metadata.block_tables,
            metadata.query_starts,
            metadata.context_starts,
            scale,
        )
    return _by_group(
        query,
        metadata.groups,
        lambda group_query, group: _group_attention(
            group_query, key_cache, value_cache, group, scale
        ),
    )


def _by_group(query: torch.Tensor, groups: Sequence, attend) -> torch.Tensor:
    """``attend(group_query, group)`` for each group of the step's tokens (an ``AttentionGroup``
    or a ``FlexPart``, whose ``token_indices`` say which), merged back into the flat order. One
    group holds every token in order, and runs on ``query`` as it is."""
    if len(groups) == 1:
        return attend(query, groups[0])
    output = torch.empty_like(query)
    for group in groups:
        group_output = attend(query.index_select(0, group.token_indices), group)
        output.index_copy_(0, group.token_indices, group_output)
    return output


def _group_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
) -> torch.Tensor:
    """Attention for one group's tokens ``query`` (num_group_tokens, num_heads, head_dim)."""
    num_requests, _, max_query_len, _ = group.attention_mask.shape
    requests, queries = group.token_request_indices, group.token_query_indices
    if max_query_len == 1:
        padded = query[:, None]  # (num_requests, 1, num_heads, head_dim): one token each
    else:
        padded = query.new_zeros(num_requests, max_query_len, *query.shape[1:])
        padded[requests, queries] = query  # (num_requests, max_query_len, num_heads, head_dim)
    keys = _gather(key_cache, group.block_tables)
    values = _gather(value_cache, group.block_tables)
    output = F.scaled_dot_product_attention(
        padded.transpose(1, 2),  # (num_requests, num_heads, max_query_len, head_dim)
        keys,
        values,
        attn_mask=group.attention_mask,
        scale=scale,
        enable_gqa=True,
    )  # (num_requests, num_heads, max_query_len, head_dim)
    if max_query_len == 1:
        return output[:, :, 0]  # (num_requests, num_heads, head_dim)
    return output.transpose(1, 2)[requests, queries]  # (num_group_tokens, num_heads, head_dim)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Each request's blocks, contiguous: (num_requests, num_kv_heads, max_context, head_dim).

    ``index_select`` on the flattened table rather than ``cache[block_tables]``: the same copy,
    several times faster on the CPU."""
    num_requests, max_num_blocks = block_tables.shape
    blocks = cache.index_select(0, block_tables.flatten())
    # (num_requests * max_num_blocks, block_size, kv_heads, head_dim)
    blocks = blocks.view(num_requests, max_num_blocks * cache.shape[1], *cache.shape[2:])
    # (num_requests, max_context, kv_heads, head_dim)
    return blocks.transpose(1, 2)  # (num_requests, kv_heads, max_context, head_dim)
