"""Outputs in MAX's vocabulary: generated tokens and the scheduler's per-request stream items."""

from __future__ import annotations

import enum
from typing import Generic, TypeVar

import msgspec

from interfaces.requests import RequestID


class GenerationStatus(str, enum.Enum):
    """Where a generation stands (MAX's ``GenerationStatus``)."""

    ACTIVE = "active"
    END_OF_SEQUENCE = "end_of_sequence"
    MAXIMUM_LENGTH = "maximum_length"

    @property
    def is_done(self) -> bool:
        return self is not GenerationStatus.ACTIVE


class LogProbabilities(msgspec.Struct, frozen=True, array_like=True):
    """Log probabilities for generated tokens: one entry per token, top-k alternatives each."""

    token_log_probabilities: list[float]
    top_log_probabilities: list[dict[int, float]]


class TextGenerationOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Tokens generated for one request in one step (MAX's ``TextGenerationOutput``).

    ``tokens`` holds only the tokens new since the previous output for this request;
    ``log_probabilities``, when asked for, one entry per step covering those tokens.
    ``prompt_log_probabilities`` comes once, with the first output, when the request asked for
    prompt log probabilities: one value per prompt token after the first.

    Made for every request every step, so not tracked by the garbage collector (``gc=False``:
    it holds lists of numbers and log probabilities, never a cycle).
    """

    request_id: RequestID
    tokens: list[int]
    final_status: GenerationStatus = GenerationStatus.ACTIVE
    log_probabilities: list[LogProbabilities] | None = None
    prompt_log_probabilities: LogProbabilities | None = None

    @property
    def is_done(self) -> bool:
        return self.final_status.is_done


class ErrorKind(str, enum.Enum):
    """Why the system ended a request with an error; the API server picks the HTTP status by it."""

    INVALID_REQUEST = "invalid_request"
    """The request can never run as asked (it would not fit in the context or the KV cache, or
    the worker refused its options): a client error, 400."""
    NOT_FOUND = "not_found"
    """It names a model (a LoRA adapter) that is not loaded: 404 ``model_not_found``."""
    OVERLOADED = "overloaded"
    """The scheduler's queue is full; the same request may succeed later: 429."""
    UNAVAILABLE = "unavailable"
    """No worker can serve it (none ready yet, or the one serving it died): 503."""
    INTERNAL = "internal"
    """It failed while running (the worker raised): 500."""


class SchedulerStatus(str, enum.Enum):
    """The scheduler's view of one request's stream (MAX's ``SchedulerStatus``)."""

    ACTIVE = "active"
    COMPLETE = "complete"
    CANCELLED = "cancelled"


class RequestTimings(msgspec.Struct, frozen=True, array_like=True):
    """How a request started, in the scheduler's clock; sent once, with its first generated token.

    ``queued_s``: from arrival at the scheduler until it was first scheduled.
    ``prefill_s``: from then until its first token was produced (every chunk of a chunked
    prefill, and any time spent preempted before that token, included).
    """

    queued_s: float
    prefill_s: float


OutputT = TypeVar("OutputT")


class SchedulerResult(
    msgspec.Struct, Generic[OutputT], array_like=True, omit_defaults=True, gc=False
):
    """One item of a request's result stream (MAX's ``SchedulerResult``); like its output, not
    tracked by the garbage collector.

    ``error`` is set only on a CANCELLED result that the system (not the client) caused, with a
    message for the user, and ``error_kind`` says which kind of failure it was. A CANCELLED
    result without an error is an abort the client asked for. ``timings`` rides on the result
    that carries a request's first generated token, for the API server's latency metrics.
    """

    status: SchedulerStatus
    result: OutputT | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    timings: RequestTimings | None = None

    @classmethod
    def active(
        cls, result: OutputT, timings: RequestTimings | None = None
    ) -> SchedulerResult[OutputT]:
        return cls(status=SchedulerStatus.ACTIVE, result=result, timings=timings)

    @classmethod
    def complete(
        cls, result: OutputT, timings: RequestTimings | None = None
    ) -> SchedulerResult[OutputT]:
        return cls(status=SchedulerStatus.COMPLETE, result=result, timings=timings)

    @classmethod
    def cancelled(
        cls, error: str | None = None, kind: ErrorKind = ErrorKind.INTERNAL
    ) -> SchedulerResult[OutputT]:
        """Aborted (no ``error``) or failed by the system with ``error`` of ``kind``."""
        if error is None:
            return cls(status=SchedulerStatus.CANCELLED)
        return cls(status=SchedulerStatus.CANCELLED, error=error, error_kind=kind)

    @classmethod
    def rejected_request(cls, error: str) -> SchedulerResult[OutputT]:
        """A request refused before queuing: it can never run as asked."""
        return cls.cancelled(error, ErrorKind.INVALID_REQUEST)

    @property
    def stop_stream(self) -> bool:
        """True when no more results follow (COMPLETE or CANCELLED)."""
        return self.status is not SchedulerStatus.ACTIVE
