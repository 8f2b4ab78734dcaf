"""Log probabilities and echo: completions' legacy shape, chat's content list, streamed and whole
(the fake scheduler reports canned values: ``fake_logprob`` and ``fake_top``)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support.fake_scheduler import ApiHarness, fake_logprob, fake_top, sse_events

EOS = 2
PROMPT = "Say hello"
PROMPT_IDS = [36218, 33662]  # "Say", " hello"
REPLY_IDS = [19556, 905]  # "Hello", " world"
EMOJI_REPLY_IDS = [26843, 40303, 228]  # "Hi", " 😊" split: " " + 3 bytes, then the 4th byte
MESSAGES = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"


@pytest.fixture(autouse=True)
def fresh_scheduler(api: ApiHarness) -> None:
    api.scheduler.reset()
    api.scheduler.reply = list(REPLY_IDS)
    api.scheduler.eos_token_id = EOS


def test_the_prompt_tokenizes_as_assumed(api: ApiHarness) -> None:
    assert api.tokenizer.encode_now(PROMPT) == PROMPT_IDS


def text(api: ApiHarness, token_id: int) -> str:
    return api.tokenizer.backend.decode([token_id], skip_special_tokens=False)


def legacy_top(api: ApiHarness, token_id: int, position: int, k: int) -> dict[str, float]:
    """The k alternatives plus the chosen token, keyed by text."""
    top = {text(api, alt): value for alt, value in fake_top(token_id, position, k).items()}
    return {**top, text(api, token_id): fake_logprob(position)}


def test_completion_logprobs(api: ApiHarness, client: httpx.Client) -> None:
    body = client.post("/v1/completions", json={"prompt": PROMPT, "logprobs": 2}).json()
    assert api.scheduler.submitted[-1].logprobs == 2
    assert api.scheduler.submitted[-1].prompt_logprobs is None
    choice = body["choices"][0]
    assert choice["text"] == "Hello world"
    generated = [*REPLY_IDS, EOS]  # the EOS token is not in the text but has a log probability
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["Hello", " world", "<|im_end|>"]
    assert logprobs["token_logprobs"] == [-0.5, -1.0, -1.5]
    assert logprobs["top_logprobs"] == [
        legacy_top(api, token_id, position, 2) for position, token_id in enumerate(generated)
    ]
    assert [len(top) for top in logprobs["top_logprobs"]] == [3, 3, 3]  # k + the chosen token
    assert logprobs["text_offset"] == [0, 5, 11]


def test_completion_logprobs_zero(client: httpx.Client) -> None:
    body = client.post("/v1/completions", json={"prompt": PROMPT, "logprobs": 0}).json()
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["top_logprobs"] == [{"Hello": -0.5}, {" world": -1.0}, {"<|im_end|>": -1.5}]


def test_echo_without_logprobs(api: ApiHarness, client: httpx.Client) -> None:
    body = client.post("/v1/completions", json={"prompt": PROMPT, "echo": True}).json()
    assert body["choices"][0]["text"] == "Say helloHello world"
    assert body["choices"][0]["logprobs"] is None
    assert api.scheduler.submitted[-1].prompt_logprobs is None
    assert body["usage"]["prompt_tokens"] == 2


def test_echo_with_logprobs(api: ApiHarness, client: httpx.Client) -> None:
    request = {"prompt": PROMPT, "echo": True, "logprobs": 1}
    body = client.post("/v1/completions", json=request).json()
    assert api.scheduler.submitted[-1].prompt_logprobs == 1
    choice = body["choices"][0]
    assert choice["text"] == "Say helloHello world"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["Say", " hello", "Hello", " world", "<|im_end|>"]
    assert logprobs["token_logprobs"] == [None, -1.0, -0.5, -1.0, -1.5]
    assert logprobs["top_logprobs"] == [
        None,
        legacy_top(api, PROMPT_IDS[1], 1, 1),
        *(legacy_top(api, t, p, 1) for p, t in enumerate([*REPLY_IDS, EOS])),
    ]
    assert logprobs["text_offset"] == [0, 3, 9, 14, 20]


def test_echo_with_max_tokens_zero_scores_the_prompt(api: ApiHarness, client: httpx.Client) -> None:
    request = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}
    body = client.post("/v1/completions", json=request).json()
    context = api.scheduler.submitted[-1]
    assert context.max_length == len(PROMPT_IDS) + 1  # one token is generated, then dropped
    choice = body["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (PROMPT, "length")
    assert choice["logprobs"]["tokens"] == ["Say", " hello"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}


@pytest.mark.parametrize("stream", [False, True])
def test_choices_of_a_prompt_echo_the_log_probabilities_its_first_choice_computed(
    api: ApiHarness, client: httpx.Client, stream: bool
) -> None:
    request = {"prompt": [PROMPT, "Hi"], "echo": True, "logprobs": 1, "n": 3, "stream": stream}
    response = client.post("/v1/completions", json=request)
    assert response.status_code == 200
    submitted = {context.request_id: context for context in api.scheduler.submitted[-6:]}
    asked = sorted(rid for rid, context in submitted.items() if context.prompt_logprobs == 1)
    assert [rid.rsplit("-", 1)[1] for rid in asked] == ["0", "3"]  # each prompt's first
    assert all(
        context.prompt_logprobs is None for rid, context in submitted.items() if rid not in asked
    )
    if stream:
        chunks = [json.loads(event)["choices"][0] for event in sse_events(response)]
        choices = {}
        for chunk in chunks:
            merged = choices.setdefault(chunk["index"], {"text": "", "tokens": [], "top": []})
            merged["text"] += chunk["text"]
            merged["tokens"] += (chunk["logprobs"] or {}).get("tokens", [])
            merged["top"] += (chunk["logprobs"] or {}).get("top_logprobs", [])
        texts = [choices[index]["text"] for index in range(6)]
        tops = [choices[index]["top"] for index in range(6)]
    else:
        body = response.json()
        texts = [choice["text"] for choice in body["choices"]]
        tops = [choice["logprobs"]["top_logprobs"] for choice in body["choices"]]
    assert texts == [PROMPT + "Hello world"] * 3 + ["HiHello world"] * 3
    first_prompt = [None, legacy_top(api, PROMPT_IDS[1], 1, 1)]
    generated = [legacy_top(api, t, p, 1) for p, t in enumerate([*REPLY_IDS, EOS])]
    assert tops[:3] == [first_prompt + generated] * 3
    assert tops[3:] == [[None, *generated]] * 3  # "Hi" is one token: nothing before it to score


@pytest.mark.parametrize("stream", [False, True])
def test_choices_waiting_for_a_failed_first_choices_log_probabilities_fail_with_it(
    api: ApiHarness, client: httpx.Client, stream: bool
) -> None:
    api.scheduler.fail_with = "the worker died"
    api.scheduler.fail_only_ending = "-0"
    request = {"prompt": PROMPT, "echo": True, "logprobs": 1, "n": 3, "stream": stream}
    response = client.post("/v1/completions", json=request, timeout=10)
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "the worker died"

    def later_choices_aborted() -> bool:
        # Read once they have reached the fake scheduler: the response may come first.
        submitted = [context.request_id for context in api.scheduler.submitted]
        first = [request_id for request_id in submitted if request_id.endswith("-0")][-1]
        later = {first[:-1] + "1", first[:-1] + "2"}
        return later <= set(submitted) and later <= set(api.scheduler.aborted)

    assert api.scheduler.wait_for(later_choices_aborted)


def test_max_tokens_zero_needs_echo(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["message"]) == (
        "max_tokens",
        "max_tokens must be at least 1 unless echo is true",
    )


def test_streamed_logprobs_match_the_whole_response(client: httpx.Client) -> None:
    request = {"prompt": PROMPT, "echo": True, "logprobs": 2, "n": 2}
    whole = client.post("/v1/completions", json=request).json()
    events = sse_events(client.post("/v1/completions", json={**request, "stream": True}))
    chunks = [json.loads(event)["choices"][0] for event in events]
    for index in (0, 1):
        mine = [chunk for chunk in chunks if chunk["index"] == index]
        merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for chunk in mine:
            for key, values in (chunk["logprobs"] or {}).items():
                merged[key] += values
        assert merged == whole["choices"][index]["logprobs"]
        assert "".join(chunk["text"] for chunk in mine) == whole["choices"][index]["text"]
    assert whole["choices"][0]["logprobs"]["text_offset"] == [0, 3, 9, 14, 20]


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"logprobs": 21}, "logprobs", "logprobs: Input should be less than or equal to 20"),
        ({"logprobs": -1}, "logprobs", "logprobs: Input should be greater than or equal to 0"),
    ],
)
def test_completion_logprobs_bounds(
    client: httpx.Client, extra: dict, param: str, message: str
) -> None:
    response = client.post("/v1/completions", json={"prompt": PROMPT, **extra})
    assert response.status_code == 400
    assert (response.json()["error"]["param"], response.json()["error"]["message"]) == (
        param,
        message,
    )


def expected_chat_content(api: ApiHarness, generated: list[int], k: int) -> list[tuple]:
    return [
        (text(api, t), fake_logprob(p), [text(api, alt) for alt in fake_top(t, p, k)])
        for p, t in enumerate(generated)
    ]


def content_summary(content: list[dict]) -> list[tuple]:
    return [
        (e["token"], e["logprob"], [top["token"] for top in e["top_logprobs"]]) for e in content
    ]


def test_chat_logprobs(api: ApiHarness, client: httpx.Client) -> None:
    api.scheduler.reply = list(EMOJI_REPLY_IDS)
    request = {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2}
    body = client.post(CHAT, json=request).json()
    assert api.scheduler.submitted[-1].logprobs == 2
    choice = body["choices"][0]
    assert choice["message"]["content"] == "Hi 😊"
    content = choice["logprobs"]["content"]
    generated = [*EMOJI_REPLY_IDS, EOS]
    assert content_summary(content) == expected_chat_content(api, generated, 2)
    assert [entry["token"] for entry in content] == ["Hi", " \ufffd", "\ufffd", "<|im_end|>"]
    assert [entry["bytes"] for entry in content] == [
        [72, 105],
        [32, 240, 159, 152],
        [138],
        list(b"<|im_end|>"),
    ]
    assert [[top["logprob"] for top in e["top_logprobs"]] for e in content] == [
        [-1.5, -2.5],
        [-2.0, -3.0],
        [-2.5, -3.5],
        [-3.0, -4.0],
    ]
    assert choice["logprobs"]["refusal"] is None


def test_chat_logprobs_without_alternatives(api: ApiHarness, client: httpx.Client) -> None:
    body = client.post(CHAT, json={"messages": MESSAGES, "logprobs": True}).json()
    assert api.scheduler.submitted[-1].logprobs == 0
    content = body["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["logprob"], e["top_logprobs"]) for e in content] == [
        ("Hello", -0.5, []),
        (" world", -1.0, []),
        ("<|im_end|>", -1.5, []),
    ]


def test_chat_without_logprobs(api: ApiHarness, client: httpx.Client) -> None:
    body = client.post(CHAT, json={"messages": MESSAGES, "logprobs": False}).json()
    assert body["choices"][0]["logprobs"] is None
    assert api.scheduler.submitted[-1].logprobs is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"top_logprobs": 2}, "top_logprobs requires logprobs to be true"),
        ({"top_logprobs": 0, "logprobs": False}, "top_logprobs requires logprobs to be true"),
        (
            {"top_logprobs": 21, "logprobs": True},
            "top_logprobs: Input should be less than or equal to 20",
        ),
    ],
)
def test_chat_top_logprobs_errors(client: httpx.Client, extra: dict, message: str) -> None:
    response = client.post(CHAT, json={"messages": MESSAGES, **extra})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["message"]) == ("top_logprobs", message)


def test_chat_stream_carries_logprobs_per_chunk(api: ApiHarness, client: httpx.Client) -> None:
    request = {"messages": MESSAGES, "logprobs": True, "top_logprobs": 1, "stream": True}
    chunks = [json.loads(e)["choices"][0] for e in sse_events(client.post(CHAT, json=request))]
    assert chunks[0]["logprobs"] is None  # the role chunk
    with_logprobs = [chunk for chunk in chunks if chunk["logprobs"] is not None]
    assert all(len(chunk["logprobs"]["content"]) == 1 for chunk in with_logprobs)
    content = [entry for chunk in with_logprobs for entry in chunk["logprobs"]["content"]]
    assert content_summary(content) == expected_chat_content(api, [*REPLY_IDS, EOS], 1)
    assert [chunk["finish_reason"] for chunk in chunks if chunk["finish_reason"]] == ["stop"]


def test_openai_client(api: ApiHarness) -> None:
    client = openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", timeout=10, max_retries=0)
    chat = client.chat.completions.create(
        model=api.MODEL_NAME, messages=MESSAGES, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert [entry.token for entry in content] == ["Hello", " world", "<|im_end|>"]
    assert [len(entry.top_logprobs) for entry in content] == [3, 3, 3]
    completion = client.completions.create(
        model=api.MODEL_NAME, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0
    )
    choice = completion.choices[0]
    assert (choice.text, choice.logprobs.tokens) == (PROMPT, ["Say", " hello"])
    assert choice.logprobs.token_logprobs == [None, -1.0]
    assert choice.logprobs.text_offset == [0, 3]
