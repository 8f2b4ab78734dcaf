"""benchmarks/serve_bench.py: requests sample as --temperature and --top-p say (greedy by
default), out-of-range values (and the greedy transformers baseline beside sampled requests)
are refused by name, and a launched run on the tiny model completes every request and names
its sampling in the report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.benchmark_scripts import BENCHMARKS, import_scripts

load_generator, serve_bench = import_scripts("load_generator", "serve_bench")


def _script(*flags: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / "serve_bench.py"), *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_requests_sample_as_asked_and_greedily_by_default():
    parser = serve_bench.build_parser()
    greedy = parser.parse_args(["--launch"])
    sampled = parser.parse_args(["--launch", "--temperature", "1", "--top-p", "0.95"])
    payload = load_generator.completion_payload("m", [1, 2], 4, greedy.temperature, greedy.top_p)
    assert payload["temperature"] == 0 and "top_p" not in payload
    payload = load_generator.completion_payload("m", [1, 2], 4, sampled.temperature, sampled.top_p)
    assert (payload["temperature"], payload["top_p"]) == (1.0, 0.95)


def test_sampling_it_cannot_run_is_refused_by_name():
    refused = (
        (["--top-p", "1.5"], "--top-p"),
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "1", "--baseline"], "--baseline decodes greedily"),
    )
    for flags, name in refused:
        completed = _script("--launch", *flags)
        assert completed.returncode == 2 and name in completed.stderr, completed.stderr


@pytest.mark.slow
def test_a_sampled_run_completes_and_its_report_names_the_sampling(tiny_llama_dir, tmp_path):
    output = tmp_path / "run.json"
    completed = _script(
        *("--launch", "--model-path", str(tiny_llama_dir)),
        *("--num-prompts", "6", "--concurrency", "3", "--input-len", "16", "--output-len", "5"),
        *("--temperature", "1", "--top-p", "0.9", "--output-json", str(output)),
        timeout=300,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "temperature 1, top-p 0.9" in completed.stdout
    result = json.loads(output.read_text())
    assert (result["config"]["temperature"], result["config"]["top_p"]) == (1.0, 0.9)
    assert result["serving"]["completed"] == 6 and result["serving"]["failed"] == 0
    assert result["serving"]["total_output_tokens"] == 6 * 5
