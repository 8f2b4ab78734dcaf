"""Batched token sampling: greedy, temperature, top-k, top-p and min-p in one pass of torch ops.

The logits processors (grammar mask, min-new-tokens, logit bias, penalties; see
``worker.logits_processors``) run first, on a copy of the logits.

Random choices use the exponential race: ``argmax(probs / noise)`` with ``noise ~ Exp(1)`` picks
token i with probability ``probs[i]``. The noise is counter-based: row r's noise for vocab id v
is a pure function of (the row's noise key, v), computed for the whole batch in a few int64
tensor ops (``exponential_noise``). A seeded request's key is ``noise_key(seed, index of the token
being generated)``, so its tokens do not depend on which other requests share the batch, on its
row, nor on whether it was preempted and resumed or moved to another worker. A row without a seed
gets a fresh key from the sampler's own random source at every step. (This replaced one
``torch.Generator`` per seeded row, re-seeded per token: about 5 times the cost of this draw on
a CPU, and one small call per row, worse still on a GPU; docs/performance.md.)

Every row's probabilities depend on that row alone (the torch ops sort only the rows that ask
for top-k, top-p or min-p). On the CPU in float32 the tokens come from C (``c_tokens``): a
batch of greedy rows from ``cpu_ops.greedy_tokens`` (one pass over the logits instead of four:
64 rows of a 49,152-token vocabulary, 5.5 ms became 0.3), any other batch from
``cpu_ops.sample_tokens``, the race in one pass with each row's noise made as it is used and
its filters found without a sort (64 rows at temperature 0.8: 46 ms became ~5; with top-p 0.95,
167 became ~11). Both pick the tokens the torch ops (``torch_tokens``, the path elsewhere)
pick, but for scores within float32 rounding of one another, a filter's mass or weight within
rounding of its threshold, and ties in the logits at a filter's boundary.

Non-finite logits never reach a probability: NaN counts as -inf (never sampled), +inf as the
largest float32 (a tie among the infinite tokens), so softmax and argmax stay defined. A row
with no finite logit left (a model that produced only NaN, or processors that forbid every
token) has no token to give: ``Sampler.__call__`` returns ``NO_TOKEN`` for it rather than a
token its grammar forbids. Temperatures below 1e-5 are greedy (``SamplingParams.is_greedy``).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from interfaces import SamplingParams
from worker.logits_processors import LogitsProcessors
from worker.models import cpu_ops

NO_TOKEN = -1
"""The token id of a row that had nothing to sample (every logit -inf or NaN)."""

_MASK_64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment
_MIX_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # splitmix64's finaliser
_NUM_UNIFORM_BITS = 52  # (2 k + 1) / 2^53 for k < 2^52 is exact in float64
CPU_NOISE_CHUNK_ELEMENTS = 1 << 17
"""On a CPU the noise is made this many entries at a time (whole rows, at least one), so that
its passes over int64 values stay in cache: 2-3 times faster at 32-64 rows of 49152 than one
pass over the batch (docs/performance.md). A GPU makes it in one pass."""


def check_supported(params: SamplingParams, vocab_size: int) -> None:
    """Raise ``ValueError`` for settings this sampler cannot apply to a vocabulary this size."""
    outside = sorted(token for token in params.logit_bias or {} if token >= vocab_size)
    if outside:
        raise ValueError(
            f"logit_bias names token ids outside the vocabulary of {vocab_size}: {outside[:5]}"
        )


def noise_key(seed: int, token_index: int) -> int:
    """The noise key (a signed int64) of output token ``token_index`` of a request seeded with
    ``seed`` (any integer; taken modulo 2^64): output ``token_index`` of a splitmix64 stream
    whose state starts at mix64(seed)."""
    state = _mix64_int(seed & _MASK_64) + (token_index + 1) * _GOLDEN_GAMMA
    return _as_int64(_mix64_int(state & _MASK_64))


def exponential_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise (num_rows, vocab_size) float32 for int64 ``keys`` (num_rows,).

    Entry (r, v) is ``-log(u)`` for u uniform in (0, 1), made of the top 52 bits of
    mix64(keys[r] + (v + 1) * gamma): output v of a splitmix64 stream whose state starts at
    the row's key. It depends on nothing else, and every entry is finite and positive.
    """
    counters = _vocab_counters(vocab_size, keys.device)
    noise = torch.empty(len(keys), vocab_size, device=keys.device)
    rows_per_chunk = max(1, len(keys))
    if keys.device.type == "cpu":
        rows_per_chunk = max(1, CPU_NOISE_CHUNK_ELEMENTS // vocab_size)
    for start in range(0, len(keys), rows_per_chunk):
        chunk = slice(start, start + rows_per_chunk)
        noise[chunk] = _rows_noise(keys[chunk], counters)
    return noise


@functools.cache
def _vocab_counters(vocab_size: int, device: torch.device) -> torch.Tensor:
    """(v + 1) * gamma for every vocab id v, int64: built once per vocabulary and device, and
    only read (every step's noise adds its keys to it)."""
    counters = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=device)
    return counters.mul_(_as_int64(_GOLDEN_GAMMA))  # wraps modulo 2^64, as splitmix64 does


def _rows_noise(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """``exponential_noise`` of ``keys``, given the vocabulary's splitmix64 counters."""
    bits = keys[:, None] + counters  # (num_rows, vocab_size)
    scratch = torch.empty_like(bits)
    _mix64_tensor(bits, scratch)
    _logical_right_shift(bits, 64 - _NUM_UNIFORM_BITS, out=bits)
    uniform = bits.double().mul_(2.0**-_NUM_UNIFORM_BITS).add_(2.0 ** -(_NUM_UNIFORM_BITS + 1))
    return uniform.log_().neg_().float()  # in [1e-16, 37]: never 0, so probs / noise is defined


def _mix64_int(value: int) -> int:
    """splitmix64's finaliser on an unsigned 64-bit Python int."""
    for shift, multiplier in zip((30, 27), _MIX_MULTIPLIERS, strict=True):
        value = ((value ^ (value >> shift)) * multiplier) & _MASK_64
    return value ^ (value >> 31)


def _mix64_tensor(values: torch.Tensor, scratch: torch.Tensor) -> None:
    """``_mix64_int`` on an int64 tensor, in place (``scratch``: a buffer of its shape): its
    multiplications wrap modulo 2^64 as unsigned ones do, and a logical shift is an
    arithmetic shift and a mask. In place, since the noise is a few passes over num_rows x
    vocab_size int64 values: fewer buffers, less memory traffic."""
    for shift, multiplier in zip((30, 27), _MIX_MULTIPLIERS, strict=True):
        values ^= _logical_right_shift(values, shift, out=scratch)
        values *= _as_int64(multiplier)
    values ^= _logical_right_shift(values, 31, out=scratch)


def _logical_right_shift(values: torch.Tensor, shift: int, out: torch.Tensor) -> torch.Tensor:
    """``values >>> shift`` (as unsigned 64-bit) into ``out``, which may be ``values``."""
    torch.bitwise_right_shift(values, shift, out=out)
    return out.bitwise_and_((1 << (64 - shift)) - 1)


def _as_int64(value: int) -> int:
    """An unsigned 64-bit value as the signed int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings as device tensors (one row per request being sampled).

    ``noise_keys[i]`` is row i's ``noise_key`` (of its seed and the index of the token it
    samples), or None for a row without a seed: the sampler draws it a fresh key.
    ``top_ks`` holds vocab_size where top-k is off, ``top_ps`` infinity where top-p is off.
    ``filtered_rows`` are the sampled (not greedy) rows that ask for top-k, top-p or min-p.
    ``processors`` edit the logits before any of that (None: no row needs them).
    """

    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    is_greedy: torch.Tensor
    all_greedy: bool
    filtered_rows: torch.Tensor
    noise_keys: Sequence[int | None]
    processors: LogitsProcessors | None = None

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        noise_keys: Sequence[int | None],
        vocab_size: int,
        device: torch.device,
        processors: LogitsProcessors | None = None,
    ) -> SamplingBatch:
        greedy = [p.is_greedy for p in params]  # temperatures below 1e-5 too
        top_ks = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        filtered = [
            row
            for row, (p, g) in enumerate(zip(params, greedy, strict=True))
            if not g and (top_ks[row] < vocab_size or p.top_p < 1.0 or p.min_p > 0.0)
        ]
        return cls(
            temperatures=_tensor(
                [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                device,
                torch.float32,
            ),
            top_ks=_tensor(top_ks, device, torch.int64),
            top_ps=_tensor(
                [p.top_p if p.top_p < 1.0 else float("inf") for p in params], device, torch.float32
            ),
            min_ps=_tensor([p.min_p for p in params], device, torch.float32),
            is_greedy=_tensor(greedy, device, torch.bool),
            all_greedy=all(greedy),
            filtered_rows=torch.tensor(filtered, dtype=torch.int64, device=device),
            noise_keys=noise_keys,
            processors=processors,
        )


def _tensor(values: list, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


class Sampler:
    """Picks one token per row of a logits batch.

    ``seed`` seeds the random source of the noise keys of rows without a seed of their own;
    None seeds it randomly.
    """

    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = device
        self.random = random.Random(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Token ids (num_rows,) int64 for float32 ``logits`` (num_rows, vocab_size): each in
        the vocabulary, or ``NO_TOKEN`` for a row without a finite logit.

        ``logits`` is not modified (the caller may still need the raw values for logprobs).
        On the CPU in float32 the C kernels pick the tokens (``cpu_ops.greedy_tokens``,
        ``cpu_ops.sample_tokens``: the same tokens as ``torch_tokens``, in one pass); elsewhere
        ``torch_tokens`` does.
        """
        if batch.processors is not None:
            logits = batch.processors.apply(logits)
        in_c = cpu_ops.applies(logits) and logits.is_contiguous()
        if batch.all_greedy:
            return cpu_ops.greedy_tokens(logits) if in_c else torch_tokens(logits, batch, None)
        keys = self.noise_keys(batch)
        if in_c:
            return c_tokens(logits, batch, keys)
        return torch_tokens(logits, batch, keys)

    def noise_keys(self, batch: SamplingBatch) -> torch.Tensor:
        """The batch's noise keys (num_rows,) int64, with a fresh key from this sampler's
        random source for each row that has none."""
        keys = [
            _as_int64(self.random.getrandbits(64)) if key is None else key
            for key in batch.noise_keys
        ]
        return torch.tensor(keys, dtype=torch.int64, device=self.device)


def torch_tokens(
    logits: torch.Tensor, batch: SamplingBatch, keys: torch.Tensor | None
) -> torch.Tensor:
    """``Sampler.__call__``'s tokens by torch ops (after the processors), the noise of ``keys``
    (None: every row greedy)."""
    logits = finite_logits(logits)
    nothing_allowed = torch.isneginf(logits).all(dim=-1)  # (num_rows,)
    tokens = logits.argmax(dim=-1)
    if not batch.all_greedy:
        scaled = finite_logits(logits / batch.temperatures[:, None])
        probs = filtered_probabilities(scaled, batch)
        sampled = (probs / exponential_noise(keys, logits.shape[-1])).argmax(dim=-1)
        tokens = torch.where(batch.is_greedy, tokens, sampled)
    return tokens.masked_fill(nothing_allowed, NO_TOKEN)


def c_tokens(logits: torch.Tensor, batch: SamplingBatch, keys: torch.Tensor) -> torch.Tensor:
    """``torch_tokens`` by ``cpu_ops.sample_tokens`` for CPU float32 ``logits``: every row,
    its filters included, in one C task (docs/performance.md: 64 rows of 49,152 logits at
    temperature 0.8, 46 ms by torch ops and ~5 in C; with top-p 0.95, 167 and ~11)."""
    return cpu_ops.sample_tokens(
        logits,
        batch.temperatures,
        batch.top_ks,
        batch.top_ps,
        batch.min_ps,
        keys,
        ~batch.is_greedy,
    )


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` with NaN as -inf and +inf as the largest float32 (unchanged when all are
    finite or -inf, so parity rows stay bit-for-bit). -inf stays -inf: a token that processors
    forbid is never picked, not even from a row with nothing else left (``nan_to_num`` would
    make it the lowest float32 by default)."""
    return torch.nan_to_num(
        logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf")
    )


def filtered_probabilities(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Softmax of ``logits`` (num_rows, vocab_size), each of ``batch.filtered_rows``
    restricted by its top-k, top-p and min-p; only those rows are sorted."""
    rows = batch.filtered_rows
    if rows.numel():
        kept = _drop_filtered(
            logits[rows], batch.top_ks[rows], batch.top_ps[rows], batch.min_ps[rows]
        )
        logits = logits.index_copy(0, rows, kept)
    return logits.softmax(dim=-1)


def _drop_filtered(
    logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor
) -> torch.Tensor:
    """``logits`` (num_rows, vocab_size) with -inf for the tokens top-k, top-p or min-p drop.

    Top-k keeps the ``top_k`` largest (ties broken by the sort); top-p keeps the smallest prefix
    of the sorted distribution whose mass reaches top_p (always at least the most likely token);
    min-p drops tokens below min_p times the top probability, after top-k.
    """
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    beyond_top_k = ranks >= top_ks[:, None]
    sorted_probs = sorted_logits.masked_fill(beyond_top_k, float("-inf")).softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    too_unlikely = sorted_probs < min_ps[:, None] * sorted_probs[:, :1]
    dropped_sorted = beyond_top_k | (mass_before > top_ps[:, None]) | too_unlikely
    dropped = torch.zeros_like(dropped_sorted).scatter_(-1, sorted_ids, dropped_sorted)
    return logits.masked_fill(dropped, float("-inf"))
