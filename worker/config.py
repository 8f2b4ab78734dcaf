"""WorkerConfig: how one worker process loads its model and sizes its KV cache (made from the
``WorkerSettings`` of its flags, ``worker.settings``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from interfaces.shared_settings import LoRASettings
from worker.grammar_limits import GrammarLimits
from worker.parallel import check_rank
from worker.settings import (
    ATTENTION_BACKENDS,
    DTYPE_NAMES,
    FLOAT32_MATMUL_PRECISIONS,
    WorkerSettings,
)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30
DEFAULT_GPU_KV_CACHE_FRACTION = 0.8
MAX_CUDAGRAPH_CAPTURE_SIZE = 4096
"""Every captured size holds a graph and its buffers: more than a worker could batch is refused."""


@dataclass(frozen=True)
class WorkerConfig:
    """Settings for one worker; validated on construction (bad values raise ``ValueError``).

    ``model_dir`` is a Hugging Face-format directory (see ``worker.model_files.resolve_model``).
    ``device`` is "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".
    ``dtype`` None means float32 on CPU and bfloat16 on CUDA.
    ``attention_backend``: "auto" reads the KV cache in place where a kernel for the device
    exists, "gathered" always copies blocks into padded batches (``worker.attention``).
    ``float32_matmul_precision`` is torch's (``torch.set_float32_matmul_precision``), set when
    the model loads: "high" packs decoder layers for the CPU's tile unit where it has one
    (``worker.models.tile_gemm``) and allows TF32 on CUDA.
    ``max_cudagraph_capture_size``: on CUDA, decode steps of up to this many requests replay
    CUDA graphs (``worker.cuda_graphs``); 0 runs every step eagerly.
    ``kv_cache_memory`` is bytes when greater than 1, a fraction of free device memory when in
    (0, 1]; None means 1 GiB on CPU and 0.8 of free memory on CUDA.
    ``max_model_len`` None means the model's ``max_position_embeddings``.
    ``seed`` seeds sampling for requests that bring no seed of their own; None draws fresh.
    ``served_model_name`` None means the model directory's name.
    ``num_threads`` is torch's CPU threads; None means every core this process may run on.
    ``rank`` and ``tensor_parallel_size`` place the worker in its tensor-parallel group;
    ``master_addr``:``master_port`` is where the ranks meet (rank 0 listens there).
    ``grammar_limits`` bound structured output: spec sizes, compile time, compiled-grammar cache.
    ``logits_processors`` are user logits processors' import paths (``worker.user_processors``).
    ``lora``: whether the worker serves LoRA adapters, and its slots for them (``worker.lora``).
    """

    model_dir: Path
    device: str = WorkerSettings.device
    dtype: str | None = None
    kv_cache_memory: float | None = None
    block_size: int = WorkerSettings.block_size
    attention_backend: str = WorkerSettings.attention_backend
    float32_matmul_precision: str = WorkerSettings.float32_matmul_precision
    max_cudagraph_capture_size: int = WorkerSettings.max_cudagraph_capture_size
    max_model_len: int | None = None
    seed: int | None = None
    served_model_name: str | None = None
    num_threads: int | None = None
    rank: int = 0
    tensor_parallel_size: int = 1
    master_addr: str = WorkerSettings.master_addr
    master_port: int = WorkerSettings.master_port
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)
    logits_processors: tuple[str, ...] = ()
    lora: LoRASettings = field(default_factory=LoRASettings)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_memory is not None and not self.kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.float32_matmul_precision not in FLOAT32_MATMUL_PRECISIONS:
            raise ValueError(
                f"float32_matmul_precision must be one of {FLOAT32_MATMUL_PRECISIONS}, "
                f"got {self.float32_matmul_precision!r}"
            )
        if not 0 <= self.max_cudagraph_capture_size <= MAX_CUDAGRAPH_CAPTURE_SIZE:
            raise ValueError(
                f"max_cudagraph_capture_size must be in [0, {MAX_CUDAGRAPH_CAPTURE_SIZE}], "
                f"got {self.max_cudagraph_capture_size}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        check_rank(self.rank, self.tensor_parallel_size)
        if self.device.startswith("cuda:") and self.tensor_parallel_size > 1:
            raise ValueError(
                f"device {self.device!r} names one GPU for {self.tensor_parallel_size} ranks; "
                "use device cuda (rank r takes GPU r modulo the GPUs on its host)"
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in [1, 65535], got {self.master_port}")

    @property
    def torch_device(self) -> torch.device:
        """The device the model and KV cache live on. Tensor-parallel ranks given "auto" or
        "cuda" take GPU ``rank`` modulo the GPUs this host has."""
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: no CUDA device is available")
        if device == "cuda" and self.tensor_parallel_size > 1:
            device = f"cuda:{self.rank % torch.cuda.device_count()}"
        return torch.device(device)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of weights, activations and the KV cache."""
        if self.dtype is not None:
            return DTYPES[self.dtype]
        return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32

    @property
    def model_name(self) -> str:
        """The name clients use for this model."""
        return self.served_model_name or self.model_dir.name


def default_num_threads() -> int:
    """CPU threads for torch: every core this process may run on."""
    return max(1, len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else 1
