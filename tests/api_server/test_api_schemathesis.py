"""Property-based requests from the app's own /openapi.json (schemathesis): whatever a client
sends, the API server answers below 500, never with FastAPI's 422, and every error in OpenAI's
shape. Bounded and deterministic: 25 valid and 25 invalid examples per operation, derandomized,
no example database; the ``fuzz``-marked test runs FUZZ_EXAMPLES of each instead
(``-m "not fuzz"`` skips it).
/metrics is left out (it only reads the scheduler's stats and takes no input)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.support.fake_scheduler import ApiHarness

ERROR_KEYS = ["message", "type", "param", "code"]
OPERATIONS = [
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /v1/embeddings",
    "POST /v1/responses",
    "GET /v1/responses/{response_id}",
    "DELETE /v1/responses/{response_id}",
    "POST /v1/load_lora_adapter",
    "POST /v1/unload_lora_adapter",
    "GET /v1/models",
    "GET /health",
    "GET /ready",
    "POST /tokenize",
    "POST /detokenize",
    "GET /version",
]
# GETs and DELETEs take no body (at most an id in the path), so only valid examples of them.
CASES = [
    (label, mode)
    for label in OPERATIONS
    for mode in GenerationMode
    if label.startswith("POST") or mode is GenerationMode.POSITIVE
]
FUZZ_EXAMPLES = 60


@pytest.fixture(scope="module")
def api(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    # Thousands of choices of one request can keep the fake scheduler busy past the usual
    # 1 s heartbeat timeout on a loaded machine; that would be a 503, not a bug.
    work_dir = tmp_path_factory.mktemp("api-schemathesis")
    harness = ApiHarness(default_model_dir, work_dir, scheduler_timeout_s=30.0)
    harness.scheduler.reply = [19556]  # one token, then EOS: every generation is quick
    harness.scheduler.eos_token_id = 2
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def openapi_schema(api: ApiHarness):
    return schemathesis.openapi.from_url(f"{api.url}/openapi.json").exclude(path="/metrics")


def test_every_operation_is_covered(openapi_schema) -> None:
    labels = [result.ok().label for result in openapi_schema.get_all_operations()]
    assert sorted(labels) == sorted(OPERATIONS)


# Driven by hand rather than through schemathesis' pytest plugin, whose lazy fixture loader
# does not work with pytest 9.
@pytest.mark.parametrize(("label", "mode"), CASES, ids=str)
def test_no_server_errors(openapi_schema, label: str, mode: GenerationMode) -> None:
    check_operation(openapi_schema, label, mode, max_examples=25)


@pytest.mark.fuzz
@pytest.mark.parametrize(("label", "mode"), CASES, ids=str)
def test_no_server_errors_with_a_larger_budget(
    openapi_schema, label: str, mode: GenerationMode
) -> None:
    check_operation(openapi_schema, label, mode, max_examples=FUZZ_EXAMPLES)


def check_operation(openapi_schema, label: str, mode: GenerationMode, max_examples: int) -> None:
    """Send ``max_examples`` examples of ``label`` in ``mode``: each is answered below 500,
    never with 422, and every error is in OpenAI's shape."""
    operation = openapi_schema.find_operation_by_label(label)

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    def check(case) -> None:
        response = case.call(timeout=30)
        where = f"{label} {case.body!r:.300} -> {response.status_code}"
        assert response.status_code < 500, f"{where}: {response.text[:500]}"
        assert response.status_code != 422, where
        if response.status_code >= 400:
            body = json.loads(response.text)
            assert list(body) == ["error"], where
            assert list(body["error"]) == ERROR_KEYS, where

    check()
