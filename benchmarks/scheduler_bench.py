"""Scheduler benchmark: the scheduler's own time per step, in one process, with no sockets.

Admits --num-requests requests of --input-len random prompt tokens into a ``Scheduler`` whose
block pool holds all of them for the whole run (a preemption stops it with an error), runs steps
through benchmarks/instant_worker.py's model-free ``InstantTokenGenerator`` until every request
is decoding (one token per step each), then times --num-steps steady-state decode steps after
--warmup-steps more. Each step does what scheduler/server.py does for one step, in its order:

- ``decode``: decode the worker's WorkerOutput frame;
- ``update``: ``Scheduler.update_from_output`` (record tokens, finish requests);
- ``encode_results``: encode the SchedulerResults for the API server;
- ``schedule``: ``Scheduler.schedule`` (decide the next step);
- ``encode_step``: encode the ScheduledStep for the worker.

``schedule + update`` is the scheduler's own work (the performance issue's target: under 1 ms
with 256 running requests); ``total`` adds the wire encoding. Socket calls, and the worker's
side (decoding the step, generating, encoding its output), are left out. Python's garbage
collector stays on, as in the server, so the p99 includes its pauses (the scheduler is built as
the server builds it, with its block pool frozen out of the collector's reach).

Example:
  .venv/bin/python benchmarks/scheduler_bench.py --num-requests 256 --num-steps 500
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable

from instant_worker import DEFAULT_NUM_KV_BLOCKS, InstantTokenGenerator
from metrics import distribution_ms
from workload import (
    DEFAULT_VOCAB_SIZE,
    BenchmarkError,
    docstring_parser,
    random_prompts,
    run_benchmark,
)

from interfaces import SamplingParams, TextContext, msgpack_numpy_decoder, msgpack_numpy_encoder
from interfaces.scheduler_to_api import SchedulerResults
from interfaces.scheduler_to_worker import ScheduledStep
from interfaces.worker_to_scheduler import CPU_STEP_TOKENS, WorkerOutput, WorkerToSchedulerMessage
from scheduler.config import KVCacheConfig, SchedulerConfig
from scheduler.placement import new_scheduler
from scheduler.scheduler import Scheduler

CLIENT_ID = b"api-server-0"
TARGET_MS = 1.0
PHASES = ("decode", "update", "encode_results", "schedule", "encode_step")
STATISTICS = ("mean", "median", "p99", "max")


def build_parser() -> argparse.ArgumentParser:
    parser = docstring_parser(__doc__, 1)
    parser.add_argument("--num-requests", type=int, default=256, help="requests running")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--num-steps", type=int, default=500, help="decode steps timed")
    parser.add_argument("--warmup-steps", type=int, default=50, help="decode steps not timed")
    parser.add_argument(
        "--num-kv-blocks",
        type=int,
        default=DEFAULT_NUM_KV_BLOCKS,
        help="the pool; the run stops with an error if a request is ever preempted",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--max-num-batched-tokens", type=int, default=CPU_STEP_TOKENS)
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--seed", type=int, default=0, help="seed for prompts")
    parser.add_argument("--output-json", help="write config and results here ('-': stdout)")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in ("num_requests", "input_len", "num_steps", "num_kv_blocks", "block_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.warmup_steps < 0:
        parser.error("--warmup-steps must not be negative")
    if args.max_num_batched_tokens < args.num_requests:
        parser.error("--max-num-batched-tokens must be at least --num-requests to decode them all")
    if args.input_len >= args.max_model_len:
        parser.error("--input-len must be below --max-model-len")


def build_scheduler(args: argparse.Namespace) -> Scheduler:
    config = SchedulerConfig(
        args.num_requests, args.max_num_batched_tokens, args.enable_prefix_caching
    )
    kv_cache = KVCacheConfig(args.num_kv_blocks, args.block_size, args.max_model_len)
    return new_scheduler(config, kv_cache)  # as the server makes it (block pool frozen for gc)


def add_requests(scheduler: Scheduler, args: argparse.Namespace) -> None:
    """Random prompts, ignore_eos, as long as the context allows: none finishes during the run."""
    prompts = random_prompts(args.num_requests, args.input_len, DEFAULT_VOCAB_SIZE, args.seed)
    for index, prompt in enumerate(prompts):
        context = TextContext(
            request_id=f"cmpl-{index:032x}",  # as long as the API server's ids
            prompt_token_ids=prompt,
            max_length=args.max_model_len,
            eos_token_ids=[2],
            sampling_params=SamplingParams(temperature=0.0, ignore_eos=True),
        )
        rejection = scheduler.add_request(context, CLIENT_ID)
        if rejection is not None:
            raise BenchmarkError(f"the scheduler rejected a request: {rejection.error}")


class StepLoop:
    """Drives the scheduler and the generator one step at a time as scheduler/server.py does."""

    def __init__(self, scheduler: Scheduler, generator: InstantTokenGenerator) -> None:
        self.scheduler = scheduler
        self.generator = generator
        self.encode = msgpack_numpy_encoder()
        self.decode_step = msgpack_numpy_decoder(ScheduledStep)
        self.decode_worker = msgpack_numpy_decoder(WorkerToSchedulerMessage)
        self.worker_frame: bytes | None = None
        """The worker's answer to the last step, still to be processed."""

    def run_step(self) -> tuple[ScheduledStep, dict[str, float]]:
        """Process the worker's answer to the last step, then schedule the next and encode it.

        Returns that step and the seconds each of ``PHASES`` took (0 for those not run).
        """
        seconds = dict.fromkeys(PHASES, 0.0)
        if self.worker_frame is not None:
            output = _timed(seconds, "decode", self.decode_worker, self.worker_frame)
            results = _timed(seconds, "update", self.scheduler.update_from_output, output)
            _timed(seconds, "encode_results", self._encode_results, results)
        step = _timed(seconds, "schedule", self.scheduler.schedule)
        step_frame = _timed(seconds, "encode_step", self.encode, step)
        self.worker_frame = self._worker_answer(step_frame)
        return step, seconds

    def _encode_results(self, results: dict) -> list[bytes]:
        return [self.encode(SchedulerResults(by_request)) for by_request in results.values()]

    def _worker_answer(self, step_frame: bytes) -> bytes:
        """What the worker sends back for ``step_frame`` (its time is not the scheduler's)."""
        step = self.decode_step(step_frame)
        outputs = self.generator.next_token(step)
        return self.encode(WorkerOutput(step.step_id, outputs, self.generator.take_refusals()))


def _timed(seconds: dict[str, float], phase: str, function: Callable, *args: object) -> object:
    """``function(*args)``, with the seconds it took stored in ``seconds[phase]``."""
    start = time.perf_counter()
    result = function(*args)
    seconds[phase] = time.perf_counter() - start
    return result


def is_steady_decode(step: ScheduledStep, num_requests: int) -> bool:
    """True when ``step`` runs one token for each of ``num_requests`` requests and no prefill."""
    return (
        len(step.num_scheduled_tokens) == num_requests
        and step.total_num_scheduled_tokens == num_requests
        and not step.new_requests
    )


def reach_steady_decode(loop: StepLoop, num_requests: int, max_steps: int) -> int:
    """Run steps until every request decodes; return how many it took."""
    for num_steps in range(1, max_steps + 1):
        step, _ = loop.run_step()
        if is_steady_decode(step, num_requests):
            return num_steps
    raise BenchmarkError(f"not all {num_requests} requests were decoding after {max_steps} steps")


def time_steps(loop: StepLoop, num_steps: int, num_requests: int) -> dict[str, list[float]]:
    """Seconds per phase, ``schedule_and_update`` and ``total`` for each of ``num_steps`` steps.

    Raises ``BenchmarkError`` if a step is not steady decode.
    """
    seconds: dict[str, list[float]] = defaultdict(list)
    for _ in range(num_steps):
        step, phases = loop.run_step()
        if not is_steady_decode(step, num_requests):
            raise BenchmarkError(
                f"step {step.step_id} is not a decode of every request: one finished or was "
                "preempted (raise --max-model-len or --num-kv-blocks)"
            )
        for phase, value in phases.items():
            seconds[phase].append(value)
        seconds["schedule_and_update"].append(phases["schedule"] + phases["update"])
        seconds["total"].append(sum(phases.values()))
    return seconds


def run(args: argparse.Namespace) -> dict:
    scheduler = build_scheduler(args)
    add_requests(scheduler, args)
    generator = InstantTokenGenerator(
        "instant", args.max_model_len, args.num_kv_blocks, args.block_size
    )
    loop = StepLoop(scheduler, generator)
    num_steps_to_decode = reach_steady_decode(
        loop, args.num_requests, max_steps=args.num_requests * args.input_len
    )
    time_steps(loop, args.warmup_steps, args.num_requests)
    seconds = time_steps(loop, args.num_steps, args.num_requests)
    if scheduler.num_preemptions:  # during the ramp-up: the timed steps had none
        raise BenchmarkError(f"{scheduler.num_preemptions} preemptions; raise --num-kv-blocks")
    per_step_ms = {
        phase: {**distribution_ms(values), "max": max(values) * 1000}
        for phase, values in seconds.items()
    }
    p99_ms = per_step_ms["schedule_and_update"]["p99"]
    return {
        "config": {key: value for key, value in vars(args).items() if key != "output_json"},
        "num_steps_to_steady_decode": num_steps_to_decode,
        "per_step_ms": per_step_ms,
        "target": {"schedule_and_update_p99_ms": TARGET_MS, "met": p99_ms < TARGET_MS},
    }


def format_report(result: dict) -> str:
    """The table of step times in milliseconds, and whether the target is met."""
    config = result["config"]
    lines = [
        f"Scheduler time per step, {config['num_requests']} requests decoding, "
        f"{config['num_steps']} steps timed (ms)",
        f"{'phase':<22}" + "".join(f"{column:>9}" for column in STATISTICS),
    ]
    for phase, ms in result["per_step_ms"].items():
        lines.append(f"{phase:<22}" + "".join(f"{ms[column]:>9.3f}" for column in STATISTICS))
    verdict = "met" if result["target"]["met"] else "not met"
    lines.append(f"target: schedule_and_update p99 < {TARGET_MS:g} ms: {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_benchmark("scheduler_bench", argv, build_parser, check_args, run, report)


def report(result: dict) -> tuple[str, bool]:
    return format_report(result), True


if __name__ == "__main__":
    sys.exit(main())
