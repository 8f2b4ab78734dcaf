"""Fixtures shared by the whole suite: an isolated cache, the default model, a tiny random Llama
and a tiny LLaVA. Each folder's conftest holds what only its tests use; tests/support/ holds the
fakes and process helpers several folders share."""

from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path

import pytest

TINY_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)

TINY_LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
"""The tiny random Llama's shape (also the tiny LLaVA's language model), less its vocabulary."""


@pytest.fixture(scope="session", autouse=True)
def collectable_at_exit():
    """Give the objects ``gc.freeze()`` moved out of the collector's reach back to it when the
    session ends, so the interpreter's exit collects them.

    The scheduler freezes its startup heap (``new_scheduler``), and tests run schedulers in this
    process beside torch. Frozen objects are never collected, not even at exit: triton's
    reference cycles (imported by torch._dynamo, which transformers' model classes import) then
    outlive the interpreter, and nanobind reports them ("nanobind: leaked 64 types!")."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session", autouse=True)
def isolated_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """Point SWITCHYARD_CACHE_DIR at a session temp dir; subprocesses inherit it."""
    cache_dir = tmp_path_factory.mktemp("switchyard-cache")
    previous = os.environ.get("SWITCHYARD_CACHE_DIR")
    os.environ["SWITCHYARD_CACHE_DIR"] = str(cache_dir)
    yield cache_dir
    if previous is None:
        os.environ.pop("SWITCHYARD_CACHE_DIR", None)
    else:
        os.environ["SWITCHYARD_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def default_model_dir(isolated_cache_dir: Path) -> Path:
    """The default model (SmolLM2-135M-Instruct GGUF) converted to a Hugging Face directory."""
    from worker.model_files import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A seeded random 2-layer Llama with the default model's tokenizer and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, **TINY_LLAMA)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(model_dir)
    for name in TINY_TOKENIZER_FILES:
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, model_dir / name)
    return model_dir


TINY_LORA_ADAPTERS = {
    "alpha": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "beta": {
        "r": 4,
        "lora_alpha": 8,
        "use_rslora": True,
        "target_modules": ["gate_proj", "up_proj", "down_proj", "q_proj"],
        "rank_pattern": {"layers.1.mlp.down_proj": 2},
        "alpha_pattern": {"gate_proj": 4},
    },
}
"""The tiny Llama's LoRA adapters' PEFT configs: attention only; the MLP and q, rank and alpha
patterns, rsLoRA."""


@pytest.fixture(scope="session")
def tiny_lora_adapters(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Seeded random PEFT LoRA adapters for the tiny Llama (``TINY_LORA_ADAPTERS``), by name:
    directories of adapter_config.json and adapter_model.safetensors. Their weights are random
    (not PEFT's no-op start), so each changes the model's greedy tokens."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    adapters = {}
    for seed, (name, options) in enumerate(TINY_LORA_ADAPTERS.items()):
        model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
        torch.manual_seed(seed)
        config = LoraConfig(init_lora_weights=False, **options)
        adapter_dir = tmp_path_factory.mktemp(f"tiny-lora-{name}")
        get_peft_model(model, config).save_pretrained(adapter_dir)
        adapters[name] = adapter_dir
    return adapters


LLAVA_IMAGE_TOKEN_ID = 49152
"""``<image>`` in the tiny LLaVA's tokenizer (the first id after the default model's vocabulary)."""
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A seeded random LLaVA: a 2-layer CLIP vision tower on 32x32 images in 8x8 patches (16
    image tokens after the CLS token is dropped), a GELU projector, and a 2-layer Llama with the
    default model's tokenizer plus ``<image>``, in transformers' own files: config.json,
    model.safetensors, processor_config.json and preprocessor_config.json, chat_template.jinja."""
    import json

    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    text_config = LlamaConfig(vocab_size=49216, **TINY_LLAMA)
    vision_config = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        projection_dim=32,
        initializer_range=0.1,
    )
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=LLAVA_IMAGE_TOKEN_ID,
        image_seq_length=16,
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    model_dir = tmp_path_factory.mktemp("tiny-llava")
    model.save_pretrained(model_dir)
    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    assert tokenizer.token_to_id("<image>") == LLAVA_IMAGE_TOKEN_ID
    tokenizer.save(str(model_dir / "tokenizer.json"))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, model_dir / name)
    (model_dir / "chat_template.jinja").write_text(LLAVA_CHAT_TEMPLATE)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )
    image_processor.save_pretrained(model_dir)  # preprocessor_config.json, as llava-hf ships
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    processor.save_pretrained(model_dir)
    assert json.loads((model_dir / "config.json").read_text())["image_seq_length"] == 16
    return model_dir
