"""Every environment variable Switchyard reads, typed, in one place (all prefixed SWITCHYARD_)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models (GGUF dequantized to safetensors) are cached."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "switchyard"
    return Path(os.environ.get("SWITCHYARD_CACHE_DIR", default))


def log_level() -> str:
    """Log level for every process: DEBUG, INFO, WARNING or ERROR."""
    return os.environ.get("SWITCHYARD_LOG_LEVEL", "INFO").upper()
