"""The API server over real HTTP against the fake scheduler: responses, streams, aborts, health."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from tests.support.fake_scheduler import ApiHarness, sse_events

REPLY = "Hello! How can I help you today? 😊"
EOS = 2
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(autouse=True)
def fresh_scheduler(api: ApiHarness) -> list[int]:
    """The fake replies REPLY then EOS; returns REPLY's token ids."""
    api.scheduler.reset()
    api.scheduler.reply = api.tokenizer.encode_now(REPLY, add_special_tokens=False)
    api.scheduler.eos_token_id = EOS
    return api.scheduler.reply


def chat_prompt_tokens(api: ApiHarness, messages: list[dict]) -> int:
    return len(api.tokenizer.encode_now(api.tokenizer.apply_chat_template(messages), False))


def test_chat_completion(api: ApiHarness, client: httpx.Client, fresh_scheduler) -> None:
    response = client.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "model": api.MODEL_NAME}
    )
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and len(body["id"]) == len("chatcmpl-") + 32
    assert body["object"] == "chat.completion"
    assert body["model"] == api.MODEL_NAME
    assert isinstance(body["created"], int)
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": REPLY},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    prompt_tokens = chat_prompt_tokens(api, MESSAGES)
    completion_tokens = len(fresh_scheduler) + 1  # the EOS token counts
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    context = api.scheduler.submitted[-1]
    # The scheduler's id: the response's, made unique (clients may reuse an X-Request-Id).
    assert re.fullmatch(re.escape(body["id"]) + r"-[0-9a-f]{12}", context.request_id)
    assert context.max_length == 256
    assert context.eos_token_ids == [EOS]
    assert context.sampling_params.temperature == 1.0 and context.sampling_params.top_k == -1


def test_chat_sampling_fields_reach_the_scheduler(api: ApiHarness, client: httpx.Client) -> None:
    request = {
        "messages": MESSAGES,
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 7,
        "min_p": 0.1,
        "seed": 42,
        "max_completion_tokens": 5,
        "max_tokens": 9,
        "stop_token_ids": [13],
        "ignore_eos": True,
        "user": "someone",
    }
    assert client.post("/v1/chat/completions", json=request).status_code == 200
    context = api.scheduler.submitted[-1]
    params = context.sampling_params
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.0, 0.5, 7, 0.1)
    assert (params.seed, params.max_new_tokens, params.ignore_eos) == (42, 5, True)
    assert params.stop_token_ids == [13]
    assert context.max_length == context.num_prompt_tokens + 5


def test_chat_stream(api: ApiHarness, client: httpx.Client, fresh_scheduler) -> None:
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = [json.loads(event) for event in sse_events(response)]
    assert {chunk["id"] for chunk in chunks} == {chunks[0]["id"]}
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert {chunk["created"] for chunk in chunks} == {chunks[0]["created"]}
    assert chunks[0]["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    contents = [chunk["choices"][0]["delta"]["content"] for chunk in chunks[1:-1]]
    assert "".join(contents) == REPLY
    assert all(contents) and len(contents) > 5
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks[:-1])
    assert chunks[-1]["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    ]
    assert all(chunk["usage"] is None for chunk in chunks)


def test_chat_stream_include_usage(api: ApiHarness, client: httpx.Client, fresh_scheduler) -> None:
    request = {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}
    chunks = [json.loads(e) for e in sse_events(client.post("/v1/chat/completions", json=request))]
    *_, finish, usage_chunk = chunks
    assert finish["choices"][0]["finish_reason"] == "stop"
    prompt_tokens = chat_prompt_tokens(api, MESSAGES)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(fresh_scheduler) + 1,
        "total_tokens": prompt_tokens + len(fresh_scheduler) + 1,
    }


def test_completion(api: ApiHarness, client: httpx.Client, fresh_scheduler) -> None:
    response = client.post("/v1/completions", json={"prompt": "Say hello", "max_tokens": 100})
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["choices"] == [
        {"index": 0, "text": REPLY, "logprobs": None, "finish_reason": "stop"}
    ]
    prompt_tokens = len(api.tokenizer.encode_now("Say hello"))
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(fresh_scheduler) + 1,
        "total_tokens": prompt_tokens + len(fresh_scheduler) + 1,
    }


def test_completion_with_token_ids_and_default_max_tokens(
    api: ApiHarness, client: httpx.Client, fresh_scheduler
) -> None:
    api.scheduler.repeat = True
    response = client.post("/v1/completions", json={"prompt": [[19556, 905]]})
    body = response.json()
    assert api.scheduler.submitted[-1].prompt_token_ids == [19556, 905]
    assert api.scheduler.submitted[-1].max_length == 2 + 16  # OpenAI's default max_tokens
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["text"] == api.tokenizer.backend.decode((fresh_scheduler * 2)[:16])
    assert body["usage"]["completion_tokens"] == 16


def test_completion_stream_with_usage(
    api: ApiHarness, client: httpx.Client, fresh_scheduler
) -> None:
    api.scheduler.repeat = True
    request = {"prompt": "Say hello", "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(client.post("/v1/completions", json=request))
    chunks = [json.loads(event) for event in events]
    texts = [chunk["choices"][0]["text"] for chunk in chunks[:-2]]
    assert "".join(texts) == api.tokenizer.backend.decode((fresh_scheduler * 2)[:16])
    assert chunks[-2]["choices"] == [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
    ]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 16
    assert {chunk["object"] for chunk in chunks} == {"text_completion"}


def test_max_tokens_finishes_with_length(
    api: ApiHarness, client: httpx.Client, fresh_scheduler
) -> None:
    request = {"messages": MESSAGES, "max_tokens": 3}
    body = client.post("/v1/chat/completions", json=request).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"] == api.tokenizer.backend.decode(
        fresh_scheduler[:3]
    )
    assert body["usage"]["completion_tokens"] == 3


def test_stop_string_cuts_the_text_and_aborts(api: ApiHarness, client: httpx.Client) -> None:
    api.scheduler.step_interval_s = 0.02
    request = {"messages": MESSAGES, "stop": ["nothing", "help"]}
    body = client.post("/v1/chat/completions", json=request).json()
    assert body["choices"][0]["message"]["content"] == "Hello! How can I "
    assert body["choices"][0]["finish_reason"] == "stop"
    request_id = api.scheduler.submitted[-1].request_id
    assert request_id.startswith(body["id"])
    assert api.scheduler.wait_for(lambda: request_id in api.scheduler.aborted)
    assert api.scheduler.wait_for(lambda: api.scheduler.stats().num_requests_running == 0)


def test_stop_string_in_a_stream(api: ApiHarness, client: httpx.Client) -> None:
    api.scheduler.step_interval_s = 0.02
    request = {"prompt": "x", "stop": "How can", "stream": True, "max_tokens": 50}
    chunks = [json.loads(e) for e in sse_events(client.post("/v1/completions", json=request))]
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == "Hello! "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    request_id = api.scheduler.submitted[-1].request_id
    assert request_id.startswith(chunks[0]["id"])
    assert api.scheduler.wait_for(lambda: request_id in api.scheduler.aborted)


def test_models(api: ApiHarness, client: httpx.Client) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [
        (api.MODEL_NAME, "model", 256)
    ]


def test_openai_client(api: ApiHarness, fresh_scheduler) -> None:
    client = openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", timeout=10, max_retries=0)
    completion = client.chat.completions.create(model=api.MODEL_NAME, messages=MESSAGES)
    assert completion.choices[0].message.content == REPLY
    stream = client.chat.completions.create(
        model=api.MODEL_NAME,
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
    assert chunks[-1].usage.completion_tokens == len(fresh_scheduler) + 1
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")


def test_text_content_parts_are_joined(api: ApiHarness, client: httpx.Client) -> None:
    content = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = {"messages": [{"role": "user", "content": content}]}
    assert client.post("/v1/chat/completions", json=request).status_code == 200
    prompt = api.tokenizer.apply_chat_template([{"role": "user", "content": "a\nb"}])
    assert api.scheduler.submitted[-1].prompt_token_ids == api.tokenizer.encode_now(prompt, False)


@pytest.mark.parametrize(
    ("skip_special_tokens", "text"), [(True, "Hi there"), (False, "Hi<|im_start|> there")]
)
def test_skip_special_tokens(
    api: ApiHarness, client: httpx.Client, skip_special_tokens: bool, text: str
) -> None:
    encode = api.tokenizer.encode_now
    api.scheduler.reply = [*encode("Hi", False), 1, *encode(" there", False)]
    request = {"prompt": "x", "skip_special_tokens": skip_special_tokens}
    body = client.post("/v1/completions", json=request).json()
    assert body["choices"][0]["text"] == text  # the final EOS is never part of the text
    assert body["usage"]["completion_tokens"] == len(api.scheduler.reply) + 1
