"""Prefill/decode disaggregation benchmark: how long prompts disturb streams that are decoding.

Runs the same seeded workload against `switchyard serve --port 0` once per mode, one server at
a time: ``hybrid`` (one worker group does prefills and decodes) and ``disaggregated``
(--prefill-workers prefill groups and --decode-workers decode groups on the same cores). In
each: one uncounted warm-up request of each kind; --num-running streams that decode
continuously (random token-id prompts of --running-input-len tokens, max_tokens
--running-output-len, ignore_eos, temperature 0; each stream sends its next request as soon as
one finishes); after --settle-s, --num-long long prompts (--long-input-len tokens, max_tokens
--long-output-len) arriving as a Poisson process with a mean gap of --arrival-interval-s.
The launcher shares the cores out among worker ranks: the hybrid worker computes on all of them,
each disaggregated worker on its share (one of two cores each, with one group of each kind).

Reported per mode: the running streams' inter-token latency (ITL, the gap between text chunks)
whose chunk arrived while a long prompt was in flight (sent, not yet finished), and for
reference while none was (once every stream had its first token, until the last long prompt
finished); the running streams' tokens per second while long prompts were in flight; and the
long prompts' time to first token (TTFT). Chunk arrival times are rebuilt from each request's
send time, TTFT and ITLs.

Examples:
  .venv/bin/python benchmarks/disagg_bench.py --output-json disagg.json
  .venv/bin/python benchmarks/disagg_bench.py --quick

The default run takes a few minutes on 2 cores; --quick is a smoke run of under a minute. Other
processes' share of the CPU during each measurement is printed: above a few percent it distorts
the comparison. Exit status: 0 when every request succeeded and both servers stopped cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys
import time

import httpx
import load_generator
from cpu_accounting import CpuWatch
from load_generator import RequestResult
from metrics import distribution_ms, per_request_records, summarize
from serve_bench import code_version, machine_info
from server_process import LaunchedServer
from workload import (
    DEFAULT_VOCAB_SIZE,
    BenchmarkError,
    check_output_json,
    docstring_parser,
    random_prompts,
    read_model_config,
    resolve_model_dir,
    run_benchmark,
    split_serve_args,
)

MODES = ("hybrid", "disaggregated")
RUNNING_PROMPTS_PER_STREAM = 64
"""Distinct prompts each running stream cycles through (no prefix-cache hits in a run)."""

WORKLOAD_FLAGS = {  # flag: (default, --quick, help)
    "num_running": (4, 2, "streams that decode continuously"),
    "running_input_len": (16, 16, "prompt tokens of a running stream's request"),
    "running_output_len": (128, 64, "max_tokens of a running stream's request"),
    "num_long": (10, 3, "long-prompt requests"),
    "long_input_len": (1024, 512, "prompt tokens of a long-prompt request"),
    "long_output_len": (8, 4, "max_tokens of a long-prompt request"),
    "arrival_interval_s": (5.0, 2.0, "mean seconds between long-prompt arrivals (Poisson)"),
    "settle_s": (3.0, 2.0, "seconds the running streams decode alone before the first arrival"),
}

SentRequest = tuple[float, RequestResult]
"""A request's send time (``time.perf_counter()``) and what the client saw of it."""


def build_parser() -> argparse.ArgumentParser:
    parser = docstring_parser(__doc__, 3)
    parser.add_argument("--model", help="model directory or .gguf (default: Switchyard's default)")
    parser.add_argument(
        "--serve-args",
        default="--max-model-len 2048 --kv-cache-memory 512MiB",
        help="`switchyard serve` flags for both modes (default: %(default)s)",
    )
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES), help="modes to run, in order"
    )
    parser.add_argument("--prefill-workers", type=int, default=1, help="disaggregated mode")
    parser.add_argument("--decode-workers", type=int, default=1, help="disaggregated mode")
    for flag, (default, quick, text) in WORKLOAD_FLAGS.items():
        kind = type(default)
        parser.add_argument(
            f"--{flag.replace('_', '-')}", type=kind, help=f"{text} ({default}; --quick {quick})"
        )
    parser.add_argument("--quick", action="store_true", help="a smaller workload, a smoke run")
    parser.add_argument("--seed", type=int, default=0, help="seed for prompts and arrivals")
    parser.add_argument(
        "--request-timeout", type=float, default=300.0, help="seconds to wait for any chunk"
    )
    parser.add_argument("--output-json", help="write config, results and per-request data here")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill unset workload flags from the defaults (or --quick's); reject bad values."""
    for flag, (default, quick, _) in WORKLOAD_FLAGS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, quick if args.quick else default)
        if not getattr(args, flag) > 0 and flag != "settle_s":
            parser.error(f"--{flag.replace('_', '-')} must be positive")
    if args.settle_s < 0 or min(args.prefill_workers, args.decode_workers) < 1:
        parser.error("--settle-s cannot be negative; --prefill/decode-workers must be at least 1")
    check_output_json(parser, args.output_json)
    args.serve_args = split_serve_args(parser, args.serve_args)


def make_prompts(args: argparse.Namespace, vocab_size: int) -> dict[str, list[list[int]]]:
    """The run's prompts, the same for every mode; the last of each list is its warm-up."""
    num_running = args.num_running * RUNNING_PROMPTS_PER_STREAM + 1
    return {
        "running": random_prompts(num_running, args.running_input_len, vocab_size, args.seed),
        "long": random_prompts(args.num_long + 1, args.long_input_len, vocab_size, args.seed + 1),
    }


async def send(client: httpx.AsyncClient, payload: dict) -> SentRequest:
    sent_at = time.perf_counter()
    return sent_at, await load_generator.stream_completion(client, payload)


async def keep_decoding(
    client: httpx.AsyncClient,
    model: str,
    prompts: list[list[int]],
    output_len: int,
    stop: asyncio.Event,
) -> list[SentRequest]:
    """One running stream: request after request until ``stop`` is set (or one fails)."""
    sent: list[SentRequest] = []
    for prompt in itertools.cycle(prompts):
        sent.append(
            await send(client, load_generator.completion_payload(model, prompt, output_len))
        )
        if stop.is_set() or not sent[-1][1].success:
            break
    return sent


async def send_arrivals(
    client: httpx.AsyncClient, payloads: list[dict], interval_s: float, seed: int
) -> list[SentRequest]:
    """The first payload at once, each next one an exponential gap later (load_generator's
    Poisson arrivals, keeping each send time and without a gap after the last)."""
    gaps = random.Random(seed)
    tasks = []
    for index, payload in enumerate(payloads):
        if index:
            await asyncio.sleep(gaps.expovariate(1 / interval_s))
        tasks.append(asyncio.create_task(send(client, payload)))
    return list(await asyncio.gather(*tasks))


def merged_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``intervals`` sorted, overlapping ones joined."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def split_gaps(
    sent: list[SentRequest], busy: list[tuple[float, float]], quiet_from: float
) -> tuple[list[float], list[float]]:
    """The ITLs of successful requests, split by when their later chunk arrived: inside one of
    the ``busy`` intervals, or else between ``quiet_from`` and the end of the last one."""
    during, quiet = [], []
    for sent_at, result in sent:
        if not result.success:
            continue
        arrived = sent_at + result.time_to_first_token
        for gap in result.inter_token_latencies:
            arrived += gap
            if any(start <= arrived < end for start, end in busy):
                during.append(gap)
            elif quiet_from <= arrived < busy[-1][1]:
                quiet.append(gap)
    return during, quiet


async def warm_up(
    client: httpx.AsyncClient, model: str, args: argparse.Namespace, prompts: dict
) -> None:
    """One short and one long request, uncounted (first steps, KV transfer path)."""
    for kind, output_len in (("running", 8), ("long", args.long_output_len)):
        payload = load_generator.completion_payload(model, prompts[kind][-1], output_len)
        result = await load_generator.stream_completion(client, payload)
        if not result.success:
            raise BenchmarkError(f"the {kind} warm-up request failed: {result.error}")


async def measure(args: argparse.Namespace, server: LaunchedServer, prompts: dict) -> dict:
    """The workload against one server: what the client saw, and the CPU taken meanwhile."""
    num_connections = args.num_running + args.num_long
    async with load_generator.new_client(
        server.base_url, num_connections, args.request_timeout
    ) as client:
        await warm_up(client, server.model, args, prompts)
        cpu_watch, stop = CpuWatch(), asyncio.Event()
        cpu_watch.start()
        measure_start = time.perf_counter()
        streams = [
            keep_decoding(
                client,
                server.model,
                prompts["running"][index : -1 : args.num_running],
                args.running_output_len,
                stop,
            )
            for index in range(args.num_running)
        ]
        running_task = asyncio.gather(*streams)
        await asyncio.sleep(args.settle_s)
        payloads = [
            load_generator.completion_payload(server.model, prompt, args.long_output_len)
            for prompt in prompts["long"][:-1]
        ]
        print(f"  {len(payloads)} long prompts arriving", file=sys.stderr, flush=True)
        long_sent = await send_arrivals(client, payloads, args.arrival_interval_s, args.seed)
        stop.set()  # the running streams finish the requests they are in, then stop
        streams_sent = await running_task
        cpu = cpu_watch.stop()
    measured_s = time.perf_counter() - measure_start
    return summarize_mode(streams_sent, long_sent, measured_s) | {"cpu": cpu}


def summarize_mode(
    streams: list[list[SentRequest]], long_sent: list[SentRequest], measured_s: float
) -> dict:
    """The numbers of one mode; which ITLs count as during arrivals and which as quiet is in
    the module docstring."""
    first_requests = [stream[0] for stream in streams]
    all_decoding = max(sent_at + result.time_to_first_token for sent_at, result in first_requests)
    busy = merged_intervals([(sent_at, sent_at + result.latency) for sent_at, result in long_sent])
    running = [request for stream in streams for request in stream]
    during, quiet = split_gaps(running, busy, all_decoding)
    busy_s = sum(end - start for start, end in busy)
    long_results = [result for _, result in long_sent]
    running_results = [result for _, result in running]
    return {
        "long": summarize(long_results, busy[-1][1] - busy[0][0]),
        "running": summarize(running_results, measured_s),
        "itl_during_arrivals_ms": distribution_ms(during),
        "itl_quiet_ms": distribution_ms(quiet),
        "long_in_flight_s": busy_s,
        "running_tokens_per_s_during_arrivals": len(during) / busy_s,
        "requests": {
            "long": per_request_records(long_results),
            "running": per_request_records(running_results),
        },
    }


def serve_args_for(mode: str, args: argparse.Namespace) -> list[str]:
    if mode == "hybrid":
        return args.serve_args
    workers = ["--prefill-workers", str(args.prefill_workers)]
    return [*args.serve_args, *workers, "--decode-workers", str(args.decode_workers)]


def run_mode(mode: str, args: argparse.Namespace, prompts: dict) -> dict:
    """Start the server for ``mode``, measure, stop it (SIGTERM, then wait)."""
    print(f"== {mode}", file=sys.stderr, flush=True)
    serve_args = serve_args_for(mode, args)
    with LaunchedServer(args.model, serve_args) as server:
        server_info = {"base_url": server.base_url, "model": server.model}
        server_info |= {"log": str(server.log_path), "serve_args": serve_args}
        measured = asyncio.run(measure(args, server, prompts))
    return measured | {"server": server_info | {"exit_code": server.exit_code()}}


def run(args: argparse.Namespace) -> dict:
    model_dir = resolve_model_dir(args.model)
    vocab_size = read_model_config(model_dir).get("vocab_size", DEFAULT_VOCAB_SIZE)
    prompts = make_prompts(args, vocab_size)
    started = time.time()
    modes = {mode: run_mode(mode, args, prompts) for mode in args.modes}
    config = {key: value for key, value in vars(args).items() if key != "output_json"}
    return {
        "started_at": started,
        "config": config | {"model_dir": str(model_dir), "vocab_size": vocab_size},
        "machine": machine_info(),
        "code": code_version(),
        "modes": modes,
    }


def report(result: dict) -> tuple[str, bool]:
    """A markdown table, one row per mode, then failures and server logs."""
    config = result["config"]
    lines = [
        f"{config['num_running']} running streams ({config['running_input_len']} prompt / "
        f"{config['running_output_len']} output tokens), {config['num_long']} long prompts "
        f"({config['long_input_len']} / {config['long_output_len']}) every "
        f"{config['arrival_interval_s']:g} s on average; {result['machine']['nproc']} cores",
        "",
        "| mode | ITL p50 (ms) | ITL p99 (ms) | TTFT p50 (ms) | TTFT p99 (ms) | TTFT mean (ms) "
        "| quiet ITL p50 (ms) | running tok/s | failed | other processes' CPU |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    notes, succeeded = [], True
    for mode, measured in result["modes"].items():
        itl, ttft = measured["itl_during_arrivals_ms"], measured["long"]["ttft_ms"]
        failed = measured["long"]["failed"] + measured["running"]["failed"]
        other = (measured["cpu"] or {}).get("other_processes_share")
        cells = [itl["median"], itl["p99"], ttft["median"], ttft["p99"], ttft["mean"]]
        cells += [measured["itl_quiet_ms"]["median"]]
        cells += [measured["running_tokens_per_s_during_arrivals"]]
        row = [mode, *(_number(cell) for cell in cells), str(failed), _percent(other)]
        lines.append("| " + " | ".join(row) + " |")
        for kind in ("long", "running"):
            errors = measured[kind]["errors"].items()
            notes += [f"{mode}, {kind}: {count} x {error}" for error, count in errors]
        server = measured["server"]
        if server["exit_code"] != 0:
            notes.append(f"{mode}: the server exited with code {server['exit_code']}")
        notes.append(f"{mode} server log: {server['log']}")
        succeeded &= failed == 0 and server["exit_code"] == 0
    return "\n".join([*lines, "", *notes]), succeeded


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _percent(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{fraction * 100:.1f} %"


def main(argv: list[str] | None = None) -> int:
    return run_benchmark("disagg_bench", argv, build_parser, check_args, run, report)


if __name__ == "__main__":
    sys.exit(main())
