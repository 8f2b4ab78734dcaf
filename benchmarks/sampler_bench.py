"""The worker's sampling cost per step over the default model's vocabulary, before and after
the counter-based draw (issue 22).

For each ``--rows`` count and each variant (temperature 0.8; with top-p 0.95; with top-k 50),
over random logits of ``--vocab-size`` ids, it times one sampling step

- (a) before, no row seeded: the sampler of commit e933b25 (every row sorted for top-k/top-p,
  noise from one ``exponential_`` over the batch);
- (b) before, every row seeded: the same, and each row's noise drawn again from its own
  ``torch.Generator``, re-seeded for the token (one small call per row);
- now, every row seeded: ``worker.sampler.Sampler`` (counter-based noise; only rows with
  top-k, top-p or min-p sorted; on a CPU in float32 the race in one C pass,
  ``cpu_ops.sample_tokens``, the noise made as it is used, elsewhere a few int64 tensor ops for
  the whole batch),

then the three noise draws alone, then a greedy step (temperature 0) by the sampler's torch ops
against ``Sampler`` now (on a CPU: ``cpu_ops.greedy_tokens``, one pass over the logits); each
number is the best of ``--repeats`` steps. Logits processors are left out (none of these rows
needs one).

Run: ``python benchmarks/sampler_bench.py [--threads 2] [--rows 1 8 32 64] [--device cpu]``;
``--quick`` is a smoke run of a few seconds (a small vocabulary, few repeats).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from workload import DEFAULT_VOCAB_SIZE, num_cores

from interfaces import SamplingParams
from worker.sampler import Sampler, SamplingBatch, exponential_noise, finite_logits, noise_key

VARIANTS = {
    "temperature 0.8": SamplingParams(top_k=0, temperature=0.8),
    "+ top-p 0.95": SamplingParams(top_k=0, temperature=0.8, top_p=0.95),
    "+ top-k 50": SamplingParams(top_k=50, temperature=0.8),
}
TOKEN_SEED_MIX = 0x9E3779B97F4A7C15
"""The per-token re-seeding of the sampler before: (seed * this + token index) mod 2^63."""


def sorted_probabilities_before(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``filtered_probabilities`` before: every row sorted, filtered or not."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks >= batch.top_ks[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    too_unlikely = sorted_probs < batch.min_ps[:, None] * sorted_probs[:, :1]
    outside = (mass_before > batch.top_ps[:, None]) | too_unlikely
    sorted_probs = sorted_logits.masked_fill(outside, float("-inf")).softmax(dim=-1)
    return torch.zeros_like(sorted_probs).scatter_(-1, sorted_ids, sorted_probs)


class SamplerBefore:
    """The sampler before the counter-based draw; ``seeds`` None: no row seeded."""

    def __init__(self, device: torch.device, seeds: list[int] | None) -> None:
        self.generator = torch.Generator(device).manual_seed(0)
        self.seeds = seeds
        self.row_generators = [torch.Generator(device) for _ in seeds or []]

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, token_index: int):
        logits = finite_logits(logits)
        tokens = logits.argmax(dim=-1)
        scaled = finite_logits(logits / batch.temperatures[:, None])
        probs = sorted_probabilities_before(scaled, batch)
        sampled = (probs / self.noise(probs, token_index)).argmax(dim=-1)
        return torch.where(batch.is_greedy, tokens, sampled)

    def noise(self, probs: torch.Tensor, token_index: int) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, (seed, generator) in enumerate(
            zip(self.seeds or [], self.row_generators, strict=True)
        ):
            generator.manual_seed((seed * TOKEN_SEED_MIX + token_index) % (1 << 63))
            noise[row].exponential_(generator=generator)
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


@dataclass(frozen=True)
class Timer:
    """Times steps on ``device``: the shortest of ``repeats`` after 2 warm-ups (on a shared
    machine the shortest is the one least disturbed by other work), on ``clock``."""

    device: torch.device
    repeats: int
    clock: Callable[[], float]

    def best_ms(self, step: Callable[[int], object]) -> float:
        """Milliseconds of ``step(token_index)``, token index counting up from 0."""
        samples = []
        for token_index in range(self.repeats + 2):
            start = self.clock()
            step(token_index)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            samples.append(self.clock() - start)
        return min(samples[2:]) * 1e3


def step_times(rows: int, params: SamplingParams, vocab_size: int, timer: Timer) -> list[float]:
    """Milliseconds per step of (a), (b) and now for ``rows`` rows sampled with ``params``."""
    device = timer.device
    logits = 4 * torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(0))
    logits = logits.to(device)
    seeds = list(range(1000, 1000 + rows))
    unseeded = SamplingBatch.from_params([params] * rows, [None] * rows, vocab_size, device)
    before_unseeded, before_seeded = SamplerBefore(device, None), SamplerBefore(device, seeds)
    sampler = Sampler(device, seed=0)

    def now(token_index: int) -> torch.Tensor:
        keys = [noise_key(seed, token_index) for seed in seeds]
        return sampler(logits, SamplingBatch.from_params([params] * rows, keys, vocab_size, device))

    return [
        timer.best_ms(lambda i: before_unseeded(logits, unseeded, i)),
        timer.best_ms(lambda i: before_seeded(logits, unseeded, i)),
        timer.best_ms(now),
    ]


def noise_times(rows: int, vocab_size: int, timer: Timer) -> list[float]:
    """Milliseconds of the noise alone: one generator, one per row re-seeded, counter-based."""
    device = timer.device
    probs = torch.empty(rows, vocab_size, device=device)
    unseeded, seeded = SamplerBefore(device, None), SamplerBefore(device, list(range(rows)))

    def counter_based(token_index: int) -> torch.Tensor:
        keys = torch.tensor([noise_key(row, token_index) for row in range(rows)], device=device)
        return exponential_noise(keys, vocab_size)

    return [
        timer.best_ms(lambda i: unseeded.noise(probs, i)),
        timer.best_ms(lambda i: seeded.noise(probs, i)),
        timer.best_ms(counter_based),
    ]


def greedy_times(rows: int, vocab_size: int, timer: Timer) -> list[float]:
    """Milliseconds of a greedy step: the sampler's torch ops (non-finite logits mapped, rows
    with nothing to pick found, argmax), and ``Sampler`` now."""
    device = timer.device
    logits = 4 * torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(0))
    logits = logits.to(device)
    params = [SamplingParams(temperature=0.0)] * rows
    batch = SamplingBatch.from_params(params, [None] * rows, vocab_size, device)
    sampler = Sampler(device, seed=0)

    def torch_ops(token_index: int) -> torch.Tensor:
        finite = finite_logits(logits)
        nothing_allowed = torch.isneginf(finite).all(dim=-1)
        return finite.argmax(dim=-1).masked_fill(nothing_allowed, -1)

    return [timer.best_ms(torch_ops), timer.best_ms(lambda i: sampler(logits, batch))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=num_cores())
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="thread: this thread's CPU time, which waiting for a busy core does not inflate "
        "(CPU and --threads 1 only: torch then computes on this thread)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 and 4 rows of 1024")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.vocab_size, args.repeats = [1, 4], 1024, 3
    if min(args.rows) < 1 or args.vocab_size < 64 or args.repeats < 1:
        parser.error("--rows and --repeats must be positive, --vocab-size at least 64")
    if args.clock == "thread" and (args.threads != 1 or args.device != "cpu"):
        parser.error("--clock thread needs --threads 1 and --device cpu")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    timer = Timer(device, args.repeats, CLOCKS[args.clock])
    print(f"vocabulary {args.vocab_size}, {args.threads} threads, {device}")
    print(f"milliseconds ({args.clock} clock) per step, the best of {args.repeats}")
    print(f"{'rows':>4}  {'variant':16s} {'(a) unseeded':>13s} {'(b) seeded':>11s} {'now':>8s}")
    for rows in args.rows:
        for name, params in VARIANTS.items():
            times = step_times(rows, params, args.vocab_size, timer)
            print(f"{rows:4d}  {name:16s} {times[0]:13.2f} {times[1]:11.2f} {times[2]:8.2f}")
    print(f"\n{'rows':>4}  noise only: {'one generator':>13s} {'per row':>8s} {'counter':>8s}")
    for rows in args.rows:
        times = noise_times(rows, args.vocab_size, timer)
        print(f"{rows:4d}  {'':12s} {times[0]:13.2f} {times[1]:8.2f} {times[2]:8.2f}")
    print(f"\n{'rows':>4}  greedy: {'torch ops':>9s} {'now':>8s}")
    for rows in args.rows:
        times = greedy_times(rows, args.vocab_size, timer)
        print(f"{rows:4d}  {'':7s} {times[0]:9.2f} {times[1]:8.2f}")


if __name__ == "__main__":
    main()
