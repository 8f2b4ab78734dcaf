"""Front-end benchmark: how fast one API server streams tokens when the worker costs nothing.

Starts the processes `switchyard serve` starts (scheduler, one API server, on ipc:// sockets in
a temporary folder and a free HTTP port on 127.0.0.1) but with benchmarks/instant_worker.py in
place of the model worker, so every step's tokens come back at once. Then sends --num-prompts
streaming completions with serve_bench.py's load generator (random token-id prompts of exactly
--input-len tokens, max_tokens=--output-len, ignore_eos, at most --concurrency in flight), after
one uncounted warm-up request, and reports serve_bench's numbers plus the CPU seconds each
process used during the timed run: API server, scheduler, instant worker and the load generator
(this process). The performance issue's target: at least 5,000 output tokens/s to 64 clients.

With fewer cores than busy processes they compete, and the load generator's own share shows
how much of the result is the client's limit rather than the server's.

Example (the model directory only provides the tokenizer and config.json):
  SWITCHYARD_CACHE_DIR=/tmp/sy-cache .venv/bin/python benchmarks/frontend_bench.py \\
      --concurrency 64 --num-prompts 256 --input-len 128 --output-len 256 --output-json fe.json

Exit status: 0 when every request succeeded, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from pathlib import Path

import load_generator
from cpu_accounting import CpuWatch, process_core_s
from metrics import per_request_records, summarize
from report import format_report
from serve_bench import code_version, machine_info
from workload import (
    DEFAULT_VOCAB_SIZE,
    BenchmarkError,
    check_output_json,
    docstring_parser,
    random_prompts,
    read_model_config,
    resolve_model_dir,
    run_benchmark,
)

from scheduler.config import SchedulerConfig
from switchyard.launcher import Launcher
from switchyard.serve_config import ServeConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
TARGET_OUTPUT_THROUGHPUT = 5000.0
"""Output tokens/s one API server should stream to 64 clients (the performance issue)."""


class InstantWorkerLauncher(Launcher):
    """`switchyard serve`'s launcher with benchmarks/instant_worker.py as the worker.

    Children run ``python -m benchmarks.instant_worker``, so the repository root must be on
    their PYTHONPATH (``put_repo_on_pythonpath``).
    """

    def _worker_argv(self, backend: str, rank: int, master_port: int | None) -> list[str]:
        """The instant worker's command line; it runs alone (one rank, no rendezvous)."""
        config = self.config
        return [
            "benchmarks.instant_worker",
            *("--model", str(config.model_dir), "--scheduler-addr", backend),
            *("--block-size", str(config.block_size)),
        ]


def build_parser() -> argparse.ArgumentParser:
    parser = docstring_parser(__doc__, 3)
    parser.add_argument("--model-path", help="model directory (default: Switchyard's default)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=256, help="output tokens per request")
    parser.add_argument(
        "--num-prompts", type=int, default=256, help="requests in all (default: 4 waves of 64)"
    )
    parser.add_argument("--concurrency", type=int, default=64, help="most requests in flight")
    parser.add_argument("--seed", type=int, default=0, help="seed for prompts")
    parser.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens
    )
    parser.add_argument(
        "--request-timeout", type=float, default=60.0, help="seconds to wait for any chunk"
    )
    parser.add_argument("--output-json", help="write config, results and per-request data here")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in ("input_len", "output_len", "num_prompts", "concurrency"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    check_output_json(parser, args.output_json)


def put_repo_on_pythonpath() -> None:
    """Let children find ``benchmarks.instant_worker`` from any working directory (the launcher
    hands this process's environment to its children)."""
    paths = [str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)


def cpu_by_process(
    before: dict[str, float | None],
    after: dict[str, float | None],
    wall_s: float,
    num_output_tokens: int,
) -> dict[str, dict[str, float]]:
    """Each process's CPU over the run: core-seconds, share of one core, and microseconds per
    output token. Processes that exited during the run (a reading is None) are left out."""
    by_process = {}
    for name, start in before.items():
        end = after.get(name)
        if start is None or end is None:
            continue
        core_s = end - start
        by_process[name] = {
            "core_s": core_s,
            "share_of_one_core": core_s / wall_s,
            "us_per_output_token": core_s * 1e6 / num_output_tokens if num_output_tokens else 0,
        }
    return by_process


def read_cpu(pids: dict[str, int]) -> dict[str, float | None]:
    """CPU seconds used so far by each child and by this process (the load generator)."""
    readings = {name: process_core_s(pid) for name, pid in pids.items()}
    readings["load_generator"] = time.process_time()
    return readings


async def benchmark(
    args: argparse.Namespace, base_url: str, prompts: list[list[int]], pids: dict[str, int]
) -> dict:
    """Warm up with the last prompt, then send the others; return the run's numbers."""
    async with load_generator.new_client(
        base_url, args.concurrency, args.request_timeout
    ) as client:
        model = (await load_generator.served_model(client))["id"]
        warm_up = load_generator.completion_payload(model, prompts[-1], min(args.output_len, 8))
        first = await load_generator.stream_completion(client, warm_up)
        if not first.success:
            raise BenchmarkError(f"the warm-up request to {base_url} failed: {first.error}")
        payloads = [
            load_generator.completion_payload(model, prompt, args.output_len)
            for prompt in prompts[:-1]
        ]
        print(f"benchmarking {base_url}: {len(payloads)} requests", file=sys.stderr, flush=True)
        cpu_watch, cpu_before = CpuWatch(), read_cpu(pids)
        cpu_watch.start()
        results, duration = await load_generator.run_load(
            client, payloads, args.concurrency, math.inf, args.seed
        )
        cpu, cpu_after = cpu_watch.stop(), read_cpu(pids)
    summary = summarize(results, duration)
    return {
        "model": model,
        "summary": summary,
        "cpu_during_run": cpu,
        "cpu_by_process": cpu_by_process(
            cpu_before, cpu_after, duration, summary["total_output_tokens"]
        ),
        "requests": per_request_records(results),
    }


def serve_and_benchmark(
    args: argparse.Namespace, model_dir: Path, prompts: list[list[int]], server_info: dict
) -> dict:
    """Start the processes, run the benchmark, stop them; record URL and exit codes."""
    put_repo_on_pythonpath()
    config = ServeConfig(
        model_dir=model_dir,
        served_model_name=model_dir.name,
        port=0,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    launcher = InstantWorkerLauncher(config)
    try:
        launcher.start()
        if (dead := launcher.dead_child()) is not None:
            raise BenchmarkError(f"the {dead} process exited during start-up (see stderr)")
        server_info["base_url"] = f"http://127.0.0.1:{launcher.port}"
        pids = {name: process.pid for name, process in launcher.children.items()}
        return asyncio.run(benchmark(args, server_info["base_url"], prompts, pids))
    finally:
        launcher.shutdown()
        exit_codes = {name: process.returncode for name, process in launcher.children.items()}
        server_info["exit_codes"] = exit_codes
        server_info["exit_code"] = next((code for code in exit_codes.values() if code), 0)


def run(args: argparse.Namespace) -> dict:
    model_dir = resolve_model_dir(args.model_path)
    vocab_size = read_model_config(model_dir).get("vocab_size", DEFAULT_VOCAB_SIZE)
    prompts = random_prompts(args.num_prompts + 1, args.input_len, vocab_size, args.seed)
    server_info = {"model_dir": str(model_dir), "vocab_size": vocab_size, "worker": "instant"}
    started = time.time()
    run_result = serve_and_benchmark(args, model_dir, prompts, server_info)
    server_info["model"] = run_result["model"]
    config = {key: value for key, value in vars(args).items() if key != "output_json"}
    config["request_rate"] = "inf"
    serving = run_result["summary"]
    return {
        "started_at": started,
        "config": config,
        "machine": machine_info(),
        "code": code_version(),
        "server": server_info,
        "serving": serving,
        "cpu_during_run": run_result["cpu_during_run"],
        "cpu_by_process": run_result["cpu_by_process"],
        "target": {
            "output_throughput": TARGET_OUTPUT_THROUGHPUT,
            "met": serving["output_throughput"] >= TARGET_OUTPUT_THROUGHPUT,
        },
        "roofline": None,
        "baseline": None,
        "comparison": {},
        "requests": run_result["requests"],
    }


def main(argv: list[str] | None = None) -> int:
    return run_benchmark("frontend_bench", argv, build_parser, check_args, run, report)


def report(result: dict) -> tuple[str, bool]:
    verdict = "met" if result["target"]["met"] else "not met"
    target = f"target >= {TARGET_OUTPUT_THROUGHPUT:.0f} output tok/s: {verdict}"
    return f"{format_report(result)}\n{target}", result["serving"]["failed"] == 0


if __name__ == "__main__":
    sys.exit(main())
