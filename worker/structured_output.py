"""Structured output: per-request grammar matchers, applied as token masks in the batched sampler.

A request's ``StructuredOutput`` (JSON object, JSON schema, regex or EBNF grammar) is compiled by
``worker.grammar_compiler`` off the step; once compiled, the request follows it with a
``RequestGrammar`` (an xgrammar ``GrammarMatcher``). Each step, ``allowed_token_mask`` asks every
matcher in the batch for its next-token bitmask and unpacks them into one boolean mask with torch
ops. Once a grammar has ended, only end-of-sequence ids are allowed, so the request stops.
xgrammar is imported on first use: it takes seconds to import and most workers never need it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar


class RequestGrammar:
    """One request's grammar state: an xgrammar matcher advanced by each output token.

    ``eos_token_ids`` are the only tokens allowed once the grammar has ended.
    """

    def __init__(self, compiled: xgrammar.CompiledGrammar, eos_token_ids: Sequence[int]) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.eos_token_ids = list(eos_token_ids)

    @property
    def is_terminated(self) -> bool:
        """True once the grammar accepted a stop token: nothing but end-of-sequence may follow."""
        return self.matcher.is_terminated()

    def accept(self, token_id: int) -> None:
        """Advance by a sampled token; ``RuntimeError`` if the grammar forbids it (a masking bug).

        After the grammar has ended the token is an end-of-sequence id and is not fed to it.
        """
        if self.is_terminated:
            return
        if not self.matcher.accept_token(token_id):
            raise RuntimeError(f"the grammar rejected sampled token {token_id}")

    def replay(self, token_ids: Sequence[int]) -> None:
        """Advance over the outputs of a resumed request."""
        for token_id in token_ids:
            self.accept(token_id)


def allowed_token_mask(
    grammars: Sequence[RequestGrammar | None],
    vocab_size: int,
    device: torch.device,
    failures: dict[int, str] | None = None,
) -> torch.Tensor | None:
    """The batch's structured-output mask: bool (num_rows, vocab_size), True = may be sampled.

    Rows without a grammar allow everything; rows whose grammar ended allow only their
    end-of-sequence ids. A row whose matcher raises allows nothing, and ``failures`` gets the
    reason by row index. None when no row has a grammar.
    """
    if all(grammar is None for grammar in grammars):
        return None
    num_words = -(-vocab_size // 32)
    bitmask = torch.full((len(grammars), num_words), -1, dtype=torch.int32)  # all bits set
    eos_edits = []
    for row, grammar in enumerate(grammars):
        if grammar is None:
            continue
        try:
            if grammar.is_terminated:
                bitmask[row] = 0
                eos_ids = [
                    token_id for token_id in grammar.eos_token_ids if 0 <= token_id < vocab_size
                ]
                eos_edits += [(row, token_id) for token_id in eos_ids]
            else:
                grammar.matcher.fill_next_token_bitmask(bitmask, row)
        except Exception as error:  # this row's grammar alone; the batch samples on
            bitmask[row] = 0
            if failures is not None:
                failures[row] = f"the grammar failed: {error}"
    allowed = unpack_bitmask(bitmask.to(device), vocab_size)
    if eos_edits:
        rows_and_ids = torch.tensor(eos_edits, dtype=torch.int64, device=device)  # (num_edits, 2)
        allowed[rows_and_ids[:, 0], rows_and_ids[:, 1]] = True
    return allowed


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's int32 bitmask (num_rows, ceil(vocab_size / 32)) as bool (num_rows, vocab_size):
    token i is allowed when bit i % 32 of word i // 32 is set."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # (num_rows, num_words, 32)
    return bits.flatten(1)[:, :vocab_size].bool()  # (num_rows, vocab_size)
