"""SamplingParams: per-request sampling settings, as in MAX's ``max.interfaces.SamplingParams``.

Validation happens on construction (``__post_init__``) and raises ``ValueError`` with a message a
user can act on; the API server turns that into an HTTP 400. Every process that decodes a
SamplingParams from the wire gets the same checks, so a hostile frame cannot smuggle in a
negative temperature.
"""

from __future__ import annotations

from typing import Any

import msgspec

MAX_LOGITS_PROCESSORS = 8
"""The most user logits processors one request may ask for."""
MAX_LOGITS_PROCESSOR_NAME_CHARS = 128
MAX_LOGITS_PROCESSOR_ARGS_BYTES = 4096
"""The bound on one processor's ``args``, as JSON."""
MAX_LOGITS_PROCESSOR_ARGS_DEPTH = 16
"""How deep one processor's ``args`` may nest (an object in an object: 2)."""

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``): dividing logits by a smaller
one overflows float32 (``1e-300`` is 0.0 there) and turns them into infinities and NaN."""


class LogitsProcessorCall(
    msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True
):
    """A request's use of one user logits processor that the workers loaded
    (``--logits-processors``): its ``name`` and the ``args`` the processor reads from its
    context (a small JSON object; None: none)."""

    name: str
    args: dict[str, Any] | None = None


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """How to pick each next token.

    Semantics follow MAX: ``top_k=1`` (the default) is greedy, as is ``temperature=0`` (or any
    temperature below ``GREEDY_TEMPERATURE``).
    ``top_k`` of 0 or -1 means "no top-k limit" (vLLM's convention for OpenAI requests).
    ``max_new_tokens=None`` means "until end of sequence or the context is full".
    ``seed`` (any integer; the worker takes it modulo 2^64) makes sampling reproducible: output
    token i is drawn from (seed, i) alone, whichever requests share the batch, and however
    often the request is preempted or moved to another worker and recomputed. The API server
    and the offline pipeline never send None: ``PipelineTokenizer.new_context`` draws a seed for
    a request that has none, so each request still gets fresh randomness and yet continues
    with the same tokens after a fault. ``seed=None`` (a raw client) draws fresh randomness
    for every token, so such a request, once moved, continues with different ones.
    ``logit_bias`` (OpenAI's, keyed by token id) is added to the logits before sampling; it is
    not one of MAX's fields.
    ``logits_processors`` names the user logits processors to apply to this request's logits
    (``worker.user_processors``), each at most once; None: none.
    """

    top_k: int = 1
    top_p: float = 1.0
    min_p: float = 0.0
    temperature: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    detokenize: bool = True
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    logits_processors: list[LogitsProcessorCall] | None = None

    def __post_init__(self) -> None:
        problem = next(_problems(self), None)
        if problem is not None:
            raise ValueError(problem)

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _problems(params: SamplingParams):
    """Yield a message for each invalid field (the caller raises the first)."""
    if params.top_k < -1:
        yield f"top_k must be -1, 0 (no limit) or a positive integer, got {params.top_k}"
    if not 0.0 < params.top_p <= 1.0:
        yield f"top_p must be in (0, 1], got {params.top_p}"
    if not 0.0 <= params.min_p <= 1.0:
        yield f"min_p must be in [0, 1], got {params.min_p}"
    if not 0.0 <= params.temperature <= 100.0:
        yield f"temperature must be in [0, 100], got {params.temperature}"
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(params, name)
        if not -2.0 <= value <= 2.0:
            yield f"{name} must be in [-2, 2], got {value}"
    if params.repetition_penalty <= 0.0:
        yield f"repetition_penalty must be positive, got {params.repetition_penalty}"
    if params.max_new_tokens is not None and params.max_new_tokens < 1:
        yield f"max_new_tokens must be at least 1, got {params.max_new_tokens}"
    if params.min_new_tokens < 0:
        yield f"min_new_tokens must be non-negative, got {params.min_new_tokens}"
    if params.max_new_tokens is not None and params.min_new_tokens > params.max_new_tokens:
        yield (
            f"min_new_tokens ({params.min_new_tokens}) must not exceed "
            f"max_new_tokens ({params.max_new_tokens})"
        )
    if params.stop_token_ids is not None and any(t < 0 for t in params.stop_token_ids):
        yield "stop_token_ids must be non-negative token ids"
    if params.stop is not None and any(not s for s in params.stop):
        yield "stop strings must be non-empty"
    if params.logit_bias is not None:
        if any(token_id < 0 for token_id in params.logit_bias):
            yield "logit_bias keys must be non-negative token ids"
        if any(not -100.0 <= bias <= 100.0 for bias in params.logit_bias.values()):
            yield "logit_bias values must be in [-100, 100]"
    if params.logits_processors is not None:
        yield from _logits_processor_problems(params.logits_processors)


def _logits_processor_problems(calls: list[LogitsProcessorCall]):
    if len(calls) > MAX_LOGITS_PROCESSORS:
        yield f"logits_processors may name at most {MAX_LOGITS_PROCESSORS} processors"
    names = [call.name for call in calls]
    if len(set(names)) != len(names):
        yield "logits_processors names a processor more than once"
    if any(not 0 < len(name) <= MAX_LOGITS_PROCESSOR_NAME_CHARS for name in names):
        yield (
            f"logits_processors names must have 1 to {MAX_LOGITS_PROCESSOR_NAME_CHARS} characters"
        )
    for call in calls:
        size = _args_size(call.args)
        if size is None:
            yield (
                f"logits_processors args of {call.name!r} must be a JSON object (string keys, "
                f"integers of 64 bits, nested at most {MAX_LOGITS_PROCESSOR_ARGS_DEPTH} deep)"
            )
        elif size > MAX_LOGITS_PROCESSOR_ARGS_BYTES:
            yield (
                f"logits_processors args of {call.name!r} exceed "
                f"{MAX_LOGITS_PROCESSOR_ARGS_BYTES} bytes as JSON"
            )


def _args_size(args: object) -> int | None:
    """Bytes of ``args`` as JSON, or None if it is not a JSON object that the wire (msgpack)
    carries: string keys, integers of 64 bits, at most ``MAX_LOGITS_PROCESSOR_ARGS_DEPTH``
    levels (measured without recursion, so no input can exhaust the stack here)."""
    if args is None:
        return 0
    if not isinstance(args, dict):
        return None
    stack: list[tuple[object, int]] = [(args, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > MAX_LOGITS_PROCESSOR_ARGS_DEPTH:
                return None
            if isinstance(value, dict):
                if not all(isinstance(key, str) for key in value):
                    return None
                value = value.values()
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, int) and not isinstance(value, bool):
            if not -(2**63) <= value < 2**64:
                return None
        elif not (value is None or isinstance(value, str | float | bool)):
            return None
    try:
        return len(msgspec.json.encode(args))
    except (TypeError, ValueError, msgspec.EncodeError):
        return None
