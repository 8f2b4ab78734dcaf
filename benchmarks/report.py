"""Compare a serving run with the roofline and the transformers baseline, and print it as a table.

``comparison()`` derives the numbers that need more than one measurement:

- fraction of GEMM roofline = total tok/s x FLOPs per token / GEMM FLOP/s (prompt and output
  tokens both counted at FLOPs per token, LM head included: an upper estimate, since prompt
  tokens skip the LM head);
- at concurrency 1, the bandwidth floor TPOT = weight bytes per decode step / read bandwidth, and
  the measured median TPOT over it;
- the server's throughputs over the baseline's.
"""

from __future__ import annotations

WIDTH = 56


def comparison(result: dict) -> dict:
    """Derived numbers for ``result`` (serve_bench.py's JSON); keys absent when not measurable."""
    serving, roofline, baseline = result["serving"], result["roofline"], result["baseline"]
    derived: dict[str, float | None] = {}
    if roofline:
        gemm_flops = roofline["gemm_flops_per_s"]
        flops_per_token = roofline["flops_per_token"]
        derived["roofline_fraction"] = (
            serving["total_token_throughput"] * flops_per_token / gemm_flops
        )
        if baseline:
            derived["baseline_roofline_fraction"] = (
                baseline["total_token_throughput"] * flops_per_token / gemm_flops
            )
        if result["config"]["concurrency"] == 1:
            floor_s = (
                roofline["weight_bytes_per_decode_step"] / roofline["read_bandwidth_bytes_per_s"]
            )
            derived["bandwidth_floor_tpot_ms"] = floor_s * 1000
            median_tpot = serving["tpot_ms"]["median"]
            derived["median_tpot_over_floor"] = (
                median_tpot / (floor_s * 1000) if median_tpot is not None else None
            )
    if baseline:
        derived["output_throughput_ratio"] = (
            serving["output_throughput"] / baseline["output_throughput"]
        )
        derived["total_throughput_ratio"] = (
            serving["total_token_throughput"] / baseline["total_token_throughput"]
        )
    return derived


def _sampling_rows(config: dict) -> list[tuple[str, str]]:
    """A row naming how requests sampled, where the run sent sampling settings."""
    if not config.get("temperature"):
        return [("Sampling", "greedy")] if "temperature" in config else []
    top_p = config.get("top_p")
    return [("Sampling", f"temperature {config['temperature']:g}, top-p {top_p or 1:g}")]


def format_report(result: dict) -> str:
    """The human-readable table of one run (vLLM benchmark_serving's layout)."""
    config, serving = result["config"], result["serving"]
    lines = [" Serving Benchmark Result ".center(WIDTH, "=")]
    lines += _rows(
        ("Server", f"{result['server']['model']} @ {result['server']['base_url']}"),
        ("Input / output tokens", f"{config['input_len']} / {config['output_len']}"),
        ("Concurrency / request rate", f"{config['concurrency']} / {config['request_rate']}"),
        *_sampling_rows(config),
        ("Successful requests", serving["completed"]),
        ("Failed requests", serving["failed"]),
        ("Benchmark duration (s)", serving["duration_s"]),
        ("Request throughput (req/s)", serving["request_throughput"]),
        ("Output token throughput (tok/s)", serving["output_throughput"]),
        ("Total token throughput (tok/s)", serving["total_token_throughput"]),
    )
    for error, count in serving["errors"].items():
        lines.append(f"  {count} x {error}"[:WIDTH])
    if result["server"].get("exit_code"):
        lines.append(f"  the server exited with code {result['server']['exit_code']}; see its log")
    cpu = result.get("cpu_during_run")
    if cpu:
        lines += _rows(("Load generator's CPU (core-s)", cpu["load_generator_core_s"]))
    lines += _other_cpu_rows(cpu)
    lines += _process_cpu_lines(result.get("cpu_by_process"))
    for key, name in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_latency_ms", "E2E latency"),
    ):
        lines += _section(name)
        lines += _rows(
            (f"Median {name} (ms)", serving[key]["median"]),
            (f"P99 {name} (ms)", serving[key]["p99"]),
        )
    lines += _roofline_lines(result) + _baseline_lines(result)
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _roofline_lines(result: dict) -> list[str]:
    roofline, derived = result["roofline"], result["comparison"]
    if not roofline:
        return []
    lines = _section("Roofline")
    lines += _rows(
        ("fp32 GEMM (GFLOP/s)", roofline["gemm_flops_per_s"] / 1e9),
        ("Memory read bandwidth (GB/s)", roofline["read_bandwidth_bytes_per_s"] / 1e9),
        ("FLOPs per token (GFLOP)", roofline["flops_per_token"] / 1e9),
        ("Weight bytes per decode step (MB)", roofline["weight_bytes_per_decode_step"] / 1e6),
        ("Fraction of GEMM roofline", _percent(derived["roofline_fraction"])),
    )
    if "bandwidth_floor_tpot_ms" in derived:
        lines += _rows(
            ("Bandwidth floor TPOT (ms)", derived["bandwidth_floor_tpot_ms"]),
            ("Median TPOT / floor", derived["median_tpot_over_floor"]),
        )
    return lines


def _baseline_lines(result: dict) -> list[str]:
    baseline, derived = result["baseline"], result["comparison"]
    if not baseline:
        return []
    lines = _section(f"transformers static batch of {baseline['batch_size']}")
    lines += _rows(
        ("Output token throughput (tok/s)", baseline["output_throughput"]),
        ("Total token throughput (tok/s)", baseline["total_token_throughput"]),
    )
    if "baseline_roofline_fraction" in derived:
        lines += _rows(
            ("Fraction of GEMM roofline", _percent(derived["baseline_roofline_fraction"]))
        )
    lines += _rows(("Switchyard / transformers, output", derived["output_throughput_ratio"]))
    return lines + _other_cpu_rows(baseline.get("cpu_during_run"))


def _other_cpu_rows(cpu: dict | None) -> list[str]:
    """How busy the rest of the machine was: above a few percent, the numbers are distorted."""
    if not cpu:
        return []
    return _rows(
        ("Other processes' CPU (core-s)", cpu["other_processes_core_s"]),
        ("  share of the machine", _percent(cpu["other_processes_share"])),
    )


def _process_cpu_lines(by_process: dict | None) -> list[str]:
    """CPU seconds and busy share of one core for each process of the run, when measured."""
    if not by_process:
        return []
    lines = _section("CPU per process (core-s, % of a core)")
    for name, cpu in by_process.items():
        lines += _rows((name, f"{cpu['core_s']:.2f} s {_percent(cpu['share_of_one_core']):>6}"))
    return lines


def _section(title: str) -> list[str]:
    return [f" {title} ".center(WIDTH, "-")]


def _rows(*rows: tuple[str, object]) -> list[str]:
    """``name: value`` lines, values right-aligned (a value too long for that follows the name)."""
    lines = []
    for name, value in rows:
        text = _value(value)
        if len(text) > WIDTH - 38:
            lines.append(f"{name}: {text}")
        else:
            lines.append(f"{name + ':':<38}{text:>{WIDTH - 38}}")
    return lines


def _value(value: object) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.1f}%"
