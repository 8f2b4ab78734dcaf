"""The paged KV cache: fixed-size blocks of keys and values, one pair of tensors per layer.

The scheduler owns block ids (which block holds which tokens); the worker owns the memory. Token
``pos`` of a request lives in slot ``block_ids[pos // block_size] * block_size + pos % block_size``
of every layer's cache.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np
import torch

from interfaces.worker_to_scheduler import MAX_KV_BLOCKS
from worker.config import DEFAULT_CPU_KV_CACHE_MEMORY, DEFAULT_GPU_KV_CACHE_FRACTION

logger = logging.getLogger(__name__)

GIB = 1 << 30


class KVCache:
    """Key and value blocks for every layer, each (num_blocks, block_size, num_kv_heads, head_dim).

    Owned by the ModelRunner; attention layers write new keys/values by slot and read them back
    through block tables. Blocks start zeroed so padded reads never meet NaNs, and written
    while the worker starts: the pool's memory is taken then, and no step pays for first
    touching its pages later (``check_fits_in_memory`` says why a pool cannot be had).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.key_caches = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        self.value_caches = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)
        ]

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int) -> KVCache:
        """A pool of ``num_blocks`` blocks for a loaded model (``worker.models``): its layers,
        this rank's key-value heads and its head size, in its weights' dtype on their device."""
        config, weight = model.config, model.model.norm.weight
        return cls(
            config.num_hidden_layers,
            num_blocks,
            block_size,
            model.num_kv_heads,
            config.head_dim,
            weight.dtype,
            weight.device,
        )

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) of layer ``index``."""
        return self.key_caches[index], self.value_caches[index]


def check_fits_in_memory(num_bytes: int, device: torch.device) -> None:
    """``ValueError`` unless the system has ``num_bytes`` of memory available for a KV cache on
    the CPU: a pool that cannot be had fails the worker's start with the reason, where writing
    its zeros would meet the OOM killer (or, overcommitted, kill another process)."""
    if device.type != "cpu":
        return
    available = free_memory(device)
    if num_bytes > available:
        raise ValueError(
            f"the KV cache needs {_in_units(num_bytes)} and the system has "
            f"{_in_units(available)} of memory available; lower --kv-cache-memory"
        )


def _in_units(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / (1 << 20):.2f} MiB"


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Memory one block takes across all layers, keys and values together."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def num_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    """How many blocks fit in ``budget_bytes``, at most ``MAX_KV_BLOCKS`` (what the scheduler
    takes); ``ValueError`` if not even one does."""
    num_blocks = int(budget_bytes) // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {int(budget_bytes)} bytes holds no block of {block_bytes} bytes; "
            "raise --kv-cache-memory"
        )
    if num_blocks > MAX_KV_BLOCKS:
        logger.info("the KV cache budget holds %d blocks; using %d", num_blocks, MAX_KV_BLOCKS)
    return min(num_blocks, MAX_KV_BLOCKS)


def kv_cache_budget(kv_cache_memory: float | None, device: torch.device) -> int:
    """Bytes for the KV cache: ``kv_cache_memory`` bytes if > 1, else that fraction of free memory.

    None means 1 GiB on CPU and 0.8 of free memory on CUDA (measured after the model is loaded).
    """
    if kv_cache_memory is None:
        if device.type == "cpu":
            return DEFAULT_CPU_KV_CACHE_MEMORY
        kv_cache_memory = DEFAULT_GPU_KV_CACHE_FRACTION
    if kv_cache_memory > 1:
        return int(kv_cache_memory)
    return int(kv_cache_memory * free_memory(device))


def free_memory(device: torch.device) -> int:
    """Free bytes on ``device``: CUDA's free memory, or the system's available memory."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def slot_mapping(block_ids: Sequence[int], start: int, end: int, block_size: int) -> np.ndarray:
    """Cache slots of token positions [start, end) of a request holding ``block_ids``."""
    positions = np.arange(start, end, dtype=np.int64)
    blocks = np.asarray(block_ids, dtype=np.int64)[positions // block_size]
    return blocks * block_size + positions % block_size
