"""CURVE key directories as each role is given them."""

from __future__ import annotations

import shutil
from pathlib import Path

from interfaces.curve_keys import FILES_BY_PROCESS


def role_keys(keys_dir: Path, tmp_path: Path, process: str) -> Path:
    """A directory with only the files ``FILES_BY_PROCESS[process]`` (one host's share)."""
    directory = tmp_path / process.replace(" ", "-")
    directory.mkdir(mode=0o700)
    for name in FILES_BY_PROCESS[process]:
        shutil.copy(keys_dir / name, directory)
    return directory
