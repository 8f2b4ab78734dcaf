"""From a parsed OpenAI request to ``interfaces.TextGenerationRequest``.

Fields OpenAI defines that Switchyard does not support yet are refused here with a 400 that
names them, rather than silently ignored. Sampling follows OpenAI's defaults (temperature 1.0,
no top-k limit): a request that sets nothing is sampled, ``temperature=0`` is greedy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from api_server.errors import invalid_request
from api_server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from interfaces import SamplingParams, TextGenerationRequest, TextGenerationRequestMessage

Check = Callable[[Any], bool]

_COMMON_UNSUPPORTED: dict[str, Check] = {
    "n": lambda r: r.n not in (None, 1),
    "logit_bias": lambda r: bool(r.logit_bias),
    "frequency_penalty": lambda r: bool(r.frequency_penalty),
    "presence_penalty": lambda r: bool(r.presence_penalty),
    "repetition_penalty": lambda r: r.repetition_penalty not in (None, 1.0),
    "min_tokens": lambda r: bool(r.min_tokens),
}
_CHAT_UNSUPPORTED: dict[str, Check] = {
    "logprobs": lambda r: bool(r.logprobs),
    "top_logprobs": lambda r: bool(r.top_logprobs),
    "echo": lambda r: r.echo,
    "tools": lambda r: bool(r.tools),
    "tool_choice": lambda r: r.tool_choice not in (None, "none"),
    "functions": lambda r: r.functions is not None,
    "function_call": lambda r: r.function_call not in (None, "none"),
    "response_format": lambda r: r.response_format is not None and r.response_format.type != "text",
    "audio": lambda r: r.audio is not None,
    "modalities": lambda r: r.modalities not in (None, ["text"]),
    "prediction": lambda r: r.prediction is not None,
    "reasoning_effort": lambda r: r.reasoning_effort is not None,
    "verbosity": lambda r: r.verbosity is not None,
    "web_search_options": lambda r: r.web_search_options is not None,
}
_COMPLETION_UNSUPPORTED: dict[str, Check] = {
    "best_of": lambda r: r.best_of not in (None, 1),
    "echo": lambda r: bool(r.echo),
    "logprobs": lambda r: r.logprobs is not None,
    "suffix": lambda r: bool(r.suffix),
}


def check_supported(request: ChatCompletionRequest | CompletionRequest) -> None:
    """Raise a 400 naming every field set to a value Switchyard does not support yet."""
    checks = dict(_COMMON_UNSUPPORTED)
    chat = isinstance(request, ChatCompletionRequest)
    checks.update(_CHAT_UNSUPPORTED if chat else _COMPLETION_UNSUPPORTED)
    unsupported = [name for name, is_unsupported in checks.items() if is_unsupported(request)]
    if unsupported:
        raise invalid_request(
            f"Unsupported parameter(s): {', '.join(unsupported)}. Switchyard does not support "
            "them yet (n must be 1; penalties 0; no logprobs, tools or structured output).",
            param=unsupported[0],
            code="unsupported_parameter",
        )
    if request.stream_options is not None and not request.stream:
        raise invalid_request(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    if chat:
        for index, message in enumerate(request.messages):
            _check_message(index, message)


def _check_message(index: int, message: ChatMessage) -> None:
    for name in ("audio", "function_call"):
        if getattr(message, name) is not None:
            raise invalid_request(
                f"messages[{index}].{name} is not supported yet", param=f"messages[{index}].{name}"
            )
    parts = message.content if isinstance(message.content, list) else []
    for part_index, part in enumerate(parts):
        param = f"messages[{index}].content[{part_index}]"
        if part.type != "text":
            raise invalid_request(
                f"{param}: content parts of type {part.type!r} are not supported yet; "
                "only {'type': 'text', 'text': ...}",
                param=param,
            )
        if part.text is None:
            raise invalid_request(f"{param}.text is required", param=f"{param}.text")


def sampling_params(request: SamplingFields) -> SamplingParams:
    """SamplingParams with OpenAI's defaults; ``ValueError`` becomes a 400."""
    try:
        return SamplingParams(
            top_k=-1 if request.top_k is None else request.top_k,
            top_p=1.0 if request.top_p is None else request.top_p,
            min_p=0.0 if request.min_p is None else request.min_p,
            temperature=1.0 if request.temperature is None else request.temperature,
            max_new_tokens=request.max_new_tokens,
            ignore_eos=request.ignore_eos,
            stop=request.stop_strings or None,
            stop_token_ids=request.stop_token_ids,
            seed=request.seed,
        )
    except ValueError as error:
        raise invalid_request(str(error)) from error


def chat_generation_request(
    request: ChatCompletionRequest, request_id: str, model_name: str
) -> TextGenerationRequest:
    """The chat request as MAX's ``TextGenerationRequest`` (call ``check_supported`` first)."""
    return TextGenerationRequest(
        request_id=request_id,
        index=0,
        model_name=model_name,
        messages=[_generation_message(message) for message in request.messages],
        timestamp_ns=time.time_ns(),
        request_path="/v1/chat/completions",
        stop=request.stop,
        sampling_params=sampling_params(request),
        cache_salt=request.cache_salt,
    )


def completion_generation_request(
    request: CompletionRequest, request_id: str, model_name: str
) -> TextGenerationRequest:
    """The completions request as ``TextGenerationRequest``; one prompt only for now."""
    return TextGenerationRequest(
        request_id=request_id,
        index=0,
        model_name=model_name,
        prompt=single_prompt(request.prompt),
        timestamp_ns=time.time_ns(),
        request_path="/v1/completions",
        stop=request.stop,
        sampling_params=sampling_params(request),
        cache_salt=request.cache_salt,
    )


def single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    """The one prompt of a request: a string or token ids; a batch of one is unwrapped."""
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise invalid_request(
                "Several prompts in one request are not supported yet; send one per request",
                param="prompt",
            )
        return prompt[0]  # type: ignore[return-value]
    return prompt  # type: ignore[return-value]


def _generation_message(message: ChatMessage) -> TextGenerationRequestMessage:
    content: str | list[dict[str, Any]] | None = message.content  # type: ignore[assignment]
    if isinstance(message.content, list):
        content = [{"type": "text", "text": part.text} for part in message.content]
    return TextGenerationRequestMessage(
        role=message.role,
        content=content,
        name=message.name,
        tool_calls=message.tool_calls,
        tool_call_id=message.tool_call_id,
    )
