"""The suite itself: a session whose tests froze the heap exits without nanobind's leak report.

It tests tests/conftest.py, which belongs to no package, so it sits beside it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

FREEZE_BESIDE_TRITON = """
import gc

import torch._dynamo  # imports triton, as transformers' model classes do


def test_freeze_the_heap_as_the_scheduler_does():
    gc.freeze()
"""
"""A test that freezes the heap (``scheduler.placement.new_scheduler`` does) in a process that
imported triton."""


def test_a_session_that_froze_the_heap_beside_triton_exits_without_leak_reports(tmp_path):
    """The "nanobind: leaked ..." lines that ended every suite run were triton's objects (a
    nanobind extension torch imports), frozen by the scheduler's ``gc.freeze()`` in the test
    process and so never collected, not even at exit; tests/conftest.py gives them back to the
    collector when the session ends (loaded here as a plugin)."""
    test_file = tmp_path / "test_freeze.py"
    test_file.write_text(FREEZE_BESIDE_TRITON)
    plugins = ["-p", "no:cacheprovider", "-p", "tests.conftest"]
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *plugins, str(test_file)],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stdout + child.stderr
    assert "1 passed" in child.stdout
    assert "leaked" not in child.stdout + child.stderr
