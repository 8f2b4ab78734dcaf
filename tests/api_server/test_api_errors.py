"""Every way a request can be refused, and OpenAI's error shape for each."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_server.app import routers
from api_server.json_body import parse_json
from tests.support.fake_scheduler import ApiHarness

MESSAGES = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def api(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    harness = ApiHarness(default_model_dir, tmp_path_factory.mktemp("api-errors"))
    harness.scheduler.reply = [19556]
    harness.scheduler.eos_token_id = 2
    yield harness
    harness.close()


def error_of(response: httpx.Response, status: int) -> dict:
    """The ``error`` object, after checking the status and that the body has exactly its shape."""
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"]
    assert list(body["error"]) == ["message", "type", "param", "code"]
    return body["error"]


def bad_request(response: httpx.Response) -> dict:
    error = error_of(response, 400)
    assert error["type"] == "invalid_request_error"
    return error


def test_malformed_json(client: httpx.Client) -> None:
    response = client.post(
        CHAT, content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    error = bad_request(response)
    assert error["message"] == "The request body is not valid JSON: Expecting value at character 14"
    assert error["param"] is None


NOT_AN_OBJECT = "The request body must be a JSON object sent as Content-Type: application/json"


@pytest.mark.parametrize(
    ("body", "content_type", "message"),
    [
        (b"", "application/json", "A JSON request body is required"),
        (b"[]", "application/json", NOT_AN_OBJECT),
        (b"42", "application/json", NOT_AN_OBJECT),
    ],
)
def test_body_that_is_not_a_json_object(
    client: httpx.Client, body: bytes, content_type: str, message: str
) -> None:
    response = client.post(CHAT, content=body, headers={"content-type": content_type})
    assert bad_request(response)["message"] == message


@pytest.mark.parametrize(
    ("content_type", "named"),
    [
        (None, "no Content-Type"),
        ("text/plain", "Content-Type 'text/plain'"),
        ("application/x-www-form-urlencoded", "Content-Type 'application/x-www-form-urlencoded'"),
        ("multipart/form-data; boundary=x", "Content-Type 'multipart/form-data; boundary=x'"),
        ("application/json-patch+json", "Content-Type 'application/json-patch+json'"),
    ],
)
def test_a_json_body_sent_as_anything_but_json_is_415(
    api: ApiHarness, client: httpx.Client, content_type: str | None, named: str
) -> None:
    """What a web page may POST cross-origin without a CORS preflight is never parsed."""
    num_submitted = len(api.scheduler.submitted)
    body = json.dumps({"messages": MESSAGES}).encode()
    headers = {} if content_type is None else {"content-type": content_type}
    response = client.post(CHAT, content=body, headers=headers)
    assert error_of(response, 415) == {
        "message": f"The request has {named}; send the body as JSON with "
        "'Content-Type: application/json'",
        "type": "invalid_request_error",
        "param": None,
        "code": "unsupported_media_type",
    }
    assert len(api.scheduler.submitted) == num_submitted


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"]
)
def test_a_json_content_type_with_or_without_parameters_is_accepted(
    client: httpx.Client, content_type: str
) -> None:
    body = json.dumps({"messages": MESSAGES}).encode()
    response = client.post(CHAT, content=body, headers={"content-type": content_type})
    assert response.status_code == 200


def test_missing_messages(client: httpx.Client) -> None:
    error = bad_request(client.post(CHAT, json={"model": "smollm2-test"}))
    assert error["message"] == "'messages' is a required property"
    assert error["param"] == "messages"


def test_missing_prompt(client: httpx.Client) -> None:
    error = bad_request(client.post("/v1/completions", json={}))
    assert (error["message"], error["param"]) == ("'prompt' is a required property", "prompt")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"stream": "yes please"}, "stream"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -5}, "max_completion_tokens"),
    ],
)
def test_mistyped_or_out_of_range_fields(client: httpx.Client, extra: dict, param: str) -> None:
    error = bad_request(client.post(CHAT, json={"messages": MESSAGES, **extra}))
    assert error["param"] == param
    assert error["message"].startswith(param)


def test_negative_max_tokens_message(client: httpx.Client) -> None:
    error = bad_request(client.post("/v1/completions", json={"prompt": "x", "max_tokens": -3}))
    assert error["message"] == "max_tokens: Input should be greater than or equal to 0"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_k": -2}, "top_k must be -1, 0 (no limit) or a positive integer, got -2"),
        ({"stop": ""}, "stop strings must be non-empty"),
    ],
)
def test_sampling_params_errors(client: httpx.Client, extra: dict, message: str) -> None:
    error = bad_request(client.post(CHAT, json={"messages": MESSAGES, **extra}))
    assert (error["message"], error["param"]) == (message, next(iter(extra)))


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        ({"functions": [{"name": "f"}]}, ["functions"]),
        ({"echo": True}, ["echo"]),
        ({"audio": {"voice": "alloy"}, "modalities": ["text", "audio"]}, ["audio", "modalities"]),
    ],
)
def test_unsupported_chat_fields_are_named(client: httpx.Client, extra: dict, names: list) -> None:
    error = bad_request(client.post(CHAT, json={"messages": MESSAGES, **extra}))
    assert error["message"].startswith(f"Unsupported parameter(s): {', '.join(names)}.")
    assert (error["param"], error["code"]) == (names[0], "unsupported_parameter")


def test_unsupported_completion_fields_are_named(client: httpx.Client) -> None:
    error = bad_request(client.post("/v1/completions", json={"prompt": "x", "suffix": "end"}))
    assert error["message"].startswith("Unsupported parameter(s): suffix.")
    assert error["param"] == "suffix"


def test_supported_defaults_are_accepted(client: httpx.Client) -> None:
    request = {
        "messages": MESSAGES,
        "n": 1,
        "logprobs": False,
        "frequency_penalty": 0,
        "presence_penalty": 0,
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "user": "u",
        "store": False,
        "metadata": {"k": "v"},
    }
    assert client.post(CHAT, json=request).status_code == 200


def test_unknown_fields_are_named(client: httpx.Client) -> None:
    error = bad_request(client.post(CHAT, json={"messages": MESSAGES, "foo": 1, "bar_baz": 2}))
    assert error["message"] == "Unrecognized request argument supplied: foo, bar_baz"


def test_unknown_field_inside_a_message(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "x", "mood": "happy"}]
    error = bad_request(client.post(CHAT, json={"messages": messages}))
    assert error["message"] == "Unrecognized request argument supplied: messages[0].mood"


def test_stream_options_without_stream(client: httpx.Client) -> None:
    request = {"messages": MESSAGES, "stream_options": {"include_usage": True}}
    error = bad_request(client.post(CHAT, json=request))
    assert error["message"] == "stream_options is only allowed when stream is true"
    assert error["param"] == "stream_options"


def test_image_content_parts_are_refused(client: httpx.Client) -> None:
    content = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    error = bad_request(
        client.post(CHAT, json={"messages": [{"role": "user", "content": content}]})
    )
    assert error["param"] == "messages[0].content[0]"
    assert "'image_url' are not supported" in error["message"]


def test_a_text_part_needs_text(client: httpx.Client) -> None:
    content = [{"type": "text", "text": "a"}, {"type": "text"}]
    error = bad_request(
        client.post(CHAT, json={"messages": [{"role": "user", "content": content}]})
    )
    assert (error["message"], error["param"]) == (
        "messages[0].content[1].text is required",
        "messages[0].content[1].text",
    )


def test_prompt_longer_than_the_context(api: ApiHarness, client: httpx.Client) -> None:
    prompt = "word " * 300
    num_tokens = len(api.tokenizer.encode_now(prompt))
    error = bad_request(client.post("/v1/completions", json={"prompt": prompt}))
    assert error["message"] == (
        f"This model's maximum context length is 256 tokens, but the prompt has {num_tokens} "
        "tokens, leaving no room for the completion. Shorten the prompt or the conversation."
    )
    assert error["param"] == "prompt"
    messages = [{"role": "user", "content": "word " * 300}]
    assert bad_request(client.post(CHAT, json={"messages": messages}))["param"] == "messages"


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "the prompt is empty: it must have at least one token"),
        (["a", ""], "the prompt is empty: it must have at least one token"),
        ([49152], "prompt token id 49152 is outside the vocabulary [0, 49152)"),
        ("", "the prompt is empty: it must have at least one token"),
    ],
)
def test_bad_prompts(client: httpx.Client, prompt, message: str) -> None:
    error = bad_request(client.post("/v1/completions", json={"prompt": prompt}))
    assert error["message"].startswith(message)
    assert error["param"] == "prompt"


def test_unknown_model(client: httpx.Client) -> None:
    error = error_of(client.post(CHAT, json={"model": "gpt-4o", "messages": MESSAGES}), 404)
    assert error == {
        "message": "The model `gpt-4o` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": "model_not_found",
    }


def test_unknown_route_and_wrong_method(client: httpx.Client) -> None:
    assert error_of(client.get("/v1/nothing"), 404)["type"] == "NotFoundError"
    assert error_of(client.get(CHAT), 405)["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def orphan(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """An API server whose scheduler address has nothing behind it."""
    harness = ApiHarness(default_model_dir, tmp_path_factory.mktemp("orphan"), with_scheduler=False)
    yield harness
    harness.close()


def test_no_scheduler(orphan: ApiHarness) -> None:
    with httpx.Client(base_url=orphan.url, timeout=httpx.Timeout(10.0)) as client:
        health = error_of(client.get("/health"), 503)
        assert health["message"] == "the scheduler did not answer a stats request within 1 s"
        for stream in (False, True):
            request = {"messages": MESSAGES, "stream": stream}
            error = error_of(client.post(CHAT, json=request), 503)
            assert error["type"] == "service_unavailable_error"
            assert "did not accept the request within 1 s" in error["message"]
        metrics = client.get("/metrics")
        assert metrics.status_code == 200
        # This process's own series; none of the scheduler's, which nobody could vouch for.
        assert "switchyard:request_success_total" in metrics.text
        assert "switchyard:kv_cache_usage_perc" not in metrics.text
        assert "switchyard:num_preemptions_total" not in metrics.text


def _containers_that_list_every_bad_item(schema: Any, path: str = "") -> list[str]:
    """Paths in a pydantic core schema of lists and dicts without ``fail_fast`` whose items can
    fail validation (not ``Any``, keys other than plain strings)."""
    if isinstance(schema, list):
        return [
            found
            for index, item in enumerate(schema)
            for found in _containers_that_list_every_bad_item(item, f"{path}[{index}]")
        ]
    if not isinstance(schema, dict):
        return []
    found = []
    kind = schema.get("type")
    if kind in ("list", "set", "frozenset", "tuple", "dict") and not schema.get("fail_fast"):
        items = [schema.get(key) for key in ("items_schema", "values_schema") if key in schema]
        items += schema.get("items_schemas", [])
        keys = schema.get("keys_schema", {"type": "str"})
        if keys != {"type": "str"} or any(item.get("type") != "any" for item in items):
            found.append(f"{path} ({kind})")
    for key, value in schema.items():
        found += _containers_that_list_every_bad_item(value, f"{path}.{key}" if path else key)
    return found


def test_every_list_and_dict_of_a_request_stops_at_its_first_bad_item() -> None:
    """Without ``fail_fast`` pydantic makes one error per bad item: a 2 MB body of a million
    bad items took seconds and GBs to refuse (api_server.protocol.FAIL_FAST)."""
    models = {
        route.body_field.field_info.annotation
        for router in routers()
        for route in router.routes
        if getattr(route, "body_field", None) is not None
    }
    assert {model.__name__ for model in models} >= {
        "ChatCompletionRequest",
        "CompletionRequest",
        "ResponsesRequest",
        "TokenizeRequest",
        "DetokenizeRequest",
    }
    found = {
        model.__name__: _containers_that_list_every_bad_item(model.__pydantic_core_schema__)
        for model in models
    }
    assert found == {name: [] for name in found}


MILLION = 1_000_000
HOSTILE_BODIES = {
    "a million token ids and one string": (
        "/v1/completions",
        {"prompt": [1] * MILLION + ["a"]},
        "prompt: Input should be a valid string; prompt[1000000]: Input should be a valid "
        "integer, unable to parse string as an integer; prompt[0]: Input should be a valid "
        "string; prompt[0]: Input should be a valid list",
    ),
    "a million prompts": (
        "/v1/completions",
        {"prompt": ["a"] * MILLION},
        "prompt: Value error, at most 2048 prompts are allowed; this request has 1000000",
    ),
    "a million unknown fields": (
        CHAT,
        {"messages": MESSAGES, **{f"k{i}": 1 for i in range(MILLION)}},
        "Unrecognized request argument supplied: "
        + ", ".join(f"k{i}" for i in range(16))
        + " (1000000 in all)",
    ),
    "a message of a million unknown fields": (
        CHAT,
        {"messages": [{"role": "user", "content": "x", **{f"k{i}": 1 for i in range(MILLION)}}]},
        "Unrecognized request argument supplied: "
        + ", ".join(f"messages[0].k{i}" for i in range(16))
        + " (1000000 in all)",
    ),
    "content parts that are not parts": (
        CHAT,
        {"messages": [{"role": "user", "content": [7] * 16384}]},
        "messages[0].content: Input should be a valid string; messages[0].content[0]: Input "
        "should be a valid dictionary or object to extract fields from",
    ),
    "a million content parts": (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * MILLION}]},
        "messages: Value error, the messages hold 1000000 content parts and tool calls; the "
        "limit is 16384",
    ),
    "a million empty tool calls over 2048 messages": (
        CHAT,
        {"messages": [{"role": "assistant", "tool_calls": [{}] * 489}] * 2048},
        "messages: Value error, the messages hold 1001472 content parts and tool calls; the "
        "limit is 16384",
    ),
    "a million content parts in Responses input items": (
        "/v1/responses",
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": ""}] * 489}] * 2048},
        "Invalid 'input': the input items hold 1001472 content parts, outputs and summary "
        "parts; the limit is 16384",
    ),
    "a million legacy functions": (
        CHAT,
        {"messages": MESSAGES, "functions": [{}] * MILLION},
        "functions: List should have at most 128 items after validation, not 1000000",
    ),
    "a million embedding inputs": (
        "/v1/embeddings",
        {"model": "m", "input": ["a"] * MILLION},
        "input: Value error, at most 2048 inputs are allowed; this request has 1000000",
    ),
    "a million stop strings": (
        CHAT,
        {"messages": MESSAGES, "stop": [1] * MILLION},
        "stop: Value error, at most 16 stop strings are allowed",
    ),
    "a million logit_bias values that are not numbers": (
        CHAT,
        {"messages": MESSAGES, "logit_bias": {str(i): "x" for i in range(MILLION)}},
        "logit_bias.0: Input should be a valid number, unable to parse string as a number",
    ),
    "a million token ids to detokenize and one string": (
        "/detokenize",
        {"tokens": [1] * MILLION + ["a"]},
        "tokens[1000000]: Input should be a valid integer, unable to parse string as an integer",
    ),
}


@pytest.mark.parametrize("case", HOSTILE_BODIES)
def test_a_body_of_a_million_bad_items_is_one_short_error(client: httpx.Client, case) -> None:
    path, body, message = HOSTILE_BODIES[case]
    error = bad_request(client.post(path, json=body, timeout=60))
    assert error["message"] == message


def test_a_400_describes_eight_errors_and_counts_the_rest(client: httpx.Client) -> None:
    bad = {name: "x" for name in ("n", "seed", "top_k", "min_tokens", "top_p", "min_p")}
    bad |= {name: "x" for name in ("temperature", "presence_penalty", "frequency_penalty")}
    bad |= {"logprobs": "x"}
    error = bad_request(client.post(CHAT, json={"messages": MESSAGES, **bad}))
    described = error["message"].split("; ")
    assert len(described) == 9 and described[-1] == "and 2 more", error["message"]


def test_a_body_is_parsed_with_the_garbage_collector_paused() -> None:
    """Many small arrays made the collector run again and again while ``json.loads`` built
    them (32 MiB: 3.4 s against 1.2 s paused); it is paused for the parse alone."""
    collections = []

    def count(phase: str, info: dict) -> None:
        collections.append(phase)

    body = json.dumps({"prompt": [[1]] * 200_000}).encode()
    gc.callbacks.append(count)
    try:
        parsed = parse_json(body)
    finally:
        gc.callbacks.remove(count)
    assert collections == [] and gc.isenabled()
    assert parsed == {"prompt": [[1]] * 200_000}
    with pytest.raises(json.JSONDecodeError):
        parse_json(b'{"prompt": [')
    assert gc.isenabled()


def test_a_long_prompt_of_whole_numbers_is_one_prompt_of_token_ids(client: httpx.Client) -> None:
    """Only lists of texts or of lists are counted as prompts: pydantic takes whole floats as
    token ids, so 3,000 of them are one prompt, too long for the context."""
    error = bad_request(client.post("/v1/completions", json={"prompt": [1.0] * 3000}))
    assert error["message"].startswith("This model's maximum context length is 256 tokens")
