"""A model-free TokenGenerator that consumes ScheduledSteps exactly as the real worker must.

Its next token is a pure function of the request's whole token sequence, so any scheduling path
(chunking, preemption and recompute, batching) that is correct yields the same outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from interfaces import RequestID, TextGenerationOutput
from interfaces.scheduler_to_worker import ScheduledStep


@dataclass
class FakeRequestState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    history: list[int] = field(default_factory=list)


def next_token_for(token_ids: list[int]) -> int:
    """Deterministic stand-in for a model: depends on every token so far."""
    return (sum(token_ids) * 31 + len(token_ids)) % 1000 + 10


class FakeTokenGenerator:
    """Implements ``TokenGenerator[ScheduledStep]`` and checks the scheduler's diffs."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.states: dict[RequestID, FakeRequestState] = {}

    def next_token(self, step: ScheduledStep) -> dict[RequestID, TextGenerationOutput]:
        for request_id in step.finished_request_ids:
            self.release(request_id)
        for new in step.new_requests:
            context = new.context
            token_ids = list(context.prompt_token_ids) + list(new.output_token_ids)
            self.states[context.request_id] = FakeRequestState(
                token_ids, list(new.block_ids), new.num_computed_tokens
            )
        for cached in step.cached_requests:
            state = self.states[cached.request_id]
            if state.num_computed_tokens != cached.num_computed_tokens:
                raise AssertionError(f"{cached.request_id}: computed tokens out of sync")
            state.block_ids.extend(cached.new_block_ids)
        return self._run(step)

    def _run(self, step: ScheduledStep) -> dict[RequestID, TextGenerationOutput]:
        outputs = {}
        for request_id, num_scheduled in step.num_scheduled_tokens.items():
            state = self.states[request_id]
            state.num_computed_tokens += num_scheduled
            capacity = len(state.block_ids) * self.block_size
            if state.num_computed_tokens > capacity:
                raise AssertionError(f"{request_id}: {state.num_computed_tokens} > {capacity}")
            if state.num_computed_tokens == len(state.token_ids):
                token = next_token_for(state.token_ids)
                state.token_ids.append(token)
                outputs[request_id] = TextGenerationOutput(request_id, [token])
        return outputs

    def release(self, request_id: RequestID) -> None:
        self.states.pop(request_id, None)
