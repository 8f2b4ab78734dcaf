"""Batched token sampling: greedy, temperature, top-k, top-p and min-p in one pass of torch ops.

The logits processors (grammar mask, min-new-tokens, logit bias, penalties; see
``worker.logits_processors``) run first, on a copy of the logits.

Random choices use the exponential race: ``argmax(probs / noise)`` with ``noise ~ Exp(1)`` picks
token i with probability ``probs[i]``. A request with a seed draws its noise from its own
generator, re-seeded from (seed, index of the token being generated), so its tokens do not depend
on which other requests share the batch, nor on whether it was preempted and resumed.

Non-finite logits never reach a probability: NaN counts as -inf (never sampled), +inf as the
largest float32 (a tie among the infinite tokens), so softmax and argmax stay defined. A row
with no finite logit left (a model that produced only NaN, or processors that forbid every
token) has no token to give: ``Sampler.__call__`` returns ``NO_TOKEN`` for it rather than a
token its grammar forbids. Temperatures below 1e-5 are greedy (``SamplingParams.is_greedy``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from interfaces import SamplingParams
from worker.logits_processors import LogitsProcessors

_SEED_MIX = 0x9E3779B97F4A7C15
NO_TOKEN = -1
"""The token id of a row that had nothing to sample (every logit -inf or NaN)."""


def check_supported(params: SamplingParams, vocab_size: int) -> None:
    """Raise ``ValueError`` for settings this sampler cannot apply to a vocabulary this size."""
    outside = sorted(token for token in params.logit_bias or {} if token >= vocab_size)
    if outside:
        raise ValueError(
            f"logit_bias names token ids outside the vocabulary of {vocab_size}: {outside[:5]}"
        )


def token_seed(seed: int, token_index: int) -> int:
    """The generator seed for output token ``token_index`` of a request seeded with ``seed``."""
    return (seed * _SEED_MIX + token_index) % (1 << 63)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings as device tensors (one row per request being sampled).

    ``generators[i]`` is None for rows without a seed; those share the sampler's generator.
    ``top_ks`` holds vocab_size where top-k is off, ``top_ps`` infinity where top-p is off.
    ``processors`` edit the logits before any of that (None: no row needs them).
    """

    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    is_greedy: torch.Tensor
    all_greedy: bool
    generators: Sequence[torch.Generator | None]
    processors: LogitsProcessors | None = None

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
        processors: LogitsProcessors | None = None,
    ) -> SamplingBatch:
        greedy = [p.is_greedy for p in params]  # temperatures below 1e-5 too
        return cls(
            temperatures=_tensor(
                [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], device
            ),
            top_ks=_tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], device),
            top_ps=_tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device),
            min_ps=_tensor([p.min_p for p in params], device),
            is_greedy=_tensor(greedy, device),
            all_greedy=all(greedy),
            generators=generators,
            processors=processors,
        )


def _tensor(values: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, device=device)


class Sampler:
    """Picks one token per row of a logits batch.

    ``seed`` seeds the generator shared by rows without a seed of their own; None seeds it
    randomly.
    """

    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.generator = torch.Generator(device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Token ids (num_rows,) int64 for float32 ``logits`` (num_rows, vocab_size): each in
        the vocabulary, or ``NO_TOKEN`` for a row without a finite logit.

        ``logits`` is not modified (the caller may still need the raw values for logprobs).
        """
        if batch.processors is not None:
            logits = batch.processors.apply(logits)
        logits = finite_logits(logits)
        nothing_allowed = torch.isneginf(logits).all(dim=-1)  # (num_rows,)
        tokens = logits.argmax(dim=-1)
        if not batch.all_greedy:
            scaled = finite_logits(logits / batch.temperatures[:, None])
            probs = filtered_probabilities(scaled, batch)
            sampled = (probs / self._noise(probs, batch.generators)).argmax(dim=-1)
            tokens = torch.where(batch.is_greedy, tokens, sampled)
        return tokens.masked_fill(nothing_allowed, NO_TOKEN)

    def _noise(self, probs: torch.Tensor, generators: Sequence[torch.Generator | None]):
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, generator in enumerate(generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # 0 / 0 would be NaN


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` with NaN as -inf and +inf as the largest float32 (unchanged when all are
    finite or -inf, so parity rows stay bit-for-bit)."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)


def filtered_probabilities(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Softmax of ``logits`` (num_rows, vocab_size) restricted by top-k, top-p and min-p.

    Top-p keeps the smallest prefix of the sorted distribution whose mass reaches top_p (always
    at least the most likely token); min-p drops tokens below min_p times the top probability.
    """
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks >= batch.top_ks[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    too_unlikely = sorted_probs < batch.min_ps[:, None] * sorted_probs[:, :1]
    outside = (mass_before > batch.top_ps[:, None]) | too_unlikely
    sorted_probs = sorted_logits.masked_fill(outside, float("-inf")).softmax(dim=-1)
    return torch.zeros_like(sorted_probs).scatter_(-1, sorted_ids, sorted_probs)
