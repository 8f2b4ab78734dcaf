"""A chat request's ``tools`` and ``tool_choice`` → what the prompt, the sampler and the parser do.

- ``none`` (the default without tools): tools are left out of the prompt and nothing is parsed.
- ``auto`` (the default with tools): tools go into the prompt through the chat template, and
  ``<tool_call>`` blocks in the output become ``message.tool_calls`` (``HermesToolParser``).
- ``required`` and a named function: generation is constrained (as structured output) to a
  JSON array of calls, or to the named function's arguments, so the model must call.

Bad definitions are 400s before anything is queued: a parameters schema that is not a JSON
schema, a ``tool_choice`` naming a function that is not in ``tools``, forcing a call without
tools, or a forced call together with a ``response_format`` constraint. Each parameters schema,
and the constraint a forced call makes of them, takes at most ``max_bytes``
(``--max-structured-output-bytes``); the tools' count is OpenAI's (``protocol.MAX_TOOLS``) and
their text counts as prompt text (``api_server.request_limits``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec

from api_server.errors import invalid_request
from api_server.protocol import ChatCompletionRequest, ChatCompletionTool, NamedToolChoice
from api_server.responses import FinishReason
from api_server.structured_output import check_size, json_schema_output, structured_output
from api_server.tool_parsers import (
    HERMES_TAGS,
    HermesToolParser,
    NamedToolParser,
    RequiredToolParser,
)
from interfaces import (
    StructuredOutput,
    TextGenerationRequestFunction,
    TextGenerationRequestTool,
    ToolParser,
)

ANY_OBJECT: dict[str, Any] = {"type": "object"}
"""The arguments schema of a function that declares no parameters."""


@dataclass(frozen=True)
class ToolCalling:
    """How one chat request uses tools.

    ``tools`` go into the prompt; ``constraint`` (None for "auto") forces the call; ``new_parser``
    makes one parser per choice; a choice that made tool calls and stopped on its own finishes
    with ``finish_reason`` ("tool_calls", or "stop" for a named function, as OpenAI answers).
    """

    tools: list[TextGenerationRequestTool]
    constraint: StructuredOutput | None
    new_parser: Callable[[], ToolParser]
    finish_reason: FinishReason
    markers: tuple[str, ...] = ()
    """Tags the parser looks for in the text (they must not be skipped as special tokens)."""


def tool_calling(request: ChatCompletionRequest, max_bytes: int | None) -> ToolCalling | None:
    """None when the request makes no tool calls (no tools, or ``tool_choice`` "none")."""
    tools = request.tools or []
    _check_tools(tools, max_bytes)
    choice = request.tool_choice or ("auto" if tools else "none")
    if choice == "none":
        return None
    if not tools:
        name = choice if isinstance(choice, str) else choice.function.name
        raise invalid_request(
            f"tool_choice {name!r} needs tools: the request defines none", param="tool_choice"
        )
    prompt_tools = [_generation_tool(tool) for tool in tools]
    if choice == "auto":
        max_calls = 1 if request.parallel_tool_calls is False else None
        new_parser = partial(HermesToolParser, max_calls)
        return ToolCalling(prompt_tools, None, new_parser, "tool_calls", HERMES_TAGS)
    if choice == "required":
        constraint = _calls_constraint(tools, request.parallel_tool_calls is not False)
        return ToolCalling(prompt_tools, constraint, RequiredToolParser, "tool_calls")
    assert isinstance(choice, NamedToolChoice)  # the protocol allows nothing else
    name = choice.function.name
    tool = next((tool for tool in tools if tool.function.name == name), None)
    if tool is None:
        raise invalid_request(
            f"tool_choice names the function {name!r}, which is not among the tools",
            param="tool_choice",
        )
    constraint = StructuredOutput("json_schema", _compact_json(_parameters(tool)))
    return ToolCalling(prompt_tools, constraint, partial(NamedToolParser, name), "stop")


def _check_tools(tools: list[ChatCompletionTool], max_bytes: int | None) -> None:
    """400 for duplicate function names and parameters that are not a JSON schema of an
    object."""
    names: set[str] = set()
    for index, tool in enumerate(tools):
        function = tool.function
        if function.name in names:
            raise invalid_request(
                f"tools[{index}].function.name {function.name!r} is defined twice",
                param=f"tools[{index}].function.name",
            )
        names.add(function.name)
        if function.parameters is None:
            continue
        param = f"tools[{index}].function.parameters"
        json_schema_output(function.parameters, param, max_bytes=max_bytes)
        if function.parameters.get("type", "object") != "object":
            raise invalid_request(
                f"{param} must describe an object (type 'object'): arguments are named",
                param=param,
            )


def chat_constraint(
    request: ChatCompletionRequest, tools: ToolCalling | None, max_bytes: int | None
) -> StructuredOutput | None:
    """The constraint on generated text: ``response_format`` (or vLLM's spellings), or the
    forced tool call; 400 if both are given, or if the forced call's schema takes more than
    ``max_bytes``."""
    constraint = structured_output(request, max_bytes)
    forced = None if tools is None else tools.constraint
    if forced is not None:
        check_size(forced.spec, "tool_choice", max_bytes, "the schema of the forced tool call")
    if constraint is not None and forced is not None:
        raise invalid_request(
            "tool_choice 'required' or a named function cannot be combined with a "
            "structured-output constraint such as response_format",
            param="tool_choice",
        )
    return forced or constraint


def _calls_constraint(tools: list[ChatCompletionTool], parallel: bool) -> StructuredOutput:
    """A JSON array of one or more calls (at most one unless ``parallel``)."""
    calls: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [_call_schema(tool) for tool in tools]},
    }
    if not parallel:
        calls["maxItems"] = 1
    return StructuredOutput("json_schema", _compact_json(calls))


def _compact_json(schema: dict[str, Any]) -> str:
    """A schema already checked (``check_unicode`` refused lone surrogates) as compact JSON."""
    return msgspec.json.encode(schema).decode()


def _call_schema(tool: ChatCompletionTool) -> dict[str, Any]:
    """One element of the array "required" generates: ``{"name": ..., "parameters": {...}}``."""
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [tool.function.name]},
            "parameters": _parameters(tool),
        },
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def _parameters(tool: ChatCompletionTool) -> dict[str, Any]:
    """The arguments' schema, always of an object (``{}`` would accept any JSON value)."""
    return {**ANY_OBJECT, **(tool.function.parameters or {})}


def _generation_tool(tool: ChatCompletionTool) -> TextGenerationRequestTool:
    function = tool.function
    return TextGenerationRequestTool(
        TextGenerationRequestFunction(function.name, function.description, function.parameters)
    )
