"""Reasoning parsers (``--reasoning-parser``): split a chat choice's text into the model's
reasoning, sent as ``reasoning_content``, and its answer, sent as ``content``.

Both parsers serve the ``<think>...</think>`` families and take vLLM's names:

- ``deepseek_r1``: the output starts inside the reasoning, because the chat template opened
  ``<think>`` in the generation prompt (or the model writes it first, and it is dropped);
  everything up to the first ``</think>`` is reasoning. A prompt that ends with ``</think>``
  (a template with thinking turned off) starts as content instead.
- ``qwen3``: the output starts as content and the first ``<think>`` opens the reasoning, unless
  the prompt itself ends with ``<think>`` (a template that opened it). With
  ``chat_template_kwargs: {"enable_thinking": false}`` Qwen3's template closes an empty
  ``<think></think>`` in the prompt and the model writes no tags: all of it is content.

For both, the reasoning ends at the first ``</think>``; what follows is content, tags and all.
A ``<think>`` never closed leaves all of the rest reasoning (the choice ran out of tokens).
No text is ever lost: text before a ``<think>`` is content, and only the tags are removed.

MAX's ``ReasoningParser`` finds a ``ReasoningSpan`` in token ids; these parsers work on the
detokenized text instead, as the tool parsers do, so a tag split across tokens or deltas, or
tags that are not single tokens, parse the same. ``ReasoningParser.stream`` holds back text
that may be the start of a tag until the next delta says, and ``finish`` lets it go;
``parse_complete`` runs a whole text through the same path, so a streamed response and a whole
one cannot disagree.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from enum import Enum

from api_server.tool_parsers import held_back_length

THINK_START, THINK_END = "<think>", "</think>"
REASONING_TAGS = (THINK_START, THINK_END)
REASONING_PARSER_NAMES = ("deepseek_r1", "qwen3")
"""The names ``--reasoning-parser`` takes."""
_PROMPT_TAIL_TOKENS = 16
"""How many of the prompt's last tokens are decoded to see whether it opened ``<think>``."""


@dataclass(frozen=True)
class ParsedReasoningDelta:
    """What one piece of text adds (MAX's ``ParsedReasoningDelta``, as text): ``reasoning`` and
    ``content`` (either may be empty), and whether the reasoning may still go on."""

    reasoning: str
    content: str
    is_still_reasoning: bool


class _State(Enum):
    BEFORE = "before"
    """Content; the first ``<think>`` opens the reasoning."""
    OPENING = "opening"
    """Reasoning from the start; a ``<think>`` the model writes first is dropped."""
    REASONING = "reasoning"
    AFTER = "after"
    """Content to the end: the reasoning ended at the first ``</think>``."""


class ReasoningParser:
    """One stream's parser: feed it every delta with ``stream``, then call ``finish`` once."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self._state = _State.OPENING if starts_in_reasoning else _State.BEFORE
        self._buffer = ""

    @property
    def is_still_reasoning(self) -> bool:
        return self._state in (_State.OPENING, _State.REASONING)

    def stream(self, delta: str) -> ParsedReasoningDelta:
        """The reasoning and content that ``delta`` makes certain."""
        self._buffer += delta
        reasoning, content = [], []
        while True:
            state = self._state
            text, is_reasoning = self._step()
            (reasoning if is_reasoning else content).append(text)
            if self._state is state:  # no tag consumed: nothing more is settled
                break
        return ParsedReasoningDelta("".join(reasoning), "".join(content), self.is_still_reasoning)

    def finish(self) -> ParsedReasoningDelta:
        """The text still held back (a partial tag at the end is text after all)."""
        rest, self._buffer = self._buffer, ""
        if self._state is _State.OPENING:
            self._state = _State.REASONING
        is_reasoning = self._state is _State.REASONING
        return ParsedReasoningDelta(
            rest if is_reasoning else "", "" if is_reasoning else rest, is_reasoning
        )

    def parse_complete(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole text, through the streaming path."""
        first, last = self.stream(text), self.finish()
        return first.reasoning + last.reasoning, first.content + last.content

    def _step(self) -> tuple[str, bool]:
        """Take what the buffer settles in the current state, up to and including the next
        tag (which changes the state): (text, whether it is reasoning)."""
        if self._state is _State.AFTER:
            text, self._buffer = self._buffer, ""
            return text, False
        if self._state is _State.OPENING:
            if self._buffer.startswith(THINK_START):
                self._buffer = self._buffer[len(THINK_START) :]
            elif THINK_START.startswith(self._buffer):
                return "", True  # may still become the tag: wait for more
            self._state = _State.REASONING
            return "", True
        is_reasoning = self._state is _State.REASONING
        tag = THINK_END if is_reasoning else THINK_START
        position = self._buffer.find(tag)
        if position >= 0:
            text, self._buffer = self._buffer[:position], self._buffer[position + len(tag) :]
            self._state = _State.AFTER if is_reasoning else _State.REASONING
            return text, is_reasoning
        end = len(self._buffer) - held_back_length(self._buffer, tag)
        text, self._buffer = self._buffer[:end], self._buffer[end:]
        return text, is_reasoning


@dataclass(frozen=True)
class ReasoningParsing:
    """How the choices of one chat request parse reasoning: ``new_parser`` makes one per
    choice (they share the prompt, so they start in the same state)."""

    name: str
    starts_in_reasoning: bool

    def new_parser(self) -> ReasoningParser:
        return ReasoningParser(self.starts_in_reasoning)


def reasoning_parsing(name: str, prompt_tail: str) -> ReasoningParsing:
    """The parsing of parser ``name`` for a prompt whose text ends with ``prompt_tail`` (its
    last ``prompt_tail_token_ids``, special tokens kept, are enough)."""
    if name not in REASONING_PARSER_NAMES:
        raise ValueError(f"unknown reasoning parser {name!r}")
    tail = prompt_tail.rstrip()
    if name == "deepseek_r1":  # unless the template closed the reasoning (thinking off)
        return ReasoningParsing(name, starts_in_reasoning=not tail.endswith(THINK_END))
    return ReasoningParsing(name, starts_in_reasoning=tail.endswith(THINK_START))


def prompt_tail_token_ids(prompt_token_ids: list[int]) -> list[int]:
    """The prompt's tokens whose text ``reasoning_parsing`` looks at."""
    return prompt_token_ids[-_PROMPT_TAIL_TOKENS:]


def reasoning_parser_name(text: str) -> str:
    """argparse type of ``--reasoning-parser``: a known parser's name, else an error that lists
    them."""
    if text not in REASONING_PARSER_NAMES:
        known = ", ".join(REASONING_PARSER_NAMES)
        raise argparse.ArgumentTypeError(f"unknown reasoning parser {text!r} (known: {known})")
    return text
