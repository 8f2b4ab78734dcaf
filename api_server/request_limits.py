"""Bounds on what one generation request may ask for (``RequestLimits``), each a 400 naming its
flag, checked on the event loop before anything costly runs (meta-validating schemas,
rendering the chat template, tokenizing):

- its prompt text: the UTF-8 bytes of its messages (text, names, earlier tool calls) and tool
  definitions, or of its prompts;
- its choices: prompts x ``n``;
- its output tokens: all choices together. With ``max_tokens`` given this is known at once; a
  choice without it may generate the rest of the context, known once its prompt is tokenized
  (``OutputBudget``).

Schemas, grammars, regexes and choice lists are bounded by ``api_server.structured_output``.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from api_server.config import RequestLimits
from api_server.errors import invalid_request
from api_server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from api_server.request_builder import split_prompts
from interfaces import TextContext


def check_request_limits(
    request: ChatCompletionRequest | CompletionRequest, limits: RequestLimits, max_model_len: int
) -> None:
    """400 when ``request`` asks for more choices, prompt text or output tokens (when its
    ``max_tokens`` says) than ``limits`` allow."""
    chat = isinstance(request, ChatCompletionRequest)
    num_prompts = 1 if chat else len(split_prompts(request.prompt))
    num_choices = num_prompts * request.num_choices_per_prompt
    if num_choices > limits.max_choices:
        raise invalid_request(
            f"This request asks for {num_choices} choices ({num_prompts} prompts x n "
            f"{request.num_choices_per_prompt}); the limit is {limits.max_choices} "
            "(--max-choices-per-request)",
            param="n",
        )
    num_bytes = chat_prompt_bytes(request) if chat else completion_prompt_bytes(request)
    check_prompt_bytes(
        num_bytes, limits.prompt_bytes(max_model_len), "messages" if chat else "prompt"
    )
    if request.max_new_tokens is not None:
        per_choice = max(request.max_new_tokens, 1)
        _check_output_tokens(num_choices * per_choice, limits.request_output_tokens(max_model_len))


def check_prompt_bytes(num_bytes: int, limit: int, param: str) -> None:
    """400 when prompt text of ``num_bytes`` UTF-8 bytes is above ``limit`` (--max-prompt-bytes)."""
    if num_bytes > limit:
        raise invalid_request(
            f"The prompt text takes {num_bytes} bytes; the limit is {limit} bytes "
            "(--max-prompt-bytes)",
            param=param,
        )


def messages_bytes(messages: list[ChatMessage]) -> int:
    """UTF-8 bytes of the text in ``messages`` (content, names, earlier tool calls)."""
    return sum(_message_bytes(message) for message in messages)


class OutputBudget:
    """The output tokens a request's choices may generate, added up as its prompts are
    tokenized: each choice may reach its context's ``max_length`` (prompt plus ``max_tokens``,
    or the whole context when ``max_tokens`` is not set). Choices that echo their prompt with
    log probabilities (completions' ``echo`` with ``logprobs``) count its tokens too, each
    choice after a prompt's first: the prompt's log probabilities are computed once, but each
    such choice answers every prompt token with its alternatives, as a generated token is, and
    they are formatted and sent for each. A prompt's first choice is left out: the client sent
    those tokens (scoring many prompts with ``n=1`` is bounded by the prompt limits)."""

    def __init__(self, limits: RequestLimits, max_model_len: int, num_choices_per_prompt: int):
        self.limit = limits.request_output_tokens(max_model_len)
        self.num_choices_per_prompt = num_choices_per_prompt
        self.num_tokens = 0
        self.echoes_logprobs = False

    def add(self, context: TextContext) -> None:
        """Count the choices of ``context``'s prompt; 400 once the total passes the limit."""
        per_choice = context.max_length - context.num_prompt_tokens
        self.num_tokens += self.num_choices_per_prompt * per_choice
        if context.prompt_logprobs is not None and self.num_choices_per_prompt > 1:
            self.num_tokens += (self.num_choices_per_prompt - 1) * context.num_prompt_tokens
            self.echoes_logprobs = True
        _check_output_tokens(self.num_tokens, self.limit, self.echoes_logprobs)


def _check_output_tokens(num_tokens: int, limit: int, echoes_logprobs: bool = False) -> None:
    if num_tokens > limit:
        echoed = ", and each choice after a prompt's first that echoes it with logprobs its tokens"
        raise invalid_request(
            f"This request's choices may generate {num_tokens} tokens in all (choices x "
            "max_tokens, a choice without max_tokens counting the rest of the context"
            f"{echoed if echoes_logprobs else ''}); the limit is {limit} "
            "(--max-request-output-tokens). Set a smaller max_tokens or ask for fewer choices.",
            param="max_tokens",
        )


def chat_prompt_bytes(request: ChatCompletionRequest) -> int:
    """UTF-8 bytes of the text the chat template will render: messages and tools."""
    num_bytes = messages_bytes(request.messages)
    for index, tool in enumerate(request.tools or []):
        function = tool.function
        num_bytes += text_bytes(function.name) + text_bytes(function.description)
        num_bytes += json_bytes(function.parameters, f"tools[{index}].function.parameters")
    return num_bytes


def completion_prompt_bytes(request: CompletionRequest) -> int:
    """UTF-8 bytes of the prompts given as text (token id prompts are bounded by the context)."""
    prompts = split_prompts(request.prompt)
    return sum(text_bytes(prompt) for prompt in prompts if isinstance(prompt, str))


def json_bytes(value: Any, param: str) -> int:
    """UTF-8 bytes of ``value`` as compact JSON; 400 when it is nested too deeply to write."""
    try:
        try:
            return len(msgspec.json.encode(value))
        except UnicodeEncodeError:  # a lone surrogate, refused later with its path
            return text_bytes(json.dumps(value, ensure_ascii=False, separators=(",", ":")))
    except RecursionError as error:
        raise invalid_request(f"{param} is nested too deeply", param=param) from error


def _message_bytes(message: ChatMessage) -> int:
    content = message.content
    if isinstance(content, list):
        num_bytes = sum(text_bytes(part.text) for part in content)
    else:
        num_bytes = text_bytes(content)
    for call in message.tool_calls or []:
        num_bytes += text_bytes(call.function.name) + text_bytes(call.function.arguments)
        num_bytes += text_bytes(call.id)
    return num_bytes + text_bytes(message.name) + text_bytes(message.tool_call_id)


def text_bytes(text: str | None) -> int:
    """UTF-8 bytes of ``text`` (a lone surrogate counts 3; ``check_unicode`` refuses it)."""
    return 0 if text is None else len(text.encode("utf-8", "surrogatepass"))
