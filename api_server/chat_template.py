"""Chat templates rendered the way Hugging Face transformers renders them, without transformers.

A template is Jinja2 in a sandbox with ``trim_blocks`` and ``lstrip_blocks``, the ``tojson``
filter, ``raise_exception`` and ``strftime_now`` globals, and a no-op ``{% generation %}`` block.
Models without a template get mlx_lm.server's plain role-prefix format instead.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

FALLBACK_ROLE_PREFIXES = {
    "system": "ASSISTANT's RULE: ",
    "user": "USER: ",
    "assistant": "ASSISTANT: ",
}
"""mlx_lm.server's default role mapping for tokenizers without a chat template."""


class ChatTemplateError(ValueError):
    """The template rejected the conversation (``raise_exception``) or failed to render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body unchanged (transformers uses
    the block to mark assistant tokens for training masks, which serving does not need)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller: Any) -> str:
        return caller()


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """Compile ``source`` once; ``ChatTemplateError`` if it is not valid Jinja."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"the model's chat template does not compile: {error}") from error


@lru_cache(maxsize=8)
def template_renders_tools(source: str) -> bool:
    """Whether the template reads the ``tools`` variable (so it describes tools itself)."""
    try:
        return "tools" in meta.find_undeclared_variables(_environment().parse(source))
    except jinja2.TemplateError:
        return False


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    special_tokens: dict[str, str],
    tools: list[dict[str, Any]] | None = None,
    options: dict[str, Any] | None = None,
) -> str:
    """Render the conversation with ``add_generation_prompt=True``.

    ``special_tokens`` supplies ``bos_token``, ``eos_token`` and friends; ``options`` are extra
    template variables (they may override ``add_generation_prompt``). Raises
    ``ChatTemplateError`` (a ``ValueError``) when the template refuses the conversation.
    """
    variables: dict[str, Any] = {**special_tokens, "add_generation_prompt": True}
    variables.update(options or {})
    variables["messages"] = messages
    variables["tools"] = tools
    try:
        return compile_template(source).render(variables)  # a dict: any name, even self
    except ChatTemplateError:
        raise
    except (
        jinja2.TemplateError,
        TypeError,
        KeyError,
        IndexError,
        AttributeError,
        ArithmeticError,  # a request's chat_template_kwargs are values the template computes with
        RecursionError,
    ) as error:
        raise ChatTemplateError(f"the chat template failed to render: {error}") from error


def render_fallback_prompt(messages: list[dict[str, Any]]) -> str:
    """The mlx_lm.server format for tokenizers without a chat template.

    Each message becomes ``<role prefix><content>\\n``; then ``ASSISTANT:`` follows (mlx_lm
    strips the trailing space). Roles without a prefix (tool, developer) get none.
    """
    prompt = "".join(
        f"{FALLBACK_ROLE_PREFIXES.get(message['role'], '')}{_text(message.get('content'))}\n"
        for message in messages
    )
    return (prompt + FALLBACK_ROLE_PREFIXES["assistant"]).rstrip()


def _text(content: str | list[dict[str, Any]] | None) -> str:
    """A message's text; of content parts, the text parts joined (this format has no image
    placeholder, so a request with images is then refused for lacking one)."""
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content if part.get("type") == "text")
    return content or ""
