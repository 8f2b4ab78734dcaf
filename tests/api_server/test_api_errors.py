"""Every way a request can be refused, and OpenAI's error shape for each."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

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
