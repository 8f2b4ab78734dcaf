"""One request's result stream turned into text: detokenize, cut at stop strings, count tokens.

The scheduler decides EOS, max tokens and stop token ids; stop *strings* are decided here: the
text is cut before the first stop string, the request finishes with "stop", and leaving the
engine's stream early makes ``EngineClient.generate`` abort the request in the scheduler.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from tokenizers import Tokenizer

from api_server.detokenizer import IncrementalDetokenizer, StopStringMatcher
from api_server.engine_client import EngineClient
from api_server.responses import FinishReason, Usage
from interfaces import GenerationStatus, SchedulerStatus, TextContext, TextGenerationOutput


class RequestFailed(Exception):
    """The system (not the client) cancelled the request; the message is for the user."""


class RequestRejected(RequestFailed):
    """The scheduler refused the request before queuing it: it can never run as asked."""


@dataclass(frozen=True)
class TextDelta:
    """New text from one scheduler result; ``finish_reason`` is set on the last one only."""

    text: str
    finish_reason: FinishReason | None = None


class GenerationStream:
    """Text deltas for one submitted ``TextContext``.

    Iterate ``deltas()`` once. Usage counts every output token the scheduler produced, including
    an end-of-sequence token and tokens past a stop string.
    """

    def __init__(
        self,
        engine: EngineClient,
        context: TextContext,
        tokenizer: Tokenizer,
        stop: list[str],
        skip_special_tokens: bool = True,
    ) -> None:
        self.context = context
        self.num_output_tokens = 0
        self._engine = engine
        self._detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._stop_matcher = StopStringMatcher(stop)
        params = context.sampling_params
        self._stop_token_ids = {*context.eos_token_ids, *(params.stop_token_ids or [])}

    def usage(self) -> Usage:
        return Usage.of(self.context.num_prompt_tokens, self.num_output_tokens)

    async def deltas(self) -> AsyncGenerator[TextDelta, None]:
        """One delta per scheduler result (its text may be empty), the last with a finish reason.

        Raises ``RequestFailed`` when the scheduler cancels the request with an error, and
        ``SchedulerUnavailable`` when the scheduler cannot be reached.
        """
        results = self._engine.generate(self.context)
        async with contextlib.aclosing(results):
            async for result in results:
                if result.status is SchedulerStatus.CANCELLED:
                    if result.rejected:
                        raise RequestRejected(result.error)
                    if result.error:
                        raise RequestFailed(result.error)
                    yield TextDelta(self._stop_matcher.flush(), "abort")
                    return
                if result.result is None:
                    continue
                is_done = result.status is SchedulerStatus.COMPLETE or result.result.is_done
                delta = self._add_output(result.result, is_done)
                yield delta
                if delta.finish_reason is not None:
                    return
        yield TextDelta("", "abort")

    def _add_output(self, output: TextGenerationOutput, is_done: bool) -> TextDelta:
        token_ids = output.tokens
        self.num_output_tokens += len(token_ids)
        ended_by_stop_token = output.final_status is GenerationStatus.END_OF_SEQUENCE
        if ended_by_stop_token and token_ids and token_ids[-1] in self._stop_token_ids:
            token_ids = token_ids[:-1]  # the EOS / stop token is not part of the text
        text = self._detokenizer.add(token_ids)
        if is_done:
            text += self._detokenizer.flush()
        text, stopped = self._stop_matcher.add(text)
        if stopped:
            return TextDelta(text, "stop")
        if not is_done:
            return TextDelta(text)
        text += self._stop_matcher.flush()
        reason = "length" if output.final_status is GenerationStatus.MAXIMUM_LENGTH else "stop"
        return TextDelta(text, reason)
