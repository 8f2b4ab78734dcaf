"""ModelConfig: the parts of a Hugging Face config.json the Llama-family model needs, and for a
LLaVA-style vision-language model (``model_type: "llava"``) the parts its vision side needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from interfaces.vision import FEATURE_SELECT_STRATEGIES, num_image_tokens

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
SUPPORTED_VISION_TOWERS = ("clip_vision_model", "siglip_vision_model")
"""Vision towers that put a class token before the patches."""


@dataclass(frozen=True)
class VisionConfig:
    """A LLaVA model's vision side: the vision tower's transformers config (``tower``, a dict
    with its ``model_type``), the projector, and how image features enter the prompt.

    ``feature_layers`` is config.json's ``vision_feature_layer``: one hidden-state index of the
    vision tower, or a list of them whose states are concatenated. ``feature_select_strategy``
    "default" drops the class token, "full" keeps it. Each image fills ``num_image_tokens``
    consecutive ``image_token_id`` positions of the prompt.
    """

    tower: dict[str, Any]
    image_token_id: int
    projector_hidden_act: str
    projector_bias: bool
    feature_layers: int | tuple[int, ...]
    feature_select_strategy: str

    @property
    def tower_type(self) -> str:
        return self.tower["model_type"]

    @property
    def image_size(self) -> int:
        return self.tower["image_size"]

    @property
    def num_channels(self) -> int:
        return self.tower.get("num_channels", 3)

    @property
    def num_image_tokens(self) -> int:
        """Tokens per image: the tower's positions (patches, and a class token for CLIP), less
        the class position under "default"; what transformers' LlavaProcessor inserts."""
        return num_image_tokens(
            self.tower_type,
            self.image_size,
            self.tower["patch_size"],
            self.feature_select_strategy,
        )


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, read from config.json without importing transformers.

    ``rope_scaling`` holds the rope parameters of a non-default rope type (e.g. llama3's
    ``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).
    ``sliding_window`` None means full attention in every layer.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str = "default"
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    vision: VisionConfig | None = None

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        """Read ``model_dir/config.json``; ``ValueError`` for unsupported architectures."""
        return cls.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type == "llava":
            return _llava_config(raw)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        num_heads = raw["num_attention_heads"]
        rope = _rope_parameters(raw)
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.pop("rope_theta")),
            rope_type=rope.pop("rope_type"),
            rope_scaling=rope,
            qkv_bias=attention_bias or model_type == "qwen2",
            o_proj_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=_sliding_window(raw),
        )


def _llava_config(raw: dict[str, Any]) -> ModelConfig:
    """The language model's config with the vision side in ``vision``.

    LLaVA config.json files often list only what differs from transformers' defaults (the Hub's
    llava-hf text configs name little more than the vocabulary), so transformers' own
    ``LlavaConfig`` fills them in: the defaults are exactly those the checkpoint was saved with.
    """
    from transformers import LlavaConfig

    llava = LlavaConfig.from_dict(raw)
    tower = llava.vision_config.to_dict()
    if tower["model_type"] not in SUPPORTED_VISION_TOWERS:
        raise ValueError(
            f"vision tower {tower['model_type']!r} is not supported; "
            f"supported: {SUPPORTED_VISION_TOWERS}"
        )
    strategy = llava.vision_feature_select_strategy
    if strategy not in FEATURE_SELECT_STRATEGIES:
        raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported")
    layers = llava.vision_feature_layer
    text = ModelConfig.from_dict(llava.text_config.to_dict())
    return replace(
        text,
        tie_word_embeddings=bool(llava.tie_word_embeddings or text.tie_word_embeddings),
        vision=VisionConfig(
            tower=tower,
            image_token_id=llava.image_token_index,
            projector_hidden_act=llava.projector_hidden_act,
            projector_bias=bool(getattr(llava, "multimodal_projector_bias", True)),
            feature_layers=layers if isinstance(layers, int) else tuple(layers),
            feature_select_strategy=strategy,
        ),
    )


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """Merge transformers 5's ``rope_parameters`` and older ``rope_theta``/``rope_scaling``."""
    rope = dict(raw.get("rope_parameters") or {})
    rope.update(raw.get("rope_scaling") or {})
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope['rope_type']!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    return rope


def _sliding_window(raw: dict[str, Any]) -> int | None:
    """The attention window, when the model uses one (Mistral v0.1; Qwen2 only when enabled)."""
    if raw.get("model_type") == "qwen2" and not raw.get("use_sliding_window", False):
        return None
    return raw.get("sliding_window")
