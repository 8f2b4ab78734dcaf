"""The Responses API's request (``POST /v1/responses``, MAX's ``OpenResponsesRequest``), and its
conversation as the chat request that the chat path generates (api_server.serving).

The fields follow OpenAI's ``ResponseCreateParams``. Those Switchyard does not support are
either not declared, so the route answers "Unknown parameter" naming them, or declared and
refused with a value by ``check_supported`` (``background: true``, a ``reasoning.effort``, an
``include``, tools other than functions). Input items are messages (``input_text``,
``output_text``, ``refusal`` and ``input_image`` parts), ``function_call`` and
``function_call_output`` (so a tool conversation continues), and ``reasoning`` (as OpenAI's
output carries it back; the prompt leaves it out, as chat templates leave out earlier
reasoning). Lists are bounded here, texts by the chat path's prompt limit.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from api_server.errors import invalid_request
from api_server.protocol import (
    FUNCTION_NAME_PATTERN,
    INT32_MAX,
    MAX_MESSAGES,
    MAX_METADATA_KEYS,
    MAX_TOOLS,
    ChatCompletionRequest,
    ChatCompletionTool,
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    FunctionName,
    ImageURL,
    JsonSchemaFormat,
    NamedToolChoice,
    OpenAIBaseModel,
    ResponseFormat,
    ToolCall,
    few_message_parts,
)
from api_server.request_builder import check_unicode

MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 64, 512
"""OpenAI's bounds on ``metadata`` (and ``MAX_METADATA_KEYS``)."""
MAX_ID_CHARS = 256
"""Ids and names a client sends (``call_id``, item ids, ``user``)."""
MAX_PARTS = 256
"""Content parts of one message."""
MAX_INCLUDE = 16
RESPONSE_ID_PATTERN = r"resp_[0-9a-f]{32}"
"""The ids this server gives responses (``new_response_id``)."""

Id = Annotated[str, Field(max_length=MAX_ID_CHARS)]


class _LooseModel(BaseModel):
    """Something we do not support, parsed only so the error can name it."""

    model_config = ConfigDict(extra="allow")

    type: str


class InputText(OpenAIBaseModel):
    type: Literal["input_text"]
    text: str


class OutputTextPart(OpenAIBaseModel):
    """An earlier answer's text, as this API returned it."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = Field(default=None, max_length=0)
    logprobs: list[Any] | None = Field(default=None, max_length=0)


class RefusalPart(OpenAIBaseModel):
    type: Literal["refusal"]
    refusal: str


class InputImage(OpenAIBaseModel):
    """An image by URL (a data URL, or what ``--allowed-media-domains`` and
    ``--allowed-local-media-path`` allow); uploaded files (``file_id``) are not supported."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: Id | None = None
    detail: Literal["auto", "low", "high", "original"] | None = None


MessagePart = Annotated[
    InputText | OutputTextPart | RefusalPart | InputImage, Field(discriminator="type")
]


class MessageItem(OpenAIBaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[MessagePart], Field(max_length=MAX_PARTS, fail_fast=True)]
    id: Id | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(OpenAIBaseModel):
    """A call made earlier: its ``name`` is whatever the model wrote (as a chat message's
    earlier tool call), so a stored response always reads back as input."""

    type: Literal["function_call"]
    call_id: Id
    name: str
    arguments: str
    id: Id | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(OpenAIBaseModel):
    type: Literal["function_call_output"]
    call_id: Id
    output: str | Annotated[list[InputText], Field(max_length=MAX_PARTS, fail_fast=True)]
    id: Id | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningItem(OpenAIBaseModel):
    type: Literal["reasoning"]
    id: Id | None = None
    summary: list[dict[str, Any]] = Field(
        default_factory=list, max_length=MAX_PARTS, fail_fast=True
    )
    content: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_PARTS, fail_fast=True)
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(item: Any) -> str:
    """An input item's type; a message may leave it out."""
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _item_type,
        custom_error_type="invalid_input_item",
        custom_error_message="input items are of type message, function_call, "
        "function_call_output or reasoning",
    ),
]


class FunctionTool(OpenAIBaseModel):
    """A function the model may call (the Responses API's flat shape)."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def _tool_type(tool: Any) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return "function" if kind == "function" else "other"


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[_LooseModel, Tag("other")],
    Discriminator(_tool_type),
]


class ToolChoiceFunction(OpenAIBaseModel):
    type: Literal["function"]
    name: str


class FormatText(OpenAIBaseModel):
    type: Literal["text"]


class FormatJsonObject(OpenAIBaseModel):
    type: Literal["json_object"]


class FormatJsonSchema(OpenAIBaseModel):
    type: Literal["json_schema"]
    name: str = Field(max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(OpenAIBaseModel):
    format: (
        Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")]
        | None
    ) = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(OpenAIBaseModel):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None
    context: str | None = None


class StreamOptions(OpenAIBaseModel):
    include_obfuscation: bool | None = None
    """Accepted; Switchyard's deltas carry no obfuscation padding."""


class ResponsesRequest(OpenAIBaseModel):
    """POST /v1/responses."""

    model: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    """None means the served model (as for chat)."""
    input: str | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES, fail_fast=True)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    text: TextConfig | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS, fail_fast=True)
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | _LooseModel | None = (
        None
    )
    parallel_tool_calls: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    store: bool | None = True
    previous_response_id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    metadata: dict[str, str] | None = Field(
        default=None, max_length=MAX_METADATA_KEYS, fail_fast=True
    )
    user: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = Field(default=None, max_length=MAX_INCLUDE, fail_fast=True)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    service_tier: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    """Accepted and ignored, as for chat."""
    safety_identifier: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    prompt_cache_key: str | None = Field(default=None, max_length=MAX_ID_CHARS)

    @field_validator("input", mode="before")
    @classmethod
    def _few_message_parts(cls, items: Any) -> Any:
        return few_message_parts(
            items,
            ("content", "output", "summary"),
            "the input items hold {count} content parts, outputs and summary parts",
        )

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        for key, value in (metadata or {}).items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise ValueError(f"metadata keys have at most {MAX_METADATA_KEY_CHARS} characters")
            if len(value) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(
                    f"metadata values have at most {MAX_METADATA_VALUE_CHARS} characters"
                )
        return metadata

    @property
    def input_items(self) -> list[InputItem]:
        """``input`` as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    @property
    def function_tools(self) -> list[FunctionTool]:
        return [tool for tool in self.tools or [] if isinstance(tool, FunctionTool)]


def check_supported(request: ResponsesRequest) -> None:
    """400 naming the first field whose value Switchyard does not support, or the first string
    that is not valid Unicode."""
    check_unicode(request)
    for index, tool in enumerate(request.tools or []):
        if not isinstance(tool, FunctionTool):
            raise _unsupported(
                f"tools[{index}].type",
                f"Tools of type {tool.type[:64]!r} are not supported; only 'function' tools",
            )
    if isinstance(request.tool_choice, _LooseModel):
        raise _unsupported(
            "tool_choice",
            f"tool_choice of type {request.tool_choice.type[:64]!r} is not supported; use "
            "'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
        )
    reasoning = request.reasoning or ReasoningConfig()
    for name in ("effort", "summary", "generate_summary"):
        if getattr(reasoning, name) is not None:
            raise _unsupported(
                f"reasoning.{name}",
                f"reasoning.{name} is not supported: the model reasons as its chat template "
                "makes it (--reasoning-parser returns that reasoning)",
            )
    checks = {
        "background": request.background is True,
        "include": bool(request.include),
        "top_logprobs": bool(request.top_logprobs),
        "truncation": request.truncation == "auto",
        "text.verbosity": request.text is not None and request.text.verbosity is not None,
    }
    for name, is_unsupported in checks.items():
        if is_unsupported:
            raise _unsupported(name, f"{name} is not supported by Switchyard's Responses API")


def _unsupported(param: str, message: str):
    return invalid_request(message, param=param, code="unsupported_parameter")


def chat_request(request: ResponsesRequest, conversation: list[InputItem]) -> ChatCompletionRequest:
    """The chat request that generates this response: ``instructions`` as the system message,
    then the conversation (earlier items, then this request's input)."""
    messages = []
    if request.instructions is not None:
        messages.append(ChatMessage(role="system", content=request.instructions))
    messages += chat_messages(conversation)
    if not messages:
        raise invalid_request("input holds no message to answer", param="input")
    if len(messages) > MAX_MESSAGES:
        raise invalid_request(
            f"The conversation holds {len(messages)} messages; the limit is {MAX_MESSAGES}",
            param="input",
        )
    tools = [
        ChatCompletionTool(
            type="function",
            function=FunctionDefinition(
                name=tool.name,
                description=tool.description,
                parameters=tool.parameters,
                strict=tool.strict,
            ),
        )
        for tool in request.function_tools
    ]
    return ChatCompletionRequest(
        model=request.model,
        messages=messages,
        max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        user=request.user,
        tools=tools or None,
        tool_choice=_chat_tool_choice(request.tool_choice),
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=_chat_response_format(request.text),
    )


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, ToolChoiceFunction):
        return NamedToolChoice(type="function", function=FunctionName(name=choice.name))
    return choice


def _chat_response_format(text: TextConfig | None) -> ResponseFormat | None:
    given = None if text is None else text.format
    if given is None or isinstance(given, FormatText):
        return None
    if isinstance(given, FormatJsonObject):
        return ResponseFormat(type="json_object")
    schema = JsonSchemaFormat(
        name=given.name, description=given.description, schema=given.schema_, strict=given.strict
    )
    return ResponseFormat(type="json_schema", json_schema=schema)


def chat_messages(items: list[InputItem]) -> list[ChatMessage]:
    """The conversation as chat messages: a ``function_call`` joins the assistant message just
    before it (or starts one), a ``function_call_output`` is a tool message, reasoning is left
    out."""
    messages: list[ChatMessage] = []
    for index, item in enumerate(items):
        if isinstance(item, MessageItem):
            messages.append(_chat_message(index, item))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(
                id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and _joins(items, index):
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output
            text = output if isinstance(output, str) else "".join(part.text for part in output)
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=text))
    return messages


def _joins(items: list[InputItem], index: int) -> bool:
    """Whether the call at ``index`` follows an assistant message or call (reasoning between
    them aside)."""
    for earlier in reversed(items[:index]):
        if isinstance(earlier, ReasoningItem):
            continue
        return isinstance(earlier, FunctionCallItem) or (
            isinstance(earlier, MessageItem) and earlier.role == "assistant"
        )
    return False


def _chat_message(index: int, item: MessageItem) -> ChatMessage:
    if isinstance(item.content, str):
        return ChatMessage(role=item.role, content=item.content)
    parts: list[ContentPart] = []
    for part_index, part in enumerate(item.content):
        if isinstance(part, InputImage):
            parts.append(_image_part(f"input[{index}].content[{part_index}]", part))
        else:
            text = part.refusal if isinstance(part, RefusalPart) else part.text
            parts.append(ContentPart(type="text", text=text))
    if all(part.type == "text" for part in parts):
        return ChatMessage(role=item.role, content="".join(part.text for part in parts))
    return ChatMessage(role=item.role, content=parts)


def _image_part(param: str, part: InputImage) -> ContentPart:
    if part.image_url is None:
        raise invalid_request(
            f"{param}: images by file_id are not supported; send image_url", param=param
        )
    detail = part.detail if part.detail in ("auto", "low", "high") else None
    return ContentPart(type="image_url", image_url=ImageURL(url=part.image_url, detail=detail))
