"""What the Responses API answers: the ``response`` object, its output items, and the stream
events that build them, in OpenAI's shapes (``openai.types.responses``).

One ``OutputAssembler`` per response turns the parsed text of its one choice (reasoning,
content and tool call pieces, as ``ChatFormat`` parses them) into output items: ``reasoning``,
``message`` with one ``output_text`` part, and ``function_call``. A new item starts whenever
the kind of text changes. Each step returns the stream events it makes, in OpenAI's order:

    response.output_item.added, response.content_part.added,
    response.output_text.delta ..., response.output_text.done,
    response.content_part.done, response.output_item.done

(``response.reasoning_text.*`` for reasoning, ``response.function_call_arguments.*`` and no
content part for a call). A whole response is the same assembly with its events dropped, so a
streamed response and a whole one cannot disagree. ``ResponseEvents`` numbers the events
(``sequence_number``) and frames them as SSE.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from api_server.responses import DeltaToolCall, FinishReason, Usage

ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]
Event = dict[str, Any]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class ReasoningItem(BaseModel):
    """The model's reasoning (``--reasoning-parser``) as text; no summary is made."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = Annotated[
    OutputMessage | ReasoningItem | FunctionCallItem, Field(discriminator="type")
]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Not measured: the scheduler does not report prefix-cache hits per request."""
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0
    """Not measured: reasoning is split from the answer as text, not as tokens."""


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, usage: Usage) -> ResponseUsage:
        return cls(
            input_tokens=usage.prompt_tokens,
            output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
        )


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] | None = None


class ResponseError(BaseModel):
    code: Literal["server_error", "rate_limit_exceeded", "invalid_prompt"]
    message: str


class ResponseObject(BaseModel):
    """A ``response`` as returned, streamed in lifecycle events, and stored. The request's
    settings it echoes (``tools``, ``text``, ``tool_choice``, ...) are as the request gave
    them, defaults filled in."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: ResponseStatus
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _OpenItem:
    """The output item being written: its kind, place and text so far."""

    def __init__(self, kind: str, output_index: int, item_id: str) -> None:
        self.kind = kind
        self.output_index = output_index
        self.item_id = item_id
        self.text = ""
        self.call_id = ""
        self.name = ""


class OutputAssembler:
    """The output items of one response, assembled from its parsed text (module docstring)."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._open: _OpenItem | None = None

    def reasoning(self, text: str) -> list[Event]:
        if not text:
            return []
        events = self._start("reasoning") if not self._is_open("reasoning") else []
        self._open.text += text
        return [*events, self._text_event("response.reasoning_text.delta", delta=text)]

    def content(self, text: str) -> list[Event]:
        if not text:
            return []
        events = self._start("message") if not self._is_open("message") else []
        self._open.text += text
        return [
            *events,
            self._text_event("response.output_text.delta", delta=text, logprobs=[]),
        ]

    def tool_call(self, delta: DeltaToolCall) -> list[Event]:
        """A piece of a call: its first names it (``id``, ``function.name``), the rest add to
        its arguments."""
        events: list[Event] = []
        if delta.id is not None or not self._is_open("function_call"):
            events += self._start("function_call")
            self._open.call_id = delta.id or new_item_id("call")
            self._open.name = delta.function.name or ""
            events[-1]["item"] = self._item("in_progress").model_dump(mode="json")
        arguments = delta.function.arguments or ""
        if arguments:
            self._open.text += arguments
            events.append(self._item_event("response.function_call_arguments.delta", arguments))
        return events

    def finish(self, finish_reason: FinishReason) -> list[Event]:
        """Close the item being written; a response with no output at all gets an empty
        message, as OpenAI's has."""
        finished = finish_reason in ("stop", "tool_calls")
        status: ItemStatus = "completed" if finished else "incomplete"
        events = [] if self.items or self._open else self._start("message")
        return events + self._close(status)

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open.kind == kind

    def _start(self, kind: str) -> list[Event]:
        events = self._close("completed")
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
        self._open = _OpenItem(kind, len(self.items), new_item_id(prefix))
        item = self._item("in_progress").model_dump(mode="json")
        if kind != "function_call":
            item["content"] = []  # its part is added next
        events.append(self._added("response.output_item.added", item=item))
        if kind != "function_call":
            events.append(self._part_event("response.content_part.added", ""))
        return events

    def _close(self, status: ItemStatus) -> list[Event]:
        open_item = self._open
        if open_item is None:
            return []
        item = self._item(status)
        events: list[Event]
        if open_item.kind == "function_call":
            events = [self._item_event("response.function_call_arguments.done", open_item.text)]
        else:
            if open_item.kind == "message":
                done = self._text_event("response.output_text.done", logprobs=[])
            else:
                done = self._text_event("response.reasoning_text.done")
            events = [
                {**done, "text": open_item.text},
                self._part_event("response.content_part.done", open_item.text),
            ]
        events.append(self._added("response.output_item.done", item=item.model_dump(mode="json")))
        self.items.append(item)
        self._open = None
        return events

    def _item(self, status: ItemStatus) -> OutputItem:
        open_item = self._open
        if open_item.kind == "message":
            content = [OutputText(text=open_item.text)]
            return OutputMessage(id=open_item.item_id, status=status, content=content)
        if open_item.kind == "reasoning":
            content = [ReasoningText(text=open_item.text)]
            return ReasoningItem(id=open_item.item_id, status=status, content=content)
        return FunctionCallItem(
            id=open_item.item_id,
            call_id=open_item.call_id,
            name=open_item.name,
            arguments=open_item.text,
            status=status,
        )

    def _added(self, event_type: str, **fields: Any) -> Event:
        return {"type": event_type, "output_index": self._open.output_index, **fields}

    def _item_event(self, event_type: str, arguments: str) -> Event:
        key = "delta" if event_type.endswith(".delta") else "arguments"
        return {
            "type": event_type,
            "item_id": self._open.item_id,
            "output_index": self._open.output_index,
            key: arguments,
        }

    def _text_event(self, event_type: str, **fields: Any) -> Event:
        return {
            "type": event_type,
            "item_id": self._open.item_id,
            "output_index": self._open.output_index,
            "content_index": 0,
            **fields,
        }

    def _part_event(self, event_type: str, text: str) -> Event:
        reasoning = self._open.kind == "reasoning"
        part: BaseModel = ReasoningText(text=text) if reasoning else OutputText(text=text)
        return self._text_event(event_type, part=part.model_dump(mode="json"))


def finished_response(
    response: ResponseObject, items: list[OutputItem], finish_reason: FinishReason, usage: Usage
) -> ResponseObject:
    """``response`` (as it was in progress) with its output, status and usage."""
    incomplete = finish_reason not in ("stop", "tool_calls")
    details = None
    if incomplete:
        reason = "max_output_tokens" if finish_reason == "length" else None
        details = IncompleteDetails(reason=reason)
    return response.model_copy(
        update={
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": details,
            "output": items,
            "usage": ResponseUsage.of(usage),
            "completed_at": int(time.time()),
        }
    )


class ResponseEvents:
    """Numbers one stream's events from 0 and frames each as ``event: TYPE\\ndata: JSON``."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def sse(self, event: Event) -> str:
        event = {**event, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def lifecycle(self, event_type: str, response: ResponseObject) -> str:
        """``response.created``, ``.in_progress``, ``.completed``, ``.incomplete``, ``.failed``."""
        return self.sse({"type": event_type, "response": response.model_dump(mode="json")})
