"""How each endpoint shapes its answer: whole responses and stream chunks, chat and completions.

One ``ResponseFormat`` per request: it fixes the response id, ``created`` time and model name, so
every chunk of a stream carries the same three.
"""

from __future__ import annotations

import time
from typing import Protocol

from pydantic import BaseModel

from api_server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    DeltaMessage,
    FinishReason,
    Usage,
)


class ResponseFormat(Protocol):
    def opening_chunks(self) -> list[BaseModel]:
        """Chunks sent before any text (chat: the assistant role)."""
        ...

    def text_chunk(self, text: str) -> BaseModel: ...

    def finish_chunk(self, finish_reason: FinishReason) -> BaseModel: ...

    def usage_chunk(self, usage: Usage) -> BaseModel:
        """The last chunk when ``stream_options.include_usage``: no choices, only usage."""
        ...

    def response(self, text: str, finish_reason: FinishReason, usage: Usage) -> BaseModel:
        """The whole (non-streaming) response."""
        ...


class ChatFormat:
    """``chat.completion`` and ``chat.completion.chunk`` objects."""

    def __init__(self, response_id: str, model: str) -> None:
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())

    def opening_chunks(self) -> list[BaseModel]:
        return [self._chunk(DeltaMessage(role="assistant", content=""))]

    def text_chunk(self, text: str) -> BaseModel:
        return self._chunk(DeltaMessage(content=text))

    def finish_chunk(self, finish_reason: FinishReason) -> BaseModel:
        return self._chunk(DeltaMessage(), finish_reason)

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(
            id=self.response_id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def response(self, text: str, finish_reason: FinishReason, usage: Usage) -> BaseModel:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)
        return ChatCompletion(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=usage,
        )

    def _chunk(self, delta: DeltaMessage, finish_reason: FinishReason | None = None) -> BaseModel:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
        return ChatCompletionChunk(
            id=self.response_id, created=self.created, model=self.model, choices=[choice]
        )


class CompletionFormat:
    """``text_completion`` objects, whole and as stream chunks."""

    def __init__(self, response_id: str, model: str) -> None:
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())

    def opening_chunks(self) -> list[BaseModel]:
        return []

    def text_chunk(self, text: str) -> BaseModel:
        return self._completion([CompletionChoice(text=text)])

    def finish_chunk(self, finish_reason: FinishReason) -> BaseModel:
        return self._completion([CompletionChoice(text="", finish_reason=finish_reason)])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._completion([], usage)

    def response(self, text: str, finish_reason: FinishReason, usage: Usage) -> BaseModel:
        return self._completion([CompletionChoice(text=text, finish_reason=finish_reason)], usage)

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
