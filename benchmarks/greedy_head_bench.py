"""Greedy tokens through the LM head's float32 logits against the greedy head (``tile_gemm.
GreedyHead``: bfloat16 estimates on the tile unit, the few tokens their bounds leave computed
exactly), in one loaded model, in turns.

For each step shape (``REQUESTSxNEWxCACHED[xSHARED]``, as kernel_ab.py takes it; blocks
shuffled over a pool of random keys and values) it runs the decoder layers once for the rows'
final states, then times (a) the LM head alone: the float32 logits and
``cpu_ops.greedy_tokens`` against the greedy head, and (b) the whole step both ways; each the
median of --rounds turns, with whether both gave the same tokens (they must: the head's tokens
are the float32 argmax's).

Run alone (nothing else on the cores):
  python benchmarks/greedy_head_bench.py [--steps 1x1x128,16x1x191,64x1x159,8x1x1600] \
      [--rounds 15] [--model-path DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from kernel_ab import add_step_arguments, parsed_steps
from model_steps import random_step
from workload import num_cores, resolve_model_dir

from worker.models import cpu_ops
from worker.models.loader import load_model

DEFAULT_STEPS = "1x1x128,16x1x191,64x1x159,8x1x1600"


def medians(ways: dict[str, Callable[[], torch.Tensor]], rounds: int) -> dict[str, float]:
    """Each way's median seconds over ``rounds`` turns (the first turn a warm-up)."""
    samples: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds + 1):
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times[1:]) for name, times in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_arguments(parser, DEFAULT_STEPS, 15, "turns of each way a step")
    args = parser.parse_args(argv)
    steps = parsed_steps(parser, args)
    torch.set_num_threads(num_cores())
    model = load_model(resolve_model_dir(args.model_path), torch.device("cpu"), torch.float32)
    if model.greedy_head is None:
        parser.error("no greedy head here (it needs AMX-BF16, a C compiler and float32 panels)")
    print("| step | head: float32 + argmax | greedy head | speed-up | whole step: float32 head |")
    print("|---|---|---|---|---|")
    for requests, new, cached, shared in steps:
        step = random_step(model, requests, new, cached, shared, shuffle=True)
        layout = step.layout

        def hidden(step=step, layout=layout) -> torch.Tensor:
            return model.hidden_states(
                step.input_ids, layout.positions, step.cache, layout.metadata, step.last_rows
            )

        with torch.inference_mode():
            states = hidden()
            heads = medians(
                {
                    "float32": lambda states=states: cpu_ops.greedy_tokens(model.logits(states)),
                    "greedy": lambda states=states: model.greedy_tokens(states),
                },
                args.rounds,
            )
            want = cpu_ops.greedy_tokens(model.logits(states))
            same = torch.equal(want, model.greedy_tokens(states))
            whole = medians(
                {
                    "float32": lambda: cpu_ops.greedy_tokens(model.logits(hidden())),
                    "greedy": lambda: model.greedy_tokens(hidden()),
                },
                args.rounds,
            )
        name = f"{requests} x {new} new after {cached}" + (f" ({shared} shared)" if shared else "")
        print(
            f"| {name} | {heads['float32'] * 1e3:.2f} ms | {heads['greedy'] * 1e3:.2f} ms "
            f"| {heads['float32'] / heads['greedy']:.2f} (same tokens: {same}) "
            f"| {whole['float32'] * 1e3:.1f} ms against {whole['greedy'] * 1e3:.1f} ms, "
            f"{whole['float32'] / whole['greedy']:.3f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
