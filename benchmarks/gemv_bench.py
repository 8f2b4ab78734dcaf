"""The CPU kernels for SmolLM2-135M's linear layers, decode-sized and larger, on this machine.

Measures, over the default model's 121 matrices (30 layers x qkv, o, gate_up, down, plus the
LM head: 538 MB of fp32), one pass of ``x W^T`` for each ``--rows`` count with

- ``F.linear`` (the default BLAS path);
- oneDNN's packed kernel (the worker's fallback without a C compiler);
- Switchyard's own kernel over column panels (``worker/models/panel_gemm.c``; skipped where
  it cannot be built);
- at "high" float32 matmul precision, its kernel over the tile form (``worker/models/tile_gemm.c``:
  three bfloat16 products on AMX; skipped without AMX-BF16), every matrix in tile form here
  (the worker keeps the LM head in panels);

- with ``--compare OLD.c``, the panel kernel built from another version of its source (e.g.
  ``git show COMMIT:worker/models/panel_gemm.c``);

and ``sum()`` of a 1 GiB tensor, the read bandwidth ``benchmarks/roofline.py`` reports. This is
why the worker has its own kernel (docs/performance.md). The kernels take turns, one pass over
all matrices each a round, so that the machine's drift falls on all of them alike.

With ``--in-cache``, each row count also times every kernel over the 120 layer matrices from
memory beside as many products over the first layer's four matrices (14 MB, which stay in the
last-level cache): the same arithmetic, so the difference is the time the weights' read adds
instead of overlapping it (docs/performance.md, "Measured and dropped (2026-11-28)").

Run: ``python benchmarks/gemv_bench.py [--threads 2] [--rows 1 4 16 64 512] [--compare OLD.c]
[--in-cache]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from workload import num_cores

from worker.models import panel_gemm, tile_gemm

NUM_LAYERS = 30
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
LM_HEAD_SHAPE = (49152, 576)


def median_ms(fn: Callable[[], object], repeats: int = 15) -> float:
    return medians_in_turns({"": fn}, repeats)[""]


def medians_in_turns(fns: dict[str, Callable[[], object]], repeats: int = 15) -> dict[str, float]:
    """Each function's median milliseconds, the functions called in turns ``repeats`` times
    (after three warm-up turns)."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for turn in range(3 + repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if turn >= 3:
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) * 1e3 for name, times in samples.items()}


def in_cache_order(num_layers: int = NUM_LAYERS) -> tuple[list[int], list[int]]:
    """The layer matrices' indices in ``main``'s list, and the same number of products over the
    first layer's matrices alone: the same arithmetic, with weights that stay in cache."""
    from_memory = list(range(num_layers * len(LAYER_SHAPES)))
    return from_memory, list(range(len(LAYER_SHAPES))) * num_layers


def print_in_cache(
    kernels: dict[str, Callable[[torch.Tensor, int], torch.Tensor]],
    xs: list[torch.Tensor],
    rows: int,
) -> None:
    """Each kernel over the layer matrices from memory and over the first layer's in cache,
    in turns: where the first takes longer than both the second and the weights' read alone
    (one row's pass), reading the weights does not overlap the arithmetic."""
    from_memory, in_cache = in_cache_order()
    flops = 2 * rows * NUM_LAYERS * sum(n * k for n, k in LAYER_SHAPES)  # either order's
    passes = {}
    for name, kernel in kernels.items():
        for label, order in (("layers", from_memory), ("in cache", in_cache)):
            passes[f"{name}, {label}"] = lambda kernel=kernel, order=order: [
                kernel(xs[i], i) for i in order
            ]
    for name, ms in medians_in_turns(passes).items():
        print(f"{rows:4d} rows  {name:32s} {ms:7.1f} ms {flops / 1e6 / ms:4.0f} GFLOP/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=num_cores())
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--compare", type=Path, help="another panel_gemm.c to time beside this")
    parser.add_argument(
        "--in-cache",
        action="store_true",
        help="also time the 120 layer matrices from memory against as many products over the "
        "first layer's four, in cache: the same arithmetic without the weights' read",
    )
    args = parser.parse_args()
    if min(args.rows) < 1 or args.threads < 1:
        parser.error("--rows and --threads take positive numbers")
    compared = None
    if args.compare is not None:
        compared = panel_gemm.build(args.compare)
        if compared is None or panel_gemm.library() is None:
            parser.error(f"{args.compare} or this checkout's panel_gemm.c could not be built")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [torch.randn(shape) for _ in range(NUM_LAYERS) for shape in LAYER_SHAPES]
    weights.append(torch.randn(LM_HEAD_SHAPE))
    parameters = sum(w.numel() for w in weights)
    kernels: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
        "F.linear": lambda x, i: F.linear(x, weights[i]),
    }
    if torch.backends.mkldnn.is_available():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
        kernels["oneDNN packed"] = lambda x, i: torch.ops.mkldnn._linear_pointwise(
            x, packed[i], None, "none", [], ""
        )
    if panel_gemm.library() is not None:
        panels = [panel_gemm.pack(w) for w in weights]

        def panel_product(library) -> Callable[[torch.Tensor, int], torch.Tensor]:
            """``library``'s kernel called directly (not through panel_gemm.linear, whose
            checks would cost this build ~1 ms a pass more than a compared one)."""

            def product(x: torch.Tensor, i: int) -> torch.Tensor:
                n, k = weights[i].shape
                y = torch.empty(x.shape[0], n)
                library.sy_panel_linear(
                    x.data_ptr(), x.shape[0], k, panels[i].data_ptr(), n, None, y.data_ptr()
                )
                return y

            return product

        kernels["Switchyard panels"] = panel_product(panel_gemm.library())
    if compared is not None:
        kernels[f"panels, {args.compare.name}"[:22]] = panel_product(compared)
    if tile_gemm.available():
        tiles = [tile_gemm.pack(w) for w in weights]
        kernels["Switchyard tiles"] = lambda x, i: tile_gemm.linear(
            x, tiles[i], None, *weights[i].shape
        )

    print(f"{len(weights)} matrices, {parameters * 4 / 1e6:.0f} MB of fp32, {args.threads} threads")
    for rows in args.rows:
        xs = [torch.randn(rows, w.shape[1]) for w in weights]
        passes = {
            name: lambda kernel=kernel, xs=xs: [kernel(x, i) for i, x in enumerate(xs)]
            for name, kernel in kernels.items()
        }
        for name, ms in medians_in_turns(passes).items():
            gb_per_s = parameters * 4 / 1e6 / ms
            gflop_per_s = 2 * parameters * rows / 1e6 / ms
            rates = f"{gb_per_s:5.1f} GB/s {gflop_per_s:4.0f} GFLOP/s"
            print(f"{rows:4d} rows  {name:22s} {ms:7.1f} ms {rates}")
        if args.in_cache:
            print_in_cache(kernels, xs, rows)
    big = torch.ones(1 << 28)  # 1 GiB
    sum_ms = median_ms(big.sum, repeats=10)
    print(f"sum() of 1 GiB: {sum_ms:.1f} ms, {big.numel() * 4 / 1e6 / sum_ms:.1f} GB/s")


if __name__ == "__main__":
    main()
