"""Log probabilities of chosen tokens and their top-k alternatives, batched.

As vLLM V1 does by default, they come from the RAW model logits (before the grammar mask, min
new tokens, logit bias, penalties and temperature), through a float32 log-softmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from interfaces import LogProbabilities, TextContext
from interfaces.requests import MAX_LOGPROBS
from worker.models import cpu_ops


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
    On the CPU in float32 the kernel (``cpu_ops.token_logprobs``) scores the rows without a
    log-softmax copy of them; torch's ops score the rows it leaves (NaN or an infinity in them)
    and everything elsewhere.
    """
    max_top = max(num_top, default=0)
    if cpu_ops.applies(logits) and logits.dim() == 2 and logits.is_contiguous():
        chosen, top_values, top_ids, nonfinite = cpu_ops.token_logprobs(
            logits, token_ids.contiguous(), max_top
        )
        if bool(nonfinite.any()):
            left = nonfinite.nonzero().squeeze(1)
            chosen[left], top_values[left], top_ids[left] = _torch_logprobs(
                logits[left], token_ids[left], max_top
            )
    else:
        chosen, top_values, top_ids = _torch_logprobs(logits, token_ids, max_top)
    chosen, top_values, top_ids = chosen.tolist(), top_values.tolist(), top_ids.tolist()
    return [
        (chosen[row], dict(zip(top_ids[row][:k], top_values[row][:k], strict=True)))
        for row, k in enumerate(num_top)
    ]


def _torch_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen (num_rows,), top values and ids (num_rows, num_top)) by torch's ops."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (num_rows, vocab_size)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    return chosen, top_values, top_ids


def as_log_probabilities(entries: Sequence[tuple[float, dict[int, float]]]) -> LogProbabilities:
    """One ``LogProbabilities`` covering ``entries`` (as ``token_logprobs`` returns them)."""
    return LogProbabilities(
        token_log_probabilities=[chosen for chosen, _ in entries],
        top_log_probabilities=[top for _, top in entries],
    )
