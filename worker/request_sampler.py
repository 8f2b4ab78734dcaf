"""Rank 0's sampling of one step's requests, where one request's failure is its own.

``RequestSampler.sample`` turns the logits of the requests that reached a sampling point into one
token each, their log probabilities and their outputs. A request whose grammar still compiles is
deferred (``take_deferred``; ``grammar_news`` says when it may sample); one whose logits
processing, sampling, log probabilities or grammar raises, or that has nothing to sample (every
logit -inf or NaN), fails alone (``take_failures``): a batch that raises is sampled again row by
row, so only the rows that raise fail, and the others get the tokens they would get alone.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping

import torch

from interfaces import LogProbabilities, RequestID, TextGenerationOutput
from interfaces.worker_to_scheduler import GrammarsReady, RequestFailure
from worker.logits_processors import build_logits_processors
from worker.logprobs import as_log_probabilities, token_logprobs
from worker.request_state import RequestState
from worker.sampler import NO_TOKEN, Sampler, SamplingBatch
from worker.structured_output import MaskFiller, RequestGrammar, allowed_token_mask
from worker.user_processors import UserProcessor

logger = logging.getLogger(__name__)


class RequestSampler:
    """Samples for the ModelRunner of rank 0 (from its thread), and remembers which requests
    failed or were deferred until the runner reports them."""

    def __init__(
        self,
        sampler: Sampler,
        vocab_size: int,
        device: torch.device,
        user_processors: Mapping[str, UserProcessor] | None = None,
        mask_filler: MaskFiller | None = None,
    ) -> None:
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.device = device
        self.user_processors = user_processors or {}
        """The user logits processors the worker loaded, by name."""
        self.mask_filler = mask_filler
        """Fills the grammar rows' masks, each within its time limit (None: one by one here,
        unbounded)."""
        self._failures: dict[RequestID, RequestFailure] = {}
        self._deferred: list[RequestID] = []
        self._parked: set[RequestID] = set()
        """Deferred requests whose grammar news is not sent yet."""

    def take_failures(self) -> dict[RequestID, RequestFailure]:
        failures, self._failures = self._failures, {}
        return failures

    def take_deferred(self) -> list[RequestID]:
        deferred, self._deferred = self._deferred, []
        return deferred

    def forget(self, request_id: RequestID) -> None:
        """``request_id`` left the worker: no news about it is due."""
        self._parked.discard(request_id)

    def discard_step(self) -> None:
        """The step failed as a whole: its failures and deferrals are not reported."""
        self._failures, self._deferred = {}, []

    def grammar_news(
        self, requests: dict[RequestID, RequestState], now: float | None = None
    ) -> GrammarsReady | None:
        """Which deferred requests' grammars compiled (attached to their state), or failed,
        since the last call; None when nothing is new."""
        news = GrammarsReady([], {})
        for request_id in sorted(self._parked):
            state = requests[request_id]
            grammar = state.pending_grammar.poll(now)
            if grammar is None:
                continue
            self._parked.discard(request_id)
            failure = grammar if isinstance(grammar, str) else _attach(state, grammar)
            if failure is None:
                news.ready.append(request_id)
            else:
                news.failed[request_id] = failure
        return news if news.ready or news.failed else None

    def sample(
        self,
        logits: torch.Tensor,
        states: list[RequestState],
        known: list[int | None] | None = None,
    ) -> dict[RequestID, TextGenerationOutput]:
        """Sample for each state whose grammar is ready from ``logits``, raw from the model:
        one row per state, or, for a state with drafts (speculative decoding), 1 + drafts rows
        (after its last known token, then after each draft). Advance each state (tokens,
        grammar) and build its output; others are deferred (grammar compiling) or failed alone.

        A state with drafts gets the drafts up to the first that differs from the token sampled
        at its position, and that sampled token (or, all accepted, the one after them): each
        position is sampled as it would be alone (``RequestState.at_draft``), so the tokens are
        those that decoding one at a time gives.

        ``known``, when given, has an entry per row: a token the model's greedy head picked
        for a row that ``picks_argmax`` (``ModelRunner``), or None; ``logits`` then holds the
        None rows only, in order."""
        ready: list[tuple[RequestState, int]] = []  # each with its first row of the step
        first_row = 0
        for state in states:
            if self._grammar_ready(state):
                ready.append((state, first_row))
            first_row += 1 + len(state.drafts)
        if not ready:
            return {}
        row_states = [
            state.at_draft(index) if index else state
            for state, _ in ready
            for index in range(1 + len(state.drafts))
        ]
        step_rows = [first + i for state, first in ready for i in range(1 + len(state.drafts))]
        if known is None:
            known = [None] * first_row
        logit_row = list(itertools.accumulate((token is None for token in known), initial=0))
        # the ready rows to sample from their logits (the others' tokens are known)
        open_rows = [i for i, r in enumerate(step_rows) if known[r] is None]
        logits = _rows(logits, [logit_row[step_rows[i]] for i in open_rows])
        drawn = []
        if open_rows:
            drawn = self._sample_isolated(logits, [row_states[i] for i in open_rows])
        tokens = [known[r] for r in step_rows]
        for i, token in zip(open_rows, drawn, strict=True):
            tokens[i] = token
        # only rows sampled from their logits may ask for log probabilities
        asked = [
            j
            for j, i in enumerate(open_rows)
            if drawn[j] != NO_TOKEN and row_states[i].logprobs is not None
        ]
        logprobs = self._logprobs_isolated(
            _rows(logits, asked),
            [drawn[j] for j in asked],
            [row_states[open_rows[j]] for j in asked],
        )
        row_logprobs = dict(zip((open_rows[j] for j in asked), logprobs, strict=True))
        outputs = {}
        row = 0
        for state, _ in ready:
            rows = range(row, row + 1 + len(state.drafts))
            row = rows.stop
            if state.request_id in self._failures:
                continue
            kept = _verified(rows, tokens, state.drafts)
            output = self._output(
                state, [tokens[r] for r in kept], [row_logprobs.get(r) for r in kept]
            )
            if output is not None:
                outputs[state.request_id] = output
        return outputs

    def _output(
        self,
        state: RequestState,
        tokens: list[int],
        logprobs: list[list[LogProbabilities] | None],
    ) -> TextGenerationOutput | None:
        """Append ``tokens`` to ``state`` and build its output; None when that fails it."""
        for token in tokens:
            try:
                state.append_output(token)  # the grammar may reject it: the request's own
            except Exception as error:
                self._fail(state, error, invalid_request=state.grammar is not None)
                return None
        try:
            prompt_logprobs = state.take_prompt_logprobs()
        except Exception as error:
            self._fail(state, error)
            return None
        return TextGenerationOutput(
            state.request_id,
            tokens,
            log_probabilities=_joined(logprobs),
            prompt_log_probabilities=prompt_logprobs,
        )

    def _grammar_ready(self, state: RequestState) -> bool:
        """Whether ``state`` may sample now: its grammar (if any) compiled; otherwise it is
        deferred while compiling, or failed (an invalid spec, the time limit)."""
        if state.pending_grammar is None:
            return True
        grammar = state.pending_grammar.poll()
        if grammar is None:
            self._deferred.append(state.request_id)
            self._parked.add(state.request_id)
            return False
        failure = grammar if isinstance(grammar, str) else _attach(state, grammar)
        if failure is not None:
            self._failures[state.request_id] = RequestFailure(failure, invalid_request=True)
            return False
        return True

    def _sample_isolated(self, logits: torch.Tensor, states: list[RequestState]) -> list[int]:
        """One token per state, ``NO_TOKEN`` where that request failed: a batch that raises is
        sampled again row by row, so only the rows that raise fail."""
        try:
            return self._sample_batch(logits, states)
        except Exception as error:
            if len(states) == 1:
                self._fail(states[0], error)
                return [NO_TOKEN]
            logger.exception("sampling %d requests failed; sampling each alone", len(states))
        return [self._sample_isolated(logits[i : i + 1], [s])[0] for i, s in enumerate(states)]

    def _sample_batch(self, logits: torch.Tensor, states: list[RequestState]) -> list[int]:
        grammar_failures: dict[int, str] = {}
        tokens = self.sampler(logits, self._sampling_batch(states, grammar_failures)).tolist()
        for row, (state, token) in enumerate(zip(states, tokens, strict=True)):
            if row in grammar_failures:
                failure = RequestFailure(grammar_failures[row], invalid_request=True)
                self._failures[state.request_id] = failure
            elif token == NO_TOKEN:
                reason = "no token could be sampled: every logit was -inf or NaN"
                self._failures[state.request_id] = RequestFailure(reason)
        return [
            NO_TOKEN if s.request_id in self._failures else t
            for s, t in zip(states, tokens, strict=True)
        ]

    def _logprobs_isolated(
        self, logits: torch.Tensor, tokens: list[int], states: list[RequestState]
    ) -> list[list[LogProbabilities] | None]:
        """``_sampled_logprobs`` of ``states`` (each asked for them and sampled ``tokens``, a
        row of ``logits`` each), row by row (failing alone) if the batch raises."""
        try:
            sampled = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
            return _sampled_logprobs(logits, sampled, states)
        except Exception as error:
            if len(states) == 1:
                self._fail(states[0], error)
                return [None]
        return [
            self._logprobs_isolated(logits[i : i + 1], [token], [state])[0]
            for i, (token, state) in enumerate(zip(tokens, states, strict=True))
        ]

    def _fail(self, state: RequestState, error: Exception, invalid_request: bool = False) -> None:
        """Fail ``state`` alone: its user gets ``error``; the step goes on."""
        logger.warning(
            "request %s failed while sampling: %r",
            state.request_id,
            error,
            extra={"request_id": state.request_id},
        )
        reason = f"the grammar failed: {error}" if invalid_request else f"sampling failed: {error}"
        self._failures[state.request_id] = RequestFailure(reason, invalid_request)

    def _sampling_batch(
        self, states: list[RequestState], grammar_failures: dict[int, str]
    ) -> SamplingBatch:
        vocab_size = self.vocab_size
        grammars = [state.grammar for state in states]
        allowed = allowed_token_mask(
            grammars, vocab_size, self.device, grammar_failures, self.mask_filler
        )
        processors = build_logits_processors(
            [state.sampling_row() for state in states],
            vocab_size,
            self.device,
            allowed,
            self.user_processors,
        )
        return SamplingBatch.from_params(
            [state.sampling_params for state in states],
            [state.next_noise_key() for state in states],
            vocab_size,
            self.device,
            processors,
        )


def _sampled_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, states: list[RequestState]
) -> list[list[LogProbabilities] | None]:
    """Each state's ``log_probabilities`` output for its sampled token; every state asked."""
    if not states:
        return []
    entries = token_logprobs(logits, tokens, [state.logprobs for state in states])
    return [[as_log_probabilities([entry])] for entry in entries]


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]``, without a copy where ``rows`` are all of them in order (a step's
    logits are 12.6 MB at 64 rows of a 49,152-token vocabulary)."""
    if rows == list(range(len(logits))):
        return logits
    return logits[rows]


def _verified(rows: range, tokens: list[int], drafts: list[int]) -> list[int]:
    """The rows whose sampled tokens a request keeps: its drafts up to the first that differs
    from the token sampled in its place, and that token (or the one after all the drafts)."""
    kept = []
    for index, row in enumerate(rows):
        kept.append(row)
        if index == len(drafts) or tokens[row] != drafts[index]:
            break
    return kept


def _joined(logprobs: list[list[LogProbabilities] | None]) -> list[LogProbabilities] | None:
    """One step's log probabilities, one entry covering every token kept (None: not asked)."""
    if logprobs[0] is None:
        return None
    entries = [entry for entries in logprobs for entry in entries]
    return [
        LogProbabilities(
            [value for entry in entries for value in entry.token_log_probabilities],
            [top for entry in entries for top in entry.top_log_probabilities],
        )
    ]


def _attach(state: RequestState, grammar: RequestGrammar) -> str | None:
    """Give ``state`` its compiled grammar; the reason for its user if replaying its outputs
    fails (None on success)."""
    try:
        state.attach_grammar(grammar)
    except Exception as error:
        return f"the grammar failed: {error}"
    return None
