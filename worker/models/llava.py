"""LLaVA (Liu et al., "Visual Instruction Tuning", 2023, and llava-1.5, "Improved Baselines with
Visual Instruction Tuning"): a vision tower turns an image into one feature per patch, a
two-layer MLP projects those into the language model's embedding space, and they take the place
of the prompt's image tokens.

The vision tower is transformers' own ``CLIPVisionModel`` or ``SiglipVisionModel``, built from
the checkpoint's ``vision_config``; it and the projector are small next to the language model and
are replicated on every tensor-parallel rank. The language model is Switchyard's Llama
(``worker.models.llama``: paged KV cache, tensor-parallel layers), fed input embeddings.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModel
from transformers.activations import ACT2FN

from worker.attention import AttentionKind, AttentionMetadata
from worker.kv_cache import KVCache
from worker.models.config import ModelConfig, VisionConfig
from worker.models.llama import LlamaForCausalLM, checkpoint_loaders, load_checkpoint

CHECKPOINT_RENAMES = (
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("vision_tower.vision_model.", "vision_tower."),
)
"""Checkpoint name prefixes and what they become here, applied in order. This module's names
are transformers 5's saved layout (``language_model.model.*``, ``language_model.lm_head.*``,
``vision_tower.*``, ``multi_modal_projector.*``); the Hub's newer layout (``model.*`` and
``lm_head.*``) and llava-hf's older one (``vision_tower.vision_model.*``) map onto it."""


class MultiModalProjector(nn.Module):
    """linear_2(act(linear_1(features))): vision features into the language model's space."""

    def __init__(self, vision: VisionConfig, text_hidden_size: int) -> None:
        super().__init__()
        num_layers = 1 if isinstance(vision.feature_layers, int) else len(vision.feature_layers)
        in_features = vision.tower["hidden_size"] * num_layers
        self.linear_1 = nn.Linear(in_features, text_hidden_size, bias=vision.projector_bias)
        self.act = ACT2FN[vision.projector_hidden_act]
        self.linear_2 = nn.Linear(text_hidden_size, text_hidden_size, bias=vision.projector_bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(nn.Module):
    """A vision tower and projector beside a Llama-family language model. Build it with
    ``load_llava``; ``config`` is the language model's, with the vision side in
    ``config.vision``."""

    def __init__(
        self, config: ModelConfig, vision_tower: nn.Module, language_model: LlamaForCausalLM
    ) -> None:
        super().__init__()
        self.config = config
        self.vision = config.vision
        self.vision_tower = vision_tower
        self.multi_modal_projector = MultiModalProjector(config.vision, config.hidden_size)
        self.language_model = language_model

    @property
    def num_kv_heads(self) -> int:
        """Key-value heads per layer in this worker's KV cache."""
        return self.language_model.num_kv_heads

    @property
    def num_heads(self) -> int:
        """Query heads per layer on this worker."""
        return self.language_model.num_heads

    @property
    def attention_kind(self) -> AttentionKind:
        """How attention reads the paged cache (``worker.attention``)."""
        return self.language_model.attention_kind

    @property
    def text_model(self) -> LlamaForCausalLM:
        """The language model: ``forward`` is its forward pass, so a step may run its
        ``hidden_states``, ``logits`` and ``greedy_tokens`` instead."""
        return self.language_model

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` (num_images, channels, height, width), any dtype and device →
        projected features (num_images, num_image_tokens, hidden_size), one per image token.

        The tower's hidden states at ``feature_layers`` (concatenated when there are several),
        without the class position under the "default" strategy.
        """
        weight = self.multi_modal_projector.linear_1.weight
        pixel_values = pixel_values.to(weight.device, weight.dtype)
        hidden_states = self.vision_tower(pixel_values, output_hidden_states=True).hidden_states
        layers = self.vision.feature_layers
        layers = [layers] if isinstance(layers, int) else layers
        selected = [hidden_states[layer] for layer in layers]
        # each (num_images, num_positions, vision_hidden_size)
        if self.vision.feature_select_strategy == "default":
            selected = [states[:, 1:] for states in selected]  # drop the class position
        return self.multi_modal_projector(torch.cat(selected, dim=-1))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings of ``input_ids`` (num_tokens,): (num_tokens, hidden_size)."""
        return self.language_model.embed(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
        input_embeddings: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The language model's forward pass (``LlamaForCausalLM.forward``); a step that
        computes image positions passes ``input_embeddings`` with their features spliced in
        (``worker.images``)."""
        return self.language_model(
            input_ids, positions, kv_cache, metadata, logits_indices, input_embeddings
        )


def load_llava(
    config: ModelConfig, model_dir: Path, device: torch.device, dtype: torch.dtype
) -> LlavaForConditionalGeneration:
    """Build the model ``config`` describes and load ``model_dir``'s safetensors weights, in any
    of the layouts ``CHECKPOINT_RENAMES`` accepts. ``ValueError`` for missing weights."""
    if config.vision is None:
        raise ValueError(f"{model_dir} holds no vision-language model")
    language_model = LlamaForCausalLM.empty(config, device, dtype)
    vision_tower = AutoModel.from_config(vision_tower_config(config.vision))
    model = LlavaForConditionalGeneration(config, vision_tower, language_model)
    model.vision_tower.to(device, dtype)
    model.multi_modal_projector.to(device, dtype)
    loaders = {
        f"language_model.{name}": load for name, load in language_model.checkpoint_loaders().items()
    }
    for prefix in ("vision_tower", "multi_modal_projector"):
        replicated = checkpoint_loaders(model.get_submodule(prefix))
        loaders.update({f"{prefix}.{name}": load for name, load in replicated.items()})
    load_checkpoint(Path(model_dir), loaders, checkpoint_name)
    language_model.finish_loading()
    return model.eval()


def vision_tower_config(vision: VisionConfig) -> AutoConfig:
    """transformers' config for the vision tower. SigLIP's pooling head is left out: LLaVA reads
    hidden states, never the pooled output."""
    settings = dict(vision.tower)
    model_type = settings.pop("model_type")
    if model_type == "siglip_vision_model":
        settings["vision_use_head"] = False
    return AutoConfig.for_model(model_type, **settings)


def checkpoint_name(name: str) -> str:
    """``name`` from any accepted checkpoint layout, as this module names it."""
    for old, new in CHECKPOINT_RENAMES:
        if name.startswith(old):
            name = new + name[len(old) :]
    return name
