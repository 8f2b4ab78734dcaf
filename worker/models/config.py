"""ModelConfig: the parts of a Hugging Face config.json the Llama-family model needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


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

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        """Read ``model_dir/config.json``; ``ValueError`` for unsupported architectures."""
        return cls.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
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
