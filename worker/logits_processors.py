"""Logit edits that change which token is likeliest, batched over every row being sampled.

Applied to a copy of the model's float32 logits before temperature, top-k, top-p and min-p, in
vLLM V1's order: the grammar mask, min-new-tokens (end-of-sequence and stop ids to -inf), logit
bias, then the repetition, frequency and presence penalties, then the user processors the
request names (``worker.user_processors``). Rows that use none of them come out bit-for-bit
unchanged, which keeps greedy parity with transformers.

A request's own edits (its logit_bias, the ids min-new-tokens blocks) become device tensors once
per request (``RequestEdits``), not every step: a full-vocabulary logit_bias is ~49k entries,
and rebuilding it from Python for each row of a batch every step cost seconds per step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from interfaces import SamplingParams
from worker.user_processors import UserProcessing, UserProcessor, user_processing


@dataclass(frozen=True)
class RequestEdits:
    """One request's sparse logit edits as device tensors, built once when it arrives.

    ``bias_token_ids`` (num_biased,) int64 and ``bias_values`` (num_biased,) float32 are its
    logit_bias; ``min_tokens_blocked_ids`` (num_blocked,) int64 are the vocabulary's ids among
    its stop ids and, unless ``ignore_eos``, its end-of-sequence ids (blocked until
    min_new_tokens outputs exist). Ids outside the vocabulary can never be sampled and are left
    out.
    """

    bias_token_ids: torch.Tensor
    bias_values: torch.Tensor
    min_tokens_blocked_ids: torch.Tensor
    prompt_seen_ids: np.ndarray | None = None
    """With a repetition penalty, the prompt's distinct token ids (sorted int64): the penalty
    reads them each step, and the prompt never changes. None without one (or not given)."""

    @classmethod
    def build(
        cls,
        params: SamplingParams,
        eos_token_ids: Sequence[int],
        vocab_size: int,
        device: torch.device,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> RequestEdits:
        bias = params.logit_bias or {}
        blocked = set()
        if params.min_new_tokens:
            blocked.update(params.stop_token_ids or ())
            if not params.ignore_eos:
                blocked.update(eos_token_ids)
        blocked = {token for token in blocked if 0 <= token < vocab_size}
        return cls(
            bias_token_ids=torch.tensor(list(bias), dtype=torch.int64, device=device),
            bias_values=torch.tensor(list(bias.values()), dtype=torch.float32, device=device),
            min_tokens_blocked_ids=torch.tensor(sorted(blocked), dtype=torch.int64, device=device),
            prompt_seen_ids=(
                np.unique(np.asarray(prompt_token_ids, dtype=np.int64))
                if prompt_token_ids is not None and params.repetition_penalty != 1.0
                else None
            ),
        )


@dataclass(frozen=True)
class SamplingRow:
    """What the logits processors need to know about one request being sampled.

    ``token_ids`` is the prompt (its first ``num_prompt_tokens``) followed by the outputs so far;
    the row does not own it and reads it only while the batch is built.
    ``blocked_token_ids`` are set to -inf for this token (min-new-tokens not reached yet): ids,
    or a (num_blocked,) int64 tensor of them.
    ``edits`` are the request's prebuilt tensors; None builds the logit bias from ``params``.
    ``request_id`` is for the user processors' context.
    """

    params: SamplingParams
    token_ids: Sequence[int]
    num_prompt_tokens: int
    blocked_token_ids: Sequence[int] | torch.Tensor = ()
    edits: RequestEdits | None = None
    request_id: str = ""

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def prompt_seen_ids(self) -> np.ndarray:
        """The prompt's distinct token ids as int64: the request's, built once, or from
        ``token_ids``."""
        if self.edits is not None and self.edits.prompt_seen_ids is not None:
            return self.edits.prompt_seen_ids
        return np.unique(np.asarray(self.prompt_token_ids, dtype=np.int64))

    @property
    def has_penalties(self) -> bool:
        params = self.params
        return (
            params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0
            or params.repetition_penalty != 1.0
        )


@dataclass(frozen=True)
class TokenEdits:
    """Sparse edits, row by row: ``logits[row, token_ids] (+)= values`` for each
    (row, token_ids, values) of ``rows`` (two (num_edits,) tensors, the ids unique in a row).

    Applied one row at a time, from each request's own tensors: a batch has at most a few
    hundred rows, while one row may edit the whole vocabulary, and gathering every row's edits
    into one tensor each step cost seconds for 128 full-vocabulary rows.
    """

    rows: list[tuple[int, torch.Tensor, torch.Tensor]]

    def add_to(self, logits: torch.Tensor) -> None:
        for row, token_ids, values in self.rows:
            logits[row].index_add_(0, token_ids, values)

    def write_to(self, logits: torch.Tensor) -> None:
        for row, token_ids, values in self.rows:
            logits[row].index_put_((token_ids,), values)


@dataclass(frozen=True)
class Penalties:
    """OpenAI/vLLM penalties, at the positions they touch: every token a row has seen (its
    outputs when it has penalties, its prompt when its repetition penalty is not 1), as flat
    indices ``row * vocab_size + token`` (unique, sorted). ``output_counts`` counts each among
    the row's outputs so far (0: seen in the prompt only); ``repetition``, ``frequency`` and
    ``presence`` are each position's row's values.

    Elsewhere the penalties change nothing (x - 0 is x), so touching only these positions gives
    the logits the whole-vocabulary arithmetic gives, at the cost of the rows' histories instead
    of rows x vocabulary (64 rows of a 49,152-token vocabulary with 228-token histories: 82-86 ms
    a step before, 3-11 after; docs/performance.md).
    """

    positions: torch.Tensor
    output_counts: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor

    def apply(self, logits: torch.Tensor) -> None:
        """In place on contiguous ``logits``: repetition (positive logits divided, negative
        multiplied) over the seen tokens, then ``-= frequency * count`` and ``-= presence *
        (count > 0)`` over the outputs, in that order, as float32 operations."""
        flat = logits.view(-1)
        values = flat[self.positions]
        values = torch.where(values > 0, values / self.repetition, values * self.repetition)
        values -= self.frequency * self.output_counts
        values -= self.presence * (self.output_counts > 0).to(values.dtype)
        flat[self.positions] = values


@dataclass(frozen=True)
class LogitsProcessors:
    """Everything applied to a batch's logits before temperature; None fields are skipped.

    ``allowed`` (num_rows, vocab_size) bool is the structured-output mask (True = may be sampled).
    ``blocked`` (min-new-tokens) yields to it: where blocking would leave a row nothing to sample
    (the grammar allows only end-of-sequence), the row is left unblocked.
    """

    allowed: torch.Tensor | None = None
    blocked: TokenEdits | None = None
    bias: TokenEdits | None = None
    penalties: Penalties | None = None
    user: UserProcessing | None = None

    @property
    def is_empty(self) -> bool:
        edits = (self.allowed, self.blocked, self.bias, self.penalties, self.user)
        return all(edit is None for edit in edits)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Return processed logits (num_rows, vocab_size); ``logits`` itself is left untouched."""
        if self.is_empty:
            return logits
        logits = logits.clone(memory_format=torch.contiguous_format)
        if self.allowed is not None:
            logits.masked_fill_(~self.allowed, float("-inf"))
        if self.blocked is not None:
            logits = self._block(logits)
        if self.bias is not None:
            self.bias.add_to(logits)
        if self.penalties is not None:
            self.penalties.apply(logits)
        if self.user is not None:
            self.user.apply(logits)
        return logits

    def _block(self, logits: torch.Tensor) -> torch.Tensor:
        unblocked = logits.clone() if self.allowed is not None else None
        self.blocked.write_to(logits)
        if unblocked is None:
            return logits
        stuck = torch.isneginf(logits).all(dim=-1, keepdim=True)  # (num_rows, 1)
        return torch.where(stuck, unblocked, logits)


def edits_logits(row: SamplingRow) -> bool:
    """Whether ``build_logits_processors`` changes ``row``'s logits: blocked ids (min new
    tokens), a logit bias, penalties or user processors. (A grammar's mask is the caller's to
    know: it comes as ``allowed``.)"""
    if len(row.blocked_token_ids) or row.has_penalties or row.params.logits_processors:
        return True
    if row.edits is not None:
        return len(row.edits.bias_token_ids) > 0
    return bool(row.params.logit_bias)


def build_logits_processors(
    rows: Sequence[SamplingRow],
    vocab_size: int,
    device: torch.device,
    allowed: torch.Tensor | None = None,
    user_processors: Mapping[str, UserProcessor] | None = None,
) -> LogitsProcessors:
    """The processors ``rows`` ask for; ``allowed`` is the grammar mask (or None);
    ``user_processors`` those the worker loaded (``ValueError`` if a row names another)."""
    requests = [(row.request_id, row.params, row.token_ids, row.num_prompt_tokens) for row in rows]
    return LogitsProcessors(
        allowed=allowed,
        blocked=_blocked_edits(rows, device),
        bias=_bias_edits(rows, device),
        penalties=_penalties(rows, vocab_size, device),
        user=user_processing(user_processors or {}, requests),
    )


def _blocked_edits(rows: Sequence[SamplingRow], device: torch.device) -> TokenEdits | None:
    edits = []
    for i, row in enumerate(rows):
        if len(row.blocked_token_ids):
            token_ids = torch.as_tensor(row.blocked_token_ids, dtype=torch.int64, device=device)
            edits.append((i, token_ids, torch.full(token_ids.shape, float("-inf"), device=device)))
    return TokenEdits(edits) if edits else None


def _bias_edits(rows: Sequence[SamplingRow], device: torch.device) -> TokenEdits | None:
    edits = []
    for i, row in enumerate(rows):
        if row.edits is not None:
            token_ids, values = row.edits.bias_token_ids, row.edits.bias_values
        elif row.params.logit_bias:
            bias = row.params.logit_bias
            token_ids = torch.tensor(list(bias), dtype=torch.int64, device=device)
            values = torch.tensor(list(bias.values()), dtype=torch.float32, device=device)
        else:
            continue
        if len(token_ids):
            edits.append((i, token_ids.to(device), values.to(device)))
    return TokenEdits(edits) if edits else None


def _penalties(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> Penalties | None:
    if not any(row.has_penalties for row in rows):
        return None
    outputs = [
        np.asarray(row.output_token_ids if row.has_penalties else (), dtype=np.int64)
        for row in rows
    ]
    prompts = [
        row.prompt_seen_ids() if row.params.repetition_penalty != 1.0 else _NO_TOKENS
        for row in rows
    ]
    output_positions = _flat_positions(outputs, vocab_size, device)
    seen = torch.cat([output_positions, _flat_positions(prompts, vocab_size, device)])
    positions, which = torch.unique(seen, return_inverse=True)
    counts = torch.zeros(len(positions), device=device)
    counts.index_add_(
        0, which[: len(output_positions)], torch.ones(len(output_positions), device=device)
    )
    row_of = positions // vocab_size
    return Penalties(
        positions=positions,
        output_counts=counts,
        repetition=_row_values(rows, "repetition_penalty", device)[row_of],
        frequency=_row_values(rows, "frequency_penalty", device)[row_of],
        presence=_row_values(rows, "presence_penalty", device)[row_of],
    )


_NO_TOKENS = np.zeros(0, dtype=np.int64)


def _flat_positions(
    token_ids: Sequence[np.ndarray], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``row * vocab_size + token`` for every token of every row (int64 arrays), in order.
    Built in numpy: from Python lists it took ~130 ns a token a step (64 rows of 8k-token
    histories: 50 ms a step). A token outside the vocabulary (which the scheduler's admission
    and the sampler never let in) is a ``ValueError``, not a position in another row."""
    tokens = np.concatenate([*token_ids, _NO_TOKENS])
    if len(tokens) and not (int(tokens.min()) >= 0 and int(tokens.max()) < vocab_size):
        raise ValueError(f"token ids outside the vocabulary of {vocab_size}")
    rows = np.repeat(np.arange(len(token_ids), dtype=np.int64), [len(ids) for ids in token_ids])
    return torch.from_numpy(rows * vocab_size + tokens).to(device)


def _row_values(rows: Sequence[SamplingRow], name: str, device: torch.device) -> torch.Tensor:
    return torch.tensor(
        [float(getattr(row.params, name)) for row in rows], dtype=torch.float32, device=device
    )
