"""/tokenize, /detokenize, /version and /v1/models, and their errors (never a 422)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import httpx
import pytest

from interfaces import TextGenerationRequestMessage
from tests.support.fake_scheduler import ApiHarness

MESSAGES = [{"role": "user", "content": "Hi there"}]


def test_tokenize_a_prompt_and_back(api: ApiHarness, client: httpx.Client) -> None:
    body = client.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert body == {"count": 2, "max_model_len": 256, "tokens": [19556, 905], "token_strs": None}
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json() == {
        "prompt": "Hello world"
    }


def test_tokenize_returns_token_strings(client: httpx.Client) -> None:
    request = {"prompt": "Hello world", "return_token_strs": True, "model": "smollm2-test"}
    assert client.post("/tokenize", json=request).json()["token_strs"] == ["Hello", "Ġworld"]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokenize_messages(
    api: ApiHarness, client: httpx.Client, add_generation_prompt: bool
) -> None:
    request = {"messages": MESSAGES, "add_generation_prompt": add_generation_prompt}
    body = client.post("/tokenize", json=request).json()
    messages = [TextGenerationRequestMessage(**message) for message in MESSAGES]
    options = {"add_generation_prompt": add_generation_prompt}
    prompt = api.tokenizer.render_messages(messages, None, options)
    assert prompt.endswith("<|im_start|>assistant\n") is add_generation_prompt
    assert body["tokens"] == api.tokenizer.encode_now(prompt, add_special_tokens=False)
    assert body["count"] == len(body["tokens"])
    detokenized = client.post("/detokenize", json={"tokens": body["tokens"]}).json()
    assert detokenized == {"prompt": prompt}


def test_chat_prompt_tokens_match_what_generation_submits(
    api: ApiHarness, client: httpx.Client
) -> None:
    api.scheduler.reply, api.scheduler.eos_token_id = [19556], 2
    assert client.post("/v1/chat/completions", json={"messages": MESSAGES}).status_code == 200
    tokens = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert tokens == api.scheduler.submitted[-1].prompt_token_ids


EXACTLY_ONE = "Give exactly one of prompt and messages"
IMAGE_PART = {"role": "user", "content": [{"type": "image_url"}]}


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/tokenize", {}, "prompt", EXACTLY_ONE),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt", EXACTLY_ONE),
        ("/tokenize", {"prompt": 5}, "prompt", "prompt: Input should be a valid string"),
        (
            "/tokenize",
            {"prompt": "x", "extra": 1},
            None,
            "Unrecognized request argument supplied: extra",
        ),
        ("/tokenize", {"messages": [IMAGE_PART]}, "messages[0].content[0]", None),
        ("/detokenize", {}, "tokens", "'tokens' is a required property"),
        (
            "/detokenize",
            {"tokens": [49152]},
            "tokens",
            "the token id 49152 is outside the vocabulary [0, 49152)",
        ),
        (
            "/detokenize",
            {"tokens": ["a"]},
            "tokens[0]",
            "tokens[0]: Input should be a valid integer, unable to parse string as an integer",
        ),
    ],
)
def test_bad_bodies_are_400s(
    client: httpx.Client, path: str, body: dict, param: str | None, message: str | None
) -> None:
    response = client.post(path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    if message is not None:
        assert error["message"] == message


SURROGATE = "is not valid Unicode: it holds a lone surrogate"


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/tokenize", rb'{"prompt": "a\ud800"}', "prompt", f"prompt {SURROGATE}"),
        (
            "/v1/completions",
            rb'{"prompt": ["ok", "\udc00"]}',
            "prompt[1]",
            f"prompt[1] {SURROGATE}",
        ),
        ("/v1/completions", rb'{"prompt": "x", "stop": "\ud800"}', "stop", f"stop {SURROGATE}"),
        (
            "/v1/chat/completions",
            rb'{"messages": [{"role": "user", "content": "\ud800"}]}',
            "messages[0].content",
            f"messages[0].content {SURROGATE}",
        ),
        (
            "/v1/completions",
            rb'{"prompt": "x", "\ud800": 1}',
            None,
            f"A field name {SURROGATE}",
        ),
        (
            "/v1/chat/completions",
            rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, '
            rb'{"type": "text", "text": "\udfff"}]}]}',
            "messages[0].content[1].text",
            f"messages[0].content[1].text {SURROGATE}",
        ),
        (
            "/v1/chat/completions",
            rb'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": '
            rb'"json_schema", "json_schema": {"name": "n", "schema": {"properties": '
            rb'{"ok": {}, "\ud800": {}}}}}}',
            "response_format.json_schema.schema.properties",
            f"response_format.json_schema.schema.properties {SURROGATE}",
        ),
    ],
)
def test_lone_surrogates_are_400s(
    client: httpx.Client, path: str, body: bytes, param: str | None, message: str
) -> None:
    """JSON can escape half of a UTF-16 pair; no tokenizer or UTF-8 encoder can take one."""
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert (response.json()["error"]["param"], response.json()["error"]["message"]) == (
        param,
        message,
    )


def test_unknown_model_is_a_404(client: httpx.Client) -> None:
    response = client.post("/tokenize", json={"prompt": "x", "model": "gpt-4o"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_version(client: httpx.Client) -> None:
    assert client.get("/version").json() == {"version": metadata.version("switchyard")}


def test_models(api: ApiHarness, client: httpx.Client, default_model_dir: Path) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert isinstance(card.pop("created"), int)
    assert card == {
        "id": api.MODEL_NAME,
        "object": "model",
        "owned_by": "switchyard",
        "root": api.MODEL_NAME,  # as vLLM: the served name, never the model's path
        "parent": None,  # a LoRA adapter's base model (as vLLM)
        "max_model_len": 256,
    }
    assert str(default_model_dir) not in client.get("/v1/models").text


def test_tokenize_and_detokenize_are_bounded_before_any_work(client: httpx.Client) -> None:
    """Prompt text above --max-prompt-bytes (1 MiB for this 256-token context) and more token
    ids than the context are 400s before anything is rendered, tokenized or decoded."""
    limit = 1024 * 1024
    too_long = "é" * (limit // 2 + 1)
    for body, param in [
        ({"prompt": too_long}, "prompt"),
        ({"messages": [{"role": "user", "content": too_long}]}, "messages"),
    ]:
        response = client.post("/tokenize", json=body)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == param
        assert response.json()["error"]["message"] == (
            f"The prompt text takes {limit + 2} bytes; the limit is {limit} bytes "
            "(--max-prompt-bytes)"
        )
    response = client.post("/detokenize", json={"tokens": [19556] * 257})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "257 tokens are more than the context length of 256"
    )
    assert client.post("/detokenize", json={"tokens": [19556] * 256}).status_code == 200
