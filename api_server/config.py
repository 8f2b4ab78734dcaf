"""Configuration of one API server process, and the model facts it reads from the model directory.

The model directory is Hugging Face format: config.json (``max_position_embeddings``), optional
generation_config.json (``eos_token_id``), tokenizer.json and tokenizer_config.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


@dataclass(frozen=True)
class EngineClientConfig:
    """How the API server talks to the scheduler.

    ``submit_timeout_s`` bounds how long a new request waits for the scheduler's socket to accept
    it; ``stats_timeout_s`` bounds a StatsRequest round trip (health checks, metrics);
    a request in flight fails once the scheduler has said nothing for ``scheduler_timeout_s``
    (it is pinged every ``heartbeat_interval_s`` while requests are in flight).
    """

    scheduler_addr: str
    submit_timeout_s: float = 5.0
    stats_timeout_s: float = 1.0
    scheduler_timeout_s: float = 30.0
    heartbeat_interval_s: float = 1.0


@dataclass(frozen=True)
class ApiServerConfig:
    """Everything one API server process needs besides its listening socket."""

    model_dir: Path
    served_model_name: str
    max_model_len: int
    """Prompt plus output tokens at most (see ``resolve_max_model_len``)."""
    engine: EngineClientConfig
    api_key: str | None = field(default=None, repr=False)
    """Clients must send ``Authorization: Bearer <api_key>``; None: no authentication."""
    allowed_origins: tuple[str, ...] = ()
    """Origins allowed by CORS ("*" for any); empty: CORS off."""


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or an empty dict when the file does not exist."""
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as file:
        data = json.load(file)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def model_context_length(model_dir: Path) -> int | None:
    """The model's context length from config.json, or None when it names none."""
    config = read_json(model_dir / "config.json")
    for key in _CONTEXT_LENGTH_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def resolve_max_model_len(model_dir: Path, requested: int | None) -> int:
    """The context length to enforce: ``requested`` if given, else the model's own.

    Raises ``ValueError`` when ``requested`` is below 2 or above the model's context length, or
    when neither is known.
    """
    model_len = model_context_length(model_dir)
    if requested is None:
        if model_len is None:
            raise ValueError(
                f"{model_dir / 'config.json'} names no context length; pass --max-model-len"
            )
        return model_len
    if requested < 2:
        raise ValueError(f"--max-model-len must be at least 2, got {requested}")
    if model_len is not None and requested > model_len:
        raise ValueError(
            f"--max-model-len {requested} exceeds the model's context length {model_len}"
        )
    return requested


def generation_eos_token_ids(model_dir: Path) -> list[int]:
    """``eos_token_id`` from generation_config.json (an int or a list), else from config.json."""
    for name in ("generation_config.json", "config.json"):
        value = read_json(model_dir / name).get("eos_token_id")
        if isinstance(value, int):
            return [value]
        if isinstance(value, list):
            return [token for token in value if isinstance(token, int)]
    return []
