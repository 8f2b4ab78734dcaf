"""A scheduler played by hand for greedy parity: every request in every step, chunked
prefills, shuffled KV blocks."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from interfaces import SamplingParams, TextContext
from interfaces.scheduler_to_worker import CachedRequestData, NewRequestData, ScheduledStep
from worker.model_runner import ModelRunner

NUM_NEW_TOKENS = 32


@dataclass
class DrivenRequest:
    """The test scheduler's view of one request."""

    request_id: str
    prompt: list[int]
    prefill_chunks: list[int]
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    outputs: list[int] = field(default_factory=list)
    sent: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.outputs)


class FakeScheduler:
    """Runs requests to NUM_NEW_TOKENS outputs each, all requests in every step."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.free_blocks = list(range(runner.num_kv_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.step_id = 0

    def generate(self, requests: list[DrivenRequest]) -> dict[str, list[int]]:
        running, finished = list(requests), []
        while running:
            output = self._step(running, finished)
            finished = [r.request_id for r in running if len(r.outputs) == NUM_NEW_TOKENS]
            running = [r for r in running if len(r.outputs) < NUM_NEW_TOKENS]
            assert set(output) <= {r.request_id for r in requests}
        self.runner.next_token(ScheduledStep(self.step_id, finished_request_ids=finished))
        assert self.runner.requests == {}
        return {r.request_id: r.outputs for r in requests}

    def _step(self, running: list[DrivenRequest], finished: list[str]) -> dict:
        new, cached, num_scheduled = [], [], {}
        for request in running:
            count = request.prefill_chunks.pop(0) if request.prefill_chunks else 1
            new_blocks = self._allocate(request, request.num_computed_tokens + count)
            if request.sent:
                cached.append(
                    CachedRequestData(request.request_id, new_blocks, request.num_computed_tokens)
                )
            else:
                new.append(self._new_request_data(request))
            num_scheduled[request.request_id] = count
        output = self.runner.next_token(
            ScheduledStep(self.step_id, new, cached, num_scheduled, finished)
        )
        self.step_id += 1
        for request in running:
            request.num_computed_tokens += num_scheduled[request.request_id]
            reached_end = request.num_computed_tokens == request.num_tokens
            assert (request.request_id in output) == reached_end
            if reached_end:
                request.outputs.extend(output[request.request_id].tokens)
        return {k: v.tokens for k, v in output.items()}

    def _allocate(self, request: DrivenRequest, num_tokens: int) -> list[int]:
        block_size = self.runner.block_size
        num_needed = -(-num_tokens // block_size) - len(request.block_ids)
        new_blocks = [self.free_blocks.pop() for _ in range(max(num_needed, 0))]
        request.block_ids.extend(new_blocks)
        return new_blocks

    def _new_request_data(self, request: DrivenRequest) -> NewRequestData:
        request.sent = True
        context = TextContext(
            request_id=request.request_id,
            prompt_token_ids=request.prompt,
            max_length=len(request.prompt) + NUM_NEW_TOKENS,
            eos_token_ids=[2],
            sampling_params=SamplingParams(top_k=1),
        )
        return NewRequestData(context, list(request.block_ids), request.num_computed_tokens)
