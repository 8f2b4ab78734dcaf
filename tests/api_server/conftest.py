"""Fixtures of the API server tests: a real API server against a fake scheduler."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def api(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A real API server (uvicorn on 127.0.0.1) against a fake scheduler; one per test module.

    A module that needs another set-up (an API key, a preset reply) defines its own ``api``.
    """
    from tests.support.fake_scheduler import ApiHarness

    harness = ApiHarness(default_model_dir, tmp_path_factory.mktemp("api"))
    yield harness
    harness.close()


@pytest.fixture
def client(api):
    """An httpx client for ``api`` with a bounded timeout."""
    import httpx

    with httpx.Client(base_url=api.url, timeout=httpx.Timeout(10.0)) as http:
        yield http
