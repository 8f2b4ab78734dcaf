"""Plays the scheduler for one ModelRunner: the requests it drives, the step driver, and the
runner and contexts they take."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from interfaces import SamplingParams, TextContext, TextGenerationOutput
from interfaces.scheduler_to_worker import CachedRequestData, NewRequestData, ScheduledStep
from worker.config import WorkerConfig
from worker.model_runner import ModelRunner

EOS = 2


@dataclass
class DrivenRequest:
    """The test scheduler's view of one request; ``outputs`` are the worker's replies."""

    context: TextContext
    prefill_chunks: list[int] = field(default_factory=list)
    resumed_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    outputs: list[TextGenerationOutput] = field(default_factory=list)
    sent: bool = False

    @property
    def request_id(self) -> str:
        return self.context.request_id

    @property
    def output_token_ids(self) -> list[int]:
        return [*self.resumed_token_ids, *(t for o in self.outputs for t in o.tokens)]

    @property
    def num_tokens(self) -> int:
        return self.context.num_prompt_tokens + len(self.output_token_ids)

    @property
    def is_done(self) -> bool:
        """Stopped as the scheduler would: a stop or end-of-sequence id once min_new_tokens were
        generated, or the length limit."""
        tokens, params = self.output_token_ids, self.context.sampling_params
        if len(tokens) >= self.context.max_new_tokens:
            return True
        ends = list(params.stop_token_ids or ())
        ends += [] if params.ignore_eos else self.context.eos_token_ids
        return bool(tokens) and len(tokens) >= params.min_new_tokens and tokens[-1] in ends


class StepDriver:
    """Plays the scheduler: every unfinished request runs in every step, blocks are shuffled.

    A request deferred for its grammar has its last token recomputed once the grammar is ready,
    as the scheduler does."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.free_blocks = list(range(runner.num_kv_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.step_id = 0

    def run(self, requests: list[DrivenRequest]) -> dict[str, DrivenRequest]:
        """Run ``requests`` to completion, then release them in the worker."""
        running = list(requests)
        while running:
            self._step(running)
            running = [r for r in running if not r.is_done]
        done = [r.request_id for r in requests]
        self.runner.next_token(ScheduledStep(self.step_id, finished_request_ids=done))
        self.step_id += 1
        assert self.runner.requests == {}
        return {r.request_id: r for r in requests}

    def _step(self, running: list[DrivenRequest]) -> None:
        new, cached, num_scheduled = [], [], {}
        for request in running:
            remaining = request.num_tokens - request.num_computed_tokens
            count = request.prefill_chunks.pop(0) if request.prefill_chunks else remaining
            new_blocks = self._allocate(request, request.num_computed_tokens + count)
            if request.sent:
                cached.append(
                    CachedRequestData(request.request_id, new_blocks, request.num_computed_tokens)
                )
            else:
                request.sent = True
                new.append(
                    NewRequestData(
                        request.context,
                        list(request.block_ids),
                        request.num_computed_tokens,
                        list(request.resumed_token_ids),
                    )
                )
            num_scheduled[request.request_id] = count
        outputs = self.runner.next_token(ScheduledStep(self.step_id, new, cached, num_scheduled))
        self.step_id += 1
        assert self.runner.take_failures() == {}
        deferred = set(self.runner.take_deferred())
        for request in running:
            request.num_computed_tokens += num_scheduled[request.request_id]
            if request.request_id in deferred:
                request.num_computed_tokens -= 1
                continue
            reached_end = request.num_computed_tokens == request.num_tokens
            assert (request.request_id in outputs) == reached_end
            if reached_end:
                request.outputs.append(outputs[request.request_id])
        self._await_grammars(deferred)

    def _await_grammars(self, deferred: set[str]) -> None:
        while deferred:
            news = self.runner.grammar_news()
            if news is None:
                time.sleep(0.01)
                continue
            assert news.failed == {}
            deferred -= set(news.ready)

    def _allocate(self, request: DrivenRequest, num_tokens: int) -> list[int]:
        num_needed = -(-num_tokens // self.runner.block_size) - len(request.block_ids)
        new_blocks = [self.free_blocks.pop() for _ in range(max(num_needed, 0))]
        request.block_ids.extend(new_blocks)
        return new_blocks


def context(request_id: str, prompt: list[int], num_new_tokens: int, **fields) -> TextContext:
    """A TextContext; ``fields`` go to SamplingParams, except TextContext's own field names."""
    own = {"logprobs", "prompt_logprobs", "structured_output", "eos_token_ids"}
    context_fields = {k: v for k, v in fields.items() if k in own}
    params = SamplingParams(**{k: v for k, v in fields.items() if k not in own})
    context_fields.setdefault("eos_token_ids", [EOS])
    return TextContext(
        request_id,
        prompt,
        len(prompt) + num_new_tokens,
        sampling_params=params,
        **context_fields,
    )


def small_runner(
    model_dir: Path, kv_cache_memory: int = 8 << 20, logits_processors: tuple[str, ...] = ()
) -> ModelRunner:
    """A CPU ModelRunner with a small KV pool, a 256-token context and a fixed sampling seed;
    ``logits_processors`` are user processors' import paths to load."""
    config = WorkerConfig(
        model_dir,
        device="cpu",
        kv_cache_memory=kv_cache_memory,
        max_model_len=256,
        seed=0,
        logits_processors=logits_processors,
    )
    return ModelRunner(config)
