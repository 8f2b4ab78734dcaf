"""Tool calls parsed out of generated text, in MAX's vocabulary (``ParsedToolCall``,
``ParsedToolCallDelta``, ``ParsedToolResponse``, ``ToolParser``).

A ``ToolParser`` turns one choice's text into assistant content and tool calls; the serving
layer maps them onto OpenAI's ``message.tool_calls`` (or ``delta.tool_calls`` when streaming).
Parsers hold the state of one stream, so each choice gets its own.
"""

from __future__ import annotations

from typing import Protocol

import msgspec


class ParsedToolCall(msgspec.Struct, frozen=True):
    """One whole tool call: ``arguments`` is a JSON object as text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str


class ParsedToolCallDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    """New output of a stream: ``content`` is assistant text outside any tool call; otherwise
    the fields extend tool call ``index`` (``id`` and ``name`` come with its first delta,
    ``arguments`` may come in pieces that concatenate to the whole JSON text)."""

    index: int = 0
    id: str | None = None
    name: str | None = None
    arguments: str | None = None
    content: str | None = None


class ParsedToolResponse(msgspec.Struct, frozen=True):
    """A whole response: ``content`` is None when there is no text besides the tool calls."""

    content: str | None
    tool_calls: list[ParsedToolCall]


class ToolParser(Protocol):
    """Parses one stream of generated text. Feed it with ``parse_delta`` and end it with
    ``finish``, or give it a whole text with ``parse_complete``. The caller sends what they
    return, never the raw text: a parser holds back text that may still become a tool call."""

    def parse_delta(self, delta: str) -> list[ParsedToolCallDelta]:
        """What ``delta`` (the next piece of text) makes ready to send; may be empty."""
        ...

    def finish(self) -> list[ParsedToolCallDelta]:
        """Everything still held back, once the text has ended."""
        ...

    def parse_complete(self, response: str) -> ParsedToolResponse:
        """The content and tool calls of a whole text (a fresh parser's whole stream)."""
        ...
