"""Whole model steps with this checkout's CPU kernels against another build of them, in turns.

Loads the model once, as a worker does (float32, the fused layer stack where it applies), and
times each step shape with this checkout's ``worker/models/cpu_ops.c`` and with ``--compare
OLD.c`` (e.g. ``git show COMMIT:worker/models/cpu_ops.c > OLD.c``; it must keep the functions
and signatures ``cpu_ops.py`` declares), the two libraries swapped in between calls, so both
see the same weights, the same cache and the same minute of this shared machine. With
``--kernel panel_gemm`` the two builds are of ``worker/models/panel_gemm.c``, the matrix
product (the layer stack's and the LM head's). A step is
``REQUESTSxNEWxCACHED`` (each request's new tokens after its cached ones) or
``REQUESTSxNEWxCACHEDxSHARED`` (the first SHARED cached tokens in the same blocks for every
request, as prefix caching leaves requests with one system prompt). Blocks are shuffled over a
pool of random keys and values. Per step it prints both medians, their ratio, whether both
picked the same next token for every request, and their logits' largest difference.

Run alone (nothing else on the cores):
  python benchmarks/kernel_ab.py --compare OLD.c [--kernel cpu_ops|panel_gemm] \
      [--steps 1x512x0,16x1x639x512] [--rounds 8] [--model-path DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from model_steps import BLOCK_SIZE, random_step
from workload import num_cores, resolve_model_dir

from worker.models import cpu_ops, panel_gemm
from worker.models.fused_layers import FusedLayers
from worker.models.loader import load_model

DEFAULT_STEPS = "1x512x0,1x512x1024,16x128x512x512,16x1x639x512,64x1x639x512,16x1x191"
KERNELS = {"cpu_ops": cpu_ops, "panel_gemm": panel_gemm}
"""The kernel modules whose C source --compare replaces, each with library() and build()."""


def parse_step(text: str) -> tuple[int, int, int, int]:
    """(requests, new tokens, cached tokens, shared tokens) of REQUESTSxNEWxCACHED[xSHARED]."""
    parts = [int(part) for part in text.split("x")]
    if len(parts) == 3:
        parts.append(0)
    if len(parts) != 4 or min(parts[:2]) < 1 or min(parts[2:]) < 0 or parts[3] > parts[2]:
        raise ValueError(text)
    if parts[3] % BLOCK_SIZE:
        raise ValueError(f"{text}: shared tokens fill whole blocks of {BLOCK_SIZE}")
    return tuple(parts)


def add_step_arguments(
    parser: argparse.ArgumentParser, steps: str, rounds: int, rounds_help: str
) -> None:
    """--steps (default ``steps``), --rounds (default ``rounds``) and --model-path, as this
    script and greedy_head_bench.py take them."""
    parser.add_argument("--steps", default=steps, help="comma-separated (see above)")
    parser.add_argument("--rounds", type=int, default=rounds, help=rounds_help)
    parser.add_argument("--model-path", help="directory or .gguf (default: the default model)")


def parsed_steps(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> list[tuple[int, int, int, int]]:
    """``args.steps`` parsed (``parse_step``), once checked with ``args.rounds``; a usage
    error (exit 2) where either does not fit."""
    try:
        steps = [parse_step(text) for text in args.steps.split(",")]
    except ValueError as error:
        parser.error(f"steps are REQUESTSxNEWxCACHED[xSHARED] of whole numbers: {error}")
    if args.rounds < 1:
        parser.error("--rounds is at least 1")
    return steps


def swaps(model, kernel: str, libraries: dict) -> dict[str, Callable[[], None]]:
    """Per build, what puts it in use: the module's ``library`` returning it, and for the
    matrix product also a layer stack built over it (the stack keeps its product's address)."""
    module = KERNELS[kernel]
    this_checkout = module.library
    found = {}
    for name, library in libraries.items():
        module.library = lambda library=library: library
        stack = FusedLayers.build(model) if kernel == "panel_gemm" else model.fused_layers

        def use(library=library, stack=stack) -> None:
            module.library = lambda: library
            model.fused_layers = stack

        found[name] = use
    module.library = this_checkout
    return found


def time_step(
    model, kernel: str, libraries: dict, step: tuple[int, int, int, int], rounds: int
) -> dict:
    """Each library's median seconds for the step, and how their logits compare."""
    inputs = random_step(model, *step, shuffle=True)
    samples: dict[str, list[float]] = {name: [] for name in libraries}
    logits: dict[str, torch.Tensor] = {}
    module, stack = KERNELS[kernel], model.fused_layers
    this_checkout = module.library
    try:
        uses = swaps(model, kernel, libraries)
        with torch.inference_mode():
            for _ in range(rounds):
                for name, use in uses.items():
                    use()
                    start = time.perf_counter()
                    logits[name] = inputs.run(model)
                    samples[name].append(time.perf_counter() - start)
    finally:
        module.library, model.fused_layers = this_checkout, stack
    this, compared = logits["this"], logits["compared"]
    return {
        **{name: statistics.median(times[1:] or times) for name, times in samples.items()},
        "same_next_tokens": bool(torch.equal(this.argmax(-1), compared.argmax(-1))),
        "max_logit_difference": (this - compared).abs().max().item(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compare", type=Path, required=True, help="another build's source")
    parser.add_argument(
        "--kernel",
        choices=sorted(KERNELS),
        default="cpu_ops",
        help="whose source --compare is (default: %(default)s)",
    )
    add_step_arguments(parser, DEFAULT_STEPS, 8, "turns of each build a step")
    args = parser.parse_args(argv)
    steps = parsed_steps(parser, args)
    module = KERNELS[args.kernel]
    if cpu_ops.library() is None or module.library() is None:
        parser.error("the CPU kernels could not be built here")
    compared = module.build(args.compare)
    if compared is None:
        parser.error(f"{args.compare} could not be built")
    torch.set_num_threads(num_cores())
    model = load_model(resolve_model_dir(args.model_path), torch.device("cpu"), torch.float32)
    libraries = {"this": module.library(), "compared": compared}
    print("| step | this | compared | compared / this | same next tokens | largest logit gap |")
    print("|---|---|---|---|---|---|")
    for step in steps:
        result = time_step(model, args.kernel, libraries, step, args.rounds)
        requests, new, cached, shared = step
        name = f"{requests} x {new} new after {cached}" + (f" ({shared} shared)" if shared else "")
        print(
            f"| {name} | {result['this'] * 1e3:.1f} ms | {result['compared'] * 1e3:.1f} ms | "
            f"{result['compared'] / result['this']:.3f} | {result['same_next_tokens']} | "
            f"{result['max_logit_difference']:.1e} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
