"""Structured output: per-request grammar matchers, applied as token masks in the batched sampler.

A request's ``StructuredOutput`` (JSON object, JSON schema, regex or EBNF grammar) is compiled by
``worker.grammar_compiler`` off the step; once compiled, the request follows it with a
``RequestGrammar`` (an xgrammar ``GrammarMatcher``). Each step, ``allowed_token_mask`` asks every
matcher in the batch for its next-token bitmask and unpacks them into one boolean mask with torch
ops. Once a grammar has ended, only end-of-sequence ids are allowed, so the request stops.
xgrammar is imported on first use: it takes seconds to import and most workers never need it.

A bitmask usually takes well under a millisecond, but an ambiguous grammar (``root ::= (a | b)*``
with ``a ::= [a-z] | [a-z] a`` and ``b ::= [a-z]* b?``: 0.5 ms at the first token, 0.6 s at the
25th, more after) keeps ever more parses alive, and xgrammar's fill cannot be interrupted. So a
``MaskFiller`` fills the rows on threads of its own (xgrammar releases the GIL meanwhile) and the
step waits at most its limit (``--grammar-mask-timeout``) for each: a row past it fails its
request alone, and its thread, left to finish that fill, is replaced. A grammar whose masks each
stay under that limit but together cost the batch more than ``--grammar-mask-time-per-token`` a
step on average (with a burst of up to one limit beyond it) fails its request too: every step
of its batch waits for its mask.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from queue import SimpleQueue
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
        self.abandoned = False
        """Set when a fill of its mask outlasted the limit: a MaskFiller thread may still be
        inside the matcher, so nothing touches it again (its request has failed)."""
        self.mask_credit_s: float | None = None
        """The seconds of mask filling its MaskFiller still allows it (None: not yet charged);
        below 0 its request has failed."""

    @property
    def over_budget(self) -> bool:
        """Its masks took more time than its MaskFiller's budget allows: its request fails."""
        return self.mask_credit_s is not None and self.mask_credit_s < 0

    @property
    def is_terminated(self) -> bool:
        """True once the grammar accepted a stop token: nothing but end-of-sequence may follow."""
        self._check_not_abandoned()
        return self.matcher.is_terminated()

    def _check_not_abandoned(self) -> None:
        if self.abandoned:  # a thread may still be inside the matcher: never touch it again
            raise RuntimeError("the grammar was abandoned after its mask's time limit")

    def accept(self, token_id: int) -> None:
        """Advance by a sampled token; ``RuntimeError`` if the grammar forbids it (a masking bug).

        After the grammar has ended the token is an end-of-sequence id and is not fed to it.
        """
        if self.is_terminated:  # (raises for an abandoned grammar)
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
    filler: MaskFiller | None = None,
) -> torch.Tensor | None:
    """The batch's structured-output mask: bool (num_rows, vocab_size), True = may be sampled.

    Rows without a grammar allow everything; rows whose grammar ended allow only their
    end-of-sequence ids. A row whose matcher raises, or (with ``filler``) outlasts its limit
    or its time budget, allows nothing, and ``failures`` gets the reason by row index. Without
    a filler the rows are filled here, one after another (tests and tools). None when no row
    has a grammar.
    """
    if all(grammar is None for grammar in grammars):
        return None
    num_words = -(-vocab_size // 32)
    bitmask = torch.full((len(grammars), num_words), -1, dtype=torch.int32)  # all bits set
    failures = {} if failures is None else failures
    eos_edits = []
    to_fill = []
    for row, grammar in enumerate(grammars):
        if grammar is None:
            continue
        if grammar.abandoned or grammar.over_budget:  # only a filler does either
            bitmask[row] = 0
            failures[row] = (
                filler.failure_of(grammar) if filler is not None else "the grammar was abandoned"
            )
            continue
        try:
            if grammar.is_terminated:
                bitmask[row] = 0
                eos_ids = [
                    token_id for token_id in grammar.eos_token_ids if 0 <= token_id < vocab_size
                ]
                eos_edits += [(row, token_id) for token_id in eos_ids]
            elif filler is None:
                grammar.matcher.fill_next_token_bitmask(bitmask, row)
            else:
                to_fill.append((row, grammar))
        except Exception as error:  # this row's grammar alone; the batch samples on
            bitmask[row] = 0
            failures[row] = f"the grammar failed: {error}"
    if to_fill:
        filler.fill(to_fill, bitmask, failures)
    allowed = unpack_bitmask(bitmask.to(device), vocab_size)
    if eos_edits:
        rows_and_ids = torch.tensor(eos_edits, dtype=torch.int64, device=device)  # (num_edits, 2)
        allowed[rows_and_ids[:, 0], rows_and_ids[:, 1]] = True
    return allowed


@dataclass(eq=False)
class _Fill:
    """One row's fill: its grammar, and a bitmask row of its own (a fill that outlasted its
    limit writes there, not into a later step's mask)."""

    grammar: RequestGrammar
    words: torch.Tensor
    started_at: float | None = None
    finished_at: float | None = None
    thread_id: int | None = None
    """The native id of the thread that took it."""
    error: Exception | None = None
    done: threading.Event = field(default_factory=threading.Event)
    retire: bool = False
    """Its thread was replaced while it filled: it exits after this fill."""
    cancelled: bool = False
    """Nobody waits for it any more (the step raised): a thread that takes it skips it."""


RETIRED_NICENESS = 19
"""A thread left to finish a fill past its limit gets only the CPU time nothing else wants."""


class MaskFiller:
    """Fills rows of a step's grammar mask on ``num_threads`` threads of its own, each row's
    fill bounded by ``timeout_s`` (counted from when a thread takes it, so rows queued behind
    others are not charged for them). A row past the limit fails
    (``failure`` names it); its grammar is marked abandoned, and its thread, which cannot be
    stopped inside xgrammar, finishes that fill at the lowest CPU priority, writes it to the
    row's own buffer, and exits, a new thread taking its place at once. Called from one thread
    (the model runner's).

    With ``per_token_s``, each grammar's fills are also held to that many seconds a fill on
    average, as a token bucket: a grammar starts with ``timeout_s`` of credit, each fill adds
    ``per_token_s`` (up to ``timeout_s``) and takes its own time, and a grammar whose credit
    falls below 0 fails its row (``budget_failure`` names the limit) and every later one. So a
    grammar may cost its batch one slow mask, but not many that each stay under the limit."""

    def __init__(
        self,
        timeout_s: float,
        failure: str,
        num_threads: int = 2,
        per_token_s: float | None = None,
        budget_failure: str = "",
    ) -> None:
        if per_token_s is not None and not budget_failure:
            raise ValueError("a MaskFiller with per_token_s needs its budget_failure message")
        self.timeout_s = timeout_s
        self.failure = failure
        self.per_token_s = per_token_s
        self.budget_failure = budget_failure
        self.num_threads = num_threads
        self._fills: SimpleQueue[_Fill | None] = SimpleQueue()
        self._lock = threading.Lock()  # a fill's done and retire change together
        self._threads = 0  # those not retired

    def fill(
        self,
        rows: list[tuple[int, RequestGrammar]],
        bitmask: torch.Tensor,
        failures: dict[int, str],
    ) -> None:
        """Fill ``bitmask``'s ``rows``, each by its grammar; a row that fails gets 0 (nothing
        allowed) and its reason in ``failures``."""
        fills = []
        try:
            for row, grammar in rows:
                fill = _Fill(grammar, torch.empty((1, bitmask.shape[1]), dtype=torch.int32))
                fills.append((row, fill))
                self._fills.put(fill)
            while self._threads < self.num_threads:
                self._start_thread()
            for row, fill in fills:
                if not self._wait(fill):
                    failures[row] = self.failure
                elif fill.error is not None:
                    failures[row] = f"the grammar failed: {fill.error}"
                elif not self._charge(fill):
                    failures[row] = self.budget_failure
                else:
                    bitmask[row] = fill.words[0]
                    continue
                bitmask[row] = 0
        except BaseException:  # e.g. no thread could start: no fill is left running unwatched
            self._give_up([fill for _, fill in fills])
            raise

    def failure_of(self, grammar: RequestGrammar) -> str:
        """Why an abandoned or over-budget ``grammar``'s request failed."""
        return self.failure if grammar.abandoned else self.budget_failure

    def _charge(self, fill: _Fill) -> bool:
        """Take finished ``fill``'s time from its grammar's credit; whether any is left."""
        if self.per_token_s is None:
            return True
        grammar = fill.grammar
        credit = self.timeout_s if grammar.mask_credit_s is None else grammar.mask_credit_s
        credit = min(self.timeout_s, credit + self.per_token_s)
        grammar.mask_credit_s = credit - (fill.finished_at - fill.started_at)
        return not grammar.over_budget

    def _give_up(self, fills: list[_Fill]) -> None:
        """Cancel those of ``fills`` not yet taken, and abandon those still running."""
        with self._lock:
            for fill in fills:
                if fill.started_at is None:
                    fill.cancelled = True
                elif not fill.done.is_set() and not fill.retire:
                    self._retire(fill)

    def _retire(self, fill: _Fill) -> None:
        """Abandon running ``fill`` (under the lock): its thread exits after it, at the lowest
        CPU priority meanwhile, and is no longer counted."""
        fill.retire = True
        fill.grammar.abandoned = True
        self._threads -= 1
        with contextlib.suppress(AttributeError, OSError):  # Linux: one thread's niceness
            os.setpriority(os.PRIO_PROCESS, fill.thread_id, RETIRED_NICENESS)

    def _wait(self, fill: _Fill) -> bool:
        """Whether ``fill`` finished within its limit; if not, it is abandoned."""
        while True:
            started_at = fill.started_at
            if started_at is None:  # still queued: a thread takes it soon
                if fill.done.wait(min(self.timeout_s, 0.005)):
                    return True
                continue
            left = started_at + self.timeout_s - time.monotonic()
            if fill.done.wait(max(left, 0.0)):
                return True
            with self._lock:
                if fill.done.is_set():
                    return True
                self._retire(fill)
            self._start_thread()
            return False

    def close(self) -> None:
        """Let its idle threads go (one busy with a fill exits after it)."""
        with self._lock:
            threads, self._threads = self._threads, 0
        for _ in range(threads):
            self._fills.put(None)

    def _start_thread(self) -> None:
        threading.Thread(target=self._serve, name="grammar-mask", daemon=True).start()
        with self._lock:  # counted once started: a thread that could not start is not one
            self._threads += 1

    def _serve(self) -> None:
        while True:
            fill = self._fills.get()
            if fill is None:
                return
            with self._lock:
                if fill.cancelled:
                    continue
                fill.thread_id = threading.get_native_id()
                fill.started_at = time.monotonic()
            try:
                fill.grammar.matcher.fill_next_token_bitmask(fill.words, 0)
            except Exception as error:  # that row's alone
                fill.error = error
            fill.finished_at = time.monotonic()
            with self._lock:
                fill.done.set()
                if fill.retire:
                    return


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's int32 bitmask (num_rows, ceil(vocab_size / 32)) as bool (num_rows, vocab_size):
    token i is allowed when bit i % 32 of word i // 32 is set."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # (num_rows, num_words, 32)
    return bits.flatten(1)[:, :vocab_size].bool()  # (num_rows, vocab_size)
