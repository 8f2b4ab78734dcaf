"""Run a tensor-parallel group of ModelRunners in child processes through a scripted schedule.

Every rank receives the same steps, as from the scheduler: new requests in full, then diffs, with
prompts prefilled in the given chunks while other requests decode and blocks drawn from a
shuffled pool. The schedule depends on no output (requests ignore EOS and run to ``num_new``
tokens), so it is written out before any rank starts. Rank 0 reports its outputs and refusals;
the other ranks report the tokens they were sent. ``tiny_requests()`` are the requests the CPU
and GPU tests script.
"""

from __future__ import annotations

import multiprocessing
import random
import socket
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from interfaces import SamplingParams, StructuredOutput, TextContext
from interfaces.scheduler_to_worker import (
    CachedRequestData,
    LoRAUpdate,
    NewRequestData,
    ScheduledStep,
)
from interfaces.shared_settings import LoRASettings
from worker.config import WorkerConfig

RANK_TIMEOUT_S = 240


@dataclass
class ScriptedRequest:
    context: TextContext
    prefill_chunks: list[int]
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_tokens: int = 0
    stop_after_first_step: bool = False
    """A request the workers are expected to refuse: named once, never again."""


def scripted_steps(
    requests: list[ScriptedRequest], num_new: int, block_size: int = 16, num_blocks: int = 256
) -> list[ScheduledStep]:
    """Steps that run every request to ``num_new`` output tokens, all requests in each step,
    with blocks from a shuffled pool of ``num_blocks``."""
    free_blocks = list(range(num_blocks))
    random.Random(0).shuffle(free_blocks)
    steps: list[ScheduledStep] = []
    running = list(requests)
    for request in running:
        request.num_tokens = len(request.context.prompt_token_ids)
    finished: list[str] = []
    while running:
        new, cached, num_scheduled = [], [], {}
        for request in running:
            prompt_length = len(request.context.prompt_token_ids)
            count = request.prefill_chunks.pop(0) if request.prefill_chunks else 1
            end = request.num_computed_tokens + count
            num_more = -(-end // block_size) - len(request.block_ids)
            new_blocks = [free_blocks.pop() for _ in range(num_more)]
            request.block_ids += new_blocks
            if request.num_computed_tokens == 0:
                new.append(NewRequestData(request.context, list(request.block_ids), 0, []))
            else:
                cached.append(
                    CachedRequestData(
                        request.context.request_id, new_blocks, request.num_computed_tokens
                    )
                )
            num_scheduled[request.context.request_id] = count
            request.num_computed_tokens = end
            if end == request.num_tokens:  # a sampling point: one more known token
                request.num_tokens += 1
            assert end <= max(request.num_tokens, prompt_length)
        steps.append(ScheduledStep(len(steps), new, cached, num_scheduled, finished))
        finished = [
            r.context.request_id
            for r in running
            if r.num_tokens - len(r.context.prompt_token_ids) == num_new
        ]
        running = [
            r
            for r in running
            if r.context.request_id not in finished and not r.stop_after_first_step
        ]
    steps.append(ScheduledStep(len(steps), finished_request_ids=finished))
    return steps


def run_group(
    model_dir: Path,
    world_size: int,
    steps: list[ScheduledStep | LoRAUpdate],
    max_model_len: int = 512,
    device: str = "cpu",
) -> list[dict]:
    """Run ``steps`` on ``world_size`` ranks; one report per rank, in rank order.
    ``AssertionError`` with its traceback if a rank raised. With ``LoRAUpdate``s among the
    steps, the ranks serve LoRA adapters (``--enable-lora``) and report each update's status."""
    context = multiprocessing.get_context("spawn")
    reports = context.Queue()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = [
        context.Process(
            target=_rank_main,
            args=(rank, world_size, port, str(model_dir), steps, max_model_len, device, reports),
        )
        for rank in range(world_size)
    ]
    for process in ranks:
        process.start()
    try:
        by_rank = dict(reports.get(timeout=RANK_TIMEOUT_S) for _ in ranks)
    finally:
        for process in ranks:
            process.join(10)
            if process.is_alive():
                process.kill()
    failures = [report["error"] for report in by_rank.values() if "error" in report]
    assert not failures, failures[0]
    return [by_rank[rank] for rank in range(world_size)]


def _rank_main(rank, world_size, port, model_dir, steps, max_model_len, device, reports) -> None:
    try:
        report = _run_rank(rank, world_size, port, model_dir, steps, max_model_len, device)
        reports.put((rank, report))
    except BaseException:  # every rank reports, so the test fails at once with the reason
        reports.put((rank, {"error": traceback.format_exc()}))


def _run_rank(rank, world_size, port, model_dir, steps, max_model_len, device) -> dict:
    from worker.model_runner import ModelRunner
    from worker.parallel import destroy_tensor_parallel, init_tensor_parallel

    config = WorkerConfig(
        Path(model_dir),
        device=device,
        dtype="float32",
        kv_cache_memory=256 << 20,
        max_model_len=max_model_len,
        num_threads=1,
        rank=rank,
        tensor_parallel_size=world_size,
        lora=LoRASettings(enable_lora=any(isinstance(step, LoRAUpdate) for step in steps)),
    )
    init_tensor_parallel(rank, world_size, "127.0.0.1", port, config.torch_device)
    runner = ModelRunner(config)
    tokens: dict[str, list[int]] = {}
    outputs, refusals, seen, lora_statuses = {}, {}, {}, []
    for step in steps:
        if isinstance(step, LoRAUpdate):
            lora_statuses.append(runner.update_lora(step).response.status.value)
            continue
        for new in step.new_requests:
            seen[new.context.request_id] = len(new.context.prompt_token_ids)
        for request_id in step.finished_request_ids:
            if request_id in runner.requests:
                state = runner.requests[request_id]
                tokens[request_id] = state.token_ids[seen[request_id] :]
        for request_id, output in runner.next_token(step).items():
            outputs.setdefault(request_id, []).append(output)
        refusals.update(runner.take_refusals())
    report = {
        "num_kv_blocks": runner.num_kv_blocks,
        "num_kv_heads": runner.model.num_kv_heads,
        "tokens": tokens,
        "outputs": outputs,
        "refusals": refusals,
        "requests_left": sorted(runner.requests),
        "lora_statuses": lora_statuses,
    }
    destroy_tensor_parallel()
    return report


NUM_NEW_TOKENS = 12


def greedy(request_id: str, prompt: list[int], **fields) -> TextContext:
    params = SamplingParams(top_k=1, ignore_eos=True)
    return TextContext(request_id, prompt, len(prompt) + NUM_NEW_TOKENS, [2], params, **fields)


def tiny_requests() -> list[ScriptedRequest]:
    """Three prompts, two prefilled in chunks while others decode; one asks for log
    probabilities; one has a grammar that only rank 0 compiles, and fails to."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40000, (n,), generator=generator).tolist() for n in (9, 40, 77)]
    bad_grammar = StructuredOutput("regex", "[0-9")
    return [
        ScriptedRequest(greedy("short", prompts[0], logprobs=2), [9]),
        ScriptedRequest(greedy("chunked", prompts[1], prompt_logprobs=1), [16, 24]),
        ScriptedRequest(greedy("long", prompts[2]), [50, 27]),
        ScriptedRequest(
            greedy("bad", prompts[0], structured_output=bad_grammar),
            [9],
            stop_after_first_step=True,
        ),
    ]
