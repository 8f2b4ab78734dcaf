"""The transformers static-batch baseline: what a plain ``model.generate`` loop achieves.

The same model directory the server loads, fp32, torch threads = cores. The prompts are
serve_bench.py's for the same seed (random token ids, all ``input_len`` long, so no padding);
they run ``batch_size`` at a time through ``generate(do_sample=False, min_new_tokens=output_len,
max_new_tokens=output_len)``. Throughput counts the wall time of every batch (loading and one
small warm-up generate are not counted).

Run alone: ``python benchmarks/hf_baseline.py --batch-size 16 --num-prompts 64``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from workload import (
    DEFAULT_VOCAB_SIZE,
    BenchmarkError,
    num_cores,
    random_prompts,
    read_model_config,
    resolve_model_dir,
    write_json,
)


def run_baseline(
    model_dir: Path,
    prompts: list[list[int]],
    output_len: int,
    batch_size: int,
    num_threads: int | None = None,
) -> dict:
    """Generate for every prompt, ``batch_size`` at a time; return throughputs and timings."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(num_threads or num_cores())
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    _generate(model, prompts[:1], min(output_len, 4))

    batch_seconds = []
    for first in range(0, len(prompts), batch_size):
        start = time.perf_counter()
        _generate(model, prompts[first : first + batch_size], output_len)
        batch_seconds.append(time.perf_counter() - start)
    duration = sum(batch_seconds)
    input_tokens = sum(len(prompt) for prompt in prompts)
    output_tokens = len(prompts) * output_len
    return {
        "num_prompts": len(prompts),
        "batch_size": batch_size,
        "num_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "duration_s": duration,
        "batch_seconds": batch_seconds,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(prompts) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }


def _generate(model, prompts: list[list[int]], output_len: int) -> None:
    """One static batch; raises if transformers produced a different number of tokens."""
    import torch

    input_ids = torch.tensor(prompts)  # (batch, input_len): equal lengths, no padding
    with torch.inference_mode():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            min_new_tokens=output_len,
            max_new_tokens=output_len,
            pad_token_id=model.config.eos_token_id,
        )
    new_tokens = output.shape[1] - input_ids.shape[1]  # output: (batch, input_len + output_len)
    if new_tokens != output_len:
        raise RuntimeError(f"generate made {new_tokens} tokens, asked for {output_len}")


def format_baseline(baseline: dict) -> str:
    rows = [
        ("prompts, batch size", f"{baseline['num_prompts']}, {baseline['batch_size']}"),
        ("duration (s)", f"{baseline['duration_s']:.2f}"),
        ("output tok/s", f"{baseline['output_throughput']:.2f}"),
        ("total tok/s", f"{baseline['total_token_throughput']:.2f}"),
    ]
    return "\n".join(f"{name:<40}{value:>12}" for name, value in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", help="Hugging Face directory or .gguf file")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens")
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts in all")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per generate call")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (as serve_bench.py)")
    parser.add_argument("--vocab-size", type=int, help="prompt ids < this (default: config.json)")
    parser.add_argument("--num-threads", type=int, help="torch threads (default: every core)")
    parser.add_argument("--output-json", help="also write the numbers here as JSON ('-': stdout)")
    args = parser.parse_args(argv)
    for flag in ("input_len", "output_len", "num_prompts", "batch_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    try:
        model_dir = resolve_model_dir(args.model_path)
        vocab_size = args.vocab_size or read_model_config(model_dir).get(
            "vocab_size", DEFAULT_VOCAB_SIZE
        )
        prompts = random_prompts(args.num_prompts, args.input_len, vocab_size, args.seed)
        baseline = run_baseline(
            model_dir, prompts, args.output_len, args.batch_size, args.num_threads
        )
    except BenchmarkError as error:
        print(f"hf_baseline: error: {error}", file=sys.stderr)
        return 1
    print(format_baseline(baseline), file=sys.stderr if args.output_json == "-" else sys.stdout)
    if args.output_json:
        write_json(args.output_json, baseline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
