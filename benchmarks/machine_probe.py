"""This machine's arithmetic peak and how fast a paged pool can be read, beside ``sum()``.

Two limits the CPU kernels are measured against (``benchmarks/machine_probe.c``, built with the
kernels' own flags):

- the float32 multiply-add peak: every thread updates 12 independent vectors held in registers,
  with no memory access (both cores, then one);
- the read rate of a pool of blocks lying in random order, as the paged KV cache's blocks do: the
  threads sum whole blocks (``--block-kib``, 12 KiB: 16 tokens of SmolLM2's keys, or values, at
  every head) in a shuffled order with each of four prefetch schemes, and in order without one,
  beside ``sum()`` of the same pool as one contiguous tensor (the floor ``context_bench.py``
  divides by). Nothing is computed but the sum, so this is what the layout allows any kernel.

Each measurement is the median of ``--rounds``, the variants taking turns. Every read is checked:
the pool holds ones, so each sum must equal the number of floats read.

Run alone: ``python benchmarks/machine_probe.py [--pool-mib 1024] [--block-kib 12] [--rounds 7]``.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch
from workload import num_cores

from worker.models import native

SOURCE = Path(__file__).with_name("machine_probe.c")
SCHEMES = {
    0: "random order, hardware prefetch alone",
    1: "random order, next block into L1",
    2: "random order, next into L1, the one after into L2",
    3: "random order, next into L1, page starts of the one after into L2",
}
FMA_FLOPS = 12 * 16 * 2  # per iteration and thread: 12 vectors of 16 multiply-adds


def load_probe() -> ctypes.CDLL | None:
    library = native.load(SOURCE)
    if library is None:
        return None
    library.sy_fma_loop.argtypes = [ctypes.c_int64]
    library.sy_fma_loop.restype = ctypes.c_float
    library.sy_read_blocks.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
    ]
    library.sy_read_blocks.restype = ctypes.c_double
    return library


def fma_peak(library: ctypes.CDLL, threads: int, iterations: int, rounds: int) -> float:
    """GFLOP/s of the register-only loop on ``threads`` threads (median of ``rounds``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            library.sy_fma_loop(iterations)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return iterations * FMA_FLOPS * threads / statistics.median(times) / 1e9


def read_rates(
    library: ctypes.CDLL, pool_bytes: int, block_bytes: int, rounds: int, seed: int = 0
) -> dict[str, float]:
    """GB/s of each way of reading the pool (median of ``rounds``, the ways taking turns)."""
    block_floats = block_bytes // 4
    num_blocks = pool_bytes // block_bytes
    pool = torch.ones(num_blocks * block_floats)
    shuffled = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    in_order = torch.arange(num_blocks)

    def blocks(order: torch.Tensor, scheme: int):
        def read() -> None:
            total = library.sy_read_blocks(
                pool.data_ptr(), order.data_ptr(), num_blocks, block_floats, scheme
            )
            if total != pool.numel():
                raise RuntimeError(f"the probe read {total} floats of {pool.numel()}")

        return read

    ways = {name: blocks(shuffled, scheme) for scheme, name in SCHEMES.items()}
    ways["in order, hardware prefetch alone"] = blocks(in_order, 0)
    ways["sum() of the pool as one tensor"] = pool.sum
    times: dict[str, list[float]] = {name: [] for name in ways}
    for turn in range(1 + rounds):
        for name, read in ways.items():
            start = time.perf_counter()
            read()
            if turn:  # the first turn warms up
                times[name].append(time.perf_counter() - start)
    return {name: pool.numel() * 4 / statistics.median(t) / 1e9 for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=num_cores())
    parser.add_argument("--pool-mib", type=int, default=1024, help="size of the pool, at most 4096")
    parser.add_argument("--block-kib", type=int, default=12, help="size of one block of it")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--fma-iterations", type=int, default=20_000_000, help="of the peak loop, each thread"
    )
    args = parser.parse_args(argv)
    if min(args.threads, args.pool_mib, args.block_kib, args.rounds, args.fma_iterations) < 1:
        parser.error("every number must be positive")
    if args.block_kib * 1024 > args.pool_mib * 1024 * 1024 or args.pool_mib > 4096:
        parser.error("the pool holds at least one block and at most 4096 MiB")
    library = load_probe()
    if library is None:
        parser.error("machine_probe.c could not be built here (no C compiler?)")
    torch.set_num_threads(args.threads)
    print(f"| float32 multiply-add peak, {args.threads} threads | 1 thread |")
    print("|---|---|")
    both = fma_peak(library, args.threads, args.fma_iterations, args.rounds)
    one = fma_peak(library, 1, args.fma_iterations, args.rounds)
    print(f"| {both:.0f} GFLOP/s | {one:.0f} GFLOP/s |")
    pool_bytes, block_bytes = args.pool_mib << 20, args.block_kib << 10
    print(f"\n| reading {args.pool_mib} MiB in blocks of {args.block_kib} KiB | GB/s |")
    print("|---|---|")
    for name, rate in read_rates(library, pool_bytes, block_bytes, args.rounds).items():
        print(f"| {name} | {rate:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
