"""api_server.request_limits and its flags: what one request may ask for, checked before
anything costly (the real-server cases are in test_hostile_requests.py)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from api_server.__main__ import build_config, parse_args
from api_server.config import ApiServerSettings, EngineClientConfig, RequestLimits
from api_server.errors import OpenAIError
from api_server.protocol import ChatCompletionRequest, CompletionRequest
from api_server.request_limits import OutputBudget, chat_prompt_bytes, check_request_limits
from api_server.structured_output import structured_output
from interfaces import TextContext
from interfaces.settings import from_args, to_argv

MESSAGES = [{"role": "user", "content": "Hi"}]
CONTEXT_LENGTH = 1000


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "Hi", **fields})


def refusal(request, limits: RequestLimits | None = None) -> tuple[str, str | None]:
    with pytest.raises(OpenAIError) as raised:
        check_request_limits(request, limits or RequestLimits(), CONTEXT_LENGTH)
    assert raised.value.status_code == 400
    return raised.value.message, raised.value.param


def test_the_defaults_follow_the_context_length() -> None:
    limits = RequestLimits()
    assert limits.prompt_bytes(1000) == 1 << 20  # at least 1 MiB
    assert limits.prompt_bytes(131072) == 16 * 131072
    assert limits.request_output_tokens(8192) == 16 * 8192
    assert RequestLimits(5, 6, 7, 8).prompt_bytes(10**6) == 5
    assert RequestLimits(5, 6, 7, 8).request_output_tokens(10**6) == 8


@pytest.mark.parametrize("name", ["max_prompt_bytes", "max_choices", "max_request_output_tokens"])
@pytest.mark.parametrize("value", [0, -1, True, 1.5])
def test_nonsense_limits_are_refused(name: str, value) -> None:
    with pytest.raises(ValueError) as raised:
        RequestLimits(**{name: value})
    assert str(raised.value) == f"{name} must be a positive integer, got {value!r}"
    with pytest.raises(ValueError):
        EngineClientConfig("ipc://x", max_stream_backlog=0)


def test_the_flags_reach_the_config_and_the_api_servers(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 64}')
    required = ["--model", str(tmp_path), "--scheduler-addr", "ipc://s"]
    config = build_config(parse_args(required))
    assert config.request_limits == RequestLimits()
    assert config.engine.max_stream_backlog == 1024
    flags = [
        *("--max-prompt-bytes", "100", "--max-structured-output-bytes", "200"),
        *("--max-choices-per-request", "3", "--max-request-output-tokens", "400"),
        *("--max-stream-backlog", "5"),
    ]
    args = parse_args([*required, *flags])
    config = build_config(args)
    assert config.request_limits == RequestLimits(100, 200, 3, 400)
    assert config.engine.max_stream_backlog == 5
    # what `switchyard serve` hands on: the flags that give these settings, after --model and
    # --scheduler-addr
    assert tuple(to_argv(from_args(ApiServerSettings, args))[4:]) == tuple(flags)


def test_choices_are_counted_over_prompts_and_n() -> None:
    assert refusal(completion(prompt=["a"] * 43, n=3)) == (
        "This request asks for 129 choices (43 prompts x n 3); the limit is 128 "
        "(--max-choices-per-request)",
        "n",
    )
    check_request_limits(completion(prompt=["a"] * 64, n=2), RequestLimits(), CONTEXT_LENGTH)
    token_prompts = completion(prompt=[[1, 2]] * 3, n=2)
    assert refusal(token_prompts, RequestLimits(max_choices=5))[0].startswith(
        "This request asks for 6 choices (3 prompts x n 2)"
    )


def test_prompt_text_counts_every_message_part_and_tool() -> None:
    request = chat(
        messages=[
            {"role": "system", "content": "é" * 10, "name": "ab"},
            {"role": "user", "content": [{"type": "text", "text": "xyz"}]},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
        tools=[
            {
                "type": "function",
                "function": {"name": "g", "description": "dd", "parameters": {"a": 1}},
            }
        ],
    )
    # (20 + 2) + 3 + (1 + 2 + 2) + (2 + 2) + (1 + 2 + 7): images and roles do not count
    assert chat_prompt_bytes(request) == 44
    assert refusal(request, RequestLimits(max_prompt_bytes=43)) == (
        "The prompt text takes 44 bytes; the limit is 43 bytes (--max-prompt-bytes)",
        "messages",
    )
    check_request_limits(request, RequestLimits(max_prompt_bytes=44), CONTEXT_LENGTH)
    assert refusal(completion(prompt=["ab", "c"]), RequestLimits(max_prompt_bytes=2)) == (
        "The prompt text takes 3 bytes; the limit is 2 bytes (--max-prompt-bytes)",
        "prompt",
    )


def test_output_tokens_count_choices_times_max_tokens_before_tokenizing() -> None:
    limits = RequestLimits(max_request_output_tokens=100)
    check_request_limits(chat(n=4, max_tokens=25), limits, CONTEXT_LENGTH)
    message, param = refusal(chat(n=4, max_completion_tokens=26), limits)
    assert message == (
        "This request's choices may generate 104 tokens in all (choices x max_tokens, a choice "
        "without max_tokens counting the rest of the context); the limit is 100 "
        "(--max-request-output-tokens). Set a smaller max_tokens or ask for fewer choices."
    )
    assert param == "max_tokens"
    echo_only = completion(prompt=["a"] * 101, max_tokens=0, echo=True)  # 1 token each
    assert refusal(echo_only, RequestLimits(max_request_output_tokens=100))[0].startswith(
        "This request's choices may generate 101 tokens in all"
    )


def test_a_choice_without_max_tokens_counts_the_rest_of_its_context() -> None:
    budget = OutputBudget(RequestLimits(max_request_output_tokens=2000), CONTEXT_LENGTH, 2)
    budget.add(TextContext(request_id="a", prompt_token_ids=[1] * 10, max_length=1000))
    assert budget.num_tokens == 2 * 990
    budget.add(TextContext(request_id="b", prompt_token_ids=[1] * 10, max_length=20))
    assert budget.num_tokens == 2000
    with pytest.raises(OpenAIError) as raised:
        budget.add(TextContext(request_id="c", prompt_token_ids=[1] * 10, max_length=11))
    assert raised.value.message.startswith("This request's choices may generate 2002 tokens")


def test_choices_that_echo_their_prompt_with_logprobs_count_it_after_the_first() -> None:
    """Each such choice prefills its prompt for itself and answers every prompt token with its
    alternatives: 128 choices of an 8k-token prompt were 1M tokens of work and of response
    that no bound counted. A prompt's first choice is not counted: the client sent it, and
    scoring many prompts with n=1 amplifies nothing."""
    budget = OutputBudget(RequestLimits(max_request_output_tokens=1600), CONTEXT_LENGTH, 3)
    logprobs = TextContext(request_id="a", prompt_token_ids=[1] * 500, max_length=501, logprobs=5)
    budget.add(logprobs)
    assert budget.num_tokens == 3 * 1
    budget.add(msgspec.structs.replace(logprobs, prompt_logprobs=5))
    assert budget.num_tokens == 3 + 3 * 1 + 2 * 500
    with pytest.raises(OpenAIError) as raised:
        budget.add(msgspec.structs.replace(logprobs, request_id="b", prompt_logprobs=0))
    assert raised.value.message == (
        "This request's choices may generate 2009 tokens in all (choices x max_tokens, a choice "
        "without max_tokens counting the rest of the context, and each choice after a "
        "prompt's first that echoes it with logprobs its tokens); the limit is 1600 "
        "(--max-request-output-tokens). Set a smaller max_tokens or ask for fewer choices."
    )
    scoring = OutputBudget(RequestLimits(max_request_output_tokens=100), CONTEXT_LENGTH, 1)
    for _ in range(50):
        scoring.add(msgspec.structs.replace(logprobs, prompt_logprobs=5))
    assert scoring.num_tokens == 50


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"guided_regex": "a" * 11}, "guided_regex takes 11 bytes; the limit is 10 bytes"),
        ({"guided_grammar": "é" * 6}, "guided_grammar takes 12 bytes; the limit is 10 bytes"),
        ({"guided_choice": ["a", "b"]}, "guided_choice takes 18 bytes; the limit is 10 bytes"),
        ({"guided_json": '{"type": "string"}'}, "guided_json takes 18 bytes; the limit is 10"),
        ({"guided_json": {"type": "string"}}, "guided_json takes 17 bytes; the limit is 10"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"a": "bcd"}}}},
            "response_format.json_schema.schema takes 11 bytes; the limit is 10",
        ),
    ],
)
def test_constraints_are_bounded_as_sent(fields: dict, message: str) -> None:
    request = chat(**fields)
    with pytest.raises(OpenAIError) as raised:
        structured_output(request, 10)
    assert raised.value.message.startswith(message)
    assert raised.value.message.endswith("(--max-structured-output-bytes)")


def test_a_schema_keeps_its_non_ascii_characters() -> None:
    output = structured_output(chat(guided_json={"description": "é" * 4}), None)
    assert output.spec == '{"description":"éééé"}'
    assert len(output.spec.encode()) == 26  # escaped as \\u00e9 it took 42
    assert structured_output(chat(guided_json={"a": "bc"}), 10).spec == '{"a":"bc"}'  # at the limit
