"""The CPU paged-attention kernel alone: decode steps over a shuffled pool, in GB/s of keys and
values read, and prefills, in GFLOP/s, optionally beside another build of
``worker/models/cpu_ops.c``.

For each ``--cases`` entry BATCHxCONTEXT, attention with the default model's head shape (9
query heads, 3 key-value heads of 64 by default) is timed as a decode step runs it: ``BATCH``
requests decode one token each over ``CONTEXT`` cached tokens, their blocks shuffled over each
of ``--layers`` pools (one per layer, 30 by default as in SmolLM2), one call per layer. The
layers' pools together must be far larger than the last-level cache, or the keys come from it
instead of memory: one pool of 16 x 4,096 tokens (100 MB) fits in this machine's 300 MB L3 and
read 30 GB/s where the same calls over 30 pools read 18-21 GB/s. Times are per call (per
layer). Each ``--prefill`` entry TOKENSxCACHED times one request's prompt chunk of ``TOKENS``
tokens after ``CACHED`` cached ones the same way, in GFLOP/s of the causal attention it computes
(4 x head_dim flops a query head and key it sees: scores and weighted values). ``--compare
SOURCE`` builds another version of cpu_ops.c (e.g. from ``git show
COMMIT:worker/models/cpu_ops.c``; it must keep ``sy_paged_attention``'s signature) and times it
in the same process, the two taking turns for ``--rounds`` rounds, so the machine's drift falls
on both alike; the largest difference between their outputs is printed too.

Run alone (nothing else on the cores):
  python benchmarks/attention_bench.py [--cases 1x4096,16x1024,16x4096] [--layers 30] \
      [--prefill 512x0,512x1024] [--compare OLD.c]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from worker.models import cpu_ops

DEFAULT_CASES = "1x128,1x4096,16x128,16x1024,16x4096,64x160"
DEFAULT_PREFILLS = "512x0,512x1024"


def load_kernel(source: Path | None):
    """``sy_paged_attention`` built from ``source`` (None: this checkout's), or None."""
    library = cpu_ops.library() if source is None else cpu_ops.build(source)
    return None if library is None else library.sy_paged_attention


def time_case(
    kernels: dict,
    batch: int,
    context: int,
    heads: tuple[int, int, int],
    rounds: int,
    layers: int,
    new_tokens: int = 1,
):
    """Median seconds of one call (one layer) of each kernel over ``rounds`` turns of a call per
    layer, and their outputs' largest gap: ``batch`` requests of ``context`` tokens, the last
    ``new_tokens`` of each the step's queries."""
    num_heads, num_kv_heads, head_dim = heads
    block_size = 16
    num_blocks = batch * -(-context // block_size)
    pools = []
    for _ in range(layers):
        key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
        pools.append((key_cache, torch.randn_like(key_cache)))
    tables = torch.randperm(num_blocks).view(batch, -1)
    query = torch.randn(batch * new_tokens, num_heads, head_dim)
    query_starts = torch.arange(batch + 1) * new_tokens
    context_starts = torch.full((batch,), context - new_tokens)
    samples: dict[str, list[float]] = {name: [] for name in kernels}
    outputs = {}
    for _ in range(rounds):
        for name, kernel in kernels.items():
            out = torch.empty_like(query)
            start = time.perf_counter()
            for key_cache, value_cache in pools:
                kernel(
                    *(query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr()),
                    *(tables.data_ptr(), tables.shape[1], query_starts.data_ptr()),
                    *(context_starts.data_ptr(), batch, num_heads, num_kv_heads, head_dim),
                    *(block_size, head_dim**-0.5, torch.get_num_threads(), out.data_ptr()),
                )
            samples[name].append((time.perf_counter() - start) / layers)
            outputs[name] = out  # the last layer's
    first = next(iter(outputs.values()))
    gap = max((out - first).abs().max().item() for out in outputs.values())
    return {name: statistics.median(times) for name, times in samples.items()}, gap


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=DEFAULT_CASES, help="BATCHxCONTEXT, comma-separated")
    parser.add_argument(
        "--prefill", default=DEFAULT_PREFILLS, help="TOKENSxCACHED, comma-separated ('': none)"
    )
    parser.add_argument("--heads", default="9,3,64", help="query heads, key-value heads, head dim")
    parser.add_argument("--compare", type=Path, help="another cpu_ops.c to time beside this one")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--layers", type=int, default=30, help="KV pools, one call each per round (1: L3-hot)"
    )
    args = parser.parse_args(argv)
    try:
        cases = [tuple(int(part) for part in case.split("x")) for case in args.cases.split(",")]
        prefills = [
            tuple(int(part) for part in case.split("x")) for case in args.prefill.split(",") if case
        ]
    except ValueError:
        parser.error("cases are BATCHxCONTEXT and prefills TOKENSxCACHED, of whole numbers")
    heads = tuple(int(part) for part in args.heads.split(","))
    if cpu_ops.library() is None:
        parser.error("the CPU kernels could not be built here")
    if len(heads) != 3 or not cpu_ops.supports_attention(*heads):
        parser.error(f"no paged kernel for heads {args.heads}")
    if args.rounds < 1 or args.layers < 1 or any(len(case) != 2 or min(case) < 1 for case in cases):
        parser.error("cases are BATCHxCONTEXT of positive numbers; rounds and layers at least 1")
    if any(len(case) != 2 or case[0] < 1 or case[1] < 0 for case in prefills):
        parser.error("prefills are TOKENSxCACHED: at least one token, no negative cache")
    kernels = {"this": load_kernel(None)}
    if args.compare is not None:
        kernels["compared"] = load_kernel(args.compare)
        if kernels["compared"] is None:
            parser.error(f"{args.compare} could not be built")
    print("| batch x context | " + " | ".join(kernels) + " | largest gap |")
    print("|---" * (len(kernels) + 2) + "|")
    for batch, context in cases:
        seconds, gap = time_case(kernels, batch, context, heads, args.rounds, args.layers)
        kv_bytes = batch * context * heads[1] * heads[2] * 2 * 4
        cells = [f"{s * 1e3:.2f} ms, {kv_bytes / s / 1e9:.1f} GB/s" for s in seconds.values()]
        print(f"| {batch} x {context} | " + " | ".join(cells) + f" | {gap:.1e} |", flush=True)
    if prefills:
        print("\n| prefill tokens x cached | " + " | ".join(kernels) + " | largest gap |")
        print("|---" * (len(kernels) + 2) + "|")
    for tokens, cached in prefills:
        seconds, gap = time_case(
            kernels, 1, cached + tokens, heads, args.rounds, args.layers, new_tokens=tokens
        )
        pairs = sum(cached + 1 + i for i in range(tokens))  # (query token, key) pairs it sees
        flops = pairs * heads[0] * heads[2] * 4
        cells = [f"{s * 1e3:.2f} ms, {flops / s / 1e9:.0f} GFLOP/s" for s in seconds.values()]
        print(f"| {tokens} x {cached} | " + " | ".join(cells) + f" | {gap:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
