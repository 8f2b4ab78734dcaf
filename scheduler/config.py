"""Scheduler configuration: frozen dataclasses, validated on construction, whose fields declare
their flags (``interfaces.settings``): ``SchedulerSettings`` is ``python -m scheduler``'s."""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass

from interfaces.lora import LoRAOperation, LoRARequest, lora_request_problem
from interfaces.settings import component, setting
from interfaces.worker_to_scheduler import CPU_STEP_TOKENS, CUDA_STEP_TOKENS, MAX_KV_BLOCKS
from scheduler.speculative import SpeculativeConfig


class PlacementPolicy(enum.Enum):
    """How a new request chooses among the worker groups that could run it
    (``scheduler.group_choice``)."""

    CACHE_AWARE = "cache-aware"
    """The group where it causes the least work: its tokens not cached there and the tokens
    queued ahead of it, among the groups not far above the least loaded."""
    LEAST_LOADED = "least-loaded"
    """The group holding the fewest requests (prefill), or with the most free KV blocks
    (decode); caches ignored."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduling step.

    ``max_num_batched_tokens`` is the single per-step token budget shared by decodes and prefill
    chunks; None leaves each worker group's scheduler the budget the group suggests
    (``with_step_tokens``). ``max_num_seqs`` caps how many requests run at once. With
    ``enable_prefix_caching``, requests reuse the KV blocks of identical prompt prefixes.

    The queue of requests waiting to run is bounded, so that overload turns into quick "try
    again later" answers instead of unbounded memory and latency: a new request is refused
    while ``max_queued_requests`` wait beyond the free sequence slots, or when its prompt would
    take the waiting tokens (prompts plus outputs so far) above ``max_queued_tokens``. An empty
    queue takes any request.
    """

    max_num_seqs: int = setting(256, "--max-num-seqs", "most requests per step")
    max_num_batched_tokens: int | None = setting(
        None,
        "--max-num-batched-tokens",
        "token budget per step (prefill chunks and decodes)",
        default_text=f"each worker group's: {CPU_STEP_TOKENS} on a CPU, {CUDA_STEP_TOKENS} on CUDA",
    )
    enable_prefix_caching: bool = setting(
        True,
        "--no-prefix-caching",
        "do not reuse the KV blocks of identical prompt prefixes",
        switch=True,
        default_text="reuse them",
    )
    max_queued_requests: int = setting(
        2048,
        "--max-queued-requests",
        "requests allowed to wait beyond those running; more get 429 Too Many Requests",
    )
    max_queued_tokens: int = setting(
        1 << 20,
        "--max-queued-tokens",
        "prompt tokens allowed to wait; more get 429 Too Many Requests",
    )
    kv_transfer_timeout_s: float = setting(
        30.0,
        "--kv-transfer-timeout",
        "with prefill and decode groups: fail a request whose KV blocks have not reached its "
        "decode group this long after its first token",
        metavar="SECONDS",
    )
    """With disaggregation: how long after its hand-off a request's KV may take to reach its
    decode group before the request fails."""
    migration_limit: int = setting(
        3,
        "--migration-limit",
        "how many times one request may move to another worker group after its group died; "
        "0 fails them as before",
        metavar="N",
    )
    """How often one request may move (and be recomputed) when a group holding it leaves: to a
    surviving hybrid group, or queued again for a prefill group; past it, it fails with 503."""
    worker_return_timeout_s: float = setting(
        60.0,
        "--worker-return-timeout",
        "when the last worker group (of a role) dies or stalls, how long its requests (and new "
        "ones) wait for a group to serve again before they fail with 503",
        metavar="SECONDS",
    )
    """How long a request whose group left, with no other group (of its role) to move to,
    waits for one to (re)register; also how long a departed group counts as restarting in
    /health."""
    stall_timeout_s: float = setting(
        30.0,
        "--stall-timeout",
        "the least time a step may take before its worker group counts as stalled (the bound "
        "grows with the group's slowest recent steps)",
        metavar="SECONDS",
    )
    """The floor of the stall bound: a group whose step has run longer than the larger of this
    and ``STALL_FACTOR`` times its slowest recent step is fenced and its requests move."""

    placement: PlacementPolicy = setting(
        PlacementPolicy.CACHE_AWARE,
        "--placement",
        "how a request chooses among several worker groups: cache-aware places it where its "
        "prompt is cached and the queue is short, least-loaded where the fewest requests are",
        default_text="cache-aware",
    )
    speculative_config: str | None = setting(
        None,
        "--speculative-config",
        'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} drafts tokens by looking up the '
        "context's last n-gram earlier in it",
        metavar="JSON",
        default_text="off",
    )
    """``SpeculativeConfig`` as JSON (``speculative`` parses it); None: no drafts."""
    lora_modules: tuple[str, ...] = setting(
        (),
        "--lora-modules",
        "LoRA adapters (PEFT directories) to load when the workers start, as NAME=PATH "
        "(comma-separated or repeated); clients name an adapter as their model",
        metavar="NAME=PATH",
        default_text="none",
    )

    @functools.cached_property
    def lora_adapters(self) -> list[tuple[str, str]]:
        """``lora_modules`` as (name, path) pairs (checked on construction)."""
        return [_lora_module(module) for module in self.lora_modules]

    def with_step_tokens(self, suggested: int) -> SchedulerConfig:
        """This config, or where it sets no ``max_num_batched_tokens`` a copy with the budget a
        worker group ``suggested`` (``WorkerReady.step_tokens``; 0: the CPU's)."""
        if self.max_num_batched_tokens is not None:
            return self
        return dataclasses.replace(self, max_num_batched_tokens=suggested or CPU_STEP_TOKENS)

    @functools.cached_property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed ``speculative_config`` (checked on construction)."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.parse(self.speculative_config)

    def __post_init__(self) -> None:
        names = [name for name, _ in self.lora_adapters]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"--lora-modules: two adapters are named {twice[0]!r}")
        if self.speculative_config is not None:
            SpeculativeConfig.parse(self.speculative_config)  # ValueError: say what is wrong
        if not self.kv_transfer_timeout_s > 0:
            raise ValueError(
                f"kv_transfer_timeout_s must be positive, got {self.kv_transfer_timeout_s}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.max_queued_requests < 1:
            raise ValueError(
                f"max_queued_requests must be at least 1, got {self.max_queued_requests}"
            )
        if self.max_queued_tokens < 1:
            raise ValueError(f"max_queued_tokens must be at least 1, got {self.max_queued_tokens}")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be at least 0, got {self.migration_limit}")
        if not self.worker_return_timeout_s >= 0:
            raise ValueError(
                f"worker_return_timeout_s must be at least 0, got {self.worker_return_timeout_s}"
            )
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be positive, got {self.stall_timeout_s}")


def _lora_module(module: str) -> tuple[str, str]:
    """``NAME=PATH`` as (name, path); ``ValueError`` naming what is wrong."""
    name, equals, path = module.partition("=")
    problem = lora_request_problem(LoRARequest(LoRAOperation.LOAD, name, path))
    if not equals or problem is not None:
        raise ValueError(f"--lora-modules: {module!r} is not NAME=PATH ({problem or 'no ='})")
    return name, path


@dataclass(frozen=True)
class KVCacheConfig:
    """What the worker reported about its KV pool (from ``WorkerReady``)."""

    num_blocks: int
    block_size: int
    max_model_len: int

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1 or self.max_model_len < 1:
            raise ValueError(f"invalid KV cache configuration: {self}")


@dataclass(frozen=True)
class WorkerLimits:
    """What a worker's handshake (``WorkerReady``) may claim before the scheduler believes it.

    The scheduler keeps one bookkeeping object per KV block of every group (about 200 bytes and
    a microsecond each), so a group reporting more than ``max_kv_blocks`` blocks is refused.
    The default is ``MAX_KV_BLOCKS``, the most a worker ever reports (it uses no more, however
    much memory it has). The other bounds are fixed (``scheduler.worker_group.ready_problem``).
    """

    max_kv_blocks: int = setting(
        MAX_KV_BLOCKS,
        "--max-worker-kv-blocks",
        "refuse a worker group whose KV pool has more blocks than this",
        metavar="N",
    )

    def __post_init__(self) -> None:
        if self.max_kv_blocks < 1:
            raise ValueError(f"max_kv_blocks must be at least 1, got {self.max_kv_blocks}")


@dataclass(frozen=True)
class SchedulerSettings:
    """``python -m scheduler``'s settings (its flags, ``interfaces.settings``) but the transport's
    and the log's; ``switchyard serve`` takes ``scheduling``'s flags too and fills the addresses.
    """

    frontend_addr: str | None = setting(
        None,
        "--frontend-addr",
        "ZeroMQ address API servers connect to, e.g. ipc:///tmp/sy/frontend",
        required=True,
    )
    backend_addr: str | None = setting(
        None,
        "--backend-addr",
        "ZeroMQ address workers connect to, e.g. tcp://127.0.0.1:5556",
        required=True,
    )
    scheduling: SchedulerConfig = component(SchedulerConfig)
    worker_limits: WorkerLimits = component(WorkerLimits)
