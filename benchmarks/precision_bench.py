"""Model steps at float32 matmul precision "highest" against "high", in-process, alternating.

Loads the model twice in one process, once per ``torch.set_float32_matmul_precision`` setting
(``--float32-matmul-precision``: "highest" packs the decoder layers in float32 panels,
``worker/models/panel_gemm.c``; "high" in bfloat16 halves for the tile unit,
``worker/models/tile_gemm.c``, where the CPU has AMX-BF16), and times the same steps on each in
turn, so that both see the same machine: prefills of one prompt and of several, and decode
steps of 1 to 64 requests over a KV cache of random keys and values. Per step shape it reports
each median, their ratio, whether the two picked the same next token for every row, and the
largest difference of their logits.

Run alone (nothing else on the cores):
  python benchmarks/precision_bench.py [--model-path DIR] [--output-json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from model_steps import random_step
from workload import num_cores, resolve_model_dir, write_json

from worker.models import tile_gemm
from worker.models.loader import load_model

PRECISIONS = ("highest", "high")
STEPS = (  # (requests, new tokens each, tokens already cached each)
    (1, 512, 0),
    (1, 1536, 0),
    (8, 128, 0),
    (1, 1, 128),
    (16, 1, 192),
    (64, 1, 192),
)


def time_steps(models: dict, requests: int, new: int, cached: int) -> dict:
    """Median seconds of the step on each model, run in turn, and how their logits compare."""
    step = random_step(next(iter(models.values())), requests, new, cached)
    repeats = 8 if new > 1 else 30
    samples: dict[str, list[float]] = {name: [] for name in models}
    logits: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for _ in range(repeats):
            for name, model in models.items():
                start = time.perf_counter()
                logits[name] = step.run(model)
                samples[name].append(time.perf_counter() - start)
    highest, high = logits["highest"], logits["high"]
    return {
        "requests": requests,
        "new_tokens": new,
        "cached_tokens": cached,
        **{f"{name}_ms": statistics.median(samples[name][2:]) * 1e3 for name in models},
        "same_next_tokens": bool(torch.equal(highest.argmax(-1), high.argmax(-1))),
        "max_logit_difference": (highest - high).abs().max().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", help="directory or .gguf (default: the default model)")
    parser.add_argument("--output-json", help="write every measurement here")
    args = parser.parse_args()
    if not tile_gemm.available():
        raise SystemExit("this CPU (or build) has no AMX-BF16 tile unit: high equals highest")
    torch.set_num_threads(num_cores())
    models = {}
    for precision in PRECISIONS:
        torch.set_float32_matmul_precision(precision)  # read when the layers are packed
        models[precision] = load_model(
            resolve_model_dir(args.model_path), torch.device("cpu"), torch.float32
        )
    torch.set_float32_matmul_precision("highest")
    results = []
    for requests, new, cached in STEPS:
        result = time_steps(models, requests, new, cached)
        results.append(result)
        ratio = result["highest_ms"] / result["high_ms"]
        print(
            f"{requests:3d} x {new:4d} new, {cached:3d} cached: highest {result['highest_ms']:7.1f}"
            f" ms, high {result['high_ms']:7.1f} ms ({ratio:.2f}x); same next tokens: "
            f"{result['same_next_tokens']}, largest logit difference "
            f"{result['max_logit_difference']:.1e}",
            flush=True,
        )
    if args.output_json:
        write_json(args.output_json, {"threads": num_cores(), "steps": results})


if __name__ == "__main__":
    main()
