"""``ServeConfig``: everything ``switchyard serve`` (and the offline pipeline) asks of the
launcher, checked when it is made (``ValueError`` with a message for the user)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from api_server.config import DEFAULT_SHUTDOWN_TIMEOUT_S, MediaConfig
from scheduler.config import SchedulerConfig

DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV cache block."""


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``switchyard serve`` needs; flags map one to one."""

    model_dir: Path | None
    """The text generation model; None serves only ``embedding_model_dir``."""
    served_model_name: str | None
    host: str = "127.0.0.1"
    port: int = 8000
    api_servers: int = 1
    tensor_parallel_size: int = 1
    prefill_workers: int = 0
    """Prefill groups (each of ``tensor_parallel_size`` ranks); 0 with ``decode_workers`` 0
    serves one hybrid group."""
    decode_workers: int = 0
    kv_transfer_timeout_s: float = SchedulerConfig.kv_transfer_timeout_s
    embedding_model_dir: Path | None = None
    """Also serve /v1/embeddings with this encoder, on a worker of its own."""
    embedding_model_name: str | None = None
    max_model_len: int | None = None
    kv_cache_memory: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    enable_prefix_caching: bool = True
    device: str | None = None
    dtype: str | None = None
    api_key: str | None = field(default=None, repr=False)
    """Passed to the API servers in their environment (SWITCHYARD_API_KEY), never in argv."""
    allowed_origins: tuple[str, ...] = ()
    allowed_local_media_path: Path | None = None
    """Chat images may be ``file://`` URLs of files inside this directory (None: none)."""
    allowed_media_domains: tuple[str, ...] = ()
    """Chat images may be http(s) URLs on these hosts (empty: none)."""
    max_images_per_prompt: int = MediaConfig.max_images_per_prompt
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    max_queued_requests: int = SchedulerConfig.max_queued_requests
    max_queued_tokens: int = SchedulerConfig.max_queued_tokens
    api_server_flags: tuple[str, ...] = ()
    """More ``python -m api_server`` flags, as given (the HTTP limits)."""
    worker_flags: tuple[str, ...] = ()
    """More ``python -m worker`` flags for text generation workers (the structured-output
    limits)."""
    log_level: str = "INFO"
    log_format: str = "text"
    """Every child logs this way (interfaces.logs), told through its environment."""

    @property
    def worker_groups(self) -> list[tuple[str, str]]:
        """(group name, role) of every text generation worker group to start."""
        if self.model_dir is None:
            return []
        if not self.prefill_workers:
            return [("hybrid", "hybrid")]
        return [(f"prefill-{i}", "prefill") for i in range(self.prefill_workers)] + [
            (f"decode-{i}", "decode") for i in range(self.decode_workers)
        ]

    @property
    def num_worker_processes(self) -> int:
        """Worker processes on this machine, which share its cores: every rank of every
        generation group, and the embedding worker."""
        generation = self.tensor_parallel_size * len(self.worker_groups)
        return generation + (self.embedding_model_dir is not None)

    @property
    def model_names(self) -> str:
        """What it serves, for people: the served model names."""
        names = (self.served_model_name, self.embedding_model_name)
        return " and ".join(name for name in names if name)

    def _generation_only_flags(self) -> list[str]:
        """The flags given that only a text generation model uses."""
        given = {
            "--tensor-parallel-size": self.tensor_parallel_size != 1,
            "--prefill-workers/--decode-workers": bool(self.prefill_workers),
            "--max-model-len": self.max_model_len is not None,
            "--kv-cache-memory": self.kv_cache_memory is not None,
            "--block-size": self.block_size != DEFAULT_BLOCK_SIZE,
            "--no-prefix-caching": not self.enable_prefix_caching,
            "--dtype": self.dtype is not None,
        }
        return [flag for flag, is_given in given.items() if is_given]

    def __post_init__(self) -> None:
        if self.model_dir is None and self.embedding_model_dir is None:
            raise ValueError("--model none serves nothing without --embedding-model")
        if (self.model_dir is None) != (self.served_model_name is None):
            raise ValueError("served_model_name goes with model_dir")
        if self.model_dir is None and (given := self._generation_only_flags()):
            raise ValueError(
                f"{', '.join(given)} configure the text generation model; --model none serves none"
            )
        if self.api_servers < 1:
            raise ValueError(f"--api-servers must be at least 1, got {self.api_servers}")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}"
            )
        if self.prefill_workers < 0 or self.decode_workers < 0:
            raise ValueError("--prefill-workers and --decode-workers cannot be negative")
        if (self.prefill_workers == 0) != (self.decode_workers == 0):
            raise ValueError(
                "disaggregated serving needs both --prefill-workers and --decode-workers "
                f"(got {self.prefill_workers} and {self.decode_workers})"
            )
        if self.allowed_local_media_path and not self.allowed_local_media_path.is_dir():
            raise ValueError(
                f"--allowed-local-media-path {self.allowed_local_media_path} is not a directory"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"--shutdown-timeout must be 0 or more, got {self.shutdown_timeout_s}")
