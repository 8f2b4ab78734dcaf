"""Prompt log probabilities, gathered chunk by chunk during prefill.

The log probability of prompt token i + 1 comes from the logits at position i. A step that
computes positions [start, end) of a request that wants prompt log probabilities therefore needs
the logits of positions [start, min(end, num_prompt_tokens - 1)); the last prompt position's
logits are the ones sampled from and are not part of this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from worker.logprobs import token_logprobs
from worker.request_state import RequestState


@dataclass
class PromptLogprobRows:
    """Which rows of one step's flat token batch feed prompt log probabilities.

    ``flat_indices[j]`` is a row of the flat batch whose logits score ``target_token_ids[j]``;
    ``spans`` lists, in the same order, each request and how many of those rows are its.
    """

    flat_indices: list[int] = field(default_factory=list)
    target_token_ids: list[int] = field(default_factory=list)
    spans: list[tuple[RequestState, int]] = field(default_factory=list)


def plan_prompt_logprob_rows(
    states: Sequence[RequestState], counts: Sequence[int]
) -> PromptLogprobRows:
    """The rows of this step (before ``num_computed_tokens`` advances) that need logits."""
    rows = PromptLogprobRows()
    request_start = 0
    for state, count in zip(states, counts, strict=True):
        if state.prompt_logprobs is not None:
            first = state.num_computed_tokens
            positions = range(first, min(first + count, state.num_prompt_tokens - 1))
            rows.flat_indices += [request_start + position - first for position in positions]
            rows.target_token_ids += [state.token_ids[position + 1] for position in positions]
            rows.spans.append((state, len(positions)))
        request_start += count
    return rows


def record_prompt_logprobs(logits: torch.Tensor, rows: PromptLogprobRows) -> None:
    """Append each request's share of ``logits`` (len(flat_indices), vocab_size), scored, to its
    ``prompt_logprobs``."""
    if not rows.flat_indices:
        return
    targets = torch.tensor(rows.target_token_ids, dtype=torch.int64, device=logits.device)
    num_top = [state.prompt_logprobs.num_top for state, n in rows.spans for _ in range(n)]
    entries = token_logprobs(logits, targets, num_top)
    start = 0
    for state, num_rows in rows.spans:
        state.prompt_logprobs.entries += entries[start : start + num_rows]
        start += num_rows
