"""``WorkerSettings``: the flags of ``python -m worker``, declared on its fields
(``interfaces.settings``). No torch here: ``switchyard serve`` takes some of these flags and
starts each worker with ``to_argv`` of its settings. ``worker.__main__`` turns them into a
``WorkerConfig``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from interfaces.settings import component, setting
from interfaces.shared_settings import (
    LogitsProcessorSettings,
    LoRASettings,
    ModelSettings,
    SchedulerAddress,
)
from interfaces.worker_to_scheduler import WorkerRole
from worker.grammar_limits import GrammarLimits

DTYPE_NAMES = ("bfloat16", "float16", "float32")
"""The dtypes of weights, activations and the KV cache (``worker.config.DTYPES``)."""
ATTENTION_BACKENDS = ("auto", "gathered")
FLOAT32_MATMUL_PRECISIONS = ("highest", "high")
"""torch.set_float32_matmul_precision's settings the worker offers ("medium", plain bfloat16
products, it does not)."""
"""How attention reads the paged KV cache (``worker.attention.choose_attention_kind``)."""
TENSOR_PARALLELISM = "tensor parallelism"
DISAGGREGATION = "disaggregation"


def parse_memory(text: str) -> float:
    """Parse ``--kv-cache-memory``: "0.5" (fraction), "2147483648", "512MiB", "2GiB" or "2GB"."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    lowered = text.strip().lower()
    for suffix, scale in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * scale)
    try:
        value = float(lowered)
    except ValueError:
        raise ValueError(f"cannot parse memory size {text!r}") from None
    return int(value) if value > 1 else value


def device_name(text: str) -> str:
    """Parse ``--device``: auto, cpu, cuda or cuda:N."""
    index = text.removeprefix("cuda:")
    if text in ("auto", "cpu", "cuda") or (index != text and index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {text!r}")


@dataclass(frozen=True)
class WorkerSettings:
    """``python -m worker``'s settings but the transport's and the log's."""

    model: ModelSettings = component(ModelSettings)
    scheduler: SchedulerAddress = component(SchedulerAddress)
    device: str = setting(
        "auto",
        "--device",
        "auto (CUDA when available, else CPU), cpu, cuda or cuda:N",
        parse=device_name,
    )
    kv_cache_memory: float | None = setting(
        None,
        "--kv-cache-memory",
        "KV cache size: bytes with an optional unit (4294967296, 512MiB, 2GiB) or a fraction of "
        "free memory (0.8)",
        parse=parse_memory,
        default_text="1 GiB on CPU, 0.8 of free memory on CUDA",
    )
    dtype: str | None = setting(
        None,
        "--dtype",
        "of weights, activations and the KV cache",
        choices=DTYPE_NAMES,
        default_text="float32 on CPU, bfloat16 on CUDA",
    )
    block_size: int = setting(16, "--block-size", "tokens per KV cache block")
    attention_backend: str = setting(
        "auto",
        "--attention-backend",
        "how attention reads the KV cache: auto (in place: Switchyard's kernel on the CPU in "
        "float32, FlexAttention on CUDA; gathered elsewhere) or gathered (each request's "
        "blocks copied into a padded batch for scaled_dot_product_attention)",
        choices=ATTENTION_BACKENDS,
    )
    float32_matmul_precision: str = setting(
        "highest",
        "--float32-matmul-precision",
        "torch.set_float32_matmul_precision for float32 models: highest, or high, where products "
        "may round through bfloat16 halves or TF32 (on the CPU, with AMX: decoder layers' products "
        "as three bfloat16 products, relative error ~5e-6 instead of ~1e-6, up to ~1.5 times as "
        "fast for prefills and large batches)",
        choices=FLOAT32_MATMUL_PRECISIONS,
    )
    max_cudagraph_capture_size: int = setting(
        128,
        "--max-cudagraph-capture-size",
        "on CUDA, the largest decode batch replayed as a CUDA graph (graphs are captured for "
        "2, 4, 8, 16, ... up to it); 0 runs every step eagerly, as vLLM's --enforce-eager does",
    )
    seed: int | None = setting(
        None, "--seed", "seed for unseeded requests", default_text="fresh randomness"
    )
    num_threads: int | None = setting(
        None, "--num-threads", "CPU threads", default_text="every core"
    )
    tensor_parallel_size: int = setting(
        1,
        "--tensor-parallel-size",
        "ranks in the group: worker processes that split the model (one per GPU on CUDA)",
        group=TENSOR_PARALLELISM,
    )
    rank: int = setting(0, "--rank", "this worker's rank in the group", group=TENSOR_PARALLELISM)
    master_addr: str = setting(
        "127.0.0.1",
        "--master-addr",
        "the host of rank 0, where the ranks meet",
        group=TENSOR_PARALLELISM,
    )
    master_port: int = setting(
        29500, "--master-port", "rank 0's rendezvous port", group=TENSOR_PARALLELISM
    )
    role: WorkerRole = setting(
        WorkerRole.HYBRID,
        "--role",
        "hybrid runs whole requests; prefill and decode groups split them; embedding serves an "
        "encoder model's vectors",
        default_text="hybrid",
        group=DISAGGREGATION,
    )
    group: str | None = setting(
        None,
        "--group",
        "the worker group's name, alike on its ranks and unique among groups",
        default_text="the role and, with tensor parallelism, the rendezvous address (the host "
        "name for a loopback one); else host and pid",
        group=DISAGGREGATION,
    )
    kv_transfer_addr: str = setting(
        "tcp://127.0.0.1:*",
        "--kv-transfer-addr",
        "a decode rank receives KV blocks here; prefill ranks connect to it, so on several hosts "
        "give an address they reach (tcp://HOST:PORT, or :* for a free port)",
        group=DISAGGREGATION,
    )
    liveness_file: str | None = setting(
        None,
        "--liveness-file",
        "touch this file between steps (at most once a second), for a liveness probe that a "
        "hung worker fails: python -m worker.liveness FILE",
        default_text="none",
        metavar="FILE",
    )
    grammar_limits: GrammarLimits = component(GrammarLimits, group="structured output")
    logits_processors: LogitsProcessorSettings = component(
        LogitsProcessorSettings, group="logits processors"
    )
    lora: LoRASettings = component(LoRASettings, group="LoRA adapters")
