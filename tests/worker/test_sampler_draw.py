"""The sampler's counter-based draw (``worker.sampler``): noise that is a pure function of
(seed, token index, vocab id), its quality, and sampling that follows it whatever the batch."""

from __future__ import annotations

import math
import random

import pytest
import torch

from interfaces import SamplingParams
from interfaces.scheduler_to_worker import NewRequestData
from tests.support.step_driver import context
from worker import sampler
from worker.models import cpu_ops
from worker.request_state import RequestState
from worker.sampler import (
    NO_TOKEN,
    Sampler,
    SamplingBatch,
    exponential_noise,
    filtered_probabilities,
    noise_key,
)

CPU = torch.device("cpu")
SPLITMIX64_SEEDED_WITH_0 = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
"""The first outputs of splitmix64 from state 0 (Steele, Lea and Flood; Vigna's reference C)."""


def _noise_of(bits: int) -> float:
    """-log(u) for u made of the top 52 of 64 random bits, as the sampler makes it."""
    return -math.log((2 * (bits >> 12) + 1) / 2**53)


def _splitmix64(state: int, count: int) -> list[int]:
    """``count`` outputs of splitmix64 from ``state``, written out on Python integers."""
    outputs = []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) % 2**64
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        outputs.append(z ^ (z >> 31))
    return outputs


def test_each_rows_noise_is_splitmix64_from_its_key():
    assert _splitmix64(0, 3) == SPLITMIX64_SEEDED_WITH_0
    keys = [0, -1, -(2**63), 2**63 - 1, noise_key(1234, 5), noise_key(-7, 0)]
    noise = exponential_noise(torch.tensor(keys), 300)
    assert noise.shape == (6, 300) and noise.dtype == torch.float32
    for row, key in enumerate(keys):
        expected = [_noise_of(bits) for bits in _splitmix64(key % 2**64, 300)]
        assert noise[row].tolist() == pytest.approx(expected, rel=1e-6)
    assert noise[0, :3].tolist() == pytest.approx(
        [_noise_of(bits) for bits in SPLITMIX64_SEEDED_WITH_0], rel=1e-6
    )


def test_the_noise_does_not_depend_on_how_the_rows_are_chunked(monkeypatch):
    keys = torch.tensor([noise_key(seed, 0) for seed in range(9)])
    two_rows_at_a_time = exponential_noise(keys, 50_000)  # CPU_NOISE_CHUNK_ELEMENTS = 2^17
    monkeypatch.setattr(sampler, "CPU_NOISE_CHUNK_ELEMENTS", 1 << 30)
    assert torch.equal(exponential_noise(keys, 50_000), two_rows_at_a_time)


def test_noise_keys_are_a_function_of_seed_and_token_index_only():
    keys = {noise_key(seed, index) for seed in range(-500, 500) for index in range(100)}
    assert len(keys) == 100_000
    assert all(-(2**63) <= key < 2**63 for key in keys)
    assert noise_key(2**64 - 1, 3) == noise_key(-1, 3)  # seeds count modulo 2^64
    assert noise_key(42, 7) == noise_key(42, 7) != noise_key(42, 8)
    first = _splitmix64(_splitmix64(42 - 0x9E3779B97F4A7C15, 1)[0], 8)  # mix64(42), then on
    assert [noise_key(42, index) % 2**64 for index in range(8)] == first


def _uniforms(keys: list[int], vocab_size: int) -> torch.Tensor:
    return torch.exp(-exponential_noise(torch.tensor(keys), vocab_size).double())


def test_the_noise_is_uniform_and_uncorrelated_across_seeds_indices_and_vocab_ids():
    """1M draws: 64 seeds x 65 token indices x 256 vocab ids (the result is fixed, so these
    bounds, six standard deviations wide, cannot flake)."""
    seeds, indices, vocab_size = range(64), range(65), 256
    u = _uniforms([noise_key(s, i) for s in seeds for i in indices], vocab_size)
    u = u.view(len(seeds), len(indices), vocab_size)  # (seed, token index, vocab id)
    assert u.min().item() > 0.0 and u.max().item() < 1.0
    counts = torch.histc(u.flatten(), bins=100, min=0.0, max=1.0)
    expected = u.numel() / 100
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 99 + 6 * math.sqrt(2 * 99)  # 99 degrees of freedom
    noise = -u.log()
    assert noise.mean().item() == pytest.approx(1.0, abs=0.006)  # Exp(1): mean 1, variance 1
    assert noise.var().item() == pytest.approx(1.0, abs=0.02)
    pairs = {
        "next token index": (u[:, :-1], u[:, 1:]),
        "next seed": (u[:-1], u[1:]),
        "next vocab id": (u[..., :-1], u[..., 1:]),
    }
    for name, (a, b) in pairs.items():
        correlation = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()
        assert abs(correlation) < 0.006, name


@pytest.mark.parametrize("contiguous", [True, False], ids=["c-race", "torch-ops"])
def test_sampled_frequencies_match_the_probabilities(contiguous):
    """40,000 successive tokens of one seed over a vocabulary of 8, without and with top-p;
    contiguous CPU float32 logits take the C race (``cpu_ops.sample_tokens``), an expanded view
    the torch ops."""
    probs = torch.tensor([0.4, 0.2, 0.15, 0.1, 0.08, 0.05, 0.02, 0.0])
    num_draws = 40_000
    keys = [noise_key(7, index) for index in range(num_draws)]
    plain = SamplingParams(top_k=0, temperature=1.0, seed=7)
    top_p = SamplingParams(top_k=0, temperature=1.0, top_p=0.7, seed=7)
    kept = torch.tensor([0.4, 0.2, 0.15, 0, 0, 0, 0, 0]) / 0.75  # mass before token 3 is 0.75
    logits = probs.log().expand(num_draws, 8)
    if contiguous:
        logits = logits.contiguous()
    for params, expected in ((plain, probs), (top_p, kept)):
        batch = SamplingBatch.from_params([params] * num_draws, keys, 8, CPU)
        tokens = Sampler(CPU, seed=0)(logits, batch)
        frequencies = torch.bincount(tokens, minlength=8) / num_draws
        bounds = 5 * (expected * (1 - expected) / num_draws).sqrt() + 1e-9
        assert ((frequencies - expected).abs() <= bounds).all(), (frequencies, expected)
        assert frequencies[expected == 0].sum().item() == 0.0


needs_c = pytest.mark.skipif(cpu_ops.library() is None, reason="no C compiler here")


@needs_c
@pytest.mark.parametrize(("rows", "vocab"), [(1, 49152), (2, 4099), (64, 49152), (5, 37)])
def test_the_c_race_picks_the_torch_ops_tokens(rows, vocab):
    """Temperatures, top-k, top-p and min-p rows, greedy rows, a lone row (split over the
    threads), vocabularies that are not a multiple of 16, logits of three scales: the C race
    and the torch ops pick the same tokens from the same noise."""
    generator = torch.Generator().manual_seed(rows)
    for scale in (1.0, 3.0, 8.0):
        logits = scale * torch.randn(rows, vocab, generator=generator)
        params = [
            SamplingParams(
                top_k=(0, 0, 0, 40, 0)[row % 5],
                top_p=(1.0, 0.9, 1.0, 1.0, 1.0)[row % 5],
                min_p=(0.0, 0.0, 0.05, 0.0, 0.0)[row % 5],
                temperature=(0.7, 1.0, 1.3, 0.5, 0.0)[(row + int(scale)) % 5],
            )
            for row in range(rows)
        ]
        keys = [noise_key(row + int(scale), 9) for row in range(rows)]
        batch = SamplingBatch.from_params(params, keys, vocab, CPU)
        key_tensor = torch.tensor(keys)
        want = sampler.torch_tokens(logits, batch, key_tensor)
        assert sampler.c_tokens(logits, batch, key_tensor).tolist() == want.tolist()


@needs_c
@pytest.mark.parametrize(("shift", "scale"), [(0.0, 0.1), (0.0, 1.0), (0.0, 12.0), (20.0, 2.0)])
def test_the_c_filters_keep_what_the_torch_sort_keeps(shift, scale):
    """Top-k of 1 to vocab - 1, top-p from 0.01 to 0.99, min-p, and their combinations, over
    flat and peaked rows and rows far from zero (most of them in one bucket of the histogram),
    some with half their tokens forbidden (-inf): the C ranking (a histogram, only the
    boundary's bucket sorted) keeps the prefix the torch sort keeps."""
    combos = [
        (top_k, top_p, min_p)
        for top_k in (0, 1, 2, 50, 1000, 4098)
        for top_p in (1.0, 0.01, 0.5, 0.9, 0.99)
        for min_p in (0.0, 0.02, 0.3)
    ]
    vocab = 4099
    generator = torch.Generator().manual_seed(3)
    logits = shift + scale * torch.randn(len(combos), vocab, generator=generator)
    logits[::7, : vocab // 2] = float("-inf")
    params = [SamplingParams(top_k=k, top_p=p, min_p=m, temperature=0.9) for k, p, m in combos]
    for index in range(3):
        keys = torch.tensor([noise_key(row, index) for row in range(len(combos))])
        batch = SamplingBatch.from_params(params, keys.tolist(), vocab, CPU)
        want = sampler.torch_tokens(logits, batch, keys)
        assert sampler.c_tokens(logits, batch, keys).tolist() == want.tolist()


@needs_c
def test_the_c_filters_break_ties_by_the_lower_index():
    """Where the top-k boundary falls among equal logits, the lower indices are kept; -0 and
    +0 are equal there."""
    logits = torch.zeros(2, 64)
    logits[0, 40] = 1.0  # the largest, then 63 ties
    logits[1] = float("-inf")
    logits[1, 0], logits[1, 3], logits[1, 7] = 0.5, -0.0, 0.0
    params = [SamplingParams(top_k=3, temperature=1.0), SamplingParams(top_k=2, temperature=1.0)]
    batch = SamplingBatch.from_params(params, [0, 1], 64, CPU)
    seen: list[set[int]] = [set(), set()]
    for index in range(300):
        keys = torch.tensor([noise_key(0, index), noise_key(1, index)])
        for row, token in enumerate(sampler.c_tokens(logits, batch, keys).tolist()):
            seen[row].add(token)
    assert seen == [{40, 0, 1}, {0, 3}]


@needs_c
def test_the_c_filters_stop_at_the_finite_tokens_and_take_top_k_below_one_as_off():
    """A grammar's mask leaves 20 tokens under a top-k of 50 (the kept prefix stops at them);
    top_k 0 or -1 given to the kernel directly filters nothing."""
    logits = torch.full((3, 5000), float("-inf"))
    generator = torch.Generator().manual_seed(4)
    allowed = torch.randperm(5000, generator=generator)[:20]
    logits[:, allowed] = torch.randn(3, 20, generator=generator)
    batch = SamplingBatch.from_params(
        [SamplingParams(top_k=50, top_p=0.9, temperature=1.0)] * 3, [0, 1, 2], 5000, CPU
    )
    for index in range(20):
        keys = torch.tensor([noise_key(row, index) for row in range(3)])
        want = sampler.torch_tokens(logits, batch, keys)
        assert sampler.c_tokens(logits, batch, keys).tolist() == want.tolist()
        off = cpu_ops.sample_tokens(
            logits,
            batch.temperatures,
            torch.tensor([0, -1, 5000]),
            torch.full((3,), float("inf")),
            torch.zeros(3),
            keys,
            torch.ones(3, dtype=torch.bool),
        )
        plain = SamplingBatch.from_params([SamplingParams(top_k=0)] * 3, [0, 1, 2], 5000, CPU)
        assert off.tolist() == sampler.torch_tokens(logits, plain, keys).tolist()


@needs_c
def test_the_c_race_keeps_what_is_not_finite_out():
    """NaN never wins, +inf ties with the largest float32 (before and after the temperature's
    division), a row with one allowed token takes it, a row with none gets NO_TOKEN, as with the
    torch ops; finite logits that a tiny temperature takes to -inf give the greedy token, with
    or without top-p (the torch ops' softmax is NaN there)."""
    nan, inf, largest = float("nan"), float("inf"), torch.finfo(torch.float32).max
    logits = torch.full((7, 40), -inf)
    logits[0, 3] = 2.0  # the one allowed token
    logits[1] = torch.randn(40, generator=torch.Generator().manual_seed(1))
    logits[1, ::3] = nan
    logits[2, 5], logits[2, 30] = inf, largest  # a race of two equal tokens
    logits[5, 5], logits[5, 30] = inf, largest  # the same, halved by the temperature
    logits[4] = logits[6] = torch.linspace(-3e38, -2.9e38, 40)  # / 1e-5: every x is -inf
    params = [SamplingParams(top_k=0, temperature=1.0)] * 4 + [
        SamplingParams(top_k=0, temperature=1e-5),
        SamplingParams(top_k=0, top_p=0.95, temperature=2.0),
        SamplingParams(top_k=0, top_p=0.9, temperature=1e-5),
    ]
    batch = SamplingBatch.from_params(params, list(range(7)), 40, CPU)
    raced = []
    for index in range(40):
        keys = torch.tensor([noise_key(row, index) for row in range(7)])
        tokens = sampler.c_tokens(logits, batch, keys).tolist()
        want = sampler.torch_tokens(logits, batch, keys).tolist()
        assert tokens[:4] == want[:4] and tokens[5] == want[5]
        assert tokens[0] == 3 and tokens[1] % 3 != 0
        assert tokens[3] == NO_TOKEN and tokens[4] == tokens[6] == 39
        raced += [tokens[2], tokens[5]]
    assert set(raced) == {5, 30}


def _hostile_logits(rows: int, vocab: int, generator: random.Random) -> torch.Tensor:
    """Logits of one of several kinds a broken model, a processor or a grammar could leave:
    NaN, +-inf, -0, subnormals and the float32 extremes sprinkled in, whole rows of -inf or
    NaN, every row tied, or values so close that only rounding separates them."""
    specials = [math.nan, math.inf, -math.inf, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38]
    logits = torch.randn(rows, vocab) * generator.choice([0.01, 1.0, 1000.0])
    kind = generator.choice(["plain", "close", "specials", "nothing", "infinite", "tied"])
    if kind == "close":
        logits = logits * 1e-6 + 5.0
    elif kind == "specials":
        for _ in range(rows * max(1, vocab // 3)):
            logits[generator.randrange(rows), generator.randrange(vocab)] = generator.choice(
                specials
            )
    elif kind == "nothing":
        logits[generator.randrange(rows)] = generator.choice([-math.inf, math.nan])
    elif kind == "infinite":
        logits[:, : max(1, vocab // 2)] = math.inf
    elif kind == "tied":
        logits[:] = generator.choice([0.0, -0.0, 7.0])
    return logits


def test_hostile_rows_get_an_allowed_token_or_none():
    """Random batches of such logits under every kind of setting (temperatures down to the
    greedy bound and below, top-k 0 to far past the vocabulary, top-p down to 1e-9, min-p up
    to 1, negative noise keys): every sampled and every greedy token is in the vocabulary and
    not -inf or NaN there, and NO_TOKEN comes exactly for rows with nothing else. (Also run by
    `make sanitize`, with the kernels built under AddressSanitizer and UBSan.)"""
    generator = random.Random(0)
    for _ in range(150):
        rows = generator.choice([1, 2, 7, 16, 33, 64])
        vocab = generator.choice([1, 2, 15, 16, 17, 257, 4099])
        logits = _hostile_logits(rows, vocab, generator)

        def column(choices: list, dtype: torch.dtype, rows: int = rows) -> torch.Tensor:
            return torch.tensor([generator.choice(choices) for _ in range(rows)], dtype=dtype)

        tokens = cpu_ops.sample_tokens(
            logits,
            column([1e-30, 1e-5, 0.1, 1.0, 2.0], torch.float32),
            column([0, 1, 2, vocab - 1, vocab, vocab + 5, 2**40], torch.int64),
            column([1e-9, 1e-3, 0.5, 0.95, 1.0, math.inf], torch.float32),
            column([0.0, 1e-9, 0.1, 1.0], torch.float32),
            column([-(2**63), -1, 0, 1, 2**63 - 1, generator.getrandbits(63)], torch.int64),
            column([True, True, True, False], torch.bool),
        )
        greedy = cpu_ops.greedy_tokens(logits)
        allowed = ~torch.isnan(logits) & ~torch.isneginf(logits)
        for row in range(rows):
            for token in (int(tokens[row]), int(greedy[row])):
                if allowed[row].any():
                    assert 0 <= token < vocab and allowed[row, token], (row, token)
                else:
                    assert token == NO_TOKEN


def test_settings_the_c_race_cannot_honour_are_refused():
    """A sampled row's temperature must be positive and finite (a negative one ranked the
    padding lanes past the vocabulary first: token 29 of 17, found by fuzzing), and top-p and
    min-p numbers; greedy rows' temperatures are not used."""
    logits = torch.randn(2, 17)
    ones, zeros = torch.ones(2), torch.zeros(2)
    top_ks, keys = torch.zeros(2, dtype=torch.int64), torch.tensor([1, 2])

    def tokens(temperatures, sampled, top_ps=ones, min_ps=zeros) -> torch.Tensor:
        return cpu_ops.sample_tokens(
            logits, temperatures, top_ks, top_ps, min_ps, keys, torch.tensor(sampled)
        )

    for temperature in (-1.0, -1e-5, 0.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="temperature must be positive and finite"):
            tokens(torch.tensor([1.0, temperature]), [True, True])
    greedy = tokens(torch.tensor([1.0, -1.0]), [True, False])
    assert greedy[1] == logits[1].argmax()
    for top_ps, min_ps in (
        (torch.tensor([1.0, math.nan]), zeros),
        (ones, torch.full((2,), math.nan)),
    ):
        with pytest.raises(ValueError, match="top_p and min_p"):
            tokens(ones, [True, True], top_ps, min_ps)


def test_seeded_tokens_ignore_the_batch_and_the_row_order():
    logits = 3 * torch.randn(6, 1000, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(top_k=0, temperature=0.8, seed=11),
        SamplingParams(top_k=0, temperature=0.8),  # unseeded
        SamplingParams(top_k=40, temperature=1.2, seed=12),
        SamplingParams(),  # greedy
        SamplingParams(top_k=0, top_p=0.9, min_p=0.05, temperature=0.8, seed=13),
        SamplingParams(top_k=0, temperature=0.8, seed=11),  # the same seed, other logits
    ]
    seeded = [0, 2, 4, 5]
    order = [5, 3, 0, 4, 1, 2]
    for index in range(20):
        keys = [None if p.seed is None else noise_key(p.seed, index) for p in params]
        batch = SamplingBatch.from_params(params, keys, 1000, CPU)
        together = Sampler(CPU, seed=index)(logits, batch).tolist()
        shuffled = SamplingBatch.from_params(
            [params[row] for row in order], [keys[row] for row in order], 1000, CPU
        )
        reordered = Sampler(CPU, seed=99)(logits[order], shuffled).tolist()
        for row in seeded:
            alone = SamplingBatch.from_params([params[row]], [keys[row]], 1000, CPU)
            token = Sampler(CPU, seed=5)(logits[row : row + 1], alone).item()
            assert together[row] == reordered[order.index(row)] == token
        assert together[3] == logits[3].argmax().item()


def test_rows_without_a_seed_draw_fresh_noise_from_the_samplers_source():
    batch = SamplingBatch.from_params(
        [SamplingParams(top_k=0), SamplingParams()], [None, 1], 50, CPU
    )
    sampler, again = Sampler(CPU, seed=3), Sampler(CPU, seed=3)
    first, second = sampler.noise_keys(batch), sampler.noise_keys(batch)
    assert first[0] != second[0] and first[1] == second[1] == 1
    assert torch.equal(again.noise_keys(batch), first)  # a worker's --seed makes them repeat


def test_only_filtered_rows_are_restricted_and_each_row_stands_alone():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(5, 4)
    params = [
        SamplingParams(top_k=0, top_p=0.7),
        SamplingParams(top_k=3),
        SamplingParams(top_k=0, min_p=0.5),
        SamplingParams(top_k=0),
        SamplingParams(top_k=2, temperature=0.0),  # greedy: its probabilities are not used
    ]
    batch = SamplingBatch.from_params(params, [0] * 5, 4, CPU)
    assert batch.filtered_rows.tolist() == [0, 1, 2]
    probs = filtered_probabilities(logits, batch)
    assert probs[:4].tolist() == [
        pytest.approx([0.625, 0.375, 0.0, 0.0]),
        pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        pytest.approx([0.625, 0.375, 0.0, 0.0]),
        pytest.approx([0.5, 0.3, 0.15, 0.05]),
    ]
    alone = SamplingBatch.from_params(params[3:4], [0], 4, CPU)
    assert torch.equal(filtered_probabilities(logits[3:4], alone)[0], probs[3])


def test_a_request_state_keys_its_next_token_by_its_index():
    prompt = [5, 6, 7]
    seeded = context("s", prompt, 8, top_k=0, seed=2**63 + 5)
    resumed = RequestState.from_new_request(
        NewRequestData(seeded, [0], 0, output_token_ids=[9, 9]), CPU, 50
    )
    assert resumed.next_noise_key() == noise_key(2**63 + 5, 2)
    resumed.append_output(4)
    assert resumed.next_noise_key() == noise_key(2**63 + 5, 3)
    unseeded = RequestState.from_new_request(
        NewRequestData(context("u", prompt, 8, top_k=0), [0], 0), CPU, 50
    )
    assert unseeded.next_noise_key() is None
