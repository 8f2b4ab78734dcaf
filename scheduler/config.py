"""Scheduler configuration: frozen, one dataclass, validated on construction."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from interfaces.worker_to_scheduler import MAX_KV_BLOCKS


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduling step.

    ``max_num_batched_tokens`` is the single per-step token budget shared by decodes and prefill
    chunks; ``max_num_seqs`` caps how many requests run at once. With ``enable_prefix_caching``,
    requests reuse the KV blocks of identical prompt prefixes.

    The queue of requests waiting to run is bounded, so that overload turns into quick "try
    again later" answers instead of unbounded memory and latency: a new request is refused
    while ``max_queued_requests`` wait beyond the free sequence slots, or when its prompt would
    take the waiting tokens (prompts plus outputs so far) above ``max_queued_tokens``. An empty
    queue takes any request.
    """

    max_num_seqs: int = 256
    # 512 keeps a burst of prompts from being prefilled in one multi-second step on a CPU, which
    # would hold back every request's first token (docs/performance.md); GPUs want 2048-8192.
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    max_queued_requests: int = 2048
    max_queued_tokens: int = 1 << 20
    kv_transfer_timeout_s: float = 30.0
    """With disaggregation: how long after its hand-off a request's KV may take to reach its
    decode group before the request fails."""

    def __post_init__(self) -> None:
        if not self.kv_transfer_timeout_s > 0:
            raise ValueError(
                f"kv_transfer_timeout_s must be positive, got {self.kv_transfer_timeout_s}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.max_queued_requests < 1:
            raise ValueError(
                f"max_queued_requests must be at least 1, got {self.max_queued_requests}"
            )
        if self.max_queued_tokens < 1:
            raise ValueError(f"max_queued_tokens must be at least 1, got {self.max_queued_tokens}")


@dataclass(frozen=True)
class KVCacheConfig:
    """What the worker reported about its KV pool (from ``WorkerReady``)."""

    num_blocks: int
    block_size: int
    max_model_len: int

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1 or self.max_model_len < 1:
            raise ValueError(f"invalid KV cache configuration: {self}")


def add_queue_flags(parser: argparse.ArgumentParser) -> None:
    """The waiting-queue bounds; ``switchyard serve`` takes the same flags."""
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=SchedulerConfig.max_queued_requests,
        help="requests allowed to wait beyond those running; more get 429 Too Many Requests",
    )
    parser.add_argument(
        "--max-queued-tokens",
        type=int,
        default=SchedulerConfig.max_queued_tokens,
        help="prompt tokens allowed to wait; more get 429 Too Many Requests",
    )


def add_kv_transfer_flag(parser: argparse.ArgumentParser) -> None:
    """``--kv-transfer-timeout``; ``switchyard serve`` takes the same flag."""
    parser.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=SchedulerConfig.kv_transfer_timeout_s,
        metavar="SECONDS",
        help="with prefill and decode groups: fail a request whose KV blocks have not reached "
        "its decode group this long after its first token",
    )


@dataclass(frozen=True)
class WorkerLimits:
    """What a worker's handshake (``WorkerReady``) may claim before the scheduler believes it.

    The scheduler keeps one bookkeeping object per KV block of every group (about 200 bytes and
    a microsecond each), so a group reporting more than ``max_kv_blocks`` blocks is refused.
    The default is ``MAX_KV_BLOCKS``, the most a worker ever reports (it uses no more, however
    much memory it has). The other bounds are fixed (``scheduler.worker_group.ready_problem``).
    """

    max_kv_blocks: int = MAX_KV_BLOCKS

    def __post_init__(self) -> None:
        if self.max_kv_blocks < 1:
            raise ValueError(f"max_kv_blocks must be at least 1, got {self.max_kv_blocks}")


def add_worker_limit_flags(parser: argparse.ArgumentParser) -> None:
    """``--max-worker-kv-blocks``: the ``WorkerLimits`` of ``python -m scheduler``."""
    parser.add_argument(
        "--max-worker-kv-blocks",
        type=int,
        default=WorkerLimits.max_kv_blocks,
        metavar="N",
        help="refuse a worker group whose KV pool has more blocks than this (default: %(default)s)",
    )
