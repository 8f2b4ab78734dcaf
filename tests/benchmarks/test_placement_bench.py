"""benchmarks/placement_bench.py and placement_report.py: the traces, the reading of /metrics,
the balance rule and the comparison exactly, and one small run against the tiny model."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest

from tests.support.benchmark_scripts import import_scripts

placement_bench, placement_report, workload = import_scripts(
    "placement_bench", "placement_report", "workload"
)

METRICS_PAGE = """\
# HELP switchyard:prefix_cache_hits_total Prompt tokens found cached.
# TYPE switchyard:prefix_cache_hits_total counter
switchyard:prefix_cache_hits_total{model_name="m"} 96.0
switchyard:prefix_cache_queries_total{model_name="m"} 200.0
switchyard:num_requests_running{model_name="m"} 5.0
switchyard:num_preemptions_total{model_name="m"} 7.0
switchyard:num_requests_running_by_group{group="hybrid-0",model_name="m",role="hybrid"} 3.0
switchyard:num_requests_running_by_group{group="hybrid-1",model_name="m",role="hybrid"} 2.0
switchyard:prefix_cache_hits_by_group_total{group="hybrid-0",model_name="m",role="hybrid"} 64.0
switchyard:prefix_cache_hits_by_group_total{group="hybrid-1",model_name="m",role="hybrid"} 32.0
switchyard:prefix_cache_queries_by_group_total{group="hybrid-0",model_name="m",role="hybrid"} 80.0
switchyard:prefix_cache_queries_by_group_total{group="hybrid-1",model_name="m",role="hybrid"} 120.0
"""


def test_metrics_page_series_are_read_by_group():
    series = placement_bench.parse_series(
        METRICS_PAGE, (placement_bench.RUNNING, placement_report.HITS, placement_bench.WAITING)
    )
    assert series == {
        placement_bench.RUNNING: {"hybrid-0": 3.0, "hybrid-1": 2.0},
        placement_report.HITS: {"": 96.0},
        placement_bench.WAITING: {},
    }
    with pytest.raises(ValueError):  # scrape() turns it into a BenchmarkError
        placement_bench.parse_series("<html>not a metrics page</html>", placement_bench.SCRAPED)


def test_hit_rates_and_preemptions_are_changes_between_two_scrapes():
    names = placement_bench.SCRAPED
    before = placement_bench.parse_series(METRICS_PAGE, names)
    after = placement_bench.parse_series(
        METRICS_PAGE.replace("} 96.0", "} 196.0")
        .replace("} 200.0", "} 400.0")
        .replace("} 64.0", "} 164.0")
        .replace("} 80.0", "} 180.0")
        .replace("} 120.0", "} 220.0")
        .replace("} 7.0", "} 9.0"),
        names,
    )
    assert placement_report.counter_changes(before, after) == {
        "hit_rate": 0.5,
        "hit_rate_by_group": {"hybrid-0": 1.0, "hybrid-1": 0.0},
        "num_queries": 200.0,
        "num_preemptions": 2.0,
    }
    assert placement_report.counter_changes(before, before)["hit_rate"] is None


def test_a_sample_is_balanced_within_one_and_a_half_times_or_two_requests_beside_an_idle_group():
    verdicts = {
        (0, 0): True,
        (2, 0): True,
        (0, 3): False,
        (3, 2): True,
        (4, 2): False,
        (6, 4): True,
        (7, 4): False,
    }
    assert {
        running: placement_report.is_balanced(list(running)) for running in verdicts
    } == verdicts


def test_balance_averages_each_groups_running_requests():
    samples = [
        {"running": {"hybrid-0": 0.0}},  # a group not listed yet runs none
        {"running": {"hybrid-0": 4.0, "hybrid-1": 2.0}},
        {"running": {"hybrid-0": 2.0, "hybrid-1": 2.0}},
        {"running": {"hybrid-0": 6.0, "hybrid-1": 2.0}},
    ]
    assert placement_report.balance(samples) == {
        "num_samples": 4,
        "mean_running": {"hybrid-0": 3.0, "hybrid-1": 1.5},
        "mean_ratio": 2.0,
        "balanced_share": 0.5,
    }
    idle = placement_report.balance([{"running": {"hybrid-0": 0.0, "hybrid-1": 0.0}}])
    assert (idle["mean_ratio"], idle["balanced_share"]) == (None, 1.0)
    assert placement_report.balance([])["balanced_share"] is None


def test_random_words_fit_the_token_count_and_repeat_for_a_seed():
    def count_characters(text: str) -> int:  # a stand-in tokenizer: one token per character
        return len(text)

    text = workload.random_words(random.Random(3), 40, count_characters)
    assert len(text) <= 40
    # the same draws: the fitted text starts it
    longer = workload.random_words(random.Random(3), 80)
    assert longer.startswith(text + " ")
    assert len(text + " " + longer.split()[len(text.split())]) > 40
    assert len(longer.split()) == 80
    assert set(longer.split()) <= set(workload.ENGLISH_WORDS)
    assert workload.random_words(random.Random(3), 80) == longer


def test_the_chat_trace_is_the_same_for_a_seed_and_its_turns_are_fresh():
    args = argparse.Namespace(
        seed=5, sessions=3, turns=2, system_tokens=20, user_tokens=6, think_time_s=4.0
    )
    trace = placement_bench.make_chat_trace(args, lambda text: len(text.split()))
    assert trace == placement_bench.make_chat_trace(args, lambda text: len(text.split()))
    think_times = [t for session in trace["think_times"] for t in session]
    assert len(think_times) == 3 and len(set(think_times)) == 3 and min(think_times) > 0
    assert len(trace["system"].split()) == 20
    turns = [turn for session in trace["turns"] for turn in session]
    assert [len(turn.split()) for turn in turns] == [6] * 6
    assert len(set(turns)) == 6
    assert (trace["system_tokens"], trace["mean_user_tokens"]) == (20, 6.0)


def test_cache_aware_is_compared_with_least_loaded_against_the_targets():
    def measured(multi_turn_ttft: float, no_prefix_ttft: float, ratio: float) -> dict:
        return {
            "multi_turn": {
                "summary": {"ttft_ms": {"median": multi_turn_ttft}},
                "balance": {"mean_ratio": ratio},
            },
            "no_prefix": {"summary": {"ttft_ms": {"median": no_prefix_ttft}}},
        }

    comparison = placement_report.compare(
        {"least-loaded": measured(1000.0, 400.0, 3.0), "cache-aware": measured(600.0, 440.0, 1.25)}
    )
    assert comparison == {
        "multi_turn_median_ttft_reduction": 0.4,
        "multi_turn_target_met": True,
        "no_prefix_median_ttft_change": comparison["no_prefix_median_ttft_change"],
        "no_prefix_target_met": False,
        "hot_prefix_balance_ratio": 1.25,
        "balance_target_met": True,
    }
    assert round(comparison["no_prefix_median_ttft_change"], 9) == 0.1
    assert placement_report.compare({"cache-aware": measured(1.0, 1.0, 1.0)}) == {}


@pytest.mark.parametrize("flag", ["--placement least-loaded", "--data-parallel-size=3"])
def test_serve_args_may_not_set_what_the_benchmark_sets(flag: str, capsys):
    parser = placement_bench.build_parser()
    args = parser.parse_args([f"--serve-args={flag}", "--output-json", "-"])
    with pytest.raises(SystemExit) as exit_info:
        placement_bench.check_args(parser, args)
    assert exit_info.value.code == 2
    assert f"the benchmark sets {flag.split('=')[0].split()[0]} itself" in capsys.readouterr().err


def test_a_small_run_against_the_tiny_model(tiny_llama_dir: Path, tmp_path: Path):
    output = tmp_path / "placement.json"
    argv = ["--model", str(tiny_llama_dir), "--policies", "cache-aware", "--sessions", "2"]
    argv += ["--turns", "2", "--system-tokens", "40", "--user-tokens", "8"]
    argv += ["--output-tokens", "3", "--stagger-s", "0", "--think-time-s", "0.05"]
    argv += ["--output-json", str(output)]
    argv += ["--serve-args=--kv-cache-memory 16MiB"]  # not the default 1 GiB: quicker to start
    assert placement_bench.main(argv) == 0
    result = json.loads(output.read_text())
    assert (result["trace"]["system_tokens"], result["trace"]["mean_user_tokens"]) == (40, 8.0)
    measured = result["policies"]["cache-aware"]
    multi_turn, no_prefix = measured["multi_turn"], measured["no_prefix"]
    assert (multi_turn["summary"]["completed"], multi_turn["summary"]["failed"]) == (4, 0)
    assert multi_turn["summary"]["total_output_tokens"] == 12
    first, second = (
        [request["prompt_tokens"] for request in multi_turn["requests"][turn::2]] for turn in (0, 1)
    )
    assert first[0] == first[1] and second[0] > first[0] + 8 + 3
    input_len = round(multi_turn["summary"]["mean_prompt_tokens"])
    assert result["trace"]["no_prefix_input_len"] == no_prefix["summary"]["input_len"] == input_len
    assert [request["prompt_tokens"] for request in no_prefix["requests"]] == [input_len] * 4
    assert multi_turn["counters"]["num_queries"] == sum(first + second)
    assert no_prefix["counters"]["hit_rate"] == 0.0
    assert (
        multi_turn["counters"]["num_preemptions"] == no_prefix["counters"]["num_preemptions"] == 0
    )
    assert sorted(multi_turn["balance"]["mean_running"]) == ["hybrid-0", "hybrid-1"]
    assert measured["server"]["exit_code"] == 0
    assert result["comparison"] == {}
