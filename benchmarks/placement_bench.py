"""Placement benchmark: cache-aware against least-loaded placement over two hybrid worker groups.

For each of --policies, one server at a time, `switchyard serve --port 0 --data-parallel-size 2
--placement POLICY` plus --serve-args runs the same seeded traces, once the server is ready
(`switchyard serve` is ready only when both groups serve) and one uncounted warm-up request per
group (random token ids, sent together so that each group gets one) has finished:

1. multi-turn chat: --sessions sessions of --turns turns each, all sharing one system prompt of
   about --system-tokens tokens; each user turn is about --user-tokens tokens of fresh words
   (random English words, seeded, fitted with the model's tokenizer.json). Sessions run
   concurrently: a session sends its next turn, with the previous answer appended as an
   assistant message, a think time after the previous turn finished (exponential with mean
   --think-time-s, seeded: a user reads the answer and types; 0 makes the sessions
   closed-loop, where the group a turn just left is the least loaded one when its session's
   next turn arrives, so least-loaded keeps each session on one group by accident); session i
   starts i x --stagger-s seconds in, so that not every first turn arrives at the same
   instant. A turn that fails ends its session (its later turns count as failed, unsent).
2. no shared prefix: --no-prefix-requests (default: as many as the chat has turns)
   /v1/completions of random token ids (ids in [100, vocab), a different prompt each), each
   of the mean prompt length the first policy's multi-turn trace had (server-counted), at
   concurrency --sessions, closed-loop.

Every request streams --output-tokens tokens with ignore_eos at temperature 0. During the
multi-turn trace /metrics is sampled every --sample-interval-s for each group's running
requests (switchyard:num_requests_running_by_group): reported are the mean per group, the
larger mean over the smaller, and the share of balanced samples. A sample is balanced when the
most loaded group runs at most 1.5 times the requests of the least loaded one; when the least
loaded runs none, when the most loaded runs at most 2 (so both idle counts as balanced). The
prefix-cache hit rate, overall and per group, is the change of hits over the change of
queries across each trace.

Compared (the acceptance of the placement issue): cache-aware's multi-turn median TTFT
against least-loaded's (target: at least 30 % lower), its no-prefix median TTFT (target: at
most 5 % higher), and its groups' running balance under the hot prefix (target: the larger
mean at most 1.5 times the smaller).

Examples:
  .venv/bin/python benchmarks/placement_bench.py
  .venv/bin/python benchmarks/placement_bench.py --sessions 4 --turns 2 --system-tokens 128 \\
      --output-tokens 8 --output-json -

Other processes' share of the CPU during each trace is printed: above a few percent it distorts
the comparison. Exit status: 0 when every request succeeded and every server stopped cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import httpx
import load_generator
from cpu_accounting import CpuWatch
from load_generator import RequestResult
from metrics import per_request_records
from placement_report import (
    COUNTERS,
    NUM_GROUPS,
    POLICIES,
    balance,
    compare,
    counter_changes,
    report,
    trace_summary,
)
from prometheus_client.parser import text_string_to_metric_families
from serve_bench import code_version, machine_info
from server_process import LaunchedServer
from workload import (
    DEFAULT_VOCAB_SIZE,
    BenchmarkError,
    check_output_json,
    docstring_parser,
    random_prompts,
    random_words,
    read_model_config,
    resolve_model_dir,
    run_benchmark,
    split_serve_args,
)

RESULTS = Path(__file__).resolve().parent / "results"

RUNNING = "switchyard:num_requests_running_by_group"
WAITING = "switchyard:num_requests_waiting_by_group"
SCRAPED = (RUNNING, WAITING, *COUNTERS)

TRACE_FLAGS = {  # flag: (default, help)
    "sessions": (32, "chat sessions, run concurrently (also the no-prefix concurrency)"),
    "turns": (6, "user turns per session"),
    "system_tokens": (1024, "tokens of the system prompt all sessions share"),
    "user_tokens": (100, "tokens of each user turn"),
    "output_tokens": (64, "tokens generated per request (ignore_eos)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = docstring_parser(__doc__, 4)
    parser.add_argument("--model", help="model directory or .gguf (default: Switchyard's default)")
    parser.add_argument(
        "--serve-args", default="", help='extra `switchyard serve` flags: --serve-args="--flag v"'
    )
    parser.add_argument(
        "--policies", nargs="+", choices=POLICIES, default=list(POLICIES), help="in this order"
    )
    for flag, (default, text) in TRACE_FLAGS.items():
        parser.add_argument(f"--{flag.replace('_', '-')}", type=int, default=default, help=text)
    parser.add_argument("--stagger-s", type=float, default=0.1, help="between session starts")
    parser.add_argument(
        "--think-time-s", type=float, default=5.0, help="mean pause before a session's next turn"
    )
    parser.add_argument(
        "--no-prefix-requests", type=int, help="requests of the no-prefix trace (default: turns)"
    )
    parser.add_argument("--sample-interval-s", type=float, default=0.5, help="/metrics sampling")
    parser.add_argument("--seed", type=int, default=0, help="seed for both traces")
    parser.add_argument(
        "--request-timeout", type=float, default=300.0, help="seconds to wait for any chunk"
    )
    parser.add_argument(
        "--output-json",
        help="write config, results and per-request data here ('-': stdout; "
        "default: benchmarks/results/placement-YYYYMMDD.json)",
    )
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in TRACE_FLAGS:
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.stagger_s < 0 or args.think_time_s < 0 or not args.sample_interval_s > 0:
        parser.error(
            "--stagger-s and --think-time-s cannot be negative; --sample-interval-s must be "
            "positive"
        )
    if args.no_prefix_requests is not None and args.no_prefix_requests < 1:
        parser.error("--no-prefix-requests must be at least 1")
    if args.output_json is None:
        RESULTS.mkdir(exist_ok=True)
        day = datetime.now(timezone.utc).strftime("%Y%m%d")
        args.output_json = str(RESULTS / f"placement-{day}.json")
    check_output_json(parser, args.output_json)
    args.serve_args = split_serve_args(parser, args.serve_args)
    for flag in ("--placement", "--data-parallel-size"):
        if any(arg.split("=")[0] == flag for arg in args.serve_args):
            parser.error(f"--serve-args: the benchmark sets {flag} itself")


def token_counter(model_dir: Path) -> Callable[[str], int] | None:
    """The model's tokenizer as a count of a text's tokens; None without a tokenizer.json."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer  # the API server's tokenizer library (no torch)

    tokenizer = Tokenizer.from_file(str(path))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def make_chat_trace(args: argparse.Namespace, count_tokens: Callable[[str], int] | None) -> dict:
    """The system prompt and every session's user turns, the same for every policy; with the
    tokenizer's count of each (None without one)."""
    rng = random.Random(args.seed)
    system = random_words(rng, args.system_tokens, count_tokens)
    turns = [
        [random_words(rng, args.user_tokens, count_tokens) for _ in range(args.turns)]
        for _ in range(args.sessions)
    ]
    user_counts = (
        [count_tokens(text) for session in turns for text in session] if count_tokens else []
    )
    mean = args.think_time_s
    think_times = [
        [rng.expovariate(1 / mean) if mean else 0.0 for _ in range(args.turns - 1)]
        for _ in range(args.sessions)
    ]
    return {
        "system": system,
        "turns": turns,
        "think_times": think_times,
        "system_tokens": count_tokens(system) if count_tokens else None,
        "mean_user_tokens": sum(user_counts) / len(user_counts) if user_counts else None,
    }


async def chat_session(
    client: httpx.AsyncClient,
    model: str,
    system: str,
    turns: list[str],
    output_tokens: int,
    delay_s: float,
    think_times: list[float],
) -> list[RequestResult]:
    """One session's turns in order, each answer appended before the next turn, which waits
    its think time."""
    await asyncio.sleep(delay_s)
    messages = [{"role": "system", "content": system}]
    results: list[RequestResult] = []
    for index, user_text in enumerate(turns):
        if results and not results[-1].success:
            results.append(RequestResult(error="not sent: an earlier turn of its session failed"))
            continue
        if index:
            await asyncio.sleep(think_times[index - 1])
        messages.append({"role": "user", "content": user_text})
        payload = load_generator.chat_payload(model, messages, output_tokens)
        results.append(await load_generator.stream_completion(client, payload))
        messages.append({"role": "assistant", "content": results[-1].text})
    return results


def parse_series(text: str, names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """``names``' values in a /metrics page: name -> {its ``group`` label ('' for none): value}.
    Names are the samples' (a counter's end in ``_total``); ``ValueError`` for a page that is
    not the Prometheus text format."""
    found: dict[str, dict[str, float]] = {name: {} for name in names}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name][sample.labels.get("group", "")] = sample.value
    return found


async def scrape(client: httpx.AsyncClient) -> dict[str, dict[str, float]]:
    """``SCRAPED`` from the server's /metrics; ``BenchmarkError`` when it does not answer or its
    page does not parse."""
    try:
        response = await client.get("/metrics")
        response.raise_for_status()
        return parse_series(response.text, SCRAPED)
    except (httpx.HTTPError, ValueError) as error:
        raise BenchmarkError(f"GET /metrics failed: {error!r}") from None


async def sample_groups(
    client: httpx.AsyncClient, interval_s: float, stop: asyncio.Event
) -> list[dict]:
    """Each group's running and waiting requests every ``interval_s`` until ``stop`` is set (a
    failed scrape is skipped)."""
    samples, start = [], time.perf_counter()
    while not stop.is_set():
        with contextlib.suppress(BenchmarkError):
            series = await scrape(client)
            elapsed = round(time.perf_counter() - start, 3)
            samples.append({"t_s": elapsed, "running": series[RUNNING], "waiting": series[WAITING]})
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
    return samples


async def warm_up(client: httpx.AsyncClient, model: str, vocab_size: int, seed: int) -> None:
    """One short request per group, sent together (either policy spreads them out)."""
    prompts = random_prompts(NUM_GROUPS, 16, vocab_size, seed + 2)
    payloads = [load_generator.completion_payload(model, prompt, 4) for prompt in prompts]
    sent = [load_generator.stream_completion(client, payload) for payload in payloads]
    for result in await asyncio.gather(*sent):
        if not result.success:
            raise BenchmarkError(f"a warm-up request failed: {result.error}")


async def chat_trace(
    client: httpx.AsyncClient,
    metrics_client: httpx.AsyncClient,
    model: str,
    trace: dict,
    args: argparse.Namespace,
) -> dict:
    """The multi-turn trace, with the groups sampled meanwhile."""
    before, stop, cpu_watch = await scrape(metrics_client), asyncio.Event(), CpuWatch()
    sampler = asyncio.create_task(sample_groups(metrics_client, args.sample_interval_s, stop))
    cpu_watch.start()
    start = time.perf_counter()
    sessions = [
        chat_session(
            client,
            model,
            trace["system"],
            turns,
            args.output_tokens,
            index * args.stagger_s,
            trace["think_times"][index],
        )
        for index, turns in enumerate(trace["turns"])
    ]
    results = [result for session in await asyncio.gather(*sessions) for result in session]
    duration_s, cpu = time.perf_counter() - start, cpu_watch.stop()
    stop.set()
    samples = await sampler
    return {
        "summary": trace_summary(results, duration_s),
        "balance": balance(samples),
        "counters": counter_changes(before, await scrape(metrics_client)),
        "cpu": cpu,
        "samples": samples,
        "requests": per_request_records(results),
    }


async def no_prefix_trace(
    client: httpx.AsyncClient,
    metrics_client: httpx.AsyncClient,
    model: str,
    prompts: list[list[int]],
    args: argparse.Namespace,
) -> dict:
    """The random-token-id trace, closed-loop at concurrency --sessions."""
    payloads = [load_generator.completion_payload(model, p, args.output_tokens) for p in prompts]
    before, cpu_watch = await scrape(metrics_client), CpuWatch()
    cpu_watch.start()
    results, duration_s = await load_generator.run_load(
        client, payloads, args.sessions, float("inf"), args.seed
    )
    cpu = cpu_watch.stop()
    return {
        "summary": trace_summary(results, duration_s) | {"input_len": len(prompts[0])},
        "counters": counter_changes(before, await scrape(metrics_client)),
        "cpu": cpu,
        "requests": per_request_records(results),
    }


async def measure(
    args: argparse.Namespace,
    server: LaunchedServer,
    trace: dict,
    vocab_size: int,
    input_len: int | None,
) -> dict:
    """Both traces against one server. The no-prefix prompts have ``input_len`` tokens, or,
    when None, the mean prompt length of this server's multi-turn trace."""
    timeout = args.request_timeout
    async with (
        load_generator.new_client(server.base_url, args.sessions, timeout) as client,
        load_generator.new_client(server.base_url, 1, 30.0) as metrics_client,
    ):
        await warm_up(client, server.model, vocab_size, args.seed)
        print(f"  multi-turn: {args.sessions} x {args.turns} turns", file=sys.stderr, flush=True)
        multi_turn = await chat_trace(client, metrics_client, server.model, trace, args)
        mean_len = multi_turn["summary"]["mean_prompt_tokens"]
        input_len = input_len or round(mean_len or args.system_tokens)
        num_requests = args.no_prefix_requests or args.sessions * args.turns
        print(f"  no prefix: {num_requests} x {input_len} tokens", file=sys.stderr, flush=True)
        prompts = random_prompts(num_requests, input_len, vocab_size, args.seed + 1)
        no_prefix = await no_prefix_trace(client, metrics_client, server.model, prompts, args)
    return {"multi_turn": multi_turn, "no_prefix": no_prefix}


def run_policy(
    policy: str, args: argparse.Namespace, trace: dict, vocab_size: int, input_len: int | None
) -> dict:
    """Start the server for ``policy``, run both traces, stop it (SIGTERM, then wait)."""
    print(f"== {policy}", file=sys.stderr, flush=True)
    serve_args = ["--data-parallel-size", str(NUM_GROUPS), "--placement", policy]
    serve_args += args.serve_args
    with LaunchedServer(args.model, serve_args) as server:
        server_info = {"base_url": server.base_url, "model": server.model}
        server_info |= {"log": str(server.log_path), "serve_args": serve_args}
        measured = asyncio.run(measure(args, server, trace, vocab_size, input_len))
    return measured | {"server": server_info | {"exit_code": server.exit_code()}}


def run(args: argparse.Namespace) -> dict:
    model_dir = resolve_model_dir(args.model)
    vocab_size = read_model_config(model_dir).get("vocab_size", DEFAULT_VOCAB_SIZE)
    trace = make_chat_trace(args, token_counter(model_dir))
    started = time.time()
    policies: dict[str, dict] = {}
    input_len = None  # the first policy's mean multi-turn prompt, for every policy
    for policy in args.policies:
        policies[policy] = run_policy(policy, args, trace, vocab_size, input_len)
        input_len = policies[policy]["no_prefix"]["summary"]["input_len"]
    config = {key: value for key, value in vars(args).items() if key != "output_json"}
    trace_info = {key: value for key, value in trace.items() if key not in ("system", "turns")}
    return {
        "started_at": started,
        "config": config | {"model_dir": str(model_dir), "vocab_size": vocab_size},
        "trace": trace_info | {"no_prefix_input_len": input_len},
        "machine": machine_info(),
        "code": code_version(),
        "policies": policies,
        "comparison": compare(policies),
    }


def main(argv: list[str] | None = None) -> int:
    return run_benchmark("placement_bench", argv, build_parser, check_args, run, report)


if __name__ == "__main__":
    sys.exit(main())
