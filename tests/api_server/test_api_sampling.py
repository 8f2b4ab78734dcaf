"""Sampling fields passed through to the scheduler, n choices, several prompts, stop strings kept
in the output (real HTTP and the official openai client against the fake scheduler)."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from interfaces import SamplingParams
from tests.support.fake_scheduler import ApiHarness, sse_events

REPLY = "Hello world, my good friend"
EOS = 2
MESSAGES = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"


@pytest.fixture(autouse=True)
def reply(api: ApiHarness) -> list[int]:
    """The fake replies REPLY then EOS; returns REPLY's token ids."""
    api.scheduler.reset()
    api.scheduler.reply = api.tokenizer.encode_now(REPLY, add_special_tokens=False)
    api.scheduler.eos_token_id = EOS
    return api.scheduler.reply


def submitted_since(api: ApiHarness, count: int) -> list:
    return api.scheduler.submitted[count:]


def engine_id(response_id: str, contexts: list) -> str:
    """The scheduler's id of one response's choices (each adds ``-<index>``): the response's
    id plus a random suffix (api_server.request_id.engine_request_id)."""
    (base,) = {context.request_id.rsplit("-", 1)[0] for context in contexts}
    assert re.fullmatch(re.escape(response_id) + r"-[0-9a-f]{12}", base), base
    return base


def test_sampling_fields_reach_the_scheduler(api: ApiHarness, client: httpx.Client) -> None:
    request = {
        "prompt": "x",
        "max_tokens": 5,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.25,
        "repetition_penalty": 1.1,
        "logit_bias": {"905": -100, "19556": 2.5},
        "min_tokens": 2,
        "seed": 7,
        "stop_token_ids": [13, 14],
        "temperature": 0.7,
    }
    assert client.post("/v1/completions", json=request).status_code == 200
    assert api.scheduler.submitted[-1].sampling_params == SamplingParams(
        top_k=-1,
        temperature=0.7,
        frequency_penalty=0.5,
        presence_penalty=-0.25,
        repetition_penalty=1.1,
        max_new_tokens=5,
        min_new_tokens=2,
        stop_token_ids=[13, 14],
        seed=7,
        logit_bias={905: -100.0, 19556: 2.5},
    )


def test_chat_max_completion_tokens_and_max_tokens(api: ApiHarness, client: httpx.Client) -> None:
    assert client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 4}).status_code == 200
    assert api.scheduler.submitted[-1].sampling_params.max_new_tokens == 4
    request = {"messages": MESSAGES, "max_tokens": 4, "max_completion_tokens": 3}
    assert client.post(CHAT, json=request).status_code == 200
    assert api.scheduler.submitted[-1].sampling_params.max_new_tokens == 3


@pytest.mark.parametrize(
    ("logit_bias", "message"),
    [
        ({"abc": 1}, "logit_bias keys must be token ids in [0, 49152), got 'abc'"),
        ({"49152": 1}, "logit_bias keys must be token ids in [0, 49152), got '49152'"),
        ({"-1": 1}, "logit_bias keys must be token ids in [0, 49152), got '-1'"),
        ({"5": 100.5}, "logit_bias values must be in [-100, 100]"),
    ],
)
def test_logit_bias_is_validated(client: httpx.Client, logit_bias: dict, message: str) -> None:
    response = client.post(CHAT, json={"messages": MESSAGES, "logit_bias": logit_bias})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": message,
        "type": "invalid_request_error",
        "param": "logit_bias",
        "code": None,
    }


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        (
            {"min_tokens": 5, "max_tokens": 3},
            "min_tokens",
            "min_tokens (5) must not exceed max_tokens (3)",
        ),
        (
            {"stop_token_ids": [49152]},
            "stop_token_ids",
            "stop_token_ids must be token ids in [0, 49152), got 49152",
        ),
        (
            {"repetition_penalty": 0},
            "repetition_penalty",
            "repetition_penalty: Input should be greater than or equal to 0.01",
        ),
        (
            {"repetition_penalty": 1e-300},
            "repetition_penalty",
            "repetition_penalty: Input should be greater than or equal to 0.01",
        ),
        (
            {"repetition_penalty": 2.5},
            "repetition_penalty",
            "repetition_penalty: Input should be less than or equal to 2",
        ),
        (
            {"stop_token_ids": list(range(1025))},
            "stop_token_ids",
            "stop_token_ids: List should have at most 1024 items after validation, not 1025",
        ),
        (
            {"logit_bias": {str(token): 1 for token in range(301)}},
            "logit_bias",
            "logit_bias: Dictionary should have at most 300 items after validation, not more",
        ),
        (
            {"stop": ["x" * 1025]},
            "stop",
            "stop: Value error, a stop string may have at most 1024 characters",
        ),
        ({"n": 129}, "n", "n: Input should be less than or equal to 128"),
    ],
)
def test_sampling_errors_name_the_field(
    client: httpx.Client, extra: dict, param: str, message: str
) -> None:
    response = client.post("/v1/completions", json={"prompt": "x", **extra})
    assert response.status_code == 400
    assert (response.json()["error"]["param"], response.json()["error"]["message"]) == (
        param,
        message,
    )


def test_n_chat_choices(api: ApiHarness, client: httpx.Client, reply: list[int]) -> None:
    before = len(api.scheduler.submitted)
    request = {"messages": MESSAGES, "n": 3, "seed": 5}
    body = client.post(CHAT, json=request).json()
    assert [choice["index"] for choice in body["choices"]] == [0, 1, 2]
    assert {choice["message"]["content"] for choice in body["choices"]} == {REPLY}
    assert {choice["finish_reason"] for choice in body["choices"]} == {"stop"}
    contexts = submitted_since(api, before)
    base = engine_id(body["id"], contexts)
    assert [context.request_id for context in contexts] == [f"{base}-{i}" for i in range(3)]
    assert [context.sampling_params.seed for context in contexts] == [5, 6, 7]
    assert len({tuple(context.prompt_token_ids) for context in contexts}) == 1
    prompt_tokens = contexts[0].num_prompt_tokens  # counted once, not n times
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 3 * (len(reply) + 1),
        "total_tokens": prompt_tokens + 3 * (len(reply) + 1),
    }


def test_unseeded_choices_get_a_drawn_seed_each_that_no_response_shows(
    api: ApiHarness, client: httpx.Client
) -> None:
    before = len(api.scheduler.submitted)
    response = client.post(CHAT, json={"messages": MESSAGES, "n": 3, "temperature": 0.8})
    again = client.post(CHAT, json={"messages": MESSAGES, "temperature": 0.8})
    assert (response.status_code, again.status_code) == (200, 200)
    *choices, other = submitted_since(api, before)
    first, second, third = sorted(choices, key=lambda context: context.request_id)
    seed = first.sampling_params.seed
    assert 0 <= seed < 2**63 and other.sampling_params.seed not in (None, seed)
    assert [context.sampling_params.seed for context in (second, third)] == [seed + 1, seed + 2]
    for sent, body in ((first, response.text), (other, again.text)):
        assert str(sent.sampling_params.seed) not in body


def test_several_prompts_times_n(api: ApiHarness, client: httpx.Client, reply: list[int]) -> None:
    before = len(api.scheduler.submitted)
    request = {"prompt": ["Say hello", "A longer second prompt"], "n": 2, "best_of": 2}
    body = client.post("/v1/completions", json=request).json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(i, REPLY) for i in range(4)]
    contexts = submitted_since(api, before)
    base = engine_id(body["id"], contexts)
    assert sorted(context.request_id for context in contexts) == [f"{base}-{i}" for i in range(4)]
    by_id = {context.request_id: context for context in contexts}
    encode = api.tokenizer.encode_now
    for index, prompt in [(0, "Say hello"), (1, "Say hello"), (2, "A longer second prompt")]:
        assert by_id[f"{base}-{index}"].prompt_token_ids == encode(prompt)
    prompt_tokens = len(encode("Say hello")) + len(encode("A longer second prompt"))
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == 4 * (len(reply) + 1)


def test_token_id_prompts(api: ApiHarness, client: httpx.Client) -> None:
    before = len(api.scheduler.submitted)
    body = client.post("/v1/completions", json={"prompt": [[1, 2, 3], [4, 5]]}).json()
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    submitted = submitted_since(api, before)
    base = engine_id(body["id"], submitted)
    contexts = {c.request_id: c for c in submitted}
    assert contexts[f"{base}-0"].prompt_token_ids == [1, 2, 3]
    assert contexts[f"{base}-1"].prompt_token_ids == [4, 5]
    assert body["usage"]["prompt_tokens"] == 5


def test_best_of_other_than_n_is_refused(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json={"prompt": "x", "n": 2, "best_of": 3})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "best_of"
    assert response.json()["error"]["message"] == (
        "best_of (3) must equal n (2) or be left out: Switchyard returns every choice it samples"
    )


def test_too_many_choices(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json={"prompt": ["x"] * 17, "n": 128})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "This request asks for 2176 choices (17 prompts x n 128); the limit is 128 "
        "(--max-choices-per-request)"
    )


def test_n_stream_interleaves_choices(api: ApiHarness, client: httpx.Client, reply) -> None:
    api.scheduler.step_interval_s = 0.005
    request = {
        "messages": MESSAGES,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = [json.loads(event) for event in sse_events(client.post(CHAT, json=request))]
    *choice_chunks, usage_chunk = chunks
    assert [chunk["choices"][0]["delta"] for chunk in choice_chunks[:2]] == [
        {"role": "assistant", "content": ""}
    ] * 2
    assert [chunk["choices"][0]["index"] for chunk in choice_chunks[:2]] == [0, 1]
    for index in (0, 1):
        mine = [chunk["choices"][0] for chunk in choice_chunks[2:]]
        mine = [choice for choice in mine if choice["index"] == index]
        assert "".join(choice["delta"].get("content", "") for choice in mine) == REPLY
        assert [choice["finish_reason"] for choice in mine if choice["finish_reason"]] == ["stop"]
        assert mine[-1]["finish_reason"] == "stop"
    content_indexes = [
        chunk["choices"][0]["index"]
        for chunk in choice_chunks[2:]
        if chunk["choices"][0]["delta"].get("content")
    ]
    assert content_indexes.index(1) < len(content_indexes) - 1 - content_indexes[::-1].index(0)
    prompt_tokens = api.scheduler.submitted[-1].num_prompt_tokens
    assert usage_chunk["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 2 * (len(reply) + 1),
        "total_tokens": prompt_tokens + 2 * (len(reply) + 1),
    }


def test_a_stop_string_aborts_every_choice(api: ApiHarness, client: httpx.Client) -> None:
    api.scheduler.step_interval_s = 0.02
    before = len(api.scheduler.submitted)
    body = client.post(CHAT, json={"messages": MESSAGES, "n": 2, "stop": "good"}).json()
    assert [choice["message"]["content"] for choice in body["choices"]] == ["Hello world, my "] * 2
    base = engine_id(body["id"], submitted_since(api, before))
    ids = {f"{base}-0", f"{base}-1"}
    assert api.scheduler.wait_for(lambda: ids <= set(api.scheduler.aborted))


@pytest.mark.parametrize(
    ("extra", "text"),
    [
        ({"stop": "good"}, "Hello world, my "),
        ({"stop": "good", "include_stop_str_in_output": True}, "Hello world, my good"),
        ({"stop": ["my", "my good"], "include_stop_str_in_output": True}, "Hello world, my"),
        ({"include_stop_str_in_output": True}, REPLY),
        ({"include_stop_str_in_output": True, "skip_special_tokens": False}, REPLY + "<|im_end|>"),
        ({"skip_special_tokens": False}, REPLY),
    ],
)
def test_include_stop_str_in_output(client: httpx.Client, extra: dict, text: str) -> None:
    body = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 50, **extra}).json()
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == (text, "stop")


def test_openai_client(api: ApiHarness, reply: list[int]) -> None:
    client = openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", timeout=10, max_retries=0)
    completion = client.completions.create(model=api.MODEL_NAME, prompt=["a", "b"], n=2)
    assert [(choice.index, choice.text) for choice in completion.choices] == [
        (i, REPLY) for i in range(4)
    ]
    assert completion.usage.completion_tokens == 4 * (len(reply) + 1)
    chat = client.chat.completions.create(
        model=api.MODEL_NAME,
        messages=MESSAGES,
        n=2,
        frequency_penalty=0.5,
        stop=["good"],
        extra_body={"min_tokens": 1, "repetition_penalty": 1.2, "include_stop_str_in_output": True},
    )
    assert [choice.message.content for choice in chat.choices] == ["Hello world, my good"] * 2
    params = api.scheduler.submitted[-1].sampling_params
    assert (params.frequency_penalty, params.min_new_tokens, params.repetition_penalty) == (
        0.5,
        1,
        1.2,
    )


def test_a_temperature_below_epsilon_is_sent_as_greedy(api: ApiHarness, client: httpx.Client):
    for temperature, sent in [(1e-300, 0.0), (9e-6, 0.0), (1e-5, 1e-5)]:
        response = client.post(CHAT, json={"messages": MESSAGES, "temperature": temperature})
        assert response.status_code == 200
        assert api.scheduler.submitted[-1].sampling_params.temperature == sent
