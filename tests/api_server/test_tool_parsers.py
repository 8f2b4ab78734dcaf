"""Tool-call parsers (streamed piece by piece and whole give the same calls) and how tools reach
the prompt: through a template that renders them, or written into the messages (Hermes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from api_server.tokenizer import HuggingFaceTokenizer
from api_server.tool_parsers import (
    HermesToolParser,
    NamedToolParser,
    RequiredToolParser,
    hermes_messages,
    merge_deltas,
)
from interfaces import ParsedToolCallDelta, ParsedToolResponse
from tests.support.tokenizer_dirs import chat_request, make_model_dir

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {}}'
TWO_CALLS = (
    f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\n"
)
DEEP = '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}</tool_call>"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def summary(response: ParsedToolResponse) -> tuple:
    """Content and (name, arguments) of each call; ids are random."""
    calls = [(call.name, json.loads(call.arguments)) for call in response.tool_calls]
    return response.content, calls


def streamed(parser, text: str, piece_length: int) -> list[ParsedToolCallDelta]:
    deltas = []
    for start in range(0, len(text), piece_length):
        deltas += parser.parse_delta(text[start : start + piece_length])
    return deltas + parser.finish()


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (
            TWO_CALLS,
            "Let me check.",
            [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})],
        ),
        ("No tools needed.  ", "No tools needed.  ", []),
        ("a <tool_ b <tool_call", "a <tool_ b <tool_call", []),
        # Models often end at EOS without the closing tag.
        (f"<tool_call>\n{TIME}", None, [("get_time", {})]),
        # Not a call: the text is kept, never lost.
        ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
        ('<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),
        (f"<tool_call>{TIME}</tool_call> Done.", " Done.", [("get_time", {})]),
        # Whitespace before a block that turns out not to be a call is kept too.
        ('Sure! <tool_call>{"name": "f", "argu', 'Sure! <tool_call>{"name": "f", "argu', []),
        ("a\n\n<tool_call>not json</tool_call> b", "a\n\n<tool_call>not json</tool_call> b", []),
        # Arguments JSON cannot carry: NaN, or nesting too deep to parse.
        ('<tool_call>{"name": "f", "arguments": {"x": NaN}}', None, []),
        (DEEP, DEEP, []),
    ],
)
def test_hermes_whole_and_streamed_agree(text: str, content: str | None, calls: list) -> None:
    if content is None and not calls:
        content = text
    assert summary(HermesToolParser().parse_complete(text)) == (content, calls)
    for piece_length in (1, 3, 7):
        deltas = streamed(HermesToolParser(), text, piece_length)
        assert summary(merge_deltas(deltas)) == (content, calls)


def test_hermes_streams_content_at_once_and_each_call_whole() -> None:
    parser = HermesToolParser()
    assert parser.parse_delta("Let me ") == [ParsedToolCallDelta(content="Let me")]
    assert parser.parse_delta("check.\n<tool") == [ParsedToolCallDelta(content=" check.")]
    assert parser.parse_delta(f"_call>\n{WEATHER}\n</tool_") == []
    [call] = parser.parse_delta("call>\n")
    assert (call.index, call.name, call.content) == (0, "get_weather", None)
    assert call.id.startswith("call_") and len(call.id) == 29
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}
    assert parser.finish() == []


def test_a_lone_surrogate_escape_in_arguments_stays_escaped() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"x": "\\ud83d", "y": "é"}}</tool_call>'
    [call] = HermesToolParser().parse_complete(text).tool_calls
    assert call.arguments == '{"x": "\\ud83d", "y": "\\u00e9"}'
    call.arguments.encode("utf-8")


def test_hermes_keeps_only_the_first_call_without_parallel_calls() -> None:
    response = HermesToolParser(max_calls=1).parse_complete(TWO_CALLS)
    assert summary(response) == (
        "Let me check.",
        [("get_weather", {"city": "Paris", "unit": "celsius"})],
    )


def test_required_calls_are_sent_as_each_element_completes() -> None:
    parser = RequiredToolParser()
    assert parser.parse_delta('[{"name": "get_time", "parameters": {') == []
    [first] = parser.parse_delta('}}, {"name": "get_weather", ')
    assert (first.index, first.name, first.arguments) == (0, "get_time", "{}")
    [second] = parser.parse_delta('"parameters": {"city": "Oslo"}}]')
    assert (second.index, second.name, json.loads(second.arguments)) == (
        1,
        "get_weather",
        {"city": "Oslo"},
    )
    assert parser.finish() == []


def test_required_calls_streamed_char_by_char_are_parsed_once_each(monkeypatch) -> None:
    """The growing element was parsed at every delta: quadratic in a long argument. Brackets
    and braces inside strings (escaped quotes too) do not end an element."""
    arguments = {"code": 'if (a) { b["}"] = "\\"}"; }' * 400, "nested": {"list": [{"a": [1]}]}}
    calls = [{"name": "edit", "parameters": arguments}, {"name": "get_time", "parameters": {}}]
    text = json.dumps(calls)
    parser = RequiredToolParser()
    parses = []
    decode = parser._decoder.raw_decode
    monkeypatch.setattr(parser._decoder, "raw_decode", lambda *a: parses.append(a) or decode(*a))
    deltas = [delta for char in text for delta in parser.parse_delta(char)]
    assert [(delta.index, delta.name, json.loads(delta.arguments)) for delta in deltas] == [
        (0, "edit", arguments),
        (1, "get_time", {}),
    ]
    assert len(parses) == 4  # each call once, then once more finding the next incomplete
    assert parser.finish() == []


def test_required_output_cut_short_keeps_its_text() -> None:
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_we'
    response = RequiredToolParser().parse_complete(text)
    assert summary(response) == (', {"name": "get_we', [("get_time", {})])


def test_named_call_streams_its_arguments() -> None:
    parser = NamedToolParser("get_weather")
    [first] = parser.parse_delta('{"city": ')
    assert (first.index, first.name, first.arguments) == (0, "get_weather", '{"city": ')
    assert parser.parse_delta('"Rome"}') == [ParsedToolCallDelta(0, arguments='"Rome"}')]
    assert parser.finish() == []
    whole = NamedToolParser("get_weather").parse_complete('{"city": "Rome"}')
    assert summary(whole) == (None, [("get_weather", {"city": "Rome"})])


def test_hermes_messages_describe_tools_and_write_out_the_history() -> None:
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": {"city": "Paris"}}
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [call, call]},
        {"role": "tool", "content": "18C", "tool_call_id": "call_1"},
        {"role": "tool", "content": "21C", "tool_call_id": "call_1"},
    ]
    rewritten = hermes_messages(messages, [TOOL])
    assert [message["role"] for message in rewritten] == ["system", "user", "assistant", "user"]
    system = rewritten[0]["content"]
    assert system.startswith("# Tools\n")
    assert f"<tools>\n{json.dumps(TOOL)}\n</tools>" in system
    written_call = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert rewritten[2]["content"] == f"{written_call}\n{written_call}"
    assert rewritten[3]["content"] == (
        "<tool_response>\n18C\n</tool_response>\n<tool_response>\n21C\n</tool_response>"
    )
    assert messages[1]["tool_calls"] == [call, call]  # the input is left as it was


def test_a_template_without_tools_gets_them_in_the_system_message(default_model_dir: Path) -> None:
    tokenizer = HuggingFaceTokenizer(default_model_dir, max_model_len=2048)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = tokenizer.apply_chat_template(messages, tools=[TOOL])
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(TOOL) in prompt
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_renders_tools_gets_them_and_object_arguments(
    default_model_dir: Path, tmp_path: Path
) -> None:
    template = (
        "{% for tool in tools %}[{{ tool.function.name }}]{% endfor %}"
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.arguments.city }}{% endfor %}{% endfor %}"
    )
    config = {"eos_token": "<|im_end|>", "chat_template": template}
    tokenizer = HuggingFaceTokenizer(make_model_dir(default_model_dir, tmp_path / "t", config), 128)
    call = {"id": "c", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    request = chat_request(
        [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]}]
    )
    prompt = tokenizer.render_messages(request.messages, tools=[TOOL])
    assert prompt == "[get_weather]Oslo"
