"""Log probabilities of chosen tokens and their top-k alternatives, batched.

As vLLM V1 does by default, they come from the RAW model logits (before the grammar mask, min
new tokens, logit bias, penalties and temperature), through a float32 log-softmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from interfaces import LogProbabilities, TextContext
from interfaces.requests import MAX_LOGPROBS


def check_logprob_counts(context: TextContext) -> None:
    """Raise ``ValueError`` unless ``logprobs`` and ``prompt_logprobs`` are None or 0..20."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(context, name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise ValueError(
                f"request {context.request_id!r}: {name} must be in [0, {MAX_LOGPROBS}], "
                f"got {value}"
            )


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]
) -> list[tuple[float, dict[int, float]]]:
    """For each row: the log probability of ``token_ids[row]`` and the ``num_top[row]`` likeliest
    tokens with theirs, most likely first.

    ``logits`` (num_rows, vocab_size) are raw model logits; ``token_ids`` is (num_rows,) int64.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (num_rows, vocab_size)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    max_top = max(num_top, default=0)
    top_values, top_ids = logprobs.topk(max_top, dim=-1)  # (num_rows, max_top) each
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [
        (chosen[row], dict(zip(top_ids[row][:k], top_values[row][:k], strict=True)))
        for row, k in enumerate(num_top)
    ]


def as_log_probabilities(entries: Sequence[tuple[float, dict[int, float]]]) -> LogProbabilities:
    """One ``LogProbabilities`` covering ``entries`` (as ``token_logprobs`` returns them)."""
    return LogProbabilities(
        token_log_probabilities=[chosen for chosen, _ in entries],
        top_log_probabilities=[top for _, top in entries],
    )
