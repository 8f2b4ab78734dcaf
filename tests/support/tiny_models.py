"""Seeded random tiny models of the architecture variants the Llama model file serves, saved
in Hugging Face format, for parity tests against transformers (and PEFT)."""

from __future__ import annotations

from pathlib import Path

import torch

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
VARIANTS = {
    "llama3-rope-bias-tied": (
        "LlamaConfig",
        {"rope_parameters": LLAMA3_ROPE, "attention_bias": True, "tie_word_embeddings": True},
    ),
    "qwen2": ("Qwen2Config", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "mistral-head-dim": ("MistralConfig", {"head_dim": 32, "sliding_window": None}),
}


def random_variant(variant: str, model_dir: Path) -> torch.nn.Module:
    """Save a seeded random tiny model of ``variant`` to ``model_dir`` and return it."""
    import transformers

    config_name, overrides = VARIANTS[variant]
    config = getattr(transformers, config_name)(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        **overrides,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:  # biases start at 0 and norms at 1: make them matter
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(model_dir)
    model.generation_config.eos_token_id = None
    return model
