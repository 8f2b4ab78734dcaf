"""Scheduler configuration: frozen, one dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduling step.

    ``max_num_batched_tokens`` is the single per-step token budget shared by decodes and prefill
    chunks; ``max_num_seqs`` caps how many requests run at once. With ``enable_prefix_caching``,
    requests reuse the KV blocks of identical prompt prefixes.
    """

    max_num_seqs: int = 256
    # 512 keeps a burst of prompts from being prefilled in one multi-second step on a CPU, which
    # would hold back every request's first token (docs/performance.md); GPUs want 2048-8192.
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True)
class KVCacheConfig:
    """What the worker reported about its KV pool (from ``WorkerReady``)."""

    num_blocks: int
    block_size: int
    max_model_len: int

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1 or self.max_model_len < 1:
            raise ValueError(f"invalid KV cache configuration: {self}")
