"""One request's result stream turned into text: detokenize, cut at stop strings, count tokens.

The scheduler decides EOS, max tokens and stop token ids; stop *strings* are decided here: the
text is cut before the first stop string (after it with ``include_stop_str_in_output``), the
request finishes with "stop", and leaving the engine's stream early makes
``EngineClient.generate`` abort the request in the scheduler. Log probabilities ride along with
the text they belong to.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Literal

from tokenizers import Tokenizer

from api_server.detokenizer import IncrementalDetokenizer, StopStringMatcher
from api_server.engine_client import EngineClient, SchedulerUnavailable
from api_server.image_segments import ImageSegments
from api_server.logprobs import TokenLogprob, output_logprobs, prompt_logprobs
from api_server.metrics import RequestMetrics
from api_server.responses import FinishReason
from interfaces import (
    ErrorKind,
    GenerationStatus,
    SchedulerStatus,
    TextContext,
    TextGenerationOutput,
)

logger = logging.getLogger(__name__)


class RequestFailed(Exception):
    """The system (not the client) ended the request; the message is for the user and ``kind``
    says why (a request that can never run, a full queue, no worker, a failure)."""

    def __init__(self, message: str, kind: ErrorKind = ErrorKind.INTERNAL) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class TextOptions:
    """How one choice's tokens become text (from the request's fields).

    ``include_stop_str_in_output`` keeps a matched stop string, and the text of the stop token
    (EOS or one of ``stop_token_ids``) that ended generation, as vLLM does.
    ``discard_output`` reports no generated tokens at all: completions' ``echo`` with
    ``max_tokens`` 0 generates one token only to get the prompt's log probabilities.
    """

    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    discard_output: bool = False


@dataclass(frozen=True)
class TextDelta:
    """New text from one scheduler result; ``finish_reason`` is set on the last one only.

    ``logprobs``: one entry per token this result produced (the token that ended generation
    included), None when the request did not ask. ``prompt_logprobs``: the whole prompt's
    entries, on the first delta only, when the request asked for them.
    """

    text: str
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    token_ids: list[int] = field(default_factory=list)
    """The tokens this result produced (a stop token included), for the offline API."""


class GenerationStream:
    """Text deltas for one submitted ``TextContext``.

    Iterate ``deltas()`` once. Usage counts every output token the scheduler produced, including
    an end-of-sequence token and tokens past a stop string (none with ``discard_output``).
    ``metrics``, when given, records the request for /metrics as it goes. ``images`` owns the
    context's image segments (the caller closes it once ``deltas()`` can no longer start).
    """

    def __init__(
        self,
        engine: EngineClient,
        context: TextContext,
        tokenizer: Tokenizer,
        options: TextOptions = TextOptions(),
        metrics: RequestMetrics | None = None,
        images: ImageSegments | None = None,
    ) -> None:
        self.context = context
        self.images = images or ImageSegments()
        self.num_output_tokens = 0
        self._metrics = metrics
        self._started = False
        self._engine = engine
        self._options = options
        self._detokenizer = IncrementalDetokenizer(tokenizer, options.skip_special_tokens)
        self._stop_matcher = StopStringMatcher(
            list(options.stop), include_stop=options.include_stop_str_in_output
        )
        params = context.sampling_params
        self._stop_token_ids = {*context.eos_token_ids, *(params.stop_token_ids or [])}

    async def deltas(self) -> AsyncGenerator[TextDelta, None]:
        """One delta per scheduler result (its text may be empty), the last with a finish reason.

        Raises ``RequestFailed`` when the scheduler cancels the request with an error, and
        ``SchedulerUnavailable`` when the scheduler cannot be reached.
        """
        finish_reason: FinishReason | Literal["error"] = "abort"  # closed early: client gone
        results = self._engine.generate(self.context, self.images)
        try:
            async with contextlib.aclosing(results):
                async for result in results:
                    if result.status is SchedulerStatus.CANCELLED:
                        if result.error:
                            kind = result.error_kind or ErrorKind.INTERNAL
                            raise RequestFailed(result.error, kind)
                        yield TextDelta(self._stop_matcher.flush(), "abort")
                        return
                    if result.result is None:
                        continue
                    if self._metrics is not None and not self._started:
                        self._started = True
                        self._metrics.started(result.timings)
                    is_done = result.status is SchedulerStatus.COMPLETE or result.result.is_done
                    delta = self._add_output(result.result, is_done)
                    if delta.finish_reason is not None:
                        finish_reason = delta.finish_reason
                        yield delta
                        return
                    yield delta
            yield TextDelta("", "abort")
        except (RequestFailed, SchedulerUnavailable):
            finish_reason = "error"
            raise
        finally:
            self._finished(finish_reason)

    def _finished(self, finish_reason: str) -> None:
        if self._metrics is not None:
            self._metrics.finished(finish_reason)
        logger.info(
            "request %s finished (%s): %d prompt tokens, %d generated",
            self.context.request_id,
            finish_reason,
            self.context.num_prompt_tokens,
            self.num_output_tokens,
        )

    def _add_output(self, output: TextGenerationOutput, is_done: bool) -> TextDelta:
        prompt = self._prompt_logprobs(output)
        if self._options.discard_output:
            return TextDelta("", "length" if is_done else None, prompt_logprobs=prompt)
        self.num_output_tokens += len(output.tokens)
        if self._metrics is not None:
            self._metrics.generated(len(output.tokens))
        logprobs = output_logprobs(output) if self.context.logprobs is not None else None
        text, finish_reason = self._add_text(output, is_done)
        return TextDelta(text, finish_reason, logprobs, prompt, list(output.tokens))

    def _prompt_logprobs(self, output: TextGenerationOutput) -> list[TokenLogprob] | None:
        if self.context.prompt_logprobs is None or output.prompt_log_probabilities is None:
            return None
        return prompt_logprobs(self.context.prompt_token_ids, output.prompt_log_probabilities)

    def _add_text(
        self, output: TextGenerationOutput, is_done: bool
    ) -> tuple[str, FinishReason | None]:
        token_ids = output.tokens
        ended_by_stop_token = output.final_status is GenerationStatus.END_OF_SEQUENCE
        keep_stop_token = self._options.include_stop_str_in_output
        if ended_by_stop_token and token_ids and token_ids[-1] in self._stop_token_ids:
            token_ids = token_ids if keep_stop_token else token_ids[:-1]
        text = self._detokenizer.add(token_ids)
        if is_done:
            text += self._detokenizer.flush()
        text, stopped = self._stop_matcher.add(text)
        if stopped:
            return text, "stop"
        if not is_done:
            return text, None
        text += self._stop_matcher.flush()
        reason = "length" if output.final_status is GenerationStatus.MAXIMUM_LENGTH else "stop"
        return text, reason
