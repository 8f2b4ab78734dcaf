"""Reliability soak: many chat completions with random client aborts, watching for leaks.

Starts `switchyard serve --port 0`; --concurrency clients send --requests chat completions (half
streaming; short prompts of varied length; max_tokens 8..64, ignore_eos), request i no earlier
than i x --duration-s / --requests s in (a slow server stretches the run). The client gives up a
random --abort-fraction: closes a stream after k events, or cancels a plain request after a
random delay. Every --sample-interval-s it samples each server process's RSS and /metrics.
With --kill-worker-every S, a random worker process is killed (SIGKILL) about every S seconds
(uniformly 0.5 S to 1.5 S apart), and with --kill-scheduler-too the scheduler is one of the
candidates: `serve` restarts it and its requests continue, so no request may fail for it; RSS
is then tracked per command line, so that a restarted process continues its predecessor's
series.

Exit status 1 unless: every request completed with max_tokens tokens or was aborted as planned;
once idle, nothing runs, waits or holds a KV block; no process's RSS grew over --max-rss-growth
from its baseline (median over the first 10 % of the run after --warmup-requests finished) to
the end (median of the last 3 samples); and the server stopped cleanly.

Example (the issue's soak, about 10 minutes; the JSON goes to benchmarks/results/):
  .venv/bin/python benchmarks/soak.py --requests 2000 --duration-s 600 --concurrency 8
and with worker kills (issue 22):
  .venv/bin/python benchmarks/soak.py --requests 2000 --duration-s 600 --kill-worker-every 60
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from cpu_accounting import CpuWatch
from load_generator import new_client
from serve_bench import code_version, machine_info
from server_process import LaunchedServer
from workload import (
    BenchmarkError,
    docstring_parser,
    run_benchmark,
    split_serve_args,
)

CHAT_PATH = "/v1/chat/completions"
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
WORDS = ("the", "river", "city", "night", "stone", "light", "garden", "engine", "paper", "music")
IDLE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Plan:
    """One request: its JSON body and, when the client gives it up, when (else both None)."""

    body: dict
    abort_after_events: int | None = None  # streaming: close after this many data events
    abort_after_s: float | None = None  # plain: cancel the request after this many seconds


def make_plans(args: argparse.Namespace, model: str) -> list[Plan]:
    """The run's requests, the same for the same --seed."""
    rng = random.Random(args.seed)
    plans = []
    for _ in range(args.requests):
        max_tokens, stream = rng.randint(8, 64), rng.random() < 0.5
        prompt = " ".join(rng.choices(WORDS, k=rng.randint(3, 60)))
        body = {"model": model, "messages": [{"role": "user", "content": prompt}]}
        body |= {"max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
        body |= {"temperature": rng.choice([0.0, 0.8])}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if rng.random() >= args.abort_fraction:
            plans.append(Plan(body))
        elif stream:
            plans.append(Plan(body, abort_after_events=rng.randint(1, max_tokens)))
        else:
            plans.append(Plan(body, abort_after_s=rng.uniform(0.05, 0.06 * max_tokens)))
    return plans


async def send(client: httpx.AsyncClient, plan: Plan) -> str:
    """Send one planned request; never raises. Returns 'completed', 'aborted' (the client gave
    up as planned), or what went wrong ('HTTP 500', an exception's name, ...)."""
    try:
        if plan.body["stream"]:
            return await _send_streaming(client, plan)
        try:
            response = await asyncio.wait_for(
                client.post(CHAT_PATH, json=plan.body), plan.abort_after_s
            )
        except TimeoutError:
            return "aborted"
        if response.status_code != 200:
            return f"HTTP {response.status_code}"
        return _check_usage(response.json().get("usage"), plan)
    except httpx.HTTPError as error:
        return type(error).__name__
    except (ValueError, KeyError, TypeError) as error:
        return f"malformed response ({type(error).__name__})"


async def _send_streaming(client: httpx.AsyncClient, plan: Plan) -> str:
    async with client.stream("POST", CHAT_PATH, json=plan.body) as response:
        if response.status_code != 200:
            return f"HTTP {response.status_code}"
        events, usage = 0, None
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                return _check_usage(usage, plan)
            chunk = json.loads(data)
            if "error" in chunk:
                return f"error event ({chunk['error'].get('type')})"
            usage, events = chunk.get("usage") or usage, events + 1
            if events == plan.abort_after_events:
                return "aborted"  # leaving the block closes the connection mid-stream
    return "stream ended without [DONE]"


def _check_usage(usage: dict | None, plan: Plan) -> str:
    if not usage:
        return "no usage in the response"
    if usage["completion_tokens"] != plan.body["max_tokens"]:
        return "completion_tokens != max_tokens"
    return "completed"


def sample_processes(launcher: psutil.Process, by_command: bool = False) -> dict[str, int]:
    """RSS bytes of the launcher and each descendant, keyed 'TITLE #PID' (title from cmdline),
    or, ``by_command``, by the whole command line (a restarted process keeps its key)."""
    rss = {}
    for process in [launcher, *launcher.children(recursive=True)]:
        try:
            command = " ".join(process.cmdline()).strip()
            key = command if by_command else f"{command[:60]} #{process.pid}"
            rss[key] = process.memory_info().rss
        except psutil.Error:  # exited between listing and reading
            continue
    return rss


def processes_titled(launcher: psutil.Process, *titles: str) -> list[psutil.Process]:
    """The launcher's processes running now whose title starts with one of ``titles``
    (``switchyard-worker``, ``switchyard-scheduler``)."""
    found = []
    for process in launcher.children(recursive=True):
        try:
            title = " ".join(process.cmdline())
        except psutil.Error:
            continue
        if title.startswith(titles):
            found.append(process)
    return found


async def read_gauges(client: httpx.AsyncClient) -> dict[str, float]:
    """The three scheduler gauges from GET /metrics (the first value of each)."""
    text = (await client.get("/metrics")).text
    gauges = {}
    for name in GAUGES:
        match = re.search(rf"^switchyard:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        if match is None:
            raise BenchmarkError(f"/metrics has no switchyard:{name}")
        gauges[name] = float(match[1])
    return gauges


class Soak:
    """One run's outcomes and samples; every method runs on one event loop."""

    def __init__(self, args: argparse.Namespace, launcher_pid: int, base_url: str) -> None:
        self.args, self.launcher = args, psutil.Process(launcher_pid)
        self.metrics_client = new_client(base_url, 1, 30.0)
        self.outcomes: list[str] = []
        self.samples: list[dict] = []
        self.kills: list[dict] = []
        """Each worker kill: when (seconds into the run) and the process's command line."""
        self.start = time.monotonic()

    async def sample(self) -> None:
        """Record one sample: time, requests finished, gauges (None if /metrics failed), RSS."""
        try:
            gauges = await read_gauges(self.metrics_client)
        except httpx.HTTPError:
            gauges = None
        entry = {"t_s": round(time.monotonic() - self.start, 2), "finished": len(self.outcomes)}
        rss = sample_processes(self.launcher, by_command=bool(self.args.kill_worker_every))
        self.samples.append({**entry, "gauges": gauges, "rss": rss})

    async def sample_forever(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.args.sample_interval_s)

    async def kill_workers_forever(self) -> None:
        """SIGKILL a random worker process (or, with --kill-scheduler-too, the scheduler) every
        0.5 to 1.5 x --kill-worker-every seconds."""
        rng = random.Random(self.args.seed + 1)
        period = self.args.kill_worker_every
        titles = ("switchyard-worker", "switchyard-scheduler")
        titles = titles if self.args.kill_scheduler_too else titles[:1]
        while True:
            await asyncio.sleep(rng.uniform(0.5 * period, 1.5 * period))
            victims = processes_titled(self.launcher, *titles)
            if not victims:
                continue  # every one is being restarted
            victim = rng.choice(victims)
            with contextlib.suppress(psutil.Error):
                command = " ".join(victim.cmdline())
                victim.kill()
                self.kills.append({"t_s": round(time.monotonic() - self.start, 2),
                                   "command": command})  # fmt: skip
                print(f"  killed {command[:60]} #{victim.pid}", file=sys.stderr, flush=True)

    async def drive(self, client: httpx.AsyncClient, plans: list[Plan]) -> None:
        """--concurrency clients take the plans in order, each at its paced start time."""
        indices, interval = iter(range(len(plans))), self.args.duration_s / len(plans)

        async def client_loop() -> None:
            for index in indices:  # shared: each plan goes to exactly one client
                await asyncio.sleep(max(0.0, self.start + index * interval - time.monotonic()))
                self.outcomes.append(await send(client, plans[index]))
                if len(self.outcomes) % max(1, len(plans) // 10) == 0:
                    self.print_progress(len(plans))

        await asyncio.gather(*(client_loop() for _ in range(self.args.concurrency)))

    def print_progress(self, total: int) -> None:
        """One stderr line: requests finished, outcomes, and the last sample's RSS in MiB."""
        rss = [
            f"{name.split()[0]} {bytes_ / 2**20:.0f}"
            for name, bytes_ in self.samples[-1]["rss"].items()
        ]
        done = f"{len(self.outcomes)}/{total} at {time.monotonic() - self.start:.0f} s"
        print(f"  {done}: {dict(Counter(self.outcomes))}; RSS {rss}", file=sys.stderr, flush=True)

    async def wait_until_idle(self) -> dict[str, float]:
        """The gauges once all read 0, or as they are after IDLE_TIMEOUT_S."""
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while (gauges := await read_gauges(self.metrics_client)) != dict.fromkeys(GAUGES, 0.0):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        return gauges


async def soak(args: argparse.Namespace, server: LaunchedServer) -> dict:
    """Run the plans against ``server``: the result's measured part (see ``run``)."""
    state = Soak(args, server.process.pid, server.base_url)
    async with (
        new_client(server.base_url, args.concurrency, args.request_timeout) as client,
        state.metrics_client,
    ):
        if key := os.environ.get("SWITCHYARD_API_KEY"):  # the server inherits and requires it
            client.headers["Authorization"] = f"Bearer {key}"
        sampler, cpu_watch = asyncio.create_task(state.sample_forever()), CpuWatch()
        background = [sampler]
        if args.kill_worker_every:
            background.append(asyncio.create_task(state.kill_workers_forever()))
        cpu_watch.start()  # other processes' CPU share tells whether a slow run was disturbed
        await state.drive(client, make_plans(args, server.model))
        cpu, run_s = cpu_watch.stop(), time.monotonic() - state.start
        for task in background:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        idle_gauges = await state.wait_until_idle()
        await state.sample()
    return {
        "run_s": run_s,
        "outcomes": dict(Counter(state.outcomes).most_common()),
        "idle_gauges": idle_gauges,
        "worker_kills": state.kills,
        "cpu_during_run": cpu,
        "rss": rss_growth(state.samples, args.warmup_requests, run_s),
        "samples": state.samples,
    }


def rss_growth(samples: list[dict], warmup_requests: int, run_s: float) -> dict[str, dict]:
    """Per process: baseline RSS (median over the first 10 % of the run after ``warmup_requests``
    finished), end RSS (median of the last 3 samples), and growth, a fraction of the baseline.
    A process missing from the end samples (it exited) has end None and growth None. Empty
    when no sample came after the warm-up."""
    warm = [sample for sample in samples if sample["finished"] >= warmup_requests]
    if not warm:
        return {}
    window = [s for s in warm if s["t_s"] <= warm[0]["t_s"] + 0.1 * run_s] or warm[:1]
    growth = {}
    for name in window[0]["rss"]:
        baseline = statistics.median(s["rss"][name] for s in window if name in s["rss"])
        ends = [s["rss"][name] for s in samples[-3:] if name in s["rss"]]
        end = statistics.median(ends) if len(ends) == 3 else None
        growth[name] = {
            "baseline_mb": baseline / 2**20,
            "end_mb": end and end / 2**20,
            "growth": end and (end - baseline) / baseline,
        }
    return growth


def checks(result: dict, max_rss_growth: float) -> dict[str, str]:
    """Each check's name and its failure ('' when it passed)."""
    failures = {k: v for k, v in result["outcomes"].items() if k not in ("completed", "aborted")}
    leaked = {k: v for k, v in result["idle_gauges"].items() if v != 0}
    rss = result["rss"] or {"no sample after the warm-up": {"growth": None}}
    grown = {n: g["growth"] for n, g in rss.items() if not _within(g["growth"], max_rss_growth)}
    exit_code = result["server"]["exit_code"]
    return {
        "no request failed": f"{sum(failures.values())} failed: {failures}" if failures else "",
        "idle: nothing running, waiting or holding KV blocks": f"{leaked}" if leaked else "",
        f"RSS growth <= {max_rss_growth:.0%}": f"grew or exited: {grown}" if grown else "",
        "server stopped cleanly": f"exit code {exit_code}" if exit_code != 0 else "",
    }


def _within(growth: float | None, limit: float) -> bool:
    return growth is not None and growth <= limit  # None: the process exited


def run(args: argparse.Namespace) -> dict:
    """Serve, soak, stop; the result (what the JSON file holds) with its checks."""
    started = time.time()
    with LaunchedServer(args.model, args.serve_args) as server:
        server_info = {"base_url": server.base_url, "model": server.model}
        server_info["log"] = str(server.log_path)
        measured = asyncio.run(soak(args, server))
    server_info["exit_code"] = server.exit_code()
    config = {key: value for key, value in vars(args).items() if key != "output_json"}
    result = {"started_at": started, "config": config, "machine": machine_info()}
    result |= {"code": code_version(), "server": server_info, **measured}
    return result | {"checks": checks(result, args.max_rss_growth)}


def report(result: dict) -> tuple[str, bool]:
    """The summary printed at the end, and whether every check passed."""
    other_cpu = (result["cpu_during_run"] or {}).get("other_processes_share")
    lines = [
        f"soak of {result['server']['model']}: {sum(result['outcomes'].values())} requests in "
        f"{result['run_s']:.0f} s; outcomes {result['outcomes']}",
        f"gauges once idle: {result['idle_gauges']}",
        f"workers killed: {len(result['worker_kills'])}" if result["worker_kills"] else "",
        f"other processes' share of the CPU during the run: {other_cpu:.0%}" if other_cpu else "",
        "RSS (MiB) baseline -> end, growth:",
    ]
    for name, g in result["rss"].items():
        end = "exited" if g["end_mb"] is None else f"{g['end_mb']:.1f} ({g['growth']:+.1%})"
        lines.append(f"  {name[:60]:<40} {g['baseline_mb']:8.1f} -> {end}")
    for name, failure in result["checks"].items():
        lines.append(f"{'FAIL' if failure else 'ok  '} {name}{': ' + failure if failure else ''}")
    lines.append(f"server log: {result['server']['log']}; JSON: {result['config']['output']}")
    return "\n".join(line for line in lines if line), not any(result["checks"].values())


def build_parser() -> argparse.ArgumentParser:
    parser = docstring_parser(__doc__, 1)
    add = parser.add_argument
    add("--model", help="model directory or .gguf to serve (default: Switchyard's default)")
    add("--serve-args", default="", help='more `switchyard serve` flags: --serve-args="--x y"')
    add("--requests", type=int, default=2000, help="requests in all")
    add("--duration-s", type=float, default=600.0, help="seconds to spread the requests over")
    add("--concurrency", type=int, default=8, help="clients, so most requests in flight")
    add("--abort-fraction", type=float, default=0.2, help="share of requests the client gives up")
    add("--seed", type=int, default=0, help="seed for the requests and aborts")
    add("--warmup-requests", type=int, default=100, help="requests before the RSS baseline")
    add("--sample-interval-s", type=float, default=5.0, help="seconds between samples")
    add("--max-rss-growth", type=float, default=0.10, help="largest RSS growth allowed, a fraction")
    add("--kill-worker-every", type=float, default=0.0, metavar="S",
        help="SIGKILL a random worker about every S seconds (0: never)")  # fmt: skip
    add("--kill-scheduler-too", action="store_true",
        help="with --kill-worker-every, the scheduler is one of the processes killed")  # fmt: skip
    add("--request-timeout", type=float, default=120.0, help="seconds to wait for any byte")
    add("--output", help="JSON result path (default: benchmarks/results/soak-TIMESTAMP.json)")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject bad flags; split --serve-args; settle the --output path (its folder is made)."""
    if min(args.requests, args.concurrency) < 1 or not args.duration_s > 0:
        parser.error("--requests, --concurrency and --duration-s must be positive")
    if not 0 <= args.abort_fraction <= 1:
        parser.error("--abort-fraction must be between 0 and 1")
    if args.kill_worker_every < 0:
        parser.error("--kill-worker-every must be at least 0")
    if args.kill_scheduler_too and not args.kill_worker_every:
        parser.error("--kill-scheduler-too needs --kill-worker-every")
    args.serve_args = split_serve_args(parser, args.serve_args)
    default = Path(__file__).parent / "results" / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    args.output = args.output or str(default)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    args.output_json = args.output  # the name run_benchmark writes to


def main(argv: list[str] | None = None) -> int:
    return run_benchmark("soak", argv, build_parser, check_args, run, report)


if __name__ == "__main__":
    sys.exit(main())
