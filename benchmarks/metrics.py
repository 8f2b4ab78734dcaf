"""Turn per-request results into the serving metrics vLLM's benchmark_serving reports.

Latencies are reported in milliseconds, throughputs per second of wall time from the first
request sent to the last one finished. Only successful requests enter latencies and token counts;
failed ones are counted and their error messages tallied.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations only: scheduler_bench.py's process stays free of httpx
    from load_generator import RequestResult


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile with linear interpolation (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def distribution_ms(seconds: list[float]) -> dict[str, float | None]:
    """Mean, median and p99 of ``seconds``, in milliseconds (None when there are no values)."""
    milliseconds = [value * 1000 for value in seconds]
    mean = sum(milliseconds) / len(milliseconds) if milliseconds else None
    return {
        "mean": mean,
        "median": percentile(milliseconds, 50),
        "p99": percentile(milliseconds, 99),
    }


def time_per_output_token(result: RequestResult) -> float | None:
    """(e2e - TTFT) / (output tokens - 1): the decode pace after the first token."""
    if result.output_tokens < 2:
        return None
    return (result.latency - result.time_to_first_token) / (result.output_tokens - 1)


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    """The benchmark's numbers for one run (see the module docstring for units)."""
    succeeded = [result for result in results if result.success]
    input_tokens = sum(result.prompt_tokens for result in succeeded)
    output_tokens = sum(result.output_tokens for result in succeeded)
    tpots = [time_per_output_token(result) for result in succeeded]
    errors = Counter(result.error for result in results if not result.success)
    return {
        "num_requests": len(results),
        "completed": len(succeeded),
        "failed": len(results) - len(succeeded),
        "errors": dict(errors.most_common()),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(succeeded) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "ttft_ms": distribution_ms([result.time_to_first_token for result in succeeded]),
        "tpot_ms": distribution_ms([tpot for tpot in tpots if tpot is not None]),
        "itl_ms": distribution_ms(
            [latency for result in succeeded for latency in result.inter_token_latencies]
        ),
        "e2e_latency_ms": distribution_ms([result.latency for result in succeeded]),
    }


def per_request_records(results: list[RequestResult]) -> list[dict]:
    """Every request's raw numbers (ms), for the JSON file."""
    return [
        {
            "error": result.error or None,
            "prompt_tokens": result.prompt_tokens,
            "output_tokens": result.output_tokens,
            "ttft_ms": result.time_to_first_token * 1000,
            "e2e_latency_ms": result.latency * 1000,
            "itl_ms": [round(latency * 1000, 3) for latency in result.inter_token_latencies],
        }
        for result in results
    ]
