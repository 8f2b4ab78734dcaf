"""Tools through the API with the official openai client: tools reach the prompt, Hermes
``<tool_call>`` output becomes ``message.tool_calls`` (whole and streamed), forced calls become
constraints, and every bad definition is a 400 naming its field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from interfaces import StructuredOutput
from tests.support.fake_scheduler import ApiHarness

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather now", "parameters": PARAMETERS},
}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL_TEXT = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def api(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    harness = ApiHarness(default_model_dir, tmp_path_factory.mktemp("api-tools"), 2048)
    yield harness
    harness.close()


@pytest.fixture
def reply(api: ApiHarness):
    """Make every request generate ``text`` then EOS."""

    def set_reply(text: str) -> None:
        api.scheduler.reply = api.tokenizer.encode_now(text, add_special_tokens=False)
        api.scheduler.eos_token_id = 2

    yield set_reply
    api.scheduler.reset()


@pytest.fixture
def openai_client(api: ApiHarness) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", timeout=10, max_retries=0)


def submitted_prompt(api: ApiHarness) -> str:
    token_ids = api.scheduler.submitted[-1].prompt_token_ids
    return api.tokenizer.backend.decode(token_ids, skip_special_tokens=False)


def test_auto_tool_call_becomes_tool_calls(api, reply, openai_client) -> None:
    reply(CALL_TEXT)
    completion = openai_client.chat.completions.create(
        model=api.MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME]
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name) == ("function", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")
    prompt = submitted_prompt(api)
    assert json.dumps(WEATHER) in prompt and json.dumps(TIME) in prompt
    assert api.scheduler.submitted[-1].structured_output is None


def test_streamed_tool_calls_assemble_to_the_same_call(api, reply, openai_client) -> None:
    reply(CALL_TEXT)
    stream = openai_client.chat.completions.create(
        model=api.MODEL_NAME, messages=MESSAGES, tools=[WEATHER], stream=True
    )
    content, calls, finish_reasons = "", {}, []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = entry["id"] or call.id
            entry["name"] = entry["name"] or call.function.name
            entry["arguments"] += call.function.arguments or ""
        if chunk.choices[0].finish_reason:
            finish_reasons.append(chunk.choices[0].finish_reason)
    assert content == "Checking."
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert finish_reasons == ["tool_calls"]


def test_plain_answers_stay_plain_with_tools(api, reply, openai_client) -> None:
    reply("It is sunny.")
    completion = openai_client.chat.completions.create(
        model=api.MODEL_NAME, messages=MESSAGES, tools=[WEATHER]
    )
    choice = completion.choices[0]
    assert (choice.message.content, choice.message.tool_calls) == ("It is sunny.", None)
    assert choice.finish_reason == "stop"


def test_tool_choice_none_leaves_tools_out(api, reply, openai_client) -> None:
    reply(CALL_TEXT)
    completion = openai_client.chat.completions.create(
        model=api.MODEL_NAME, messages=MESSAGES, tools=[WEATHER], tool_choice="none"
    )
    assert completion.choices[0].message.content == CALL_TEXT
    assert completion.choices[0].message.tool_calls is None
    assert "get_weather" not in submitted_prompt(api)


def test_named_tool_choice_forces_its_arguments(api, reply, openai_client) -> None:
    reply('{"city": "Oslo"}')
    completion = openai_client.chat.completions.create(
        model=api.MODEL_NAME,
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = completion.choices[0]
    assert api.scheduler.submitted[-1].structured_output == StructuredOutput(
        "json_schema", json.dumps(PARAMETERS, separators=(",", ":"))
    )
    assert choice.finish_reason == "stop"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Oslo"},
    )


@pytest.mark.parametrize("parallel", [None, False])
def test_required_tool_choice_forces_an_array_of_calls(api, reply, openai_client, parallel) -> None:
    reply('[{"name": "get_time", "parameters": {}}]')
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    completion = openai_client.chat.completions.create(
        model=api.MODEL_NAME,
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice="required",
        **extra,
    )
    schema = json.loads(api.scheduler.submitted[-1].structured_output.spec)
    assert (schema["type"], schema["minItems"], schema.get("maxItems")) == (
        "array",
        1,
        None if parallel is None else 1,
    )
    names = [option["properties"]["name"]["enum"] for option in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == PARAMETERS
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_time", "{}")
    ]


def test_a_conversation_with_tool_results_is_rendered(api, reply, openai_client) -> None:
    reply("It is 18C in Paris.")
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    completion = openai_client.chat.completions.create(
        model=api.MODEL_NAME, messages=messages, tools=[WEATHER]
    )
    assert completion.choices[0].message.content == "It is 18C in Paris."
    prompt = submitted_prompt(api)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' in prompt
    assert "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>" in prompt


def test_a_function_named_like_a_mode_is_still_forced(api, reply, openai_client) -> None:
    reply("{}")
    tool = {"type": "function", "function": {"name": "none", "parameters": {}}}
    completion = openai_client.chat.completions.create(
        model=api.MODEL_NAME,
        messages=MESSAGES,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "none"}},
    )
    # An empty schema would accept any JSON value: the arguments must still be an object.
    assert api.scheduler.submitted[-1].structured_output == StructuredOutput(
        "json_schema", '{"type":"object"}'
    )
    [call] = completion.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("none", "{}")


@pytest.mark.parametrize(
    "arguments",
    [
        '{"a": ' + "[" * 1500 + "]" * 1500 + "}",  # too deep to parse: rendered as text
        '{"x": "\\ud800"}',  # decodes to a lone surrogate: rendered as text
        "not json",
    ],
)
def test_odd_arguments_in_the_history_are_rendered_as_text(
    api, reply, client: httpx.Client, arguments: str
) -> None:
    reply("ok")
    call = {"id": "c1", "type": "function", "index": 0}
    call["function"] = {"name": "get_weather", "arguments": arguments}
    messages = [*MESSAGES, {"role": "assistant", "tool_calls": [call]}]
    messages.append({"role": "tool", "tool_call_id": "c1", "content": "18C"})
    response = client.post(CHAT, json={"messages": messages, "tools": [WEATHER]})
    assert response.status_code == 200, response.text
    assert json.dumps(arguments)[:200] in submitted_prompt(api)


def test_special_tool_call_tokens_reach_the_parser(default_model_dir: Path, tmp_path: Path) -> None:
    """Models whose <tool_call> tags are special tokens: the tags are not skipped."""
    from tokenizers import AddedToken, Tokenizer

    model_dir = tmp_path / "special-tags"
    shutil.copytree(default_model_dir, model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken("<tool_call>", special=True)])
    tokenizer.add_special_tokens([AddedToken("</tool_call>", special=True)])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    harness = ApiHarness(model_dir, tmp_path, 2048)
    try:
        harness.scheduler.reply = harness.tokenizer.encode_now(CALL_TEXT, add_special_tokens=False)
        harness.scheduler.eos_token_id = 2
        assert tokenizer.token_to_id("<tool_call>") in harness.scheduler.reply
        client = openai.OpenAI(base_url=f"{harness.url}/v1", api_key="x", max_retries=0)
        completion = client.chat.completions.create(
            model=harness.MODEL_NAME, messages=MESSAGES, tools=[WEATHER]
        )
        [call] = completion.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        plain = client.chat.completions.create(model=harness.MODEL_NAME, messages=MESSAGES)
        assert plain.choices[0].message.content == CALL_TEXT.replace("<tool_call>", "").replace(
            "</tool_call>", ""
        )
    finally:
        harness.close()


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "tool_choice names the function 'x', which is not among the tools",
        ),
        (
            {"tool_choice": "required"},
            "tool_choice",
            "tool_choice 'required' needs tools: the request defines none",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "tools[0].function.parameters",
            "tools[0].function.parameters is not a valid JSON schema: ",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
            "tool_choice 'required' or a named function cannot be combined with a structured",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
            "tools[0].function.name",
            "tools[0].function.name: String should match pattern",
        ),
        (
            {"tools": [{"type": "retrieval", "function": {"name": "f"}}]},
            "tools[0].type",
            "tools[0].type: Input should be 'function'",
        ),
        (
            {"tools": [WEATHER, WEATHER]},
            "tools[1].function.name",
            "tools[1].function.name 'get_weather' is defined twice",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "tools[0].function.parameters",
            "tools[0].function.parameters must describe an object (type 'object')",
        ),
        (
            {"tool_choice": "sometimes"},
            "tool_choice",
            "tool_choice",
        ),
    ],
)
def test_bad_tool_requests_are_400s(
    client: httpx.Client, extra: dict, param: str, message: str
) -> None:
    response = client.post(CHAT, json={"messages": MESSAGES, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(message)


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "18C"}, "messages[1].tool_call_id"),
        (
            {
                "role": "user",
                "content": "x",
                "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
            },
            "messages[1].tool_calls",
        ),
        ({"role": "assistant", "tool_calls": [{"id": "c"}]}, "messages[1].tool_calls[0].function"),
    ],
)
def test_bad_tool_messages_are_400s(client: httpx.Client, message: dict, param: str) -> None:
    response = client.post(CHAT, json={"messages": [*MESSAGES, message]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
