"""The benchmark scripts (benchmarks/, not a package) imported for their tests as they import
each other when run: by name, with benchmarks/ on ``sys.path`` while they load."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def import_scripts(*names: str) -> tuple[ModuleType, ...]:
    """The scripts ``names`` (e.g. "gemv_bench"), imported; their neighbours too, as they ask."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return tuple(importlib.import_module(name) for name in names)
    finally:
        sys.path.remove(str(BENCHMARKS))
