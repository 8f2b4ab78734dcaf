"""Serving benchmark for Switchyard's OpenAI endpoint, in the manner of vLLM's benchmark_serving.

Sends --num-prompts streaming completions of random token-id prompts (exactly
--input-len tokens, ids in [100, vocab size)) with max_tokens=--output-len, ignore_eos,
greedy unless --temperature and --top-p say otherwise, at most --concurrency at a time, and
reports throughput and TTFT / TPOT / ITL / end-to-end latency. One warm-up request (greedy) is
sent first and not counted.

--baseline and --roofline run first, each in a child process and before the server is
started, so nothing competes for the cores: the transformers static-batch baseline on the same
prompts and model directory, and this machine's GEMM and memory-bandwidth peaks.

Examples:
  python benchmarks/serve_bench.py --launch --concurrency 16 --num-prompts 64 --baseline --roofline
  python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 --concurrency 1 --seed 7

Against a long-running server with prefix caching, change --seed between runs: the same seed
sends the same prompts. Exit status: 0 when every request succeeded, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import load_generator
from cpu_accounting import CpuWatch
from metrics import per_request_records, summarize
from report import comparison, format_report
from server_process import LaunchedServer
from workload import (
    DEFAULT_VOCAB_SIZE,
    BenchmarkError,
    add_sampling_arguments,
    check_output_json,
    check_sampling_arguments,
    docstring_parser,
    num_cores,
    random_prompts,
    read_model_config,
    resolve_model_dir,
    run_benchmark,
    split_serve_args,
)

HERE = Path(__file__).resolve().parent


def build_parser() -> argparse.ArgumentParser:
    parser = docstring_parser(__doc__, 2)
    server = parser.add_mutually_exclusive_group(required=True)
    server.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000")
    server.add_argument(
        "--launch", action="store_true", help="start `switchyard serve --port 0` for this run"
    )
    parser.add_argument("--model", help="served model name (default: GET /v1/models)")
    parser.add_argument(
        "--model-path",
        help="model directory or .gguf: what --launch serves and what --baseline/--roofline "
        "load (default: Switchyard's default model, or the served model's local directory)",
    )
    parser.add_argument(
        "--serve-args",
        default="",
        help='extra `switchyard serve` flags: --serve-args="--flag value"',
    )
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests in all")
    parser.add_argument("--concurrency", type=int, default=16, help="most requests in flight")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for prompts and arrivals")
    add_sampling_arguments(parser)
    parser.add_argument(
        "--vocab-size",
        type=int,
        help=f"prompt ids < this (default: the model's config.json, else {DEFAULT_VOCAB_SIZE})",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=300.0, help="seconds to wait for any chunk"
    )
    parser.add_argument("--baseline", action="store_true", help="run the transformers baseline")
    parser.add_argument("--roofline", action="store_true", help="measure GEMM and bandwidth")
    parser.add_argument("--output-json", help="write config, results and per-request data here")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in ("input_len", "output_len", "num_prompts", "concurrency"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if not args.request_rate > 0:
        parser.error("--request-rate must be positive (inf: send all at once)")
    if args.vocab_size is not None and args.vocab_size <= 100:
        parser.error("--vocab-size must be above 100 (ids below 100 are left to special tokens)")
    check_sampling_arguments(parser, args)
    if args.baseline and args.temperature > 0:
        parser.error("--baseline decodes greedily: run it without --temperature")
    check_output_json(parser, args.output_json)
    args.serve_args = split_serve_args(parser, args.serve_args)
    if args.base_url:  # accept the OpenAI client's form, http://host:port/v1, too
        args.base_url = args.base_url.rstrip("/").removesuffix("/v1")


def run_child(script: str, child_args: list[str]) -> dict:
    """Run ``benchmarks/SCRIPT`` in a child; its output goes to stderr, its JSON is returned."""
    with tempfile.TemporaryDirectory() as folder:
        json_path = Path(folder) / "result.json"
        argv = [sys.executable, str(HERE / script), *child_args, "--output-json", str(json_path)]
        print(f"running: {script} {' '.join(child_args)}", file=sys.stderr, flush=True)
        cpu_watch = CpuWatch()
        cpu_watch.start()
        completed = subprocess.run(argv, stdout=sys.stderr, check=False)
        cpu = cpu_watch.stop()
        if completed.returncode != 0 or not json_path.is_file():
            raise BenchmarkError(f"{script} failed with exit status {completed.returncode}")
        return {**json.loads(json_path.read_text()), "cpu_during_run": cpu}


def run_before_server(args: argparse.Namespace, model_dir: Path, vocab_size: int) -> dict:
    """The baseline and roofline measurements asked for (None for those not asked)."""
    measured: dict[str, dict | None] = {"baseline": None, "roofline": None}
    if args.baseline:
        workload_flags = {
            "--model-path": model_dir,
            "--batch-size": args.concurrency,
            "--input-len": args.input_len,
            "--output-len": args.output_len,
            "--num-prompts": args.num_prompts,
            "--seed": args.seed,
            "--vocab-size": vocab_size,
        }
        child_args = [str(part) for flag in workload_flags.items() for part in flag]
        measured["baseline"] = run_child("hf_baseline.py", child_args)
    if args.roofline:
        measured["roofline"] = run_child("roofline.py", ["--model-path", str(model_dir)])
    return measured


async def benchmark(args: argparse.Namespace, base_url: str, prompts: list[list[int]]) -> dict:
    """Warm up with the last prompt, then send the others; return the run's numbers.

    With ``--launch`` the server is this process's child, so the CPU other processes took during
    the run can be told apart from the benchmark's own (``cpu``; None with ``--base-url``).
    """
    cpu_watch = CpuWatch() if args.launch else None
    async with load_generator.new_client(
        base_url, args.concurrency, args.request_timeout
    ) as client:
        model = args.model or (await load_generator.served_model(client))["id"]
        warm_up = load_generator.completion_payload(model, prompts[-1], min(args.output_len, 8))
        first = await load_generator.stream_completion(client, warm_up)
        if not first.success:
            raise BenchmarkError(f"the warm-up request to {base_url} failed: {first.error}")
        payloads = [
            load_generator.completion_payload(
                model, prompt, args.output_len, args.temperature, args.top_p
            )
            for prompt in prompts[:-1]
        ]
        print(f"benchmarking {base_url}: {len(payloads)} requests", file=sys.stderr, flush=True)
        if cpu_watch:
            cpu_watch.start()
        results, duration = await load_generator.run_load(
            client, payloads, args.concurrency, args.request_rate, args.seed
        )
    return {
        "model": model,
        "cpu": cpu_watch.stop() if cpu_watch else None,
        "summary": summarize(results, duration),
        "requests": per_request_records(results),
    }


async def served_model_dir(base_url: str) -> Path | None:
    """The running server's model directory when it is on this machine (``root`` in /v1/models)."""
    async with load_generator.new_client(base_url, 1, 30.0) as client:
        root = (await load_generator.served_model(client)).get("root")
    return Path(root) if root and (Path(root) / "config.json").is_file() else None


def model_dir_for(args: argparse.Namespace) -> Path | None:
    """Where the model's config.json and weights are, when this run needs or can know them."""
    if args.model_path is not None or args.launch:
        return resolve_model_dir(args.model_path)
    model_dir = asyncio.run(served_model_dir(args.base_url))  # also: is the server reachable?
    if model_dir is None and (args.baseline or args.roofline):
        return resolve_model_dir(None)
    return model_dir


def machine_info() -> dict:
    return {
        "nproc": num_cores(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch_version": _version("torch"),
        "transformers_version": _version("transformers"),
    }


def code_version() -> dict:
    """The commit the server runs and the files changed since (the tree may be mid-edit)."""

    def git(*git_args: str) -> str:
        try:
            completed = subprocess.run(
                ["git", *git_args], cwd=HERE, capture_output=True, text=True, check=False
            )
        except OSError:  # no git here
            return ""
        return completed.stdout

    return {
        "commit": git("rev-parse", "HEAD").strip(),
        "changed": git("status", "--porcelain").splitlines(),
    }


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def serve_and_benchmark(
    args: argparse.Namespace, prompts: list[list[int]], server_info: dict
) -> dict:
    """Run the benchmark against the given or launched server; add what is known to
    ``server_info`` (URL; for a launched server its log and exit code after SIGTERM)."""
    if not args.launch:
        server_info["base_url"] = args.base_url
        return asyncio.run(benchmark(args, args.base_url, prompts))
    with LaunchedServer(args.model_path, args.serve_args) as server:
        server_info.update(base_url=server.base_url, log=str(server.log_path))
        run_result = asyncio.run(benchmark(args, server.base_url, prompts))
    server_info["exit_code"] = server.exit_code()
    return run_result


def run(args: argparse.Namespace) -> dict:
    model_dir = model_dir_for(args)
    vocab_size = args.vocab_size or (
        read_model_config(model_dir).get("vocab_size", DEFAULT_VOCAB_SIZE)
        if model_dir
        else DEFAULT_VOCAB_SIZE
    )
    machine = machine_info()
    measured = run_before_server(args, model_dir, vocab_size) if model_dir else {}
    prompts = random_prompts(args.num_prompts + 1, args.input_len, vocab_size, args.seed)
    server_info = {
        "launched": args.launch,
        "model_dir": str(model_dir) if model_dir else None,
        "vocab_size": vocab_size,
    }
    started = time.time()
    run_result = serve_and_benchmark(args, prompts, server_info)
    server_info["model"] = run_result["model"]
    config = {key: value for key, value in vars(args).items() if key != "output_json"}
    config["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    result = {
        "started_at": started,
        "config": config,
        "machine": machine,
        "code": code_version(),
        "server": server_info,
        "serving": run_result["summary"],
        "cpu_during_run": run_result["cpu"],
        "roofline": measured.get("roofline"),
        "baseline": measured.get("baseline"),
    }
    result["comparison"] = comparison(result)
    result["requests"] = run_result["requests"]
    return result


def main(argv: list[str] | None = None) -> int:
    return run_benchmark("serve_bench", argv, build_parser, check_args, run, report)


def report(result: dict) -> tuple[str, bool]:
    return format_report(result), result["serving"]["failed"] == 0


if __name__ == "__main__":
    sys.exit(main())
