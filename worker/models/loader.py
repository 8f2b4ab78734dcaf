"""Which model a directory holds, by its config.json: a Llama-family LM, or a LLaVA-style
vision-language model around one."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from worker.models.config import ModelConfig
from worker.models.llama import LlamaForCausalLM, load_llama

if TYPE_CHECKING:  # importing llava imports transformers' vision models: 2 s a worker start
    from worker.models.llava import LlavaForConditionalGeneration

    Model = LlamaForCausalLM | LlavaForConditionalGeneration
    """What the model runner drives: ``forward(input_ids, positions, kv_cache, metadata,
    logits_indices, input_embeddings=None)``, ``embed``, ``config`` and ``num_kv_heads``; a
    model that reads images has ``config.vision`` and ``image_features``."""


def load_model(model_dir: Path, device: torch.device, dtype: torch.dtype) -> Model:
    """Build the model described by ``model_dir/config.json`` and load its safetensors weights.

    Raises ``ValueError`` for an unsupported architecture, missing files, or missing weights.
    """
    config = ModelConfig.from_dir(model_dir)
    if config.vision is None:
        return load_llama(config, Path(model_dir), device, dtype)
    from worker.models.llava import load_llava

    return load_llava(config, Path(model_dir), device, dtype)
