"""Hostile HTTP requests (issue 20, items 1, 3, 4, 5 and 6) against one real `switchyard serve`.

They are sent while an innocent greedy stream runs: the innocent stream must end with the same
tokens as alone, each hostile request must get a 400 whose message names the limit it broke,
and the server must stay healthy. The server runs with ``--max-stream-backlog 16`` so that a
client that never reads is found within a few steps. Images shared between choices are covered
by test_api_images.py (a vision model) and test_scheduler_images.py.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.support.clients import SlowReader, health_status, in_background, wait_until
from tests.support.serve_process import (
    DEFAULT_MODEL_NAME,
    MAX_STREAM_BACKLOG,
    ServeProcess,
    chat_messages,
    gauges_settle,
    long_chat,
)

pytestmark = pytest.mark.slow

INNOCENT = {
    "model": DEFAULT_MODEL_NAME,
    "messages": chat_messages("Name three colours of the rainbow."),
    "max_tokens": 16,
    "ignore_eos": True,
    "temperature": 0,
    "logprobs": True,
    "stream": True,
}
SCHEMA_LIMIT = "the limit is 131072 bytes (--max-structured-output-bytes)"


@pytest.fixture(scope="module")
def serve(hostile_serve) -> ServeProcess:
    """The server the hostile-input modules share, with ``--max-stream-backlog 16``
    (tests/e2e/conftest.py)."""
    return hostile_serve.get()


@pytest.fixture(scope="module")
def alone(serve: ServeProcess) -> list[str]:
    """The innocent stream's tokens when it runs alone."""
    outcome, thread = in_background(serve.base_url, INNOCENT)
    thread.join(120)
    assert outcome.status == 200 and outcome.finish_reasons == ["length"]
    return streamed_tokens(outcome.events)


@pytest.fixture(scope="module")
def max_model_len(serve: ServeProcess) -> int:
    return httpx.get(f"{serve.base_url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]


def streamed_tokens(events: list[dict]) -> list[str]:
    return [
        entry["token"]
        for event in events
        for choice in event.get("choices", [])
        if choice.get("logprobs")
        for entry in choice["logprobs"]["content"]
    ]


class InnocentStream:
    """The innocent stream, started on entry (once its first token arrived) and checked on
    exit: the same tokens as alone, and a healthy server."""

    def __init__(self, serve: ServeProcess, alone: list[str]) -> None:
        self.serve, self.alone = serve, alone

    def __enter__(self) -> InnocentStream:
        self.outcome, self.thread = in_background(self.serve.base_url, INNOCENT)
        assert self.outcome.first_event.wait(120)
        return self

    def __exit__(self, *exc_info) -> None:
        self.thread.join(120)
        if exc_info[0] is None:
            assert self.outcome.status == 200, self.outcome.error
            assert streamed_tokens(self.outcome.events) == self.alone
            assert self.outcome.finish_reasons == ["length"]
            assert health_status(self.serve.base_url) == 200


def post(serve: ServeProcess, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    """``body`` as UTF-8 JSON (non-ASCII characters unescaped, as a hostile client sends)."""
    content = json.dumps(body, ensure_ascii=False).encode()
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{serve.base_url}{path}", content=content, headers=headers, timeout=120)


def chat(**fields) -> dict:
    return {"messages": chat_messages("Hi"), "max_tokens": 4, **fields}


def error_of(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def non_ascii_schema(num_bytes: int) -> dict:
    """A JSON schema whose description takes ``num_bytes`` of 2-byte characters."""
    return {"type": "object", "description": "é" * (num_bytes // 2)}


HOSTILE = {
    "a 22.9 MiB schema of 2-byte characters": (
        lambda: chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "big", "schema": non_ascii_schema(24_000_000)},
            }
        ),
        "response_format",
        "response_format.json_schema.schema takes 24000034 bytes; " + SCHEMA_LIMIT,
    ),
    "a guided_json string just above the limit": (
        lambda: chat(guided_json=json.dumps(non_ascii_schema(131_072), ensure_ascii=False)),
        "guided_json",
        "guided_json takes 131109 bytes; " + SCHEMA_LIMIT,
    ),
    "a choice list of 5000 alternatives": (
        lambda: chat(guided_choice=[f"option {i}" for i in range(5000)]),
        "guided_choice",
        "guided_choice: List should have at most 1000 items after validation, not 5000",
    ),
    "a choice list of 200 KB": (
        lambda: chat(structured_outputs={"choice": [f"{i}" + "x" * 2000 for i in range(100)]}),
        "structured_outputs.choice",
        "structured_outputs.choice takes 200696 bytes; " + SCHEMA_LIMIT,
    ),
    "a 1 MB grammar": (
        lambda: chat(guided_grammar="root ::= " + " | ".join(['"ab"'] * 200_000)),
        "guided_grammar",
        "guided_grammar takes 1400006 bytes; " + SCHEMA_LIMIT,
    ),
    "a tool whose parameters schema is 300 KB": (
        lambda: chat(tools=[{"type": "function", "function": {"name": "f", **params(300_000)}}]),
        "tools[0].function.parameters",
        "tools[0].function.parameters takes 300000 bytes; " + SCHEMA_LIMIT,
    ),
    "2M stop_token_ids": (
        lambda: chat(stop_token_ids=[13] * 2_000_000),
        "stop_token_ids",
        "stop_token_ids: List should have at most 1024 items after validation, not 2000000",
    ),
    "a full-vocabulary logit_bias with n=128": (
        lambda: chat(logit_bias={str(token): 1 for token in range(49152)}, n=128),
        "logit_bias",
        "logit_bias: Dictionary should have at most 300 items after validation, not more",
    ),
    "a stop string of 100k characters": (
        lambda: chat(stop=["x" * 100_000]),
        "stop",
        "stop: Value error, a stop string may have at most 1024 characters",
    ),
    "a 4 MiB prompt": (
        lambda: {"messages": chat_messages("é" * (2 << 20)), "max_tokens": 4},
        "messages",
        "The prompt text takes 4194304 bytes; the limit is 1048576 bytes (--max-prompt-bytes)",
    ),
    "repetition_penalty 1e-300": (
        lambda: chat(repetition_penalty=1e-300),
        "repetition_penalty",
        "repetition_penalty: Input should be greater than or equal to 0.01",
    ),
    "a schema that passes the size check and fails meta-validation": (
        lambda: chat(guided_json={**params(100_000)["parameters"], "minProperties": -1}),
        "guided_json",
        "guided_json is not a valid JSON schema: -1 is less than the minimum of 0",
    ),
}


def params(num_bytes: int) -> dict:
    """A function's ``parameters``: an object schema of ``num_bytes`` as compact JSON."""
    return {"parameters": {"type": "object", "description": "p" * (num_bytes - 34)}}


def test_hostile_requests_get_400s_naming_their_limits(serve, alone, max_model_len) -> None:
    with InnocentStream(serve, alone):
        errors = {case: error_of(post(serve, build())) for case, (build, _, _) in HOSTILE.items()}
        completions = {"prompt": ["Once upon a time"] * 2048, "max_tokens": 16}
        many_prompts = error_of(post(serve, completions, "/v1/completions"))
        unbounded = {"messages": chat_messages("Hi"), "n": 128, "ignore_eos": True}
        many_contexts = error_of(post(serve, unbounded))
        # A quarter of the context echoed by 128 choices: 32 contexts of prefill and response.
        echoed_prompt = "hello " * (max_model_len // 4)
        echoes = {"prompt": echoed_prompt, "echo": True, "logprobs": 5, "n": 128, "max_tokens": 1}
        many_echoes = error_of(post(serve, echoes, "/v1/completions"))
    for case, (_, param, message) in HOSTILE.items():
        expected = {"message": message, "type": "invalid_request_error", "param": param}
        assert errors[case] == {**expected, "code": None}, case
    assert many_prompts["message"] == (
        "This request asks for 2048 choices (2048 prompts x n 1); the limit is 128 "
        "(--max-choices-per-request)"
    )
    match = re.fullmatch(
        r"This request's choices may generate (\d+) tokens in all \(choices x max_tokens, a "
        r"choice without max_tokens counting the rest of the context\); the limit is (\d+) "
        r"\(--max-request-output-tokens\)\. Set a smaller max_tokens or ask for fewer choices\.",
        many_contexts["message"],
    )
    assert match is not None, many_contexts["message"]
    num_prompt_tokens = max_model_len - int(match.group(1)) // 128
    assert 0 < num_prompt_tokens < 64 and int(match.group(1)) % 128 == 0
    assert int(match.group(2)) == 16 * max_model_len
    assert many_contexts["param"] == "max_tokens"
    # Each choice prefilled its prompt for itself (cached blocks hold no logprobs) and answered
    # each token with 5 alternatives: counted now, as generated tokens are.
    num_echoed = post(serve, {"prompt": echoes["prompt"]}, "/tokenize").json()["count"]
    assert many_echoes["message"].startswith(
        f"This request's choices may generate {128 + 127 * num_echoed} tokens in all (choices "
        "x max_tokens, a choice without max_tokens counting the rest of the context, and each "
        "choice after a prompt's first that echoes it with logprobs its tokens)"
    )


MILLION = 1_000_000
BAD_ITEMS = {
    "a million token ids and one string": (
        "/v1/completions",
        {"prompt": [1] * MILLION + ["a"], "max_tokens": 4},
        "prompt: Input should be a valid string; prompt[1000000]: Input should be a valid "
        "integer, unable to parse string as an integer; prompt[0]: Input should be a valid "
        "string; prompt[0]: Input should be a valid list",
    ),
    "a million unknown fields": (
        "/v1/chat/completions",
        {**chat(), **{f"k{i}": 1 for i in range(MILLION)}},
        "Unrecognized request argument supplied: "
        + ", ".join(f"k{i}" for i in range(16))
        + " (1000000 in all)",
    ),
    "a million logit_bias values that are not numbers": (
        "/v1/chat/completions",
        chat(logit_bias={str(i): "x" for i in range(MILLION)}),
        "logit_bias.0: Input should be a valid number, unable to parse string as a number",
    ),
}


def test_bodies_of_a_million_bad_items_get_one_short_400_each(serve, alone) -> None:
    """Pydantic made one error per bad item (seconds of the event loop and GBs per body);
    now each list stops at its first bad item and unknown fields are counted, not listed."""
    with InnocentStream(serve, alone):
        errors = {
            case: error_of(post(serve, body, path)) for case, (path, body, _) in BAD_ITEMS.items()
        }
    for case, (_, _, message) in BAD_ITEMS.items():
        assert errors[case]["message"] == message, case


def test_a_temperature_of_1e_300_is_greedy(serve, alone) -> None:
    response = post(serve, {**INNOCENT, "temperature": 1e-300, "stream": False})
    assert response.status_code == 200
    entries = response.json()["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in entries] == alone


def test_a_client_that_never_reads_is_aborted_and_the_others_are_not(serve, alone) -> None:
    body = {**long_chat(2000), "n": 8, "logprobs": True, "top_logprobs": 20}
    never = SlowReader(serve.base_url, body, max_segment=536)
    try:
        assert wait_until(lambda: serve.gauges()["num_requests_running"] == 8, 120)
        with InnocentStream(serve, alone):
            pass
        # Aborted at the scheduler while its client still reads nothing.
        assert wait_until(lambda: serve.gauges()["num_requests_running"] == 0, 120)
        events = never.read_all()
    finally:
        never.socket.close()
    assert 0 < len(streamed_tokens(events)) < 8 * 2000
    assert events[-1] == {
        "error": {
            "message": "The client stopped reading the response: more than "
            f"{MAX_STREAM_BACKLOG} results were waiting for it (--max-stream-backlog), so the "
            "request was aborted",
            "type": "invalid_request_error",
            "param": None,
            "code": "stream_backlog_full",
        }
    }


def test_the_server_is_idle_and_healthy_afterwards(serve) -> None:
    assert gauges_settle(serve) == {
        "num_requests_running": 0.0,
        "num_requests_waiting": 0.0,
        "kv_cache_usage_perc": 0.0,
    }
    assert health_status(serve.base_url) == 200
