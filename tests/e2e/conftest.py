"""Fixtures the end-to-end tests share: one `switchyard serve` for the three hostile-input
modules (test_hostile_http.py, test_hostile_requests.py, test_hostile_sampling.py), which each
send bad input beside an innocent stream and leave the server idle, so that they need not start
one each (a start is the model's load in a new worker, seconds even on an idle machine)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.serve_process import (
    COMPILE_TIMEOUT_S,
    MASK_TIME_PER_TOKEN_S,
    MASK_TIMEOUT_S,
    MAX_STREAM_BACKLOG,
    SharedServe,
)


@pytest.fixture(scope="session")
def hostile_serve(default_model_dir) -> Iterator[SharedServe]:
    """The hostile-input modules' server: the default model with their limits set."""
    shared = SharedServe(
        *("--max-stream-backlog", str(MAX_STREAM_BACKLOG)),
        *("--grammar-compile-timeout", str(COMPILE_TIMEOUT_S)),
        *("--grammar-mask-timeout", str(MASK_TIMEOUT_S)),
        *("--grammar-mask-time-per-token", str(MASK_TIME_PER_TOKEN_S)),
    )
    yield shared
    shared.stop()
