"""The engine the parity tests drive (the real scheduler over a real worker, in one process)
and transformers' greedy reference tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from interfaces import SamplingParams, TextContext
from interfaces.scheduler_to_worker import ScheduledStep
from interfaces.worker_to_scheduler import WorkerOutput
from scheduler.config import KVCacheConfig, SchedulerConfig
from scheduler.scheduler import Scheduler
from worker.config import WorkerConfig
from worker.kv_cache import bytes_per_block
from worker.model_runner import ModelRunner
from worker.models.config import ModelConfig

NUM_NEW_TOKENS = 20
BLOCK_SIZE = 16


class Engine:
    """Scheduler + ModelRunner without sockets; records every step for the assertions."""

    def __init__(
        self,
        model_dir: Path,
        num_blocks: int,
        max_model_len: int,
        budget: int,
        speculative_config: str | None = None,
        device: str = "cpu",
    ):
        model = ModelConfig.from_dir(model_dir)
        block_bytes = bytes_per_block(
            model.num_hidden_layers, BLOCK_SIZE, model.num_key_value_heads, model.head_dim,
            torch.float32,
        )  # fmt: skip
        spare = 1 if device == "cuda" else 0  # CUDA graphs pad their rows into a spare block
        self.runner = ModelRunner(
            WorkerConfig(
                model_dir,
                device=device,
                dtype="float32",
                kv_cache_memory=(num_blocks + spare) * block_bytes,
                max_model_len=max_model_len,
            )
        )
        assert self.runner.num_kv_blocks == num_blocks
        kv_cache = KVCacheConfig(num_blocks, BLOCK_SIZE, max_model_len)
        config = SchedulerConfig(8, budget, speculative_config=speculative_config)
        self.scheduler = Scheduler(config, kv_cache)
        self.steps: list[ScheduledStep] = []
        self.logprobs: dict[str, list[float]] = {}
        """Each request's sampled tokens' log probabilities, when it asked for them."""

    def generate(
        self,
        prompts: dict[str, list[int]],
        params: SamplingParams | None = None,
        num_new_tokens: int = NUM_NEW_TOKENS,
        logprobs: int | None = None,
    ) -> dict[str, list[int]]:
        """Each prompt's tokens, greedy unless ``params`` say otherwise."""
        tokens = {request_id: [] for request_id in prompts}
        params = params or SamplingParams(top_k=1, ignore_eos=True)
        for request_id, prompt in prompts.items():
            max_length = len(prompt) + num_new_tokens
            context = TextContext(request_id, prompt, max_length, [2], params, logprobs=logprobs)
            assert self.scheduler.add_request(context, b"test") is None
            self.logprobs[request_id] = []
        while self.scheduler.has_unfinished_requests():
            step = self.scheduler.schedule()
            self.steps.append(step)
            output = WorkerOutput(step.step_id, self.runner.next_token(step))
            for request_id, result in self.scheduler.update_from_output(output)[b"test"].items():
                tokens[request_id] += result.result.tokens
                for entry in result.result.log_probabilities or []:
                    self.logprobs[request_id] += entry.token_log_probabilities
            self.scheduler.check_integrity()
        return tokens


def greedy_tokens(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``model``'s (transformers) greedy continuation of ``prompt``, with an explicit attention
    mask (see ``reference``)."""
    with torch.inference_mode():
        input_ids = torch.tensor([prompt])
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
        )
    return output[0, len(prompt) :].tolist()
