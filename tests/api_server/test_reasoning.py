"""Reasoning parsers (``--reasoning-parser``): the ``<think>`` split itself, streamed and whole
responses agreeing however the text is chunked (with tool calls in the content), and the HTTP
API with the official openai client under a Qwen3-style and a DeepSeek-R1-style template."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from api_server.__main__ import build_config, parse_args
from api_server.choices import ChoiceDelta, ChoiceOutput
from api_server.formats import ChatFormat
from api_server.reasoning import (
    REASONING_TAGS,
    ReasoningParser,
    ReasoningParsing,
    reasoning_parsing,
)
from api_server.responses import Usage
from api_server.tool_parsers import HERMES_TAGS, HermesToolParser
from api_server.tools import ToolCalling
from tests.support.fake_scheduler import ApiHarness

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
DEEPSEEK_R1_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]

# (starts in reasoning, output, reasoning, content)
CASES = [
    (False, "<think>Rayleigh.</think>\n\nScattering.", "Rayleigh.", "\n\nScattering."),
    (False, "No tags at all.", "", "No tags at all."),
    (False, "Before <think>mid</think> after", "mid", "Before  after"),
    (False, "<think>never closed", "never closed", ""),
    (False, "<think></think>answer", "", "answer"),
    (False, "<think>a</think>b</think>c<think>d", "a", "b</think>c<think>d"),
    (False, "ends with a partial <thi", "", "ends with a partial <thi"),
    (True, "inside</think>answer", "inside", "answer"),
    (True, "<think>model opened it too</think>x", "model opened it too", "x"),
    (True, "never closed <think>", "never closed <think>", ""),
    (True, "partial </thi", "partial </thi", ""),
    (True, "</think>", "", ""),
    (True, "", "", ""),
    (True, "a</think>" + CALL, "a", CALL),
]
RECORDED = [
    # Shapes real models write: Qwen3 (tags in the output), DeepSeek-R1 (opened in the prompt),
    # a reasoning model calling a tool after thinking, and one cut by max_tokens.
    "<think>\nThe user asks about the sky. Rayleigh scattering.\n</think>\n\nBecause of "
    "Rayleigh scattering: shorter wavelengths scatter more.",
    "Okay, the sky. Blue light scatters more.\n</think>\n\nRayleigh scattering.",
    "<think>\nI should call the weather tool.\n</think>\n\n" + CALL,
    "<think>\nLet me think about <tool_call> tags inside reasoning: they are not calls",
    "<think>a</think>Here: " + CALL + "\nand </think> stays content.",
]
FRAGMENTS = ["<think>", "</think>", "<", "/", "think", ">", "a", " ", "\n", "é", CALL, "<tool_"]


@pytest.mark.parametrize(("starts_in_reasoning", "text", "reasoning", "content"), CASES)
def test_think_split(starts_in_reasoning: bool, text: str, reasoning: str, content: str) -> None:
    assert ReasoningParser(starts_in_reasoning).parse_complete(text) == (reasoning, content)


def test_tag_split_across_deltas_is_held_back() -> None:
    parser = ReasoningParser(starts_in_reasoning=False)
    first = parser.stream("Hi <th")
    assert (first.reasoning, first.content, first.is_still_reasoning) == ("", "Hi ", False)
    second = parser.stream("ink>why</thi")
    assert (second.reasoning, second.content, second.is_still_reasoning) == ("why", "", True)
    third = parser.stream("nk>ok")
    assert (third.reasoning, third.content, third.is_still_reasoning) == ("", "ok", False)
    last = parser.finish()
    assert (last.reasoning, last.content) == ("", "")


@pytest.mark.parametrize(
    ("name", "prompt_tail", "starts_in_reasoning"),
    [
        ("qwen3", "<|im_start|>assistant\n", False),
        ("qwen3", "<|im_start|>assistant\n<think>\n", True),
        ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("deepseek_r1", "<|Assistant|><think>\n", True),
        ("deepseek_r1", "<|Assistant|>", True),
        ("deepseek_r1", "<|Assistant|><think>\n\n</think>\n\n", False),
    ],
)
def test_prompt_decides_where_output_starts(
    name: str, prompt_tail: str, starts_in_reasoning: bool
) -> None:
    assert reasoning_parsing(name, prompt_tail).starts_in_reasoning is starts_in_reasoning


def _format(starts_in_reasoning: bool, with_tools: bool) -> ChatFormat:
    tools = ToolCalling([], None, HermesToolParser, "tool_calls", HERMES_TAGS)
    reasoning = ReasoningParsing("qwen3", starts_in_reasoning)
    return ChatFormat("chatcmpl-1", "m", None, None, tools if with_tools else None, reasoning)


def _streamed(text: str, cuts: list[int], fmt: ChatFormat) -> tuple:
    """(content, reasoning, [(name, arguments)], finish_reason) assembled from the chunks of
    ``text`` cut at ``cuts``."""
    bounds = [0, *cuts, len(text)]
    content, reasoning, calls, finish_reason = "", "", {}, None
    for number, (start, end) in enumerate(itertools.pairwise(bounds)):
        last = number == len(bounds) - 2
        delta = ChoiceDelta(0, text[start:end], None, "length" if last else None)
        chunks = [fmt.delta_chunk(delta)] + ([fmt.finish_chunk(0, "length")] if last else [])
        for chunk in filter(None, chunks):
            [choice] = chunk.choices
            content += choice.delta.content or ""
            reasoning += choice.delta.reasoning_content or ""
            finish_reason = choice.finish_reason or finish_reason
            for call in choice.delta.tool_calls or []:
                name, arguments = calls.get(call.index, ("", ""))
                calls[call.index] = (
                    call.function.name or name,
                    arguments + call.function.arguments,
                )
    return content, reasoning, [calls[index] for index in sorted(calls)], finish_reason


def _whole(text: str, fmt: ChatFormat) -> tuple:
    [choice] = fmt.response([ChoiceOutput(0, text, None, "length")], Usage.of(1, 1)).choices
    message = choice.message
    calls = [(call.function.name, call.function.arguments) for call in message.tool_calls or []]
    return message.content or "", message.reasoning_content or "", calls, choice.finish_reason


@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("starts_in_reasoning", [False, True])
def test_stream_and_whole_agree_for_any_chunking(starts_in_reasoning, with_tools) -> None:
    rng = random.Random(25)
    generated = [
        "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 24))) for _ in range(60)
    ]
    for text in RECORDED + [case[1] for case in CASES] + generated:
        expected = _whole(text, _format(starts_in_reasoning, with_tools))
        for _ in range(12):
            cuts = sorted(
                rng.sample(range(1, len(text)), min(max(len(text) - 1, 0), rng.randint(0, 8)))
            )
            streamed = _streamed(text, cuts, _format(starts_in_reasoning, with_tools))
            assert streamed == expected, (text, cuts)
        single_characters = list(range(1, len(text)))
        assert _streamed(text, single_characters, _format(starts_in_reasoning, with_tools)) == (
            expected
        )


def test_tool_call_after_reasoning_is_parsed_from_content_only() -> None:
    text = "<think>maybe <tool_call>{}</tool_call></think>\n\n" + CALL
    content, reasoning, calls, finish_reason = _whole(text, _format(False, with_tools=True))
    assert reasoning == "maybe <tool_call>{}</tool_call>"
    assert content == ""
    assert calls == [("get_weather", '{"city": "Paris"}')]
    assert finish_reason == "length"


def test_reasoning_parser_flag(default_model_dir: Path, capsys) -> None:
    args = ["--model", str(default_model_dir), "--scheduler-addr", "ipc://s"]
    config = build_config(parse_args([*args, "--reasoning-parser", "deepseek_r1"]))
    assert config.reasoning_parser == "deepseek_r1"
    assert build_config(parse_args(args)).reasoning_parser is None
    with pytest.raises(SystemExit):
        parse_args([*args, "--reasoning-parser", "granite"])
    assert (
        "argument --reasoning-parser: unknown reasoning parser 'granite' "
        "(known: deepseek_r1, qwen3)" in capsys.readouterr().err
    )
    # Without a text generation model there is no output to parse.
    no_model = ["--scheduler-addr", "ipc://s", "--reasoning-parser", "qwen3"]
    with pytest.raises(ValueError, match="--reasoning-parser parses --model's output; give it"):
        build_config(parse_args(no_model))
    from api_server.config import ApiServerSettings
    from switchyard.serve_config import ServeConfig

    parsing = ApiServerSettings(reasoning_parser="qwen3")
    with pytest.raises(ValueError, match=r"^--reasoning-parser configure the text generation"):
        ServeConfig(None, None, embedding_model_dir=default_model_dir, api_server=parsing)


# Through HTTP: the fake scheduler generates the text, the tokenizer has an inline template.


@pytest.fixture(scope="module")
def api(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    harness = ApiHarness(default_model_dir, tmp_path_factory.mktemp("api-reasoning"), 2048)
    yield harness
    harness.close()


@pytest.fixture
def serve(api: ApiHarness, monkeypatch: pytest.MonkeyPatch):
    """Serve with reasoning parser ``name`` and chat ``template``; every request generates
    ``text`` then EOS."""

    def configure(name: str | None, template: str, text: str) -> None:
        state = api.app.state.server
        monkeypatch.setattr(
            state, "config", dataclasses.replace(state.config, reasoning_parser=name)
        )
        monkeypatch.setattr(api.tokenizer, "chat_templates", {"default": template})
        api.scheduler.reply = api.tokenizer.encode_now(text, add_special_tokens=False)
        api.scheduler.eos_token_id = 2

    yield configure
    api.scheduler.reset()


@pytest.fixture
def client(api: ApiHarness) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", timeout=10, max_retries=0)


def _both(client: openai.OpenAI, **fields) -> tuple[tuple, tuple]:
    """(reasoning, content, finish reason) whole and streamed."""
    whole = client.chat.completions.create(model=ApiHarness.MODEL_NAME, messages=MESSAGES, **fields)
    message = whole.choices[0].message
    whole_parts = (
        getattr(message, "reasoning_content", None),
        message.content,
        whole.choices[0].finish_reason,
    )
    stream = client.chat.completions.create(
        model=ApiHarness.MODEL_NAME, messages=MESSAGES, stream=True, **fields
    )
    reasoning, content, finish_reason = [], [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        content.append(delta.content or "")
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    return whole_parts, ("".join(reasoning) or None, "".join(content), finish_reason)


def _prompt(api: ApiHarness) -> str:
    token_ids = api.scheduler.submitted[-1].prompt_token_ids
    return api.tokenizer.backend.decode(token_ids, skip_special_tokens=False)


def test_qwen3_tags_in_the_output(api, serve, client) -> None:
    serve("qwen3", QWEN3_TEMPLATE, "<think>\nShort waves scatter.\n</think>\n\nRayleigh.")
    whole, streamed = _both(client)
    assert whole == ("\nShort waves scatter.\n", "\n\nRayleigh.", "stop")
    assert streamed == whole
    assert _prompt(api).endswith("<|im_start|>assistant\n")


def test_qwen3_without_thinking_has_no_reasoning(api, serve, client) -> None:
    serve("qwen3", QWEN3_TEMPLATE, "Rayleigh scattering.")
    whole, streamed = _both(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert whole == (None, "Rayleigh scattering.", "stop")
    assert streamed == whole
    assert _prompt(api).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_deepseek_r1_output_starts_inside_reasoning(api, serve, client) -> None:
    serve("deepseek_r1", DEEPSEEK_R1_TEMPLATE, "Blue scatters more.\n</think>\n\nRayleigh.")
    whole, streamed = _both(client)
    assert whole == ("Blue scatters more.\n", "\n\nRayleigh.", "stop")
    assert streamed == whole
    assert _prompt(api).endswith("<|Assistant|><think>\n")


def test_qwen3_under_a_template_that_opened_think(api, serve, client) -> None:
    serve("qwen3", DEEPSEEK_R1_TEMPLATE, "Blue.</think>Rayleigh.")
    whole, streamed = _both(client)
    assert whole == ("Blue.", "Rayleigh.", "stop")
    assert streamed == whole


def test_reasoning_cut_by_max_tokens(api, serve, client) -> None:
    serve("deepseek_r1", DEEPSEEK_R1_TEMPLATE, "a b c d e f g h i j k l m n o p")
    whole, streamed = _both(client, max_tokens=4)
    assert whole[1:] == ("", "length")
    assert whole[0] == api.tokenizer.backend.decode(api.scheduler.reply[:4])
    assert streamed == whole


def test_tool_call_after_reasoning(api, serve, client) -> None:
    serve("qwen3", QWEN3_TEMPLATE, "<think>Use the tool.</think>\n\n" + CALL)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    completion = client.chat.completions.create(
        model=ApiHarness.MODEL_NAME, messages=MESSAGES, tools=[tool]
    )
    choice = completion.choices[0]
    assert choice.message.reasoning_content == "Use the tool."
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert choice.finish_reason == "tool_calls"


def test_constrained_output_is_all_content(api, serve, client) -> None:
    """A grammar shapes the output from its first token, so there is no reasoning to split:
    under deepseek_r1 (output starting inside reasoning) a required tool call and a JSON
    object still arrive as a tool call and as content."""
    serve("deepseek_r1", DEEPSEEK_R1_TEMPLATE, '[{"name": "get_weather", "arguments": {}}]')
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    completion = client.chat.completions.create(
        model=ApiHarness.MODEL_NAME, messages=MESSAGES, tools=[tool], tool_choice="required"
    )
    message = completion.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert [call.function.name for call in message.tool_calls] == ["get_weather"]
    serve("deepseek_r1", DEEPSEEK_R1_TEMPLATE, '{"sky": "blue"}')
    whole, streamed = _both(client, response_format={"type": "json_object"})
    assert whole == (None, '{"sky": "blue"}', "stop")
    assert streamed == whole


def test_template_kwargs_may_use_any_identifier_the_template_does_not_own(
    api, serve, client
) -> None:
    serve("qwen3", QWEN3_TEMPLATE, "x")
    whole, _ = _both(client, extra_body={"chat_template_kwargs": {"self": 1, "enable_thinking": 0}})
    assert whole == (None, "x", "stop")
    # An integer of more digits than Python converts (4,300): raw JSON, as a client sends it.
    body = json.dumps({"model": ApiHarness.MODEL_NAME, "messages": MESSAGES})
    body = body[:-1] + ', "chat_template_kwargs": {"n": ' + "9" * 5000 + "}}"
    response = httpx.post(
        f"{api.url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert response.status_code == 400  # the body parser refuses it first
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_without_a_parser_the_tags_stay_content(api, serve, client) -> None:
    serve(None, QWEN3_TEMPLATE, "<think>x</think>y")
    whole, streamed = _both(client)
    assert whole == (None, "<think>x</think>y", "stop")
    assert streamed == whole


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"messages": []}, "may not set 'messages'"),
        ({"not an identifier": 1}, "may not set 'not an identifier'"),
        ({"raise_exception": 1}, "may not set 'raise_exception'"),
        ({"big": "x" * 20000}, "the limit is 16384"),
    ],
)
def test_bad_chat_template_kwargs_are_400(api, serve, client, kwargs, message) -> None:
    serve("qwen3", QWEN3_TEMPLATE, "x")
    with pytest.raises(openai.BadRequestError, match=message) as error:
        client.chat.completions.create(
            model=ApiHarness.MODEL_NAME,
            messages=MESSAGES,
            extra_body={"chat_template_kwargs": kwargs},
        )
    assert error.value.status_code == 400


def test_each_choice_has_its_own_parser(api, serve, client) -> None:
    serve("qwen3", QWEN3_TEMPLATE, "<think>Blue.</think>Rayleigh.")
    stream = client.chat.completions.create(
        model=ApiHarness.MODEL_NAME, messages=MESSAGES, n=2, stream=True
    )
    parts = {0: ["", ""], 1: ["", ""]}
    for chunk in stream:
        for choice in chunk.choices:
            parts[choice.index][0] += getattr(choice.delta, "reasoning_content", None) or ""
            parts[choice.index][1] += choice.delta.content or ""
    assert parts == {0: ["Blue.", "Rayleigh."], 1: ["Blue.", "Rayleigh."]}


def test_special_think_tokens_reach_the_parser(default_model_dir: Path, tmp_path: Path) -> None:
    """Models whose <think> tags are special tokens: the tags are not skipped."""
    from tokenizers import AddedToken, Tokenizer

    model_dir = tmp_path / "special-think"
    shutil.copytree(default_model_dir, model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(tag, special=True) for tag in REASONING_TAGS])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    harness = ApiHarness(model_dir, tmp_path, 2048)
    try:
        state = harness.app.state.server
        state.config = dataclasses.replace(state.config, reasoning_parser="qwen3")
        text = "<think>Blue.</think>Rayleigh."
        harness.scheduler.reply = harness.tokenizer.encode_now(text, add_special_tokens=False)
        harness.scheduler.eos_token_id = 2
        assert tokenizer.token_to_id("<think>") in harness.scheduler.reply
        client = openai.OpenAI(base_url=f"{harness.url}/v1", api_key="x", max_retries=0)
        message = (
            client.chat.completions.create(model=harness.MODEL_NAME, messages=MESSAGES)
            .choices[0]
            .message
        )
        assert (message.reasoning_content, message.content) == ("Blue.", "Rayleigh.")
    finally:
        harness.close()


def test_tokenize_renders_messages_as_the_chat_completion_does(api, serve, client) -> None:
    """/tokenize takes ``chat_template_kwargs`` as vLLM's does, so it counts the prompt a chat
    completion with the same kwargs sends; with a prompt, or with bad kwargs, it is a 400."""
    serve("qwen3", QWEN3_TEMPLATE, "Rayleigh scattering.")
    kwargs = {"enable_thinking": False}
    client.chat.completions.create(
        model=ApiHarness.MODEL_NAME, messages=MESSAGES, extra_body={"chat_template_kwargs": kwargs}
    )
    sent = list(api.scheduler.submitted[-1].prompt_token_ids)
    counted = httpx.post(
        f"{api.url}/tokenize",
        json={"messages": MESSAGES, "chat_template_kwargs": kwargs},
        timeout=10,
    ).json()
    assert (counted["tokens"], counted["count"]) == (sent, len(sent))
    plain = httpx.post(f"{api.url}/tokenize", json={"messages": MESSAGES}, timeout=10).json()
    assert plain["count"] < counted["count"]  # without the empty think block
    refused = [
        ({"prompt": "Hi", "chat_template_kwargs": kwargs}, "applies to messages, not a prompt"),
        (
            {"messages": MESSAGES, "chat_template_kwargs": {"messages": []}},
            "may not set 'messages'",
        ),
    ]
    for body, message in refused:
        response = httpx.post(f"{api.url}/tokenize", json=body, timeout=10)
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]["message"]
