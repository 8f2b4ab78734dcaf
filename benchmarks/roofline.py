"""This machine's roofline (fp32 GEMM FLOP/s, memory read bandwidth) and a model's cost per token.

What is counted, for a model of P parameters of which E are the input embedding:

- FLOPs per token = 2 x (P - E - H) + 2 x hidden x vocab, where H is an untied LM head's
  parameters (0 when tied): every matmul weight multiplies once per token (2 FLOPs per
  multiply-add), and the LM head is counted once whether or not it shares the embedding matrix.
  The embedding lookup, norms' elementwise work and attention's score/value products are not
  counted (attention is about 5% more at 192 tokens of context for SmolLM2-135M).
- FLOPs per prompt token = 2 x (P - E - H): engines compute logits only where a token is
  sampled, so a prompt token (all but the last) skips the LM head.
- Weight bytes per decode step = bytes per parameter x (P - E - H + hidden x vocab): one decode
  step reads every matmul weight once, whatever the batch size. The KV cache read is not counted.

Run alone: ``python benchmarks/roofline.py [--model-path DIR_OR_GGUF] [--output-json PATH]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from workload import BenchmarkError, num_cores, read_model_config, resolve_model_dir, write_json

GEMM_SIZE = 2048
BANDWIDTH_BYTES = 1 << 30
BYTES_PER_PARAMETER = 4  # the server's CPU default is float32


def measure_gemm_flops(size: int = GEMM_SIZE, repeats: int = 5, iterations: int = 4) -> list[float]:
    """FLOP/s of ``torch.mm`` on two ``size`` x ``size`` fp32 matrices (2 size^3 FLOPs), one
    sample per repeat of ``iterations`` products."""
    import torch

    a = torch.randn(size, size)
    b = torch.randn(size, size)
    out = torch.empty(size, size)
    return [
        2 * size**3 * iterations / seconds
        for seconds in _timed(lambda: torch.mm(a, b, out=out), repeats, iterations)
    ]


def measure_read_bandwidth(
    num_bytes: int = BANDWIDTH_BYTES, repeats: int = 10, device=None
) -> list[float]:
    """Bytes/s of ``tensor.sum()`` over a ``num_bytes`` fp32 tensor (every byte read once), on
    the CPU or on ``device`` (CUDA: 4x the bytes, so the launch is lost in the read)."""
    read = read_bandwidth_probe(num_bytes, device)
    read()  # the first touch of the tensor's pages
    read()
    return [read() for _ in range(repeats)]


def read_bandwidth_probe(num_bytes: int = BANDWIDTH_BYTES, device=None) -> Callable[[], float]:
    """A function that measures one ``sum()`` of the same tensor, as ``measure_read_bandwidth``
    does, and returns its bytes/s: for samples taken in turns with other work."""
    import torch

    on_cuda = device is not None and device.type != "cpu"
    num_bytes *= 4 if on_cuda else 1
    data = torch.ones(num_bytes // 4, device=device)

    def read() -> float:
        if on_cuda:  # work queued before is not this read's
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        data.sum()
        if on_cuda:
            torch.cuda.synchronize(device)
        return num_bytes / (time.perf_counter() - start)

    return read


def measure_copy_bandwidth(num_bytes: int = BANDWIDTH_BYTES // 2, repeats: int = 10) -> list[float]:
    """Bytes/s of ``target.copy_(source)``, counting bytes read plus bytes written."""
    import torch

    source = torch.ones(num_bytes // 4)
    target = torch.empty_like(source)
    return [2 * num_bytes / seconds for seconds in _timed(lambda: target.copy_(source), repeats)]


def _timed(operation: Callable[[], object], repeats: int, iterations: int = 1) -> list[float]:
    """Seconds of ``iterations`` calls, ``repeats`` times, after two warm-up calls."""
    for _ in range(2):
        operation()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iterations):
            operation()
        samples.append(time.perf_counter() - start)
    return samples


def parameter_counts(model_dir: Path) -> dict[str, int]:
    """Parameters by role, read from the safetensors headers (no weights loaded)."""
    from safetensors import safe_open

    counts = {"total": 0, "embedding": 0, "untied_lm_head": 0}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (safe_open is not a dict)
                numel = 1
                for dim in tensors.get_slice(name).get_shape():
                    numel *= dim
                counts["total"] += numel
                if "embed_tokens" in name:
                    counts["embedding"] += numel
                elif name.startswith("lm_head"):
                    counts["untied_lm_head"] += numel
    if counts["total"] == 0:
        raise BenchmarkError(f"{model_dir} has no *.safetensors weights")
    return counts


def model_costs(model_dir: Path) -> dict:
    """FLOPs per token and weight bytes per decode step, as the module docstring defines them."""
    config = read_model_config(model_dir)
    counts = parameter_counts(model_dir)
    lm_head = config["hidden_size"] * config["vocab_size"]
    body = counts["total"] - counts["embedding"] - counts["untied_lm_head"]
    return {
        "num_parameters": counts["total"],
        "num_embedding_parameters": counts["embedding"],
        "num_non_embedding_parameters": body,
        "num_lm_head_parameters": lm_head,
        "tied_embeddings": counts["untied_lm_head"] == 0,
        "flops_per_token": 2 * (body + lm_head),
        "flops_per_prompt_token": 2 * body,
        "bytes_per_parameter": BYTES_PER_PARAMETER,
        "weight_bytes_per_decode_step": BYTES_PER_PARAMETER * (body + lm_head),
    }


def measure_roofline(model_dir: Path, num_threads: int | None = None) -> dict:
    """The machine's peaks and the model's costs in one dict (what serve_bench.py stores)."""
    import torch

    torch.set_num_threads(num_threads or num_cores())
    return {
        "num_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "gemm_size": GEMM_SIZE,
        **_best_and_median("gemm_flops_per_s", measure_gemm_flops()),
        **_best_and_median("read_bandwidth_bytes_per_s", measure_read_bandwidth()),
        **_best_and_median("copy_bandwidth_bytes_per_s", measure_copy_bandwidth()),
        "model_dir": str(model_dir),
        **model_costs(model_dir),
    }


def _best_and_median(name: str, samples: list[float]) -> dict[str, float]:
    """``name``: the best sample (the peak the derived numbers use); ``name_median`` beside it."""
    return {name: max(samples), f"{name}_median": statistics.median(samples)}


def format_roofline(roofline: dict) -> str:
    floor_ms = roofline["weight_bytes_per_decode_step"] / roofline["read_bandwidth_bytes_per_s"]
    rows = [
        (f"fp32 GEMM {roofline['gemm_size']}^2 (GFLOP/s)", roofline["gemm_flops_per_s"] / 1e9),
        ("memory read, sum of 1 GiB (GB/s)", roofline["read_bandwidth_bytes_per_s"] / 1e9),
        ("  median of 10", roofline["read_bandwidth_bytes_per_s_median"] / 1e9),
        ("memory copy, read+write (GB/s)", roofline["copy_bandwidth_bytes_per_s"] / 1e9),
        ("model parameters (M)", roofline["num_parameters"] / 1e6),
        ("  non-embedding (M)", roofline["num_non_embedding_parameters"] / 1e6),
        ("  LM head hidden x vocab (M)", roofline["num_lm_head_parameters"] / 1e6),
        ("FLOPs per token (GFLOP)", roofline["flops_per_token"] / 1e9),
        ("weight bytes per decode step (MB)", roofline["weight_bytes_per_decode_step"] / 1e6),
        ("bandwidth floor per decode step (ms)", floor_ms * 1000),
    ]
    return "\n".join(f"{name:<40}{value:>12.2f}" for name, value in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model-path", help="Hugging Face directory or .gguf file (default: Switchyard's default)"
    )
    parser.add_argument("--num-threads", type=int, help="torch threads (default: every core)")
    parser.add_argument("--output-json", help="also write the numbers here as JSON ('-': stdout)")
    args = parser.parse_args(argv)
    try:
        roofline = measure_roofline(resolve_model_dir(args.model_path), args.num_threads)
    except BenchmarkError as error:
        print(f"roofline: error: {error}", file=sys.stderr)
        return 1
    print(format_roofline(roofline), file=sys.stderr if args.output_json == "-" else sys.stdout)
    if args.output_json:
        write_json(args.output_json, roofline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
