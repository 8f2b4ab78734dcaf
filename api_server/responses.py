"""OpenAI response schemas (pydantic v2): completions, chat completions, their stream chunks,
usage and the model list. Field names and ``object`` values follow OpenAI exactly."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer

FinishReason = Literal["stop", "length", "abort", "tool_calls"]
""""abort": the scheduler cancelled the request without an error (vLLM's name); "tool_calls":
the model stopped after calling tools."""


def _now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's ``logprobs``: one entry per generated token."""

    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """A completion choice's legacy ``logprobs``: four lists, one entry per token each."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class _OmitsNone(BaseModel):
    """Serializes without the fields that are None (OpenAI leaves unset fields out)."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str
    """The arguments as JSON text."""


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class AssistantMessage(BaseModel):
    """``content`` is None when the message holds only tool calls; ``tool_calls`` is left out
    when there are none."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    """The model's reasoning (``--reasoning-parser``; vLLM's name); left out when there is none."""
    tool_calls: list[ResponseToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_tool_calls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for name in ("reasoning_content", "tool_calls"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunctionCall(_OmitsNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_OmitsNone):
    """A streamed piece of tool call ``index``: id, type and name come with its first piece;
    the ``arguments`` pieces concatenate to the whole JSON text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_OmitsNone):
    """A streamed piece of the assistant's message; unset fields are left out (``"delta": {}``)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class Completion(BaseModel):
    """A /v1/completions response, and (``usage`` None until the end) each of its stream chunks."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "switchyard"
    root: str | None = None
    parent: str | None = None
    """A LoRA adapter's base model (vLLM's field); None for a base model."""
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
