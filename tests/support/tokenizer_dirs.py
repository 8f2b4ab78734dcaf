"""Model directories with a chosen tokenizer config, and the chat requests the tokenizer renders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from interfaces import SamplingParams, TextGenerationRequest, TextGenerationRequestMessage


def make_model_dir(source: Path, target: Path, tokenizer_config: dict, **files: str) -> Path:
    """A model directory with ``source``'s tokenizer.json and the given configs."""
    target.mkdir()
    shutil.copy(source / "tokenizer.json", target / "tokenizer.json")
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (target / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    for name, text in files.items():
        (target / name.replace("__", ".")).write_text(text)
    return target


def chat_request(messages: list[dict], max_new_tokens: int | None = None) -> TextGenerationRequest:
    return TextGenerationRequest(
        request_id="r1",
        index=0,
        messages=[TextGenerationRequestMessage(**message) for message in messages],
        sampling_params=SamplingParams(max_new_tokens=max_new_tokens),
    )
