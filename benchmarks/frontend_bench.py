"""Front-end benchmark: how fast one API server streams tokens when the worker costs nothing.

Starts the processes `switchyard serve` starts (scheduler, one API server, on ipc:// sockets in
a temporary folder and a free HTTP port on 127.0.0.1) but with benchmarks/instant_worker.py in
place of the model worker, so every step's tokens come back at once. Then sends --num-prompts
streaming completions with serve_bench.py's load generator (random token-id prompts of exactly
--input-len tokens, max_tokens=--output-len, ignore_eos, at most --concurrency in flight), after
one uncounted warm-up request, and reports serve_bench's numbers plus the CPU seconds each
process used during the timed run: API server, scheduler, instant worker and the load generator
(this process). The performance issue's target: at least 5,000 output tokens/s to 64 clients.

With --chat the requests are streaming chat completions instead: conversations of
--chat-turns messages of random vocabulary words, about --input-len prompt tokens in all, so
the API server renders the chat template and tokenizes a long prompt for every request (the
front end's prompt path), and the report's prompt tokens are what the server counted.

With fewer cores than busy processes they compete, and the load generator's own share shows
how much of the result is the client's limit rather than the server's.

Example (the model directory only provides the tokenizer and config.json):
  SWITCHYARD_CACHE_DIR=/tmp/sy-cache .venv/bin/python benchmarks/frontend_bench.py \\
      --concurrency 64 --num-prompts 256 --input-len 128 --output-len 256 --output-json fe.json
  SWITCHYARD_CACHE_DIR=/tmp/sy-cache .venv/bin/python benchmarks/frontend_bench.py --chat \\
      --concurrency 32 --num-prompts 256 --input-len 3000 --output-len 16

Exit status: 0 when every request succeeded, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import re
import sys
import time
from pathlib import Path

import load_generator
from cpu_accounting import CpuWatch, process_core_s
from instant_worker import INSTANT_WORKER_SETTINGS
from metrics import per_request_records, summarize
from report import format_report
from serve_bench import code_version, machine_info
from tokenizers import Tokenizer
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

from api_server.config import HttpBind
from interfaces.settings import to_argv
from interfaces.worker_to_scheduler import CPU_STEP_TOKENS
from scheduler.config import SchedulerConfig
from switchyard.launcher import Launcher
from switchyard.serve_config import ServeConfig
from worker.settings import WorkerSettings

REPO_ROOT = Path(__file__).resolve().parent.parent
TARGET_OUTPUT_THROUGHPUT = 5000.0
"""Output tokens/s one API server should stream to 64 clients (the performance issue)."""
WORD_TOKEN = re.compile("\u0120[a-z]{3,}")
"""A byte-level BPE token for a space and a lower-case word, which tokenizes back to itself."""


class InstantWorkerLauncher(Launcher):
    """`switchyard serve`'s launcher with benchmarks/instant_worker.py as the worker.

    Children run ``python -m benchmarks.instant_worker``, so the repository root must be on
    their PYTHONPATH (``put_repo_on_pythonpath``).
    """

    def _worker_argv(self, settings: WorkerSettings) -> list[str]:
        """The instant worker's command line: the worker's flags it takes (it runs alone: one
        rank, no rendezvous)."""
        given = {name: getattr(settings, name) for name in INSTANT_WORKER_SETTINGS}
        return ["benchmarks.instant_worker", *to_argv(WorkerSettings(**given))]


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
    parser.add_argument("--max-num-batched-tokens", type=int, default=CPU_STEP_TOKENS)
    parser.add_argument(
        "--request-timeout", type=float, default=60.0, help="seconds to wait for any chunk"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="send long chat conversations to /v1/chat/completions instead of token-id prompts",
    )
    parser.add_argument(
        "--chat-turns", type=int, default=8, help="messages per conversation (with --chat)"
    )
    parser.add_argument("--output-json", help="write config, results and per-request data here")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in ("input_len", "output_len", "num_prompts", "concurrency", "chat_turns"):
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
    args: argparse.Namespace, base_url: str, prompts: list, pids: dict[str, int]
) -> dict:
    """Warm up with the last prompt, then send the others; return the run's numbers."""
    async with load_generator.new_client(
        base_url, args.concurrency, args.request_timeout
    ) as client:
        model = (await load_generator.served_model(client))["id"]
        payload = load_generator.chat_payload if args.chat else load_generator.completion_payload
        warm_up = payload(model, prompts[-1], min(args.output_len, 8))
        first = await load_generator.stream_completion(client, warm_up)
        if not first.success:
            raise BenchmarkError(f"the warm-up request to {base_url} failed: {first.error}")
        payloads = [payload(model, prompt, args.output_len) for prompt in prompts[:-1]]
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


def chat_conversations(
    model_dir: Path, num_prompts: int, input_len: int, num_turns: int, seed: int
) -> list[list[dict]]:
    """``num_prompts`` conversations of ``num_turns`` messages (user and assistant in turn, the
    last a user's) of random words from the model's vocabulary, ``input_len`` words in all,
    each about one token. The same arguments always give the same conversations."""
    vocabulary = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab()
    words = sorted(token[1:] for token in vocabulary if WORD_TOKEN.fullmatch(token))
    if not words:
        raise BenchmarkError(f"{model_dir}'s vocabulary has no plain word tokens for --chat")
    rng = random.Random(seed)
    words_per_turn = max(1, input_len // num_turns)
    roles = ["user" if (num_turns - turn) % 2 else "assistant" for turn in range(num_turns)]
    return [
        [
            {"role": role, "content": " ".join(rng.choices(words, k=words_per_turn))}
            for role in roles
        ]
        for _ in range(num_prompts)
    ]


def serve_and_benchmark(
    args: argparse.Namespace, model_dir: Path, prompts: list, server_info: dict
) -> dict:
    """Start the processes, run the benchmark, stop them; record URL and exit codes."""
    put_repo_on_pythonpath()
    config = ServeConfig(
        model_dir=model_dir,
        served_model_name=model_dir.name,
        bind=HttpBind(port=0),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        ),
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
    if args.chat:
        num_turns, seed = args.chat_turns, args.seed
        prompts = chat_conversations(
            model_dir, args.num_prompts + 1, args.input_len, num_turns, seed
        )
    else:
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
