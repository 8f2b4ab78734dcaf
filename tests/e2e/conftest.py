"""Fixtures the end-to-end tests share: one `switchyard serve` for the three hostile-input
modules (test_hostile_http.py, test_hostile_requests.py, test_hostile_sampling.py), which each
send bad input beside an innocent stream and leave the server idle, so that they need not start
one each (a start is the model's load in a new worker, seconds even on an idle machine)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.serve_process import ServeProcess

MAX_STREAM_BACKLOG = 16
"""``--max-stream-backlog``: a client that never reads is found within a few steps."""
COMPILE_TIMEOUT_S = 10
"""``--grammar-compile-timeout``: a slow grammar fails within seconds (test_hostile_sampling)."""


class SharedServe:
    """A `switchyard serve` that several modules use in turn: started by the first to ask; a
    module that leaves it busy (a grammar still compiling) stops it, and the next module to
    ask gets a fresh one."""

    def __init__(self, *flags: str) -> None:
        self.flags = flags
        self._serve: ServeProcess | None = None

    def get(self) -> ServeProcess:
        if self._serve is None or self._serve.process.poll() is not None:
            self._serve = ServeProcess(*self.flags)
        return self._serve

    def stop(self) -> None:
        if self._serve is not None:
            self._serve.kill()
            self._serve = None


@pytest.fixture(scope="session")
def hostile_serve(default_model_dir) -> Iterator[SharedServe]:
    """The hostile-input modules' server: the default model with their two limits set."""
    shared = SharedServe(
        *("--max-stream-backlog", str(MAX_STREAM_BACKLOG)),
        *("--grammar-compile-timeout", str(COMPILE_TIMEOUT_S)),
    )
    yield shared
    shared.stop()
