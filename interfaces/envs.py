"""Every environment variable Switchyard reads, typed, in one place (all prefixed SWITCHYARD_)."""

from __future__ import annotations

import os
from pathlib import Path

API_KEY_VARIABLE = "SWITCHYARD_API_KEY"


def cache_dir() -> Path:
    """Where converted models (GGUF dequantized to safetensors) are cached."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "switchyard"
    return Path(os.environ.get("SWITCHYARD_CACHE_DIR", default))


def log_level() -> str:
    """Log level for every process: DEBUG, INFO, WARNING or ERROR."""
    return os.environ.get("SWITCHYARD_LOG_LEVEL", "INFO").upper()


def api_key() -> str | None:
    """SWITCHYARD_API_KEY: the key API clients must send as ``Authorization: Bearer <key>``.

    None when unset or empty (no authentication). The launcher hands the key to API servers
    this way rather than on their command lines, where ``ps`` would show it.
    """
    return os.environ.get(API_KEY_VARIABLE) or None
