"""A conversation as chat templates see it: plain dicts in Hugging Face's shape.

Text parts are joined into one string; a message with images keeps its parts, text parts as
``{"type": "text", "text": ...}`` and images as ``{"type": "image"}``, which vision models'
templates render as their image placeholder. "developer" becomes "system", tools are OpenAI's
``{"type": "function", "function": {...}}``, and earlier tool calls carry their arguments as an
object (templates write them with ``tojson``), as transformers and vLLM pass them.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from interfaces import TextGenerationRequestMessage, TextGenerationRequestTool


def template_message(message: TextGenerationRequestMessage) -> dict[str, Any]:
    """The template's view of one message (``ValueError`` for unsupported content parts)."""
    result: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": _flatten_content(message.content),
    }
    for name in ("name", "tool_call_id"):
        value = getattr(message, name)
        if value is not None:
            result[name] = value
    if message.tool_calls:
        result["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
    return result


def template_tool(tool: TextGenerationRequestTool) -> dict[str, Any]:
    """OpenAI's shape, ``type`` first (``to_builtins`` alone would omit the default type)."""
    return {"type": tool.type, "function": msgspec.to_builtins(tool.function)}


def is_about_tools(message: dict[str, Any]) -> bool:
    """Whether a template message is a tool result or holds tool calls."""
    return message["role"] == "tool" or bool(message.get("tool_calls"))


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """``arguments`` as an object when the JSON text holds one that can be rendered; otherwise
    (not JSON, not an object, nested too deeply, an escaped lone surrogate) the text as is."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
            json.dumps(parsed, ensure_ascii=False).encode("utf-8")
        except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
            parsed = None
        if isinstance(parsed, dict):
            function["arguments"] = parsed
    return {**call, "function": function}


def _flatten_content(content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]]:
    """Join text parts with newlines (vLLM's "string" content format); with images, the parts
    as Hugging Face processors pass them (vLLM's "openai" content format)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") == "image":
            parts.append({"type": "image"})
        elif part.get("type") == "text":
            parts.append({"type": "text", "text": part.get("text", part.get("content", ""))})
        else:
            raise ValueError(f"content parts of type {part.get('type')!r} are not supported")
    if any(part["type"] == "image" for part in parts):
        return parts
    return "\n".join(part["text"] for part in parts)
