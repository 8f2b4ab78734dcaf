"""Decode-step time against context length, in-process, beside the bytes-read floor.

Loads the model as a worker does, fills a KV cache with random keys and values, and times one
decode step (the forward pass of ``--batch-sizes`` requests, one new token each, every request
``context`` tokens long; blocks shuffled over the pool as a busy server leaves them) for each
context length. Each step is timed two ways in the same run: attention reading the paged cache
in place (what the server uses: ``worker/models/cpu_ops.c`` on the CPU, FlexAttention on CUDA)
and the gathered torch path (every request's blocks copied into a padded batch, then
``scaled_dot_product_attention``; the fused small ops off too). The floor is the bytes a step
must read (every weight once, plus every request's keys and values at every layer) over the
device's read bandwidth (``sum()`` of 1 GiB on the CPU, 4 GiB on CUDA).

The in-place steps of every batch and context, each over a cache of its own (all held at
once), and one ``sum()`` are timed in turns, ``--rounds`` rounds: on a shared machine whose
speed drifts by tens of percent over minutes, steps timed minutes apart compare the minutes,
not the contexts. The growth line per batch size is the step's growth from the shortest
context to the longest against the time its extra keys and values take at ``sum()``'s rate,
taken within each round (the median and range over rounds are printed).

``layout`` is the median time of building one step's attention layout on the host and copying
it to the device (for FlexAttention, its block mask), which the step times leave out.
On CUDA a third time is the in-place step replayed as a CUDA graph (``worker.cuda_graphs``, as
the worker runs decode steps), the copy of its inputs included. With ``--shared-prefix N``
every request's first N tokens lie in the same blocks (as prefix caching leaves requests with
one system prompt), which the CPU kernel reads once for all of them; the floor counts them
once.

Run alone (nothing else on the cores):
  python benchmarks/context_bench.py [--contexts 128,256,...] [--batch-sizes 1,16] \
      [--block-size 16] [--shared-prefix 512] [--device cuda --dtype bfloat16] \
      [--rounds 10] [--output-json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from roofline import model_costs, read_bandwidth_probe
from workload import num_cores, resolve_model_dir, write_json

DEFAULT_CONTEXTS = (128, 256, 512, 1024, 2048, 4096)
DEFAULT_BATCH_SIZES = (1, 16)
DEFAULT_BLOCK_SIZE = 16
REPEATS = 10


def kv_bytes_per_token(model, itemsize: int) -> int:
    """Bytes of keys and values one token holds over all layers (what a decode reads of it)."""
    config = model.config
    return 2 * config.num_hidden_layers * model.num_kv_heads * config.head_dim * itemsize


@contextlib.contextmanager
def gathered(model) -> Iterator[None]:
    """Within the block, the model runs its torch code: gathered attention, unfused small ops."""
    from worker.attention import AttentionKind
    from worker.models import cpu_ops

    applies, kind = cpu_ops.applies, model.attention_kind
    cpu_ops.applies = lambda tensor: False
    model.attention_kind = AttentionKind.GATHERED
    try:
        yield
    finally:
        cpu_ops.applies, model.attention_kind = applies, kind


def prepare_decode_step(
    model,
    batch_size: int,
    context: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    cuda_graph: bool = False,
    shared_prefix: int = 0,
) -> tuple[Callable[[], None], float]:
    """(one decode step of ``batch_size`` requests at ``context`` tokens in blocks of
    ``block_size``, ready to run under ``torch.inference_mode()``; the median seconds of building
    its layout) with the model's attention, over a cache of its own; every request's first
    ``shared_prefix`` tokens (whole blocks) lie in the first request's blocks. With
    ``cuda_graph``, the step replays a CUDA graph of it (``worker.cuda_graphs``), its inputs'
    copy to the device included, and the layout time is 0."""
    import numpy as np
    import torch

    from worker.attention import build_batch_layout
    from worker.cuda_graphs import DecodeGraphs
    from worker.kv_cache import KVCache

    config, device = model.config, model.model.norm.weight.device

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    blocks_per_request = -(-context // block_size)
    num_blocks = batch_size * blocks_per_request
    cache = KVCache.for_model(model, num_blocks + 1, block_size)  # +1: a graph's padding rows
    for tensor in (*cache.key_caches, *cache.value_caches):
        tensor.normal_()
    pool = np.random.default_rng(0).permutation(num_blocks).reshape(batch_size, -1).tolist()
    for table in pool[1:]:
        table[: shared_prefix // block_size] = pool[0][: shared_prefix // block_size]

    def build():
        return build_batch_layout(
            [context - 1] * batch_size,
            [1] * batch_size,
            pool,
            block_size,
            device,
            kind=model.attention_kind,
            num_cache_blocks=num_blocks + 1,
        )

    synchronize()  # the cache's random fill runs on the device: not part of the layout
    input_ids = torch.randint(100, config.vocab_size, (batch_size,), device=device)
    if cuda_graph:
        graphs = DecodeGraphs(model, cache, num_blocks, context, [max(batch_size, 2)])
        graphs.capture()
        positions, token_ids = [context - 1] * batch_size, input_ids.tolist()

        def step() -> None:
            graphs.run(positions, pool, token_ids)
            synchronize()

        return step, 0.0

    layout_samples = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        layout = build()
        synchronize()
        layout_samples.append(time.perf_counter() - start)
    logits_indices = torch.arange(batch_size, device=device)

    def step() -> None:
        model(input_ids, layout.positions, cache, layout.metadata, logits_indices)
        synchronize()

    return step, statistics.median(layout_samples)


def repeated(step: Callable[[], None]) -> list[float]:
    """Seconds of ``REPEATS`` runs of ``step``, after two uncounted, as the worker runs one."""
    import torch

    with torch.inference_mode():
        for _ in range(2):
            step()
        return [timed(step) for _ in range(REPEATS)]


def timed(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def measure(
    model_dir: Path,
    contexts: list[int],
    batch_sizes: list[int],
    device_name: str,
    dtype_name: str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    shared_prefix: int = 0,
    rounds: int = REPEATS,
) -> dict:
    """Every (batch, context) in place over a cache of its own, all timed in turns for
    ``rounds`` rounds with one ``sum()`` read per round; then each gathered (and on CUDA as a
    graph) on its own. Rows hold medians; ``growth`` holds each batch size's growth from the
    shortest context to the longest against the bytes' time, per round."""
    import torch

    from worker.models.loader import load_model

    torch.set_num_threads(num_cores())
    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    model = load_model(model_dir, device, dtype)
    itemsize = dtype.itemsize
    weight_bytes = model_costs(model_dir)["weight_bytes_per_decode_step"] * itemsize // 4
    configurations = [(batch, context) for batch in batch_sizes for context in contexts]

    def timing(context: int) -> dict:
        shared = min(shared_prefix, context - 1) // block_size * block_size
        return {"block_size": block_size, "shared_prefix": shared}

    def kv_bytes(batch_size: int, context: int) -> int:
        shared = timing(context)["shared_prefix"]
        unique_tokens = shared + batch_size * (context - shared)
        return unique_tokens * kv_bytes_per_token(model, itemsize)

    steps, layout_seconds = {}, {}
    for batch, context in configurations:
        steps[batch, context], layout_seconds[batch, context] = prepare_decode_step(
            model, batch, context, **timing(context)
        )
    read = read_bandwidth_probe(device=device)
    samples: dict[tuple[int, int], list[float]] = {key: [] for key in configurations}
    bandwidths = []
    with torch.inference_mode():  # as the worker runs a step
        for step in (*steps.values(), read):  # the first touch of every cache and the tensor
            step()
            step()
        for _ in range(rounds):
            bandwidths.append(read())
            for key, step in steps.items():
                samples[key].append(timed(step))
    del steps, step, read  # every cache and the 1 GiB at once; the gathered steps make their own
    bandwidth = statistics.median(bandwidths)

    rows = []
    for batch, context in configurations:
        with gathered(model):
            gathered_step, _ = prepare_decode_step(model, batch, context, **timing(context))
            gathered_samples = repeated(gathered_step)
        rows.append(
            {
                "batch_size": batch,
                "context": context,
                "in_place_ms": statistics.median(samples[batch, context]) * 1e3,
                "gathered_ms": statistics.median(gathered_samples) * 1e3,
                "layout_ms": layout_seconds[batch, context] * 1e3,
                "kv_bytes": kv_bytes(batch, context),
                "floor_ms": (weight_bytes + kv_bytes(batch, context)) / bandwidth * 1e3,
            }
        )
        if device.type == "cuda":
            graph_step, _ = prepare_decode_step(
                model, batch, context, cuda_graph=True, **timing(context)
            )
            rows[-1]["cuda_graph_ms"] = statistics.median(repeated(graph_step)) * 1e3
        print(format_row(rows[-1]), flush=True)

    growth = []
    shortest, longest = min(contexts), max(contexts)
    for batch in batch_sizes if longest > shortest else ():
        extra_bytes = kv_bytes(batch, longest) - kv_bytes(batch, shortest)
        pairs = zip(samples[batch, longest], samples[batch, shortest], strict=True)
        ratios = [
            (long - short) / (extra_bytes / rate)
            for (long, short), rate in zip(pairs, bandwidths, strict=True)
        ]
        growth.append(
            {
                "batch_size": batch,
                "from_context": shortest,
                "to_context": longest,
                "extra_kv_bytes": extra_bytes,
                "step_growth_ms": (
                    statistics.median(samples[batch, longest])
                    - statistics.median(samples[batch, shortest])
                )
                * 1e3,
                "bytes_ms": extra_bytes / bandwidth * 1e3,
                "ratio_median": statistics.median(ratios),
                "ratios": ratios,
            }
        )
    from torch._dynamo.utils import counters

    return {
        "model_dir": str(model_dir),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "compiled_graphs": counters["stats"]["unique_graphs"],  # FlexAttention's, on CUDA
        "dtype": dtype_name,
        "attention": model.attention_kind.value,
        "num_threads": torch.get_num_threads(),
        "block_size": block_size,
        "shared_prefix": shared_prefix,
        "read_bandwidth_bytes_per_s_median": bandwidth,
        "read_bandwidth_bytes_per_s": bandwidths,
        "weight_bytes_per_decode_step": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token(model, itemsize),
        "rounds": rounds,
        "repeats": REPEATS,
        "rows": rows,
        "growth": growth,
    }


def format_growth(entry: dict) -> str:
    ratios = entry["ratios"]
    return (
        f"batch {entry['batch_size']}, {entry['from_context']} to {entry['to_context']} tokens: "
        f"the step grows {entry['step_growth_ms']:.1f} ms for "
        f"{entry['extra_kv_bytes'] / 1e6:.0f} MB more keys and values "
        f"({entry['bytes_ms']:.1f} ms at sum()'s rate): {entry['ratio_median']:.2f} x "
        f"(median of {len(ratios)} rounds; {min(ratios):.2f}-{max(ratios):.2f})"
    )


HEADER = (
    "| batch | context | KV read (MB) | in place (ms) | gathered (ms) | layout (ms) | floor (ms) "
    "| in place / floor |"
)


def format_row(row: dict) -> str:
    graph = f" {row['cuda_graph_ms']:.2f} |" if "cuda_graph_ms" in row else ""
    return (
        f"| {row['batch_size']} | {row['context']} | {row['kv_bytes'] / 1e6:.0f} "
        f"| {row['in_place_ms']:.2f} | {row['gathered_ms']:.2f} | {row['layout_ms']:.2f} "
        f"| {row['floor_ms']:.2f} | {row['in_place_ms'] / row['floor_ms']:.2f} |{graph}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", help="directory or .gguf (default: the default model)")
    parser.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)))
    parser.add_argument("--batch-sizes", default=",".join(map(str, DEFAULT_BATCH_SIZES)))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument(
        "--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV cache block"
    )
    parser.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="tokens every request shares (whole blocks, as a prefix-cache hit leaves them)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=REPEATS,
        help="rounds of in-place steps, every configuration once a round in turns",
    )
    parser.add_argument("--output-json", help="write every measurement here")
    args = parser.parse_args(argv)
    try:
        contexts = [int(value) for value in args.contexts.split(",")]
        batch_sizes = [int(value) for value in args.batch_sizes.split(",")]
    except ValueError:
        parser.error("--contexts and --batch-sizes take comma-separated whole numbers")
    if min(contexts) < 1 or min(batch_sizes) < 1 or args.block_size < 1 or args.rounds < 1:
        parser.error("contexts, batch sizes, the block size and --rounds must be positive")
    if args.shared_prefix < 0:
        parser.error("--shared-prefix must not be negative")
    graphs = args.device == "cuda"  # a third column: the in-place step replayed as a graph
    print(HEADER + (" CUDA graph (ms) |" if graphs else ""))
    print("|---" * (9 if graphs else 8) + "|")
    results = measure(
        resolve_model_dir(args.model_path),
        contexts,
        batch_sizes,
        args.device,
        args.dtype,
        args.block_size,
        args.shared_prefix,
        args.rounds,
    )
    bandwidth = results["read_bandwidth_bytes_per_s_median"]
    print(f"read bandwidth (median of {args.rounds} rounds): {bandwidth / 1e9:.1f} GB/s")
    for entry in results["growth"]:
        print(format_growth(entry))
    if args.output_json:
        write_json(args.output_json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
