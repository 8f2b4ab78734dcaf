"""Whether a request may join the queue: can it ever run, and is there room to wait?

A request that can never run (an empty prompt, one that leaves no room to generate, one whose
KV cache would not fit in the pool) is rejected as invalid; one that could run but finds the
queue full is refused as overloaded, to try again later (``SchedulerConfig``'s queue bounds).
"""

from __future__ import annotations

import logging

from interfaces import ErrorKind, SchedulerResult, TextContext, TextGenerationOutput
from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig

logger = logging.getLogger(__name__)

TextResult = SchedulerResult[TextGenerationOutput]


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
    if block_manager.num_blocks_for(max_tokens) > block_manager.num_blocks:
        return (
            f"the request may need {max_tokens} tokens of KV cache, more than the "
            f"{block_manager.num_blocks * block_manager.block_size} the pool holds"
        )
    return None


def queue_overload(
    config: SchedulerConfig, num_queued: int, num_waiting_tokens: int, num_prompt_tokens: int
) -> str | None:
    """Why a queue holding ``num_queued`` requests and ``num_waiting_tokens`` tokens cannot
    take a prompt of ``num_prompt_tokens`` now, or None."""
    if num_queued >= config.max_queued_requests:
        return f"{num_queued} requests are already waiting; try again later"
    if num_waiting_tokens + num_prompt_tokens > config.max_queued_tokens:
        return (
            f"{num_waiting_tokens} tokens are already waiting, and the queue holds at most "
            f"{config.max_queued_tokens}; try again later"
        )
    return None
