"""Tool-call parsers (``interfaces.ToolParser``) for the three ways a chat request calls tools.

- ``HermesToolParser`` (``tool_choice`` "auto"): the model writes text and, when it decides to,
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen2.5 and
  many more). ``hermes_system_prompt`` and ``hermes_tool_call_text`` teach that format to
  models whose chat template knows nothing of tools.
- ``NamedToolParser`` (``tool_choice`` naming a function): generation is constrained to that
  function's arguments, so the whole text is the arguments.
- ``RequiredToolParser`` (``tool_choice`` "required"): generation is constrained to a JSON
  array of ``{"name": ..., "parameters": {...}}`` objects (vLLM's shape); each call is sent as
  soon as its object is complete.

Each parser holds one stream's state; ``parse_complete`` runs a whole text through the same
streaming path, so streamed and whole responses cannot disagree.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from interfaces import ParsedToolCall, ParsedToolCallDelta, ParsedToolResponse

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
HERMES_TAGS = (TOOL_CALL_START, TOOL_CALL_END)
_SEPARATORS = "[, \t\r\n"
"""What may come before an element of the JSON array of calls."""


def new_tool_call_id() -> str:
    """An id in OpenAI's shape (``call_`` and 24 alphanumerics)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def merge_deltas(deltas: list[ParsedToolCallDelta]) -> ParsedToolResponse:
    """One response from a stream's deltas: contents joined, tool calls assembled by index."""
    content = "".join(delta.content for delta in deltas if delta.content)
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        if delta.content is not None:
            continue
        call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
        call["id"] = delta.id or call["id"]
        call["name"] = delta.name or call["name"]
        call["arguments"] += delta.arguments or ""
    tool_calls = [ParsedToolCall(**calls[index]) for index in sorted(calls)]
    return ParsedToolResponse(content or None, tool_calls)


class _StreamParser:
    """``parse_complete`` for parsers that implement ``parse_delta`` and ``finish``."""

    def parse_delta(self, delta: str) -> list[ParsedToolCallDelta]:
        raise NotImplementedError

    def finish(self) -> list[ParsedToolCallDelta]:
        raise NotImplementedError

    def parse_complete(self, response: str) -> ParsedToolResponse:
        return merge_deltas(self.parse_delta(response) + self.finish())


class HermesToolParser(_StreamParser):
    """Content outside ``<tool_call>`` blocks streams as it comes, except text that may be the
    start of a tag, and whitespace just before a tool call (held until what follows is known).
    A block whose body is not ``{"name": str, "arguments": object}`` JSON stays content, so no
    text is ever lost; an unterminated block at the end is parsed if it is whole JSON (models
    often stop at EOS instead of the closing tag). ``max_calls`` (``parallel_tool_calls``
    false: 1) drops calls beyond it."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self._buffer = ""
        self._in_call = False
        self._num_calls = 0
        self._space_before_call = ""
        """Whitespace cut from before the open call: given back if the call is not one."""

    def parse_delta(self, delta: str) -> list[ParsedToolCallDelta]:
        self._buffer += delta
        deltas: list[ParsedToolCallDelta] = []
        while True:
            tag = TOOL_CALL_END if self._in_call else TOOL_CALL_START
            position = self._buffer.find(tag)
            if position < 0:
                break
            before, self._buffer = self._buffer[:position], self._buffer[position + len(tag) :]
            if self._in_call:
                deltas += self._call_or_content(before, closed=True)
            else:
                text = before.rstrip()
                self._space_before_call = before[len(text) :]
                deltas += self._content(text)
            self._in_call = not self._in_call
        if not self._in_call:
            # Send what can no longer become a tool call: not a partial tag at the end, and
            # not trailing whitespace, which is dropped if a tool call follows it.
            end = len(self._buffer) - held_back_length(self._buffer, TOOL_CALL_START)
            text = self._buffer[:end].rstrip()
            self._buffer = self._buffer[len(text) :]
            deltas += self._content(text)
        return deltas

    def finish(self) -> list[ParsedToolCallDelta]:
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            self._in_call = False
            return self._call_or_content(rest, closed=False)
        return self._content(rest)

    def _call_or_content(self, body: str, closed: bool) -> list[ParsedToolCallDelta]:
        call = _parse_call(body, arguments_key="arguments")
        space, self._space_before_call = self._space_before_call, ""
        if call is None:
            raw = space + TOOL_CALL_START + body + (TOOL_CALL_END if closed else "")
            return self._content(raw)
        if self.max_calls is not None and self._num_calls >= self.max_calls:
            return []
        index, self._num_calls = self._num_calls, self._num_calls + 1
        name, arguments = call
        return [ParsedToolCallDelta(index, new_tool_call_id(), name, arguments)]

    def _content(self, text: str) -> list[ParsedToolCallDelta]:
        if not text or (self._num_calls and text.isspace()):
            return []
        return [ParsedToolCallDelta(content=text)]


class NamedToolParser(_StreamParser):
    """The whole text is the arguments of function ``name`` (generation was constrained to
    its parameters' schema): the first delta names the call, the rest extend its arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False

    def parse_delta(self, delta: str) -> list[ParsedToolCallDelta]:
        if self._started and not delta:
            return []
        if self._started:
            return [ParsedToolCallDelta(0, arguments=delta)]
        self._started = True
        return [ParsedToolCallDelta(0, new_tool_call_id(), self.name, delta)]

    def finish(self) -> list[ParsedToolCallDelta]:
        return [] if self._started else self.parse_delta("")


class RequiredToolParser(_StreamParser):
    """The text is a JSON array of ``{"name": ..., "parameters": {...}}`` (generation was
    constrained to it); each element becomes a call as soon as it is complete. Anything that
    does not parse (the text was cut by max_tokens) is returned as content at the end.

    Each new character is scanned once for brackets outside strings, and an element is parsed
    only when a ``}`` closes it (back to the array's depth): parsing the growing element at
    every delta was quadratic (an 8k-token argument took 1.7 s)."""

    def __init__(self) -> None:
        self._text = ""
        self._position = 0
        self._num_calls = 0
        self._decoder = json.JSONDecoder()
        self._scanned = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._closed = False

    def parse_delta(self, delta: str) -> list[ParsedToolCallDelta]:
        self._text += delta
        self._scan()
        deltas = []
        while self._closed and (call := self._next_call()) is not None:
            name, arguments = call
            deltas.append(ParsedToolCallDelta(self._num_calls, new_tool_call_id(), name, arguments))
            self._num_calls += 1
        self._closed = False
        return deltas

    def finish(self) -> list[ParsedToolCallDelta]:
        rest = self._text[self._position :]
        if self._num_calls and not rest.strip(_SEPARATORS + "]"):
            return []
        return [ParsedToolCallDelta(content=rest)] if rest else []

    def _scan(self) -> None:
        """Follow the brackets of the new text; ``_closed`` once an object ends at the array's
        depth (or at the top, for text that is not an array)."""
        for char in self._text[self._scanned :]:
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "[{":
                self._depth += 1
            elif char in "]}":
                self._depth -= 1
                self._closed |= char == "}" and self._depth <= 1
        self._scanned = len(self._text)

    def _next_call(self) -> tuple[str, str] | None:
        """The next array element as a call once it is complete (and moves past it); None
        until then, or when it is not a call."""
        start = self._position
        while start < len(self._text) and self._text[start] in _SEPARATORS:
            start += 1
        try:
            _, end = self._decoder.raw_decode(self._text, start)
        except (ValueError, RecursionError):
            return None
        call = _parse_call(self._text[start:end], arguments_key="parameters")
        if call is not None:
            self._position = end
        return call


def _parse_call(text: str, arguments_key: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) from ``{"name": str, <arguments_key>: object}``; None
    when ``text`` is not that (or is nested too deeply to parse)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None
    try:
        return value["name"], _json_text(arguments)
    except ValueError:  # NaN or Infinity: not JSON a client can read
        return None


def _json_text(value: Any) -> str:
    """``value`` as JSON text that is valid UTF-8: non-ASCII kept as is, unless the model
    wrote a lone surrogate escape (half an emoji), which only an ASCII escape can carry."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, allow_nan=False)
    return text


def held_back_length(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The conversation rewritten for a chat template that knows nothing of tools: the tools
    and the ``<tool_call>`` format described in the system message, earlier calls written out
    in the assistant's text, and tool results as user turns in ``<tool_response>`` tags (one
    turn for consecutive results)."""
    rewritten: list[dict[str, Any]] = []
    previous_role = None
    for message in messages:
        if message["role"] == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if previous_role == "tool":
                rewritten[-1]["content"] += "\n" + response
            else:
                rewritten.append({"role": "user", "content": response})
        elif message.get("tool_calls"):
            calls = [_hermes_call_text(call["function"]) for call in message["tool_calls"]]
            content = "\n".join(([message["content"]] if message["content"] else []) + calls)
            rewritten.append({"role": message["role"], "content": content})
        else:
            rewritten.append(dict(message))
        previous_role = message["role"]
    if tools:
        _add_to_system_message(rewritten, _hermes_system_prompt(tools))
    return rewritten


def _add_to_system_message(messages: list[dict[str, Any]], text: str) -> None:
    if messages and messages[0]["role"] == "system" and messages[0]["content"]:
        messages[0]["content"] += "\n\n" + text
    elif messages and messages[0]["role"] == "system":
        messages[0]["content"] = text
    else:
        messages.insert(0, {"role": "system", "content": text})


def _hermes_system_prompt(tools: list[dict[str, Any]]) -> str:
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _hermes_call_text(function: dict[str, Any]) -> str:
    call = {"name": function["name"], "arguments": function["arguments"]}
    return f"{TOOL_CALL_START}\n{json.dumps(call, ensure_ascii=False)}\n{TOOL_CALL_END}"
