"""From a parsed OpenAI request to ``interfaces.TextGenerationRequest``s, one per prompt.

Fields OpenAI defines that Switchyard does not support yet are refused here with a 400 that
names them, rather than silently ignored. Sampling follows OpenAI's defaults (temperature 1.0,
no top-k limit): a request that sets nothing is sampled, ``temperature=0`` is greedy. The model's
generation_config.json may change those defaults (``api_server.generation_config``, applied to
the request before it gets here). Checks that need the vocabulary (``logit_bias`` keys,
``stop_token_ids``) take its size.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from pydantic import BaseModel

from api_server.errors import invalid_request
from api_server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    LogitsProcessorUse,
    SamplingFields,
)
from interfaces import (
    SamplingParams,
    StructuredOutput,
    TextGenerationRequest,
    TextGenerationRequestMessage,
    TextGenerationRequestTool,
)
from interfaces.requests import PreparedImage
from interfaces.sampling import LogitsProcessorCall

Check = Callable[[Any], bool]
Prompt = str | list[int]

GREEDY_BELOW_TEMPERATURE = 1e-5
"""A temperature below this samples as greedily as 0 does, and is sent as 0 (vLLM's
``_SAMPLING_EPS``): dividing logits by it would overflow float32."""

_CHAT_UNSUPPORTED: dict[str, Check] = {
    "echo": lambda r: r.echo,
    "functions": lambda r: r.functions is not None,
    "function_call": lambda r: r.function_call not in (None, "none"),
    "audio": lambda r: r.audio is not None,
    "modalities": lambda r: r.modalities not in (None, ["text"]),
    "prediction": lambda r: r.prediction is not None,
    "reasoning_effort": lambda r: r.reasoning_effort is not None,
    "verbosity": lambda r: r.verbosity is not None,
    "web_search_options": lambda r: r.web_search_options is not None,
}
_COMPLETION_UNSUPPORTED: dict[str, Check] = {
    "suffix": lambda r: bool(r.suffix),
}
_PARAM_OF_SAMPLING_FIELD = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def check_unicode(request: BaseModel) -> None:
    """400 naming the first string in ``request`` that is not valid Unicode: a lone UTF-16
    surrogate, which JSON's ``\\ud800`` escapes let through but neither the tokenizer nor the
    wire encoder can take."""
    parts = _invalid_string_path(request.model_dump(by_alias=True))
    if parts is not None:
        path = "".join(
            f"[{part}]" if isinstance(part, int) else f".{part}" if index else str(part)
            for index, part in enumerate(parts)
        )
        raise invalid_request(
            f"{path or 'A key'} is not valid Unicode: it holds a lone surrogate",
            param=path or None,
        )


_WALKED = frozenset({str, dict, list})
"""The types the walk looks into (``model_dump`` gives plain ones)."""


def _invalid_string_path(value: Any) -> list[str | int] | None:
    """The keys and indexes down to the first string in ``value`` that is not valid Unicode
    (an invalid key is named by its object's path), or None. Paths are built on the way back
    from that string only, and a list of numbers is passed over in C: a valid prompt of a
    million token ids took 0.7 s and 135 MB of paths, now 0.07 s with its ``model_dump``."""
    if isinstance(value, str):
        return None if _is_unicode(value) else []
    if isinstance(value, dict):
        if not all(_is_unicode(key) for key in value if isinstance(key, str)):
            return []
        items = value.items()
    elif isinstance(value, list) and not _WALKED.isdisjoint(map(type, value)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if type(item) in _WALKED:
            found = _invalid_string_path(item)
            if found is not None:
                return [key, *found]
    return None


def _is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_supported(request: ChatCompletionRequest | CompletionRequest) -> None:
    """Raise a 400 naming the first field set to a value Switchyard does not support yet, or
    a combination of fields that is invalid."""
    check_unicode(request)
    chat = isinstance(request, ChatCompletionRequest)
    checks = _CHAT_UNSUPPORTED if chat else _COMPLETION_UNSUPPORTED
    unsupported = [name for name, is_unsupported in checks.items() if is_unsupported(request)]
    if unsupported:
        raise invalid_request(
            f"Unsupported parameter(s): {', '.join(unsupported)}. Switchyard does not support "
            "them yet (no legacy functions, audio or suffix).",
            param=unsupported[0],
            code="unsupported_parameter",
        )
    if request.stream_options is not None and not request.stream:
        raise invalid_request(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    if chat:
        _check_chat(request)
    else:
        _check_completion(request)


def _check_chat(request: ChatCompletionRequest) -> None:
    if request.top_logprobs is not None and not request.logprobs:
        raise invalid_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    for index, message in enumerate(request.messages):
        check_message(index, message)


def _check_completion(request: CompletionRequest) -> None:
    if request.best_of not in (None, request.n):
        raise invalid_request(
            f"best_of ({request.best_of}) must equal n ({request.n}) or be left out: Switchyard "
            "returns every choice it samples",
            param="best_of",
        )
    if request.max_tokens == 0 and not request.echo:
        raise invalid_request(
            "max_tokens must be at least 1 unless echo is true", param="max_tokens"
        )


def check_message(index: int, message: ChatMessage) -> None:
    """400 for message fields and content parts that are not supported yet, and for tool
    fields on the wrong role (tool calls belong to assistants, results to tool messages)."""
    for name in ("audio", "function_call"):
        if getattr(message, name) is not None:
            raise invalid_request(
                f"messages[{index}].{name} is not supported yet", param=f"messages[{index}].{name}"
            )
    if message.tool_calls is not None and message.role != "assistant":
        raise invalid_request(
            f"messages[{index}].tool_calls is only allowed on assistant messages",
            param=f"messages[{index}].tool_calls",
        )
    if message.role == "tool" and not message.tool_call_id:
        raise invalid_request(
            f"messages[{index}] has role 'tool' and needs the tool_call_id it answers",
            param=f"messages[{index}].tool_call_id",
        )
    parts = message.content if isinstance(message.content, list) else []
    for part_index, part in enumerate(parts):
        _check_part(f"messages[{index}].content[{part_index}]", part, message.role)


def _check_part(param: str, part: ContentPart, role: str) -> None:
    if part.type == "image_url":
        if role != "user":
            raise invalid_request(f"{param}: images are only allowed in user messages", param=param)
        if part.image_url is None:
            raise invalid_request(f"{param}.image_url is required", param=param)
        return
    if part.type != "text":
        raise invalid_request(
            f"{param}: content parts of type {part.type!r} are not supported; only "
            "{'type': 'text', 'text': ...} and {'type': 'image_url', 'image_url': {'url': ...}}",
            param=param,
        )
    if part.text is None:
        raise invalid_request(f"{param}.text is required", param=f"{param}.text")


def sampling_params(
    request: SamplingFields, vocab_size: int, processor_names: Collection[str] = ()
) -> SamplingParams:
    """SamplingParams with OpenAI's defaults; every invalid value is a 400 naming its field.

    ``max_tokens`` 0 (completions' echo only) generates one token, which is then discarded.
    ``processor_names`` are the user logits processors the workers load: a request that
    names another is a 400.
    """
    max_new_tokens = request.max_new_tokens
    min_new_tokens = request.min_tokens or 0
    if max_new_tokens is not None and min_new_tokens > max_new_tokens:
        raise invalid_request(
            f"min_tokens ({min_new_tokens}) must not exceed max_tokens ({max_new_tokens})",
            param="min_tokens",
        )
    try:
        return SamplingParams(
            top_k=-1 if request.top_k is None else request.top_k,
            top_p=1.0 if request.top_p is None else request.top_p,
            min_p=0.0 if request.min_p is None else request.min_p,
            temperature=_temperature(request.temperature),
            frequency_penalty=request.frequency_penalty or 0.0,
            presence_penalty=request.presence_penalty or 0.0,
            repetition_penalty=request.repetition_penalty or 1.0,
            max_new_tokens=None if max_new_tokens is None else max(max_new_tokens, 1),
            min_new_tokens=min_new_tokens,
            ignore_eos=request.ignore_eos,
            stop=request.stop_strings or None,
            stop_token_ids=_stop_token_ids(request.stop_token_ids, vocab_size),
            seed=request.seed,
            logit_bias=_logit_bias(request.logit_bias, vocab_size),
            logits_processors=_logits_processors(request.logits_processors, processor_names),
        )
    except ValueError as error:
        raise invalid_request(str(error), param=_param_of(str(error))) from error


def _temperature(temperature: float | None) -> float:
    """OpenAI's default 1.0 when unset; 0 (greedy) below ``GREEDY_BELOW_TEMPERATURE``."""
    if temperature is None:
        return 1.0
    return 0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature


def _param_of(message: str) -> str:
    """The request field a ``SamplingParams`` error message is about (its first word)."""
    field = message.split(" ", 1)[0]
    return _PARAM_OF_SAMPLING_FIELD.get(field, field)


def _logit_bias(logit_bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's ``{"token id": bias}`` as ``{token_id: bias}``; 400 for keys that are not token
    ids of this vocabulary. (Bias values are range-checked by ``SamplingParams``.)"""
    if not logit_bias:
        return None
    parsed = {}
    for key, bias in logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            token_id = -1
        if not 0 <= token_id < vocab_size:
            raise invalid_request(
                f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}",
                param="logit_bias",
            )
        parsed[token_id] = bias
    return parsed


def _logits_processors(
    uses: list[str | LogitsProcessorUse] | None, loaded: Collection[str]
) -> list[LogitsProcessorCall] | None:
    """The request's ``logits_processors`` for the wire; 400 for names the workers do not load."""
    if not uses:
        return None
    calls = [
        LogitsProcessorCall(use)
        if isinstance(use, str)
        else LogitsProcessorCall(use.name, use.args)
        for use in uses
    ]
    unknown = [call.name for call in calls if call.name not in loaded]
    if unknown:
        offered = ", ".join(sorted(loaded)) if loaded else "none (see --logits-processors)"
        raise invalid_request(
            f"logits_processors names processors this server does not load: {unknown}; it loads "
            f"{offered}",
            param="logits_processors",
        )
    return calls


def _stop_token_ids(token_ids: list[int] | None, vocab_size: int) -> list[int] | None:
    for token_id in token_ids or []:
        if not 0 <= token_id < vocab_size:
            raise invalid_request(
                f"stop_token_ids must be token ids in [0, {vocab_size}), got {token_id}",
                param="stop_token_ids",
            )
    return token_ids


def chat_generation_request(
    request: ChatCompletionRequest,
    request_id: str,
    params: SamplingParams,
    tools: list[TextGenerationRequestTool] | None = None,
    constraint: StructuredOutput | None = None,
    images: list[PreparedImage] | None = None,
) -> TextGenerationRequest:
    """The chat request as MAX's ``TextGenerationRequest`` (call ``check_supported`` first, and
    take ``params`` from ``sampling_params``); ``tools`` are the functions the prompt offers
    (None: none), ``images`` the conversation's in prompt order."""
    return TextGenerationRequest(
        request_id=request_id,
        index=0,
        messages=[generation_message(message) for message in request.messages],
        images=images or [],
        tools=tools or None,
        logprobs=request.num_logprobs,
        sampling_params=params,
        structured_output=constraint,
        cache_salt=request.cache_salt,
        chat_template_options=request.chat_template_kwargs,
    )


def completion_generation_requests(
    request: CompletionRequest,
    request_id: str,
    params: SamplingParams,
    constraint: StructuredOutput | None = None,
) -> list[TextGenerationRequest]:
    """One ``TextGenerationRequest`` per prompt, ``index`` the prompt's position (their number
    is bounded by ``api_server.request_limits``), as ``chat_generation_request`` makes them."""
    return [
        TextGenerationRequest(
            request_id=request_id,
            index=index,
            prompt=prompt,
            logprobs=request.num_logprobs,
            echo=bool(request.echo),
            sampling_params=params,
            structured_output=constraint,
            cache_salt=request.cache_salt,
        )
        for index, prompt in enumerate(split_prompts(request.prompt))
    ]


def split_prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[Prompt]:
    """The prompts of a completions request: a string, token ids, or a list of either."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def generation_message(message: ChatMessage) -> TextGenerationRequestMessage:
    """The wire form of a chat message: text parts reduced to their text, image parts to
    ``{"type": "image"}`` (Hugging Face's placeholder part; the pixels travel separately)."""
    content: str | list[dict[str, Any]] | None = message.content  # type: ignore[assignment]
    if isinstance(message.content, list):
        content = [
            {"type": "image"} if part.type == "image_url" else {"type": "text", "text": part.text}
            for part in message.content
        ]
    return TextGenerationRequestMessage(
        role=message.role,
        content=content,
        name=message.name,
        tool_calls=_wire_tool_calls(message),
        tool_call_id=message.tool_call_id,
    )


def _wire_tool_calls(message: ChatMessage) -> list[dict[str, Any]] | None:
    if message.tool_calls is None:
        return None
    return [call.model_dump(exclude={"index"}) for call in message.tool_calls]
