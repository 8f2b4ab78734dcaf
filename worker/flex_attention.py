"""Attention over the paged KV cache in place on CUDA, with torch's FlexAttention.

The cache, (num_blocks, block_size, kv_heads, head_dim), is seen as one key sequence
(1, kv_heads, num_blocks * block_size, head_dim) with no copy, and each part of the step's
``FlexLayout`` (``worker.flex_layout``: decodes as a batch, prefills as one tiled sequence) is
one FlexAttention call per layer through that part's block mask.

The kernel is FlexAttention's Triton kernel, compiled on first use (``torch.compile``) for any
size at once; ``warm_up`` compiles it before the worker serves.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

from worker.flex_layout import QUERY_TILE, FlexPart, build_flex_layout

COMPILED_SHAPES = 64
"""How many times the kernel may compile (torch.compile's recompile_limit): once per dtype,
head shape, part and gradient mode. A worker serves one model, so it needs a few; tests more."""


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


def cache_as_sequence(
    key_cache: torch.Tensor, value_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's cache, (num_blocks, block_size, num_kv_heads, head_dim) each, as one key and
    one value sequence: (1, num_kv_heads, num_blocks * block_size, head_dim), views, no copy."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    sequence_shape = (1, num_blocks * block_size, num_kv_heads, head_dim)
    return (
        key_cache.view(sequence_shape).transpose(1, 2),
        value_cache.view(sequence_shape).transpose(1, 2),
    )


def part_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    part: FlexPart,
    scale: float,
) -> torch.Tensor:
    """One part's attention: ``query`` (num_part_tokens, num_heads, head_dim) over the cache as
    a sequence (``cache_as_sequence``); same shape out."""
    num_tokens = query.shape[0]
    rows = F.pad(query, (0, 0, 0, 0, 0, part.num_rows - num_tokens))
    # (num_rows, num_heads, head_dim): padding rows see no key
    # decodes: (batch_size, num_heads, 1, head_dim), one query per request;
    # prefills: (1, num_heads, num_rows, head_dim), one sequence
    rows = rows[:, :, None] if part.decodes else rows.transpose(0, 1)[None]
    if part.splits > 1:  # each request's query once for each slice of its blocks
        rows = rows.repeat_interleave(part.splits, dim=0)
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
        return_aux=AuxRequest(lse=True) if part.splits > 1 else None,
    )
    if part.splits > 1:
        return _merge_splits(*output, part.splits)[:num_tokens]
    if part.decodes:  # (batch_size, num_heads, 1, head_dim)
        return output[:num_tokens, :, 0]
    # (1, num_heads, num_rows, head_dim)
    return output[0, :, :num_tokens].transpose(0, 1)  # (num_tokens, num_heads, head_dim)


def _merge_splits(output: torch.Tensor, aux, splits: int) -> torch.Tensor:
    """Each request's attention from its rows' (``splits`` consecutive rows, each over a slice
    of its keys): the rows' outputs (rows, heads, 1, head_dim) weighted by the softmax of their
    log-sum-exps (rows, heads, 1), a row that saw no key weighing 0. (num_requests, heads,
    head_dim), in the output's dtype."""
    _, num_heads, _, head_dim = output.shape
    weights = torch.softmax(aux.lse.view(-1, splits, num_heads), dim=1)  # float32
    merged = (output.view(-1, splits, num_heads, head_dim).float() * weights[..., None]).sum(1)
    return merged.to(output.dtype)


def warm_up(key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int) -> None:
    """Compile the kernel for a decode part and a prefill part over one layer's cache (read,
    not written), as a step would call it, so the first requests do not wait for it. A cache
    of one block (a tiny ``max_model_len``) leaves it to the first step."""
    num_blocks, block_size, _, head_dim = key_cache.shape
    if num_blocks < 2:
        return
    steps = [([block_size, block_size + 1], [1, 1]), ([0], [block_size + 3])]
    with torch.inference_mode():
        for starts, counts in steps:
            query_lens = np.array(counts)
            layout = build_flex_layout(
                np.array(starts),
                query_lens,
                np.cumsum(query_lens) - query_lens,
                np.array([[0, 1]] * len(starts)),
                block_size,
                num_blocks,
                key_cache.device,
            )
            (part,) = layout.parts
            query = key_cache.new_zeros(sum(counts), num_heads, head_dim)
            part_attention(query, *cache_as_sequence(key_cache, value_cache), part, head_dim**-0.5)


@cache
def _kernel(device_type: str):
    """The compiled kernel on CUDA; elsewhere (tests on the CPU) the eager reference, which
    applies the same block mask densely.

    Compiling changes two of torch's process-wide settings, which only this kernel uses in a
    worker: duck sizing is off (two sizes equal once are not assumed to stay equal) and the
    recompile limit is at least ``COMPILED_SHAPES``."""
    if device_type == "cuda":
        import torch.fx.experimental._config as shape_config

        shape_config.use_duck_shape = False
        torch._dynamo.config.recompile_limit = max(
            torch._dynamo.config.recompile_limit, COMPILED_SHAPES
        )
        return torch.compile(flex_attention, fullgraph=True, dynamic=True)
    return _eager


def _eager(query, keys, values, block_mask, scale, enable_gqa, kernel_options, return_aux):
    """FlexAttention without compiling; ``kernel_options`` are the Triton kernel's alone."""
    return flex_attention(
        query,
        keys,
        values,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=enable_gqa,
        return_aux=return_aux,
    )
