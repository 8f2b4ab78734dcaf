"""The placement benchmark's analysis and report, from placement_bench.py's measurements.

``balance()`` and ``counter_changes()`` read the /metrics scrapes of one trace, ``compare()``
sets cache-aware against least-loaded and ``report()`` prints the whole result (placement_bench.py's
JSON) as a markdown table. The rules and targets are the ones placement_bench.py's docstring states.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from metrics import percentile, summarize

if TYPE_CHECKING:  # for annotations only
    from load_generator import RequestResult

POLICIES = ("least-loaded", "cache-aware")
NUM_GROUPS = 2
BALANCED_RATIO = 1.5
"""A sample is balanced when its most loaded group runs at most this many times the requests
of its least loaded one..."""
BALANCED_WHEN_ONE_IDLE = 2
"""...or, when one group runs none, the other runs at most this many."""

HITS, QUERIES = "switchyard:prefix_cache_hits_total", "switchyard:prefix_cache_queries_total"
GROUP_HITS = "switchyard:prefix_cache_hits_by_group_total"
GROUP_QUERIES = "switchyard:prefix_cache_queries_by_group_total"
PREEMPTIONS = "switchyard:num_preemptions_total"
COUNTERS = (HITS, QUERIES, GROUP_HITS, GROUP_QUERIES, PREEMPTIONS)
"""The counters ``counter_changes()`` reads from each scrape."""


def is_balanced(running: list[float]) -> bool:
    """The module's rule for one sample of the groups' running requests."""
    most, least = max(running), min(running)
    return most <= BALANCED_WHEN_ONE_IDLE if least == 0 else most / least <= BALANCED_RATIO


def balance(samples: list[dict]) -> dict:
    """Mean running requests per group, the larger mean over the smaller (None when the smaller
    is 0), and the share of balanced samples (None without samples)."""
    groups = sorted({group for sample in samples for group in sample["running"]})
    rows = [[sample["running"].get(group, 0.0) for group in groups] for sample in samples]
    means = {group: sum(row[i] for row in rows) / len(rows) for i, group in enumerate(groups)}
    smaller = min(means.values(), default=0.0)
    return {
        "num_samples": len(samples),
        "mean_running": means,
        "mean_ratio": max(means.values()) / smaller if smaller > 0 else None,
        "balanced_share": sum(map(is_balanced, rows)) / len(rows) if rows and groups else None,
    }


def counter_changes(before: dict, after: dict) -> dict:
    """Between two scrapes (each with ``COUNTERS``): the prefix-cache hit rate (hits over
    queries, the prompt tokens looked up) overall and per group, the number of queries, and the
    preemptions."""

    def change(name: str, group: str = "") -> float:
        return after[name].get(group, 0.0) - before[name].get(group, 0.0)

    def rate(hits: str, queries: str, group: str) -> float | None:
        return change(hits, group) / change(queries, group) if change(queries, group) else None

    groups = sorted(after[GROUP_QUERIES])
    return {
        "hit_rate": rate(HITS, QUERIES, ""),
        "hit_rate_by_group": {group: rate(GROUP_HITS, GROUP_QUERIES, group) for group in groups},
        "num_queries": change(QUERIES),
        "num_preemptions": change(PREEMPTIONS),
    }


def trace_summary(results: list[RequestResult], duration_s: float) -> dict:
    """``summarize()`` plus the TTFT p90 and the mean prompt length (ms, tokens)."""
    summary = summarize(results, duration_s)
    succeeded = [result for result in results if result.success]
    summary["ttft_ms"]["p90"] = percentile([r.time_to_first_token * 1000 for r in succeeded], 90)
    tokens = summary["total_input_tokens"]
    summary["mean_prompt_tokens"] = tokens / len(succeeded) if succeeded else None
    return summary


def compare(policies: dict[str, dict]) -> dict:
    """Cache-aware against least-loaded, each number with its target (empty without both)."""
    if not set(POLICIES) <= policies.keys():
        return {}

    def median_ttft(policy: str, trace: str) -> float | None:
        return policies[policy][trace]["summary"]["ttft_ms"]["median"]

    def change(trace: str) -> float | None:
        ours, theirs = median_ttft("cache-aware", trace), median_ttft("least-loaded", trace)
        return ours / theirs - 1 if ours is not None and theirs else None

    reduction = change("multi_turn")
    ratio = policies["cache-aware"]["multi_turn"]["balance"]["mean_ratio"]
    return {
        "multi_turn_median_ttft_reduction": None if reduction is None else -reduction,
        "multi_turn_target_met": reduction is not None and -reduction >= 0.30,
        "no_prefix_median_ttft_change": change("no_prefix"),
        "no_prefix_target_met": change("no_prefix") is not None and change("no_prefix") <= 0.05,
        "hot_prefix_balance_ratio": ratio,
        "balance_target_met": ratio is not None and ratio <= BALANCED_RATIO,
    }


def report(result: dict) -> tuple[str, bool]:
    """A markdown table, one row per policy and trace; balance, comparison, failures, logs."""
    config, trace = result["config"], result["trace"]
    lines = [
        f"{config['sessions']} sessions x {config['turns']} turns, system prompt "
        f"{_tokens(trace['system_tokens'], config['system_tokens'])} tokens, user turns "
        f"{_tokens(trace['mean_user_tokens'], config['user_tokens'])}, "
        f"{config['output_tokens']} output tokens; no-prefix prompts "
        f"{trace['no_prefix_input_len']} tokens; {NUM_GROUPS} groups, "
        f"{result['machine']['nproc']} cores",
        "",
        "| policy | trace | requests | failed | TTFT p50 (ms) | TTFT p90 (ms) | TPOT p50 (ms) "
        "| duration (s) | prefix hit rate | preemptions | other processes' CPU |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    notes, succeeded = [], True
    for policy, measured in result["policies"].items():
        for trace_name in ("multi_turn", "no_prefix"):
            summary = measured[trace_name]["summary"]
            ttft, tpot = summary["ttft_ms"], summary["tpot_ms"]
            counters = measured[trace_name]["counters"]
            other = (measured[trace_name]["cpu"] or {}).get("other_processes_share")
            cells = [policy, trace_name, str(summary["num_requests"]), str(summary["failed"])]
            cells += [_number(ttft["median"]), _number(ttft["p90"]), _number(tpot["median"])]
            cells += [_number(summary["duration_s"]), _percent(counters["hit_rate"])]
            cells += [f"{counters['num_preemptions']:.0f}", _percent(other)]
            lines.append("| " + " | ".join(cells) + " |")
            notes += [f"{policy}, {trace_name}: {n} x {e}" for e, n in summary["errors"].items()]
            succeeded &= summary["failed"] == 0
        notes.append(_balance_line(policy, measured["multi_turn"]))
        server = measured["server"]
        if server["exit_code"] != 0:
            notes.append(f"{policy}: the server exited with code {server['exit_code']}")
        notes.append(f"{policy} server log: {server['log']}")
        succeeded &= server["exit_code"] == 0
    return "\n".join([*lines, "", *notes, *_comparison_lines(result["comparison"])]), succeeded


def _balance_line(policy: str, multi_turn: dict) -> str:
    balance, rates = multi_turn["balance"], multi_turn["counters"]["hit_rate_by_group"]
    groups = ", ".join(
        f"{group} {mean:.2f} running (hit rate {_percent(rates.get(group))})"
        for group, mean in balance["mean_running"].items()
    )
    return (
        f"{policy}, multi-turn: {groups}; larger/smaller {_number(balance['mean_ratio'], 2)}; "
        f"balanced samples {_percent(balance['balanced_share'])} of {balance['num_samples']}"
    )


def _comparison_lines(comparison: dict) -> list[str]:
    if not comparison:
        return []
    reduction, change = (
        comparison["multi_turn_median_ttft_reduction"],
        comparison["no_prefix_median_ttft_change"],
    )
    met = {True: "met", False: "MISSED"}
    return [
        "",
        "cache-aware against least-loaded:",
        f"  multi-turn median TTFT {_percent(reduction)} lower (target >= 30 %): "
        + met[comparison["multi_turn_target_met"]],
        f"  no-prefix median TTFT {_percent(change, signed=True)} (target <= +5 %): "
        + met[comparison["no_prefix_target_met"]],
        f"  hot-prefix running balance {_number(comparison['hot_prefix_balance_ratio'], 2)}x "
        f"(target <= {BALANCED_RATIO}x): " + met[comparison["balance_target_met"]],
    ]


def _tokens(measured: float | None, asked: int) -> str:
    return f"~{asked}" if measured is None else f"{measured:.0f}"


def _number(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _percent(fraction: float | None, signed: bool = False) -> str:
    return "n/a" if fraction is None else f"{fraction * 100:{'+' if signed else ''}.1f} %"
