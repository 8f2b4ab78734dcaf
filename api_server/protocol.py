"""OpenAI request schemas (pydantic v2) for /v1/chat/completions and /v1/completions.

Every field OpenAI defines is declared, so a request built by an OpenAI SDK parses; fields we do
not support yet are rejected by ``api_server.request_builder`` with a 400 naming them. Fields OpenAI
does not define (and that are not vLLM extensions listed here) fail validation as
"Unrecognized request argument supplied". Integers that travel to the scheduler are bounded here,
so none can overflow msgpack, and so are lists that would cost the scheduler or the worker per
token (stop strings and stop token ids, ``logit_bias``, choice lists, messages, tools). The sizes
an operator sets (prompt text, schemas, choices x tokens) are checked by
``api_server.request_limits``. Response schemas live in ``api_server.responses``.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from api_server.errors import TOO_MANY_UNKNOWN_FIELDS
from interfaces.requests import MAX_LOGPROBS
from interfaces.sampling import MAX_LOGITS_PROCESSOR_NAME_CHARS, MAX_LOGITS_PROCESSORS

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
"""Each stop string's length (the stream holds back that much text while it might match)."""
MAX_STOP_TOKEN_IDS = 1024
"""More than any vocabulary's special tokens (Llama 3 reserves 256), so no real user meets it;
the scheduler checks each generated token against the set."""
MAX_LOGIT_BIAS = 300
"""OpenAI's bound on ``logit_bias`` entries."""
MAX_GUIDED_CHOICES = 1000
"""Alternatives of a choice constraint: OpenAI's bound on the values of a schema's enums."""
MAX_MESSAGES = 2048
"""OpenAI's bound on the messages of one chat request."""
MAX_METADATA_KEYS = 16
"""OpenAI's bound on ``metadata`` pairs."""
MAX_CACHE_SALT_CHARS = 1024
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 2.0
"""A penalty divides or multiplies logits: below 0.01 it is no longer finite in float32 at
usual logit sizes, and above 2 no one uses it."""
MAX_N = 128
"""OpenAI's bound on ``n``."""
MAX_TOOLS = 128
"""OpenAI's bound on the functions one request may define (``tools``, and the legacy
``functions``, which is refused as unsupported once bounded)."""
MAX_MODALITIES = 8
"""``modalities``: OpenAI names two (text, audio)."""
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
"""OpenAI's rule for function names."""
MAX_CHAT_TEMPLATE_KWARGS_BYTES = 16 * 1024
"""``chat_template_kwargs`` as JSON: switches such as ``enable_thinking``, not documents."""
CHAT_TEMPLATE_RESERVED = frozenset(
    {"messages", "tools", "raise_exception", "strftime_now", "namespace", "range", "dict"}
    | {"lipsum", "cycler", "joiner"}
)
"""Template variables the server sets from the request itself, and the template's functions."""
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_MESSAGE_PARTS = 16384
"""Content parts and earlier tool calls in all the messages of one request, counted before any
is validated: each costs a few microseconds to validate, so 32 MiB of empty tool calls took
5 s of the event loop (2,048 messages of 8 parts each are within it)."""
MAX_PROMPTS = 2048
"""Prompts of one completions request (a list of texts or of token-id lists), as OpenAI bounds
the inputs of one embeddings request; ``--max-choices-per-request`` (prompts x n) is smaller
unless an operator raises it."""
MAX_UNKNOWN_FIELDS_NAMED = 16
"""An object with more unknown fields than this is one error (``TOO_MANY_UNKNOWN_FIELDS``)
naming the first of them."""

FAIL_FAST = Field(fail_fast=True)
"""Every list and dict of a request body validates with this: it stops at its first bad item.
Without it, pydantic makes one error per bad item (for each member of a union), each with its
path and message, on the event loop: a 2 MB ``prompt`` of a million ints and one string took
~10 s and 2 GB to refuse. tests/api_server/test_api_errors.py checks every request model."""


def bounded_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """``chat_template_kwargs`` as received, checked: identifier names other than
    ``CHAT_TEMPLATE_RESERVED``, at most ``MAX_CHAT_TEMPLATE_KWARGS_BYTES`` as JSON
    (``ValueError`` otherwise, which pydantic makes a 400)."""
    if kwargs is None:
        return None
    for name in kwargs:
        if not name.isidentifier() or name in CHAT_TEMPLATE_RESERVED:
            raise ValueError(
                f"chat_template_kwargs may not set {name!r}: names are identifiers other "
                f"than {', '.join(sorted(CHAT_TEMPLATE_RESERVED))}"
            )
    try:
        num_bytes = len(json.dumps(kwargs, ensure_ascii=False).encode("utf-8", "replace"))
    except RecursionError as error:
        raise ValueError("chat_template_kwargs is nested too deeply") from error
    except ValueError as error:  # e.g. an integer of more digits than Python converts
        raise ValueError(f"chat_template_kwargs cannot be written as JSON: {error}") from error
    if num_bytes > MAX_CHAT_TEMPLATE_KWARGS_BYTES:
        raise ValueError(
            f"chat_template_kwargs takes {num_bytes} bytes as JSON; the limit is "
            f"{MAX_CHAT_TEMPLATE_KWARGS_BYTES}"
        )
    return kwargs


ChatTemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(bounded_template_kwargs)]
"""``chat_template_kwargs`` of a request (chat completions, /tokenize), checked on receipt."""


class OpenAIBaseModel(BaseModel):
    """Unknown fields are errors (OpenAI: "Unrecognized request argument supplied: X")."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _few_unknown_fields(cls, data: Any) -> Any:
        """More than ``MAX_UNKNOWN_FIELDS_NAMED`` unknown fields are one error (pydantic
        would make one each: a million took 7 s to refuse)."""
        if not isinstance(data, dict) or len(data) <= MAX_UNKNOWN_FIELDS_NAMED:
            return data
        accepted = _accepted_names(cls)
        unknown = [name for name in data if name not in accepted]
        if len(unknown) > MAX_UNKNOWN_FIELDS_NAMED:
            raise PydanticCustomError(
                TOO_MANY_UNKNOWN_FIELDS,
                "{count} unknown fields",
                {"names": unknown[:MAX_UNKNOWN_FIELDS_NAMED], "count": len(unknown)},
            )
        return data


def few_message_parts(
    messages: Any,
    keys: tuple[str, ...] = ("content", "tool_calls"),
    what: str = "the messages hold {count} content parts and tool calls",
) -> Any:
    """``messages`` as received, or a ``ValueError`` (``what``, then the limit) if the lists
    under ``keys`` in its items hold more than ``MAX_MESSAGE_PARTS`` in all, before pydantic
    validates any."""
    if isinstance(messages, list) and len(messages) <= MAX_MESSAGES:
        count = sum(
            len(message[key])
            for message in messages
            if isinstance(message, dict)
            for key in keys
            if isinstance(message.get(key), list)
        )
        if count > MAX_MESSAGE_PARTS:
            raise ValueError(f"{what.format(count=count)}; the limit is {MAX_MESSAGE_PARTS}")
    return messages


def at_most_items(items: Any, limit: int, what: str) -> Any:
    """``items`` as received, or a ``ValueError`` for a list of more than ``limit`` texts or
    lists, before pydantic validates each (a list of token ids is one item, bounded later;
    so is one of numbers, which pydantic takes as token ids when they are whole)."""
    if isinstance(items, list) and len(items) > limit and isinstance(items[0], str | list):
        raise ValueError(f"at most {limit} {what} are allowed; this request has {len(items)}")
    return items


@cache
def _accepted_names(model: type[BaseModel]) -> frozenset[str]:
    """The keys ``model`` takes: its fields' names and aliases."""
    fields = model.model_fields
    aliases = {field.alias for field in fields.values() if field.alias}
    return frozenset(fields) | aliases


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class ImageURL(OpenAIBaseModel):
    """An image part's image: a data URL, or a file:// or http(s) URL where the server allows
    them (api_server.images). ``detail`` is accepted and ignored, as vLLM does."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(BaseModel):
    """One part of a message's content: ``text`` or ``image_url``. Parts of other types are
    parsed (so the error can name their type) and rejected by the request builder."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class FunctionCall(OpenAIBaseModel):
    """A call the assistant made earlier in the conversation; ``arguments`` is JSON text."""

    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    """A call in an earlier assistant message. ``index`` is accepted (and ignored) because
    clients that assemble streamed calls keep it when they send the message back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], FAIL_FAST] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, fail_fast=True)
    tool_call_id: str | None = None
    refusal: str | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None


class FunctionDefinition(OpenAIBaseModel):
    """A function the model may call; ``parameters`` is a JSON schema (checked later)."""

    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    """``tool_choice`` that forces a call of one function."""

    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(OpenAIBaseModel):
    """``response_format.json_schema``: the schema is kept as given and checked later."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(OpenAIBaseModel):
    """vLLM's ``structured_outputs`` extension: exactly one constraint may be set."""

    json_: str | dict[str, Any] | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    json_object: bool | None = None
    choice: list[str] | None = Field(default=None, max_length=MAX_GUIDED_CHOICES, fail_fast=True)


ProcessorName = Annotated[str, Field(min_length=1, max_length=MAX_LOGITS_PROCESSOR_NAME_CHARS)]


class LogitsProcessorUse(OpenAIBaseModel):
    """One entry of Switchyard's ``logits_processors``: a processor the server loaded
    (``--logits-processors``), by name, and the JSON object its processor reads as ``args``.
    A bare name in the list means no args."""

    name: ProcessorName
    args: dict[str, Any] | None = None


class SamplingFields(OpenAIBaseModel):
    """Fields shared by chat and completions requests (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    """None means the served model (as vLLM allows)."""
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS, fail_fast=True
    )
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | Annotated[list[str], FAIL_FAST] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    user: str | None = None
    response_format: ResponseFormat | None = None
    top_k: int | None = Field(default=None, ge=-INT32_MAX, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(
        default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY
    )
    min_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    """Keep the matched stop string (or stop token's text) at the end of the text (vLLM)."""
    stop_token_ids: list[int] | None = Field(
        default=None, max_length=MAX_STOP_TOKEN_IDS, fail_fast=True
    )
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    """Only requests with the same salt share prefix-cache entries (vLLM's extension)."""
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: str | dict[str, Any] | bool | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = Field(
        default=None, max_length=MAX_GUIDED_CHOICES, fail_fast=True
    )
    logits_processors: list[ProcessorName | LogitsProcessorUse] | None = Field(
        default=None, max_length=MAX_LOGITS_PROCESSORS, fail_fast=True
    )
    """User logits processors to apply, by name, in the order the server loaded them."""

    @field_validator("stop", mode="before")
    @classmethod
    def _few_stop_strings(cls, stop: Any) -> Any:
        """Counted before the strings are validated."""
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        return stop

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if any(len(string) > MAX_STOP_STRING_CHARS for string in strings):
            raise ValueError(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters")
        return stop

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def num_choices_per_prompt(self) -> int:
        return self.n or 1

    @property
    def max_new_tokens(self) -> int | None:
        """The most tokens to generate; None means until EOS or the context is full."""
        return None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatCompletionTool] | None = Field(
        default=None, max_length=MAX_TOOLS, fail_fast=True
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = Field(
        default=None, max_length=MAX_TOOLS, fail_fast=True
    )
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = Field(default=None, max_length=MAX_MODALITIES, fail_fast=True)
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    metadata: dict[str, str] | None = Field(
        default=None, max_length=MAX_METADATA_KEYS, fail_fast=True
    )
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    echo: bool = False
    chat_template_kwargs: ChatTemplateKwargs = None
    """Extra variables for the chat template, e.g. ``{"enable_thinking": false}`` (vLLM's
    extension); names are identifiers, at most ``MAX_CHAT_TEMPLATE_KWARGS_BYTES`` as JSON."""

    @field_validator("messages", mode="before")
    @classmethod
    def _few_message_parts(cls, messages: Any) -> Any:
        return few_message_parts(messages)

    @property
    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's current name) wins over ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per generated token, or None when log probabilities are off."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    """POST /v1/completions. ``max_tokens`` defaults to 16 as in OpenAI's API (and vLLM);
    0 is allowed only with ``echo`` (score the prompt without generating)."""

    prompt: (
        str
        | Annotated[list[int], FAIL_FAST]
        | Annotated[list[str], FAIL_FAST]
        | Annotated[list[Annotated[list[int], FAIL_FAST]], FAIL_FAST]
    )
    max_tokens: int | None = Field(default=16, ge=0)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _few_prompts(cls, prompt: Any) -> Any:
        """Counted before the prompts are validated (a list of ints is one prompt)."""
        return at_most_items(prompt, MAX_PROMPTS, "prompts")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs
