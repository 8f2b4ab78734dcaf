"""Switchyard's front door: the ``switchyard`` CLI, the launcher that runs every role, and the
offline Python API (``from switchyard import pipeline, GenerationConfig``).

This package imports the role packages (api_server, scheduler, worker); they never import it.
The offline API loads on first use, so the CLI starts without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from switchyard.offline import (
        ChatTemplateConfig,
        EngineConfig,
        GenerationConfig,
        Pipeline,
        Response,
        Session,
        pipeline,
    )

__all__ = [
    "ChatTemplateConfig",
    "EngineConfig",
    "GenerationConfig",
    "Pipeline",
    "Response",
    "Session",
    "pipeline",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import importlib

        return getattr(importlib.import_module("switchyard.offline"), name)
    raise AttributeError(f"module 'switchyard' has no attribute {name!r}")
