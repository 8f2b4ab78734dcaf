"""Every environment variable Switchyard reads, typed, in one place (all prefixed SWITCHYARD_,
but prometheus-client's PROMETHEUS_MULTIPROC_DIR)."""

from __future__ import annotations

import os
from pathlib import Path

API_KEY_VARIABLE = "SWITCHYARD_API_KEY"
CURVE_KEYS_DIR_VARIABLE = "SWITCHYARD_CURVE_KEYS_DIR"
PROMETHEUS_MULTIPROC_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
SHM_NAMESPACE_VARIABLE = "SWITCHYARD_SHM_NAMESPACE"
DEFAULT_SHM_NAMESPACE = "0" * 8


def cache_dir() -> Path:
    """Where converted models (GGUF dequantized to safetensors) are cached."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "switchyard"
    return Path(os.environ.get("SWITCHYARD_CACHE_DIR", default))


def log_level() -> str:
    """Log level for every process: DEBUG, INFO, WARNING or ERROR."""
    return os.environ.get("SWITCHYARD_LOG_LEVEL", "INFO").upper()


def log_format() -> str:
    """Log format for every process: "text" or "json" (``interfaces.logs``)."""
    return os.environ.get("SWITCHYARD_LOG_FORMAT", "text").lower()


def prometheus_multiproc_dir() -> str | None:
    """PROMETHEUS_MULTIPROC_DIR (prometheus-client's own variable, read by it at import): the
    directory API server processes share their metrics through; None when unset or empty."""
    return os.environ.get(PROMETHEUS_MULTIPROC_DIR_VARIABLE) or None


def api_key() -> str | None:
    """SWITCHYARD_API_KEY: the key API clients must send as ``Authorization: Bearer <key>``.

    None when unset or empty (no authentication). The launcher hands the key to API servers
    this way rather than on their command lines, where ``ps`` would show it.
    """
    return os.environ.get(API_KEY_VARIABLE) or None


def curve_keys_dir() -> Path | None:
    """SWITCHYARD_CURVE_KEYS_DIR: the CURVE key directory for the internal ZeroMQ sockets.

    None when unset or empty (no CURVE: plaintext, unauthenticated ZeroMQ traffic). The
    directory is made by ``generate_curve_keys`` in ``interfaces.transport``.
    """
    value = os.environ.get(CURVE_KEYS_DIR_VARIABLE)
    return Path(value).expanduser() if value else None


def shm_namespace() -> str:
    """SWITCHYARD_SHM_NAMESPACE: 8 hex digits in the name of every shared-memory segment this
    process creates (``interfaces.shared_memory``), so that one deployment's segments can be
    told from another's and swept after a crash. ``switchyard serve`` gives its processes one of
    their own; without it, ``DEFAULT_SHM_NAMESPACE``. ``ValueError`` for another form."""
    value = os.environ.get(SHM_NAMESPACE_VARIABLE) or DEFAULT_SHM_NAMESPACE
    if len(value) != 8 or any(c not in "0123456789abcdef" for c in value):
        raise ValueError(f"{SHM_NAMESPACE_VARIABLE} must be 8 lower-case hex digits, got {value!r}")
    return value


def shm_namespace_set() -> bool:
    """Whether SWITCHYARD_SHM_NAMESPACE is set (``switchyard serve`` then keeps it)."""
    return bool(os.environ.get(SHM_NAMESPACE_VARIABLE))
