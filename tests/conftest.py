"""Fixtures shared by the whole suite: an isolated cache, the default model, a tiny random Llama."""

from __future__ import annotations

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

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(model_dir)
    for name in TINY_TOKENIZER_FILES:
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, model_dir / name)
    return model_dir


@pytest.fixture(scope="module")
def api(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A real API server (uvicorn on 127.0.0.1) against a fake scheduler; one per test module.

    A module that needs another set-up (an API key, a preset reply) defines its own ``api``.
    """
    from tests.fake_scheduler import ApiHarness

    harness = ApiHarness(default_model_dir, tmp_path_factory.mktemp("api"))
    yield harness
    harness.close()


@pytest.fixture
def client(api):
    """An httpx client for ``api`` with a bounded timeout."""
    import httpx

    with httpx.Client(base_url=api.url, timeout=httpx.Timeout(10.0)) as http:
        yield http
