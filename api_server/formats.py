"""How each endpoint shapes its answer: whole responses and stream chunks, chat and completions.

One ``ResponseFormat`` per request: it fixes the response id, ``created`` time and model name, so
every chunk of a stream carries the same three, and it formats log probabilities (``num_logprobs``
alternatives per token; None when the request did not ask for them).
"""

from __future__ import annotations

import time
from typing import Protocol

from pydantic import BaseModel

from api_server.choices import ChoiceDelta, ChoiceOutput
from api_server.logprobs import TokenLogprob, TokenTexts, chat_logprobs, completion_logprobs
from api_server.reasoning import ReasoningParser, ReasoningParsing
from api_server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FinishReason,
    ResponseFunctionCall,
    ResponseToolCall,
    Usage,
)
from api_server.tools import ToolCalling
from interfaces import ParsedToolCallDelta, ToolParser


class ResponseFormat(Protocol):
    def opening_chunks(self, indexes: list[int]) -> list[BaseModel]:
        """Chunks sent before any text (chat: the assistant role, once per choice)."""
        ...

    def delta_chunk(self, delta: ChoiceDelta) -> BaseModel | None:
        """The chunk for one choice's new text and log probabilities; None if it has neither."""
        ...

    def finish_chunk(self, index: int, finish_reason: FinishReason) -> BaseModel: ...

    def usage_chunk(self, usage: Usage) -> BaseModel:
        """The last chunk when ``stream_options.include_usage``: no choices, only usage."""
        ...

    def response(self, choices: list[ChoiceOutput], usage: Usage) -> BaseModel:
        """The whole (non-streaming) response."""
        ...


class _FormatBase:
    """What every response format needs: ids, the creation time and logprob settings."""

    def __init__(
        self, response_id: str, model: str, num_logprobs: int | None, texts: TokenTexts
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.num_logprobs = num_logprobs
        self.texts = texts


class ChatFormat(_FormatBase):
    """``chat.completion`` and ``chat.completion.chunk`` objects. With ``reasoning``, each
    choice's text first goes through its own reasoning parser: the reasoning becomes
    ``reasoning_content``, the rest goes on as the text. With ``tools``, that text goes through
    the choice's tool parser: tool calls become ``tool_calls``, the rest ``content``, and a
    choice that called tools finishes with ``tools.finish_reason``."""

    def __init__(
        self,
        response_id: str,
        model: str,
        num_logprobs: int | None,
        texts: TokenTexts,
        tools: ToolCalling | None = None,
        reasoning: ReasoningParsing | None = None,
    ) -> None:
        super().__init__(response_id, model, num_logprobs, texts)
        self.tools = tools
        self.reasoning = reasoning
        self._parsers: dict[int, ToolParser] = {}
        self._reasoning_parsers: dict[int, ReasoningParser] = {}
        self._called_tools: set[int] = set()

    def opening_chunks(self, indexes: list[int]) -> list[BaseModel]:
        return [self._chunk(index, DeltaMessage(role="assistant", content="")) for index in indexes]

    def delta_chunk(self, delta: ChoiceDelta) -> BaseModel | None:
        logprobs = self._logprobs(delta.logprobs)
        if self.tools is None and self.reasoning is None:
            if not delta.text and not delta.logprobs:
                return None
            return self._chunk(delta.index, DeltaMessage(content=delta.text), logprobs=logprobs)
        reasoning, text = self._stream_reasoning(delta)
        if self.tools is None:
            message = DeltaMessage(content=text or None, reasoning_content=reasoning or None)
            message = message if text or reasoning else None
        else:
            message = self._delta_message(delta.index, self._stream_tools(delta, text), reasoning)
        if message is None and not delta.logprobs:
            return None
        return self._chunk(delta.index, message or DeltaMessage(), logprobs=logprobs)

    def _stream_reasoning(self, delta: ChoiceDelta) -> tuple[str, str]:
        """(reasoning, the rest) of the delta's text; no reasoning without a parser."""
        if self.reasoning is None:
            return "", delta.text
        if delta.index not in self._reasoning_parsers:
            self._reasoning_parsers[delta.index] = self.reasoning.new_parser()
        parser = self._reasoning_parsers[delta.index]
        parsed = parser.stream(delta.text)
        reasoning, text = parsed.reasoning, parsed.content
        if delta.finish_reason is not None:
            rest = parser.finish()
            reasoning, text = reasoning + rest.reasoning, text + rest.content
        return reasoning, text

    def _stream_tools(self, delta: ChoiceDelta, text: str) -> list[ParsedToolCallDelta]:
        if delta.index not in self._parsers:
            self._parsers[delta.index] = self.tools.new_parser()
        parser = self._parsers[delta.index]
        parsed = parser.parse_delta(text)
        if delta.finish_reason is not None:
            parsed += parser.finish()
        return parsed

    def finish_chunk(self, index: int, finish_reason: FinishReason) -> BaseModel:
        return self._chunk(index, DeltaMessage(), self._finish_reason(index, finish_reason))

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(
            id=self.response_id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def response(self, choices: list[ChoiceOutput], usage: Usage) -> BaseModel:
        return ChatCompletion(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=[self._choice(choice) for choice in choices],
            usage=usage,
        )

    def _choice(self, choice: ChoiceOutput) -> ChatChoice:
        message = self._message(choice)  # first: it records whether the choice called tools
        return ChatChoice(
            index=choice.index,
            message=message,
            logprobs=self._logprobs(choice.logprobs),
            finish_reason=self._finish_reason(choice.index, choice.finish_reason),
        )

    def _message(self, choice: ChoiceOutput) -> AssistantMessage:
        reasoning, text = "", choice.text
        if self.reasoning is not None:
            reasoning, text = self.reasoning.new_parser().parse_complete(choice.text)
        reasoning_content = reasoning or None
        if self.tools is None:
            return AssistantMessage(content=text, reasoning_content=reasoning_content)
        parsed = self.tools.new_parser().parse_complete(text)
        if not parsed.tool_calls:
            return AssistantMessage(
                content=parsed.content or "", reasoning_content=reasoning_content
            )
        self._called_tools.add(choice.index)
        tool_calls = [
            ResponseToolCall(
                id=call.id, function=ResponseFunctionCall(name=call.name, arguments=call.arguments)
            )
            for call in parsed.tool_calls
        ]
        return AssistantMessage(
            content=parsed.content, reasoning_content=reasoning_content, tool_calls=tool_calls
        )

    def _delta_message(
        self, index: int, parsed: list[ParsedToolCallDelta], reasoning: str = ""
    ) -> DeltaMessage | None:
        content = "".join(delta.content for delta in parsed if delta.content)
        tool_calls = [
            DeltaToolCall(
                index=delta.index,
                id=delta.id,
                type="function" if delta.id else None,
                function=DeltaFunctionCall(name=delta.name, arguments=delta.arguments),
            )
            for delta in parsed
            if delta.content is None
        ]
        if tool_calls:
            self._called_tools.add(index)
        if not content and not tool_calls and not reasoning:
            return None
        return DeltaMessage(
            content=content or None,
            reasoning_content=reasoning or None,
            tool_calls=tool_calls or None,
        )

    def _finish_reason(self, index: int, finish_reason: FinishReason) -> FinishReason:
        if self.tools is not None and finish_reason == "stop" and index in self._called_tools:
            return self.tools.finish_reason
        return finish_reason

    def _logprobs(self, entries: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if entries is None or self.num_logprobs is None:
            return None
        return chat_logprobs(entries, self.num_logprobs, self.texts)

    def _chunk(
        self,
        index: int,
        delta: DeltaMessage,
        finish_reason: FinishReason | None = None,
        logprobs: ChatLogprobs | None = None,
    ) -> BaseModel:
        choice = ChatChunkChoice(
            index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason
        )
        return ChatCompletionChunk(
            id=self.response_id, created=self.created, model=self.model, choices=[choice]
        )


class CompletionFormat(_FormatBase):
    """``text_completion`` objects, whole and as stream chunks. In a stream, each choice's
    ``text_offset`` values continue from its previous chunk."""

    def __init__(
        self, response_id: str, model: str, num_logprobs: int | None, texts: TokenTexts
    ) -> None:
        super().__init__(response_id, model, num_logprobs, texts)
        self._text_offsets: dict[int, int] = {}

    def opening_chunks(self, indexes: list[int]) -> list[BaseModel]:
        return []

    def delta_chunk(self, delta: ChoiceDelta) -> BaseModel | None:
        if not delta.text and not delta.logprobs:
            return None
        offset = self._text_offsets.get(delta.index, 0)
        logprobs = self._logprobs(delta.logprobs, offset)
        if logprobs is not None:
            self._text_offsets[delta.index] = offset + sum(map(len, logprobs.tokens))
        choice = CompletionChoice(index=delta.index, text=delta.text, logprobs=logprobs)
        return self._completion([choice])

    def finish_chunk(self, index: int, finish_reason: FinishReason) -> BaseModel:
        return self._completion(
            [CompletionChoice(index=index, text="", finish_reason=finish_reason)]
        )

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._completion([], usage)

    def response(self, choices: list[ChoiceOutput], usage: Usage) -> BaseModel:
        completion_choices = [
            CompletionChoice(
                index=choice.index,
                text=choice.text,
                logprobs=self._logprobs(choice.logprobs, 0),
                finish_reason=choice.finish_reason,
            )
            for choice in choices
        ]
        return self._completion(completion_choices, usage)

    def _logprobs(
        self, entries: list[TokenLogprob] | None, text_offset: int
    ) -> CompletionLogprobs | None:
        if entries is None or self.num_logprobs is None:
            return None
        return completion_logprobs(entries, self.num_logprobs, self.texts, text_offset)

    def _completion(
        self, choices: list[CompletionChoice], usage: Usage | None = None
    ) -> Completion:
        return Completion(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        )
