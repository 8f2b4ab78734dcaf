"""Decode steps replayed as CUDA graphs.

On a GPU, a decode step of a small model is bound by launching its kernels from Python, not by
the GPU: SmolLM2-135M's 30 layers launch some 300 kernels, 21-37 ms a step on an H100 whatever
the batch or context (docs/performance.md). A CUDA graph records one step's kernels once and
replays them with one launch.

A graph fixes every shape, so each captured batch size has its own graph (``capture_sizes``);
a step's batch is padded up to the next one. Padding rows decode token 0 at position 0 into a
spare cache block the scheduler never hands out (the ``ModelRunner`` keeps it back), so they
write nothing another request reads. Block tables are as wide as ``max_model_len`` needs; the
FlexAttention kernel still visits only each row's own blocks. What changes from step to step
lives in static buffers the graphs read: token ids, positions, cache slots, and the block
mask's tensors (each row's block count and table, each used block's place in its table,
``worker.flex_layout.decode_block_mask``), refilled before each replay.

The kernel runs one program per request and query head, each walking all of its request's
blocks: a lone decode of a long context would keep a few of a GPU's multiprocessors busy. So a
small batch also has a second graph that splits each request's table into slices
(``key_splits``), one block-mask row each, and merges the slices' outputs by their
log-sum-exps; a step takes it when its longest context reaches ``SPLIT_MIN_TOKENS``.

A step runs here when every request decodes one token (no draft tokens, no prompt tokens with
log probabilities, no image rows), none with a LoRA adapter, on a one-rank group, with at most
the largest captured batch; every other step runs eagerly. Off CUDA (tests) the same buffers and
masks run eagerly, so the padding and the masks are checked on the CPU too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from worker.attention import AttentionMetadata
from worker.flex_layout import MIN_SIZE, FlexLayout, FlexPart, decode_block_mask, place_blocks
from worker.kv_cache import KVCache

logger = logging.getLogger(__name__)

MAX_SPLITS = 16
"""The most slices a request's blocks are split into (a power of two)."""
PROGRAMS_PER_PROCESSOR = 4
"""Kernel programs ``key_splits`` aims for on each of the GPU's multiprocessors."""
SPLIT_MIN_TOKENS = 512
"""The longest context from which a step takes its size's split graph. On an H200 splitting
cost a lone decode 0.6 ms at 128 tokens and saved it 6.3 ms at 4,096 (an unsplit walk costs
about 32 us a block, so splitting pays from some 20 blocks on)."""


def capture_sizes(max_size: int) -> list[int]:
    """The batch sizes to capture, up to ``max_size``: 2, 4, then every multiple of 8 (vLLM's
    choice), and ``max_size`` itself; none for 0. A batch of one runs padded to two, the
    smallest size FlexAttention's compiled kernel serves without compiling again."""
    if max_size < 1:
        return []
    largest = max(max_size, MIN_SIZE)
    sizes = {size for size in (2, 4, *range(8, largest + 1, 8)) if size <= largest}
    return sorted(sizes | {largest})


def key_splits(size: int, num_heads: int, processors: int) -> int:
    """How many slices each request's blocks take in a graph of ``size`` requests of
    ``num_heads`` query heads: a power of two up to ``MAX_SPLITS``, enough that the programs
    (one per request, head and slice) give each of ``processors`` multiprocessors
    ``PROGRAMS_PER_PROCESSOR``; 1 once the batch alone does."""
    wanted = min(PROGRAMS_PER_PROCESSOR * processors // (size * num_heads), MAX_SPLITS)
    splits = 1
    while splits * 2 <= wanted:
        splits *= 2
    return splits


class DecodeGraphs:
    """One graph per captured batch size over ``model``'s decode step (module docstring).

    ``spare_block`` is a cache block no request uses; ``max_model_len`` bounds the block
    tables' width; ``sizes`` are the batch sizes to capture (``capture_sizes``);
    ``processors`` the multiprocessors ``key_splits`` fills (default: the GPU's; 1 off CUDA,
    which splits nothing). On CUDA the graphs are recorded by ``capture``; until then (and off
    CUDA) ``run`` runs the same step eagerly.
    """

    def __init__(
        self,
        model: nn.Module,
        kv_cache: KVCache,
        spare_block: int,
        max_model_len: int,
        sizes: Sequence[int],
        processors: int | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.spare_block = spare_block
        self.block_size = block_size = kv_cache.block_size
        self.sizes = sorted(sizes)
        if not self.sizes or self.sizes[0] < MIN_SIZE:
            raise ValueError(f"capture sizes must be at least {MIN_SIZE}, got {sizes}")
        device = model.model.norm.weight.device
        self.device = device
        if processors is None and device.type == "cuda":
            processors = torch.cuda.get_device_properties(device).multi_processor_count
        self.splits = {
            size: key_splits(size, model.num_heads, processors or 1) for size in self.sizes
        }
        num_cache_blocks = kv_cache.key_caches[0].shape[0]
        largest = self.sizes[-1]
        width = -(-max(-(-max_model_len // block_size), MIN_SIZE) // MAX_SPLITS) * MAX_SPLITS
        # (blocks a table may hold, a multiple of every split)
        longs = {"dtype": torch.int64, "device": device}
        self.input_ids = torch.zeros(largest, **longs)
        self.positions = torch.zeros(largest, **longs)
        self.slots = torch.full((largest,), spare_block * block_size, **longs)
        self.rows = torch.arange(largest, **longs)  # every row's logits
        self.logical_index = torch.zeros(num_cache_blocks, **longs)  # the spare block's: 0
        self.counts = torch.ones(largest, dtype=torch.int32, device=device)
        self.slice_counts = torch.ones(largest * MAX_SPLITS, dtype=torch.int32, device=device)
        """Split graphs' block counts: request b's slice s is row b * splits + s."""
        self.tables = torch.full((largest, width), spare_block, dtype=torch.int32, device=device)
        self._places = np.zeros(num_cache_blocks, dtype=np.int64)
        """The host's copy of ``logical_index``, for the check that no block is at two places."""
        self.variants = [(size, 1) for size in self.sizes] + [
            (size, splits) for size, splits in self.splits.items() if splits > 1
        ]
        """(size, splits) of every graph: each size unsplit, and split where that helps."""
        self._metadata = {variant: self._attention_metadata(*variant) for variant in self.variants}
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def largest(self) -> int:
        """The largest batch a graph serves."""
        return self.sizes[-1]

    def serves(self, counts: Sequence[int]) -> bool:
        """Whether a step scheduling ``counts`` tokens per request runs here (the caller checks
        the rest: no adapter, prompt log probabilities or image rows)."""
        return len(counts) <= self.largest and all(count == 1 for count in counts)

    @torch.inference_mode()
    def capture(self) -> None:
        """Record every graph (``variants``), the largest first, all in one memory pool (one
        step runs at a time). Each runs twice eagerly first, on a side stream, so that
        FlexAttention compiles and every lazy set-up happens outside the capture."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for variant in self.variants:
                for _ in range(2):
                    self._forward(*variant)
        current.wait_stream(side)
        pool = None
        for variant in sorted(self.variants, reverse=True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                logits = self._forward(*variant)
            pool = graph.pool()
            self._graphs[variant] = (graph, logits)
        torch.cuda.synchronize(self.device)

    def run(
        self,
        positions: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        input_ids: Sequence[int],
    ) -> torch.Tensor:
        """Float32 logits (len(positions), vocab_size) of one decode step: request i computes
        token ``input_ids[i]`` at ``positions[i]``, its blocks ``block_ids[i]`` (they cover
        the position). On CUDA a view of the graph's output: read it before the next step."""
        batch = len(positions)
        size = next(size for size in self.sizes if size >= batch)
        long = max(positions) + 1 >= SPLIT_MIN_TOKENS
        variant = (size, self.splits[size] if long else 1)
        self._fill(*variant, positions, block_ids, input_ids)
        if variant in self._graphs:
            graph, logits = self._graphs[variant]
            graph.replay()
        else:
            logits = self._forward(*variant)
        return logits[:batch]

    def _fill(
        self,
        size: int,
        splits: int,
        positions: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        input_ids: Sequence[int],
    ) -> None:
        """Copy one step's inputs into the buffers the graph of ``size`` rows, each request's
        blocks in ``splits`` slices, reads: two host-to-device copies, then copies on the
        device."""
        batch, block_size = len(positions), self.block_size
        token_positions = np.zeros(size, dtype=np.int64)
        token_positions[:batch] = positions
        counts = token_positions // block_size + 1  # padding rows: one block, the spare one
        per_slice = self.tables.shape[1] // splits
        slice_counts = np.clip(counts[:, None] - np.arange(splits) * per_slice, 0, per_slice)
        width = int(counts.max())
        tables = np.full((size, width), self.spare_block, dtype=np.int32)
        for row, (ids, count) in enumerate(zip(block_ids, counts, strict=False)):
            tables[row, :count] = ids[:count]
        slots = (
            tables[np.arange(size), counts - 1].astype(np.int64) * block_size
            + token_positions % block_size
        )
        used_blocks, used_places = place_blocks(tables, counts, self._places)
        token_ids = np.zeros(size, dtype=np.int64)
        token_ids[:batch] = input_ids
        longs = torch.from_numpy(
            np.concatenate([token_ids, token_positions, slots, used_blocks, used_places])
        ).to(self.device)
        ints = torch.from_numpy(
            np.concatenate([counts, slice_counts.ravel(), tables.ravel()]).astype(np.int32)
        ).to(self.device)
        self.input_ids[:size].copy_(longs[:size])
        self.positions[:size].copy_(longs[size : 2 * size])
        self.slots[:size].copy_(longs[2 * size : 3 * size])
        num_used = len(used_blocks)
        self.logical_index[longs[3 * size : 3 * size + num_used]] = longs[3 * size + num_used :]
        num_slices = size * splits
        self.counts[:size].copy_(ints[:size])
        self.slice_counts[:num_slices].copy_(ints[size : size + num_slices])
        self.tables[:size, :width].copy_(ints[size + num_slices :].view(size, width))

    def _attention_metadata(self, size: int, splits: int) -> AttentionMetadata:
        """The attention metadata of a step of ``size`` rows, each request's blocks in
        ``splits`` slices, over the buffers' first rows."""
        block_mask = decode_block_mask(
            self.counts[:size] if splits == 1 else self.slice_counts[: size * splits],
            self.tables[:size],
            self.positions[:size],
            self.logical_index,
            self.block_size,
            splits,
        )
        part = FlexPart(block_mask, decodes=True, num_rows=size, token_indices=None, splits=splits)
        return AttentionMetadata(self.slots[:size], groups=(), flex=FlexLayout((part,)))

    def _forward(self, size: int, splits: int) -> torch.Tensor:
        return self.model(
            self.input_ids[:size],
            self.positions[:size],
            self.kv_cache,
            self._metadata[size, splits],
            self.rows[:size],
        )


def build_decode_graphs(
    model: nn.Module,
    kv_cache: KVCache,
    spare_block: int,
    max_model_len: int,
    max_size: int,
) -> DecodeGraphs | None:
    """Capture ``model``'s decode graphs; None (every step then runs eagerly, with a warning)
    when capturing fails, so that a GPU or driver without graph support still serves."""
    graphs = DecodeGraphs(model, kv_cache, spare_block, max_model_len, capture_sizes(max_size))
    try:
        graphs.capture()
    except Exception as error:  # any failure leaves the eager path, which works
        logger.warning("CUDA graphs not captured, decode steps run eagerly: %s", error)
        return None
    logger.info("captured CUDA graphs of decode steps for batch sizes %s", graphs.sizes)
    return graphs
