"""Whether a request may join the queue: can it ever run, and is there room to wait?

A request that can never run (an empty prompt, one that leaves no room to generate, one whose
KV cache would not fit in the pool) is rejected as invalid; one that could run but finds the
queue full is refused as overloaded, to try again later (``SchedulerConfig``'s queue bounds).

Before either, ``context_problem`` checks the values a context brought over the wire: decoding
proved their types, not that a worker can use them (a token id of 2**63 does not fit the
int64 the block hashes and the model's embedding table take).
"""

from __future__ import annotations

import logging
import math

from interfaces import ErrorKind, SchedulerResult, TextContext, TextGenerationOutput
from interfaces.requests import MAX_LOGPROBS, MAX_REQUEST_ID_LENGTH
from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig

logger = logging.getLogger(__name__)

TextResult = SchedulerResult[TextGenerationOutput]
UNREPORTED_VOCAB_LIMIT = 1 << 31
"""Token ids must be below this when no worker reported its vocabulary size."""
FLOAT_SAMPLING_FIELDS = (
    "top_p", "min_p", "temperature", "frequency_penalty", "presence_penalty", "repetition_penalty"
)  # fmt: skip


def refusal(context: TextContext, problem: str | None, overload: str | None) -> TextResult | None:
    """The result refusing ``context`` (logged): INVALID_REQUEST for a ``problem`` that keeps
    it from ever running, else OVERLOADED for an ``overload``; None to accept it."""
    if problem is None and overload is None:
        return None
    verb, reason = ("rejected", problem) if problem is not None else ("refused", overload)
    request_id = context.request_id
    logger.warning("%s request %s: %s", verb, request_id, reason, extra={"request_id": request_id})
    if problem is not None:
        return SchedulerResult.rejected_request(problem)
    return SchedulerResult.cancelled(overload, ErrorKind.OVERLOADED)


def context_problem(context: TextContext, vocab_size: int) -> str | None:
    """Why a context's values cannot be served by workers whose vocabulary holds ``vocab_size``
    tokens (0: not reported), or None. Token ids must index the vocabulary (``eos_token_ids``
    may also be -1, "none"), lists of them be no longer than it, logprobs counts at most
    ``MAX_LOGPROBS``, sampling numbers be finite (``SamplingParams`` checked their ranges when
    they were decoded) and ``top_k`` fit the worker's int64 tensors, images lie in the prompt
    in order."""
    if not 1 <= len(context.request_id) <= MAX_REQUEST_ID_LENGTH:
        return f"the request id must be 1 to {MAX_REQUEST_ID_LENGTH} characters"
    limit = vocab_size or UNREPORTED_VOCAB_LIMIT
    params = context.sampling_params
    token_lists = (
        ("prompt token ids", context.prompt_token_ids, 0),
        ("generated token ids", context.generated_token_ids, 0),
        ("eos_token_ids", context.eos_token_ids, -1),
        ("stop_token_ids", params.stop_token_ids or [], 0),
        ("logit_bias keys", list(params.logit_bias or {}), 0),
    )
    for name, token_ids, lowest in token_lists:
        if not name.endswith(" token ids") and len(token_ids) > limit:
            return f"{len(token_ids)} {name}, more than the vocabulary's {limit} tokens"
        if token_ids and not (lowest <= min(token_ids) and max(token_ids) < limit):
            return f"{name} must be in [{lowest}, {limit})"
    for name in FLOAT_SAMPLING_FIELDS:
        if not math.isfinite(getattr(params, name)):
            return f"{name} must be a finite number, got {getattr(params, name)}"
    if params.top_k >= 1 << 63:
        return f"top_k must be below 2**63, got {params.top_k}"
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(context, name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            return f"{name} must be in [0, {MAX_LOGPROBS}], got {value}"
    return _images_problem(context)


def _images_problem(context: TextContext) -> str | None:
    end = 0
    for image in context.images:
        if not end <= image.start_idx < image.end_idx <= len(context.prompt_token_ids):
            return "images must cover prompt positions in order, without overlapping"
        if len(image.image_hash) > 128:
            return "an image hash is longer than 128 characters"
        end = image.end_idx
    return None


def admission_problem(
    context: TextContext, max_model_len: int, block_manager: BlockManager
) -> str | None:
    """Why ``context`` can never run with this context length and block pool, or None."""
    num_prompt = len(context.prompt_token_ids)
    if num_prompt == 0:
        return "the prompt is empty"
    if num_prompt >= max_model_len:
        return (
            f"the prompt has {num_prompt} tokens, but the model's context length is "
            f"{max_model_len}; no room is left to generate"
        )
    max_tokens = min(context.max_length, max_model_len)
    num_generated = len(context.generated_token_ids)
    if num_generated and num_prompt + num_generated >= max_tokens:
        return (
            f"the prompt and the {num_generated} tokens generated already "
            f"leave no room to generate within {max_tokens} tokens"
        )
    if block_manager.num_blocks_for(max_tokens) > block_manager.num_blocks:
        return (
            f"the request may need {max_tokens} tokens of KV cache, more than the "
            f"{block_manager.num_blocks * block_manager.block_size} the pool holds"
        )
    return None


def num_context_tokens(context: TextContext) -> int:
    """The tokens ``context`` holds when it is queued: its prompt plus the tokens it generated
    already (``Request.num_tokens``), as the queue's token bound counts them."""
    return len(context.prompt_token_ids) + len(context.generated_token_ids)


def queue_overload(
    config: SchedulerConfig, num_queued: int, num_waiting_tokens: int, context: TextContext
) -> str | None:
    """Why a queue holding ``num_queued`` requests and ``num_waiting_tokens`` tokens cannot
    take ``context`` now, or None. Never for a context that brings tokens it generated already:
    an API server submits a request so again after a scheduler restart, and it was accepted
    once (as a request that moves between groups, it is not refused for a full queue)."""
    if context.generated_token_ids:
        return None
    if num_queued >= config.max_queued_requests:
        return f"{num_queued} requests are already waiting; try again later"
    if num_waiting_tokens + num_context_tokens(context) > config.max_queued_tokens:
        return (
            f"{num_waiting_tokens} tokens are already waiting, and the queue holds at most "
            f"{config.max_queued_tokens}; try again later"
        )
    return None
