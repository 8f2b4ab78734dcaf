"""The CPU kernels of worker/models/cpu_ops.c against the torch code they replace.

Attention in place must equal the gathered ``scaled_dot_product_attention`` path for every
shape the layout produces: decodes, whole prompts and chunks after a cached prefix in one
batch, grouped-query and multi-head attention, blocks smaller and larger than the kernel's
16-key chunk, a lone decode whose context is split over the threads, and decodes that share a
cached prefix (read once for all of them).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.paged_batches import shuffled_blocks
from worker.attention import AttentionKind, build_batch_layout, paged_attention, write_kv
from worker.kv_cache import KVCache
from worker.logprobs import token_logprobs
from worker.models import cpu_ops, tile_gemm
from worker.models.loader import load_model
from worker.models.rotary import RotaryEmbedding
from worker.sampler import NO_TOKEN, finite_logits

CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(cpu_ops.library() is None, reason="no C compiler for the kernels")


def _random_batch(requests, block_size, num_kv_heads, head_dim, seed=0, shared=()):
    """Caches of random keys/values and each request's blocks, shuffled over the pool; then
    for each (request, source, n) of ``shared``, the request's first n blocks are the
    source's (a prefix-cache hit)."""
    block_ids, num_blocks = shuffled_blocks(requests, block_size, seed)
    for request, source, n in shared:
        block_ids[request][:n] = block_ids[source][:n]
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator)
    value_cache = torch.randn(shape, generator=generator)
    return key_cache, value_cache, block_ids


def _both_ways(requests, num_heads, num_kv_heads, head_dim, block_size, shared=(), nan_key=None):
    """(in place, gathered) attention outputs for ``requests`` [(num_computed, num_new)];
    ``nan_key`` (request, position): that key NaN, every head's."""
    key_cache, value_cache, block_ids = _random_batch(
        requests, block_size, num_kv_heads, head_dim, shared=shared
    )
    if nan_key is not None:
        request, position = nan_key
        block = block_ids[request][position // block_size]
        key_cache[block, position % block_size] = float("nan")
    starts, counts = zip(*requests, strict=True)
    num_tokens = sum(counts)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=torch.Generator().manual_seed(1))
    scale = head_dim**-0.5
    outputs = []
    for kind in (AttentionKind.IN_PLACE_CPU, AttentionKind.GATHERED):
        layout = build_batch_layout(starts, counts, block_ids, block_size, CPU, kind)
        assert layout.metadata.in_place_cpu == (kind is AttentionKind.IN_PLACE_CPU)
        outputs.append(paged_attention(query, key_cache, value_cache, layout.metadata, scale))
    return outputs


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (9, 3, 64, 16),
        (8, 8, 128, 4),
        (4, 1, 64, 32),
        (16, 1, 16, 16),
        (6, 2, 48, 8),
        (96, 8, 64, 16),  # more heads than a decode task takes: one task per key-value head
    ],
)
def test_in_place_attention_equals_the_gathered_path(num_heads, num_kv_heads, head_dim, block_size):
    # a whole prompt, decodes, a chunk after a cached prefix, a one-token prompt
    requests = [(0, 37), (17, 1), (40, 33), (3, 1), (100, 1), (0, 1), (64, 16), (300, 45)]
    in_place, gathered = _both_ways(requests, num_heads, num_kv_heads, head_dim, block_size)
    torch.testing.assert_close(in_place, gathered, rtol=1e-5, atol=2e-6)


def test_a_nan_key_makes_the_rows_that_see_it_nan_and_no_others():
    """Rows that see the key are NaN; rows before it and other requests get what they get
    without it, to the bit: in a prefill tile, a decode, and a decode whose context is split
    over threads. (The gathered path is no reference here: its masked scores are the NaN plus
    -inf, so rows that never see the key come out NaN too.)"""
    batch = [(0, 40), (30, 1), (0, 1), (64, 16)]
    cases = [(batch, (0, 20)), (batch, (1, 5)), (batch, (3, 70)), ([(2000, 1)], (0, 1500))]
    for requests, nan_key in cases:
        clean, _ = _both_ways(requests, 9, 3, 64, 16)
        poisoned, _ = _both_ways(requests, 9, 3, 64, 16, nan_key=nan_key)
        request, position = nan_key
        first = sum(count for _, count in requests[:request])
        start, count = requests[request]
        seeing = list(range(first + max(position - start, 0), first + count))
        others = [row for row in range(len(clean)) if row not in seeing]
        assert poisoned[seeing].isnan().all()
        assert torch.equal(poisoned[others], clean[others])


SHARING_REQUESTS = [
    (37, 1), (100, 1), (150, 1), (96, 1), (63, 1), (64, 1), (40, 9), (130, 1), (129, 1),
    (200, 1), (17, 1), (120, 1),
]  # fmt: skip
SHARING_BLOCKS = [
    (1, 2, 6), (3, 2, 6), (11, 2, 6), (5, 2, 4), (4, 7, 4), (6, 7, 2), (8, 7, 8), (9, 7, 2),
]  # fmt: skip
"""Decodes of 16-token blocks sharing cached prefixes: four share 6 blocks and a fifth 4 of
them (left out: grouping it would read more); one whose every key is in the 4 blocks it shares
with two that share 8 (nothing of its own to read); a chunk and a decode that share only 2 (too
few to group)."""
SHARING_GROUPS = [[1, 2, 3, 11], [4, 7, 8]], [96, 64]
"""The groups, where a key-value head has 3 query heads or more; with one (multi-head
attention) 3 or 4 decodes are too few rows a head to group (``MIN_SHARED_ROWS``)."""


def _groups(requests, shared, num_heads, num_kv_heads):
    """How the kernel groups the decodes of ``requests``: (members of each group, sorted by
    their first; the keys each group shares)."""
    _, _, block_ids = _random_batch(requests, 16, num_kv_heads, 16, shared=shared)
    starts, counts = zip(*requests, strict=True)
    layout = build_batch_layout(starts, counts, block_ids, 16, CPU, AttentionKind.IN_PLACE_CPU)
    metadata = layout.metadata
    group_of, shared_keys = cpu_ops.shared_prefix_groups(
        metadata.block_tables,
        metadata.query_starts,
        metadata.context_starts,
        num_heads,
        num_kv_heads,
        16,
    )
    members = {}
    for request, group in enumerate(group_of):
        if group >= 0:
            members.setdefault(group, []).append(request)
    groups = sorted(members.values())
    return groups, [shared_keys[group[0]] for group in groups]


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 8, 128), (4, 1, 64), (6, 2, 48)]
)
def test_decodes_sharing_a_prefix_read_it_once_and_equal_the_gathered_path(
    num_heads, num_kv_heads, head_dim, num_threads
):
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        in_place, gathered = _both_ways(
            SHARING_REQUESTS, num_heads, num_kv_heads, head_dim, 16, SHARING_BLOCKS
        )
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(in_place, gathered, rtol=1e-5, atol=2e-6)
    expected = SHARING_GROUPS if num_heads > num_kv_heads else ([], [])
    assert _groups(SHARING_REQUESTS, SHARING_BLOCKS, num_heads, num_kv_heads) == expected


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 8, 128)])
def test_many_decodes_sharing_a_long_prefix_in_several_tasks(
    num_heads, num_kv_heads, head_dim, num_threads
):
    """30 decodes after a 20-block prefix (more members than one task holds, the prefix in
    parts), beside a prompt and a decode of their own."""
    requests = [(325 + 7 * i, 1) for i in range(30)] + [(0, 20), (50, 1)]
    shared = [(i, 0, 20) for i in range(1, 30)]
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        in_place, gathered = _both_ways(requests, num_heads, num_kv_heads, head_dim, 16, shared)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(in_place, gathered, rtol=1e-5, atol=2e-6)
    assert _groups(requests, shared, num_heads, num_kv_heads) == ([list(range(30))], [320])


def test_head_shapes_without_a_kernel_keep_the_gathered_path():
    assert cpu_ops.supports_attention(16, 1, 64)
    assert not cpu_ops.supports_attention(32, 1, 64)  # more query heads per kv head than lanes
    assert not cpu_ops.supports_attention(8, 8, 72)  # not a multiple of 16
    assert not cpu_ops.supports_attention(8, 8, 512)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("context", [600, 1024, 4097])
def test_a_long_lone_decode_split_over_threads_is_exact(context, num_threads):
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        in_place, gathered = _both_ways([(context - 1, 1)], 9, 3, 64, 16)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(in_place, gathered, rtol=1e-5, atol=2e-6)


def test_in_place_layout_names_each_requests_blocks_and_starts():
    layout = build_batch_layout(
        [0, 5, 2], [3, 1, 2], [[4], [1, 3], [6]], 4, CPU, AttentionKind.IN_PLACE_CPU
    )
    metadata = layout.metadata
    assert metadata.groups == ()
    assert metadata.slot_mapping.tolist() == [16, 17, 18, 13, 26, 27]
    assert metadata.block_tables.tolist() == [[4, 0], [1, 3], [6, 0]]
    assert metadata.query_starts.tolist() == [0, 3, 4, 6]
    assert metadata.context_starts.tolist() == [0, 5, 2]
    assert layout.positions.tolist() == [0, 1, 2, 5, 2, 3]


def test_rope_write_kv_equals_rotate_then_write():
    num_tokens, num_heads, num_kv_heads, head_dim = 7, 9, 3, 64
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    positions = torch.tensor([0, 5, 9, 100, 2, 3, 4])
    angles = positions[:, None].float() * torch.rand(head_dim // 2, generator=generator)
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]  # (num_tokens, 1, head_dim)
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([3, 7, 8, 20, 21, 39, 0])
    caches = [torch.zeros(10, 4, num_kv_heads, head_dim) for _ in range(4)]

    query = cpu_ops.rope_write_kv(qkv, cos, sin, slots, caches[0], caches[1], num_heads)

    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(num_tokens, -1, head_dim)
    want_query, key = RotaryEmbedding.rotate(qk, cos, sin).split([num_heads, num_kv_heads], 1)
    value = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, -1, head_dim)
    write_kv(caches[2], caches[3], key, value, slots)
    torch.testing.assert_close(query, want_query, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(caches[0], caches[2], rtol=1e-6, atol=1e-6)
    assert torch.equal(caches[1], caches[3])  # values are copied, not computed


def test_add_rms_norm_adds_in_place_and_normalises():
    generator = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, 70, 576, generator=generator)  # 70 rows: threaded
    weight = torch.randn(576, generator=generator)
    total = x + residual
    want = weight * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-5))

    torch.testing.assert_close(cpu_ops.add_rms_norm(x, residual, weight, 1e-5), want)
    assert torch.equal(residual, total)  # the residual stream now holds the sum
    before = residual.clone()
    torch.testing.assert_close(cpu_ops.add_rms_norm(None, residual, weight, 1e-5), want)
    assert torch.equal(residual, before)  # no x: nothing added, nothing written


def test_add_rms_norm_takes_widths_that_are_not_multiples_of_16():
    x, residual = torch.randn(2, 3, 40)
    weight = torch.randn(40)
    total = x + residual
    want = weight * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(cpu_ops.add_rms_norm(x, residual, weight, 1e-6), want)


@pytest.mark.parametrize("inner", [1536, 40])
def test_silu_mul_equals_torch(inner):
    gate_up = torch.randn(33, 2 * inner, generator=torch.Generator().manual_seed(0)) * 8
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("vocab_size", [6, 16, 37, 49152])
def test_greedy_tokens_equal_the_samplers_torch_ops(vocab_size):
    """First index of the largest, NaN as -inf, +inf tied with the largest float32, -1 when
    nothing is finite: in the vector lanes, across them and in the tail."""
    nan, inf, top = float("nan"), float("inf"), torch.finfo(torch.float32).max
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(12, vocab_size, generator=generator)
    last = vocab_size - 1
    logits[0] = nan  # nothing to pick
    logits[1] = -inf
    logits[2, ::2] = nan  # NaN never wins, whatever lies beside it
    logits[3, 1], logits[3, last] = inf, inf  # ties among +inf: the first
    logits[4, last], logits[4, min(3, last)] = top, inf  # +inf ties with the largest float32
    logits[5] = 7.0  # all equal: index 0
    logits[6, last] = 50.0  # the tail's (or the last lane's) own maximum
    logits[7, min(17, last)], logits[7, min(33, last)] = 9.0, 9.0  # ties across lanes
    logits[8] = -inf
    logits[8, last] = nan
    logits[9] = nan
    logits[9, last] = -3.0  # one finite value after NaN
    logits[10, : vocab_size // 2] = -inf  # the maximum in the second half
    want = finite_logits(logits).argmax(-1)
    want[torch.isneginf(finite_logits(logits)).all(-1)] = NO_TOKEN
    assert cpu_ops.greedy_tokens(logits).tolist() == want.tolist()
    assert cpu_ops.greedy_tokens(logits[5:6].contiguous()).tolist() == [0]  # one row, no threads


def test_the_kernels_refuse_what_does_not_fit():
    cache = torch.zeros(4, 16, 2, 64)
    tables, starts, first = torch.zeros(1, 1, dtype=torch.int64), torch.tensor([0, 1]), [0]
    query = torch.zeros(1, 4, 64)
    with pytest.raises(TypeError, match="float32"):
        cpu_ops.paged_attention(query.double(), cache, cache, tables, starts, starts[:1], 1.0)
    with pytest.raises(TypeError, match="int64"):
        cpu_ops.paged_attention(query, cache, cache, tables.int(), starts, starts[:1], 1.0)
    with pytest.raises(ValueError, match="as many starts"):
        cpu_ops.paged_attention(query, cache, cache, tables, starts[:1], starts[:1], 1.0)
    with pytest.raises(ValueError, match="do not fit queries"):
        cpu_ops.paged_attention(
            query[..., :32].contiguous(), cache, cache, tables, starts, starts[first], 1.0
        )
    with pytest.raises(ValueError, match="no paged kernel for 3/2 heads"):
        cpu_ops.paged_attention(
            query[:, :3].contiguous(), cache, cache, tables, starts, starts[first], 1.0
        )
    with pytest.raises(ValueError, match="contiguous"):
        cpu_ops.silu_mul(torch.zeros(8, 4).t())
    with pytest.raises(ValueError, match="greedy tokens of logits shaped"):
        cpu_ops.greedy_tokens(torch.zeros(4))
    with pytest.raises(TypeError, match="float32"):
        cpu_ops.greedy_tokens(torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="cannot normalise"):
        cpu_ops.add_rms_norm(None, torch.zeros(2, 8), torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="do not fit the cache's heads"):
        cpu_ops.rope_write_kv(
            torch.zeros(1, 100), torch.zeros(1, 1, 64), torch.zeros(1, 1, 64),
            torch.zeros(1, dtype=torch.int64), cache, cache, 4,
        )  # fmt: skip
    with pytest.raises(ValueError, match="2-D"):
        cpu_ops.paged_attention(query, cache, cache, tables[0], starts, starts[first], 1.0)
    with pytest.raises(ValueError, match="blocks of no tokens"):
        empty = torch.zeros(4, 0, 2, 64)
        cpu_ops.paged_attention(query, empty, empty, tables, starts, starts[first], 1.0)
    with pytest.raises(ValueError, match="block_size must be positive"):
        cpu_ops.shared_prefix_groups(tables, starts, starts[first], 4, 2, 0)
    with pytest.raises(ValueError, match="past its block table"):
        cpu_ops.shared_prefix_groups(tables, starts, torch.tensor([16]), 4, 2, 16)


def test_the_model_gives_the_same_logits_in_place_flex_and_gathered(tiny_llama_dir):
    """One mixed step (prompt, chunk after a prefix, decode) through the whole tiny model, with
    the kernels, with FlexAttention's mask (eager on the CPU) and with torch's ops."""
    model = load_model(tiny_llama_dir, CPU, torch.float32)
    assert model.attention_kind is AttentionKind.IN_PLACE_CPU
    logits = []
    for kind in AttentionKind:
        with _kernels_enabled(kind is AttentionKind.IN_PLACE_CPU):
            logits.append(_mixed_step(model, kind, 3, list(range(15)))[0])
    for other in logits[1:]:
        torch.testing.assert_close(other, logits[0], rtol=1e-4, atol=1e-4)
        assert torch.equal(other.argmax(-1), logits[0].argmax(-1))


def _mixed_step(
    model, kind: AttentionKind, seed: int, rows: list[int]
) -> tuple[torch.Tensor, KVCache]:
    """One mixed step of 15 tokens through ``model`` (a 9-token prompt, a 5-token chunk after
    6 cached tokens, a decode after 12), its prefixes computed the same way first, in a fresh
    cache of shuffled blocks: (the logits of flat-batch ``rows``, the cache)."""
    block_size = 4
    block_ids, num_blocks = shuffled_blocks([(0, 9), (6, 5), (12, 1)], block_size)
    generator = torch.Generator().manual_seed(seed)
    prefix_ids = torch.randint(0, model.config.vocab_size, (18,), generator=generator)
    input_ids = torch.randint(0, model.config.vocab_size, (15,), generator=generator)
    cache = KVCache.for_model(model, num_blocks, block_size)
    with torch.no_grad():
        prefix = build_batch_layout(
            [0, 0], [6, 12], block_ids[1:], block_size, CPU, kind, num_blocks
        )
        model(prefix_ids, prefix.positions, cache, prefix.metadata, torch.tensor([0]))
        step = build_batch_layout(
            [0, 6, 12], [9, 5, 1], block_ids, block_size, CPU, kind, num_blocks
        )
        indices = torch.tensor(rows, dtype=torch.int64)
        return model(input_ids, step.positions, cache, step.metadata, indices), cache


@pytest.mark.parametrize("precision", ["highest", "high"])
@pytest.mark.parametrize("biases", [False, True])
def test_the_fused_layer_stack_gives_the_layer_modules_results_to_the_bit(
    tiny_llama_dir, tmp_path, biases, precision
):
    """``FusedLayers`` (every layer in one C call) against the layer modules over the same
    mixed step (a prompt, a chunk after a prefix, a decode): the same logits and the same KV
    cache, bit for bit; with biases on every linear layer too, and with the layers in tile
    form ("high" float32 matmul precision) as in panels."""
    if precision == "high" and not tile_gemm.available():
        pytest.skip("no AMX-BF16 tile unit here")
    model_dir = tiny_llama_dir
    if biases:
        model_dir = _with_biases(tiny_llama_dir, tmp_path)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        model = load_model(model_dir, CPU, torch.float32)
    finally:
        torch.set_float32_matmul_precision(before)
    packing = model.model.layers[0].mlp.down_proj.packing
    assert packing == ("tiles" if precision == "high" else "panels")
    assert model.fused_layers is not None
    fused = model.fused_layers
    results = []
    for stack in (fused, None):
        model.fused_layers = stack
        results.append(_mixed_step(model, AttentionKind.IN_PLACE_CPU, 5, list(range(15))))
    (fused_logits, fused_cache), (module_logits, module_cache) = results
    assert torch.equal(fused_logits, module_logits)
    for layer in range(model.config.num_hidden_layers):
        for fused_part, module_part in zip(
            fused_cache.layer(layer), module_cache.layer(layer), strict=True
        ):
            assert torch.equal(fused_part, module_part)


@pytest.mark.parametrize("path", ["fused", "modules", "gathered"])
def test_the_last_layer_finishes_only_the_rows_whose_logits_are_taken(tiny_llama_dir, path):
    """A step's last layer runs past its attention for the rows whose logits it takes (in any
    order, named twice, or none at all), not for every prompt token: the same logits and the
    same KV cache, to the bit, as a step that finishes every row, through the fused stack and
    through the layer modules (in-place attention and gathered)."""
    model = load_model(tiny_llama_dir, CPU, torch.float32)
    assert model.fused_layers is not None
    if path != "fused":
        model.fused_layers = None
    kind = AttentionKind.GATHERED if path == "gathered" else AttentionKind.IN_PLACE_CPU
    every_row, every_cache = _mixed_step(model, kind, 7, list(range(15)))
    for rows in ([8, 13, 14], [14, 3, 8, 3], [0], []):
        logits, cache = _mixed_step(model, kind, 7, rows)
        assert logits.shape == (len(rows), model.config.vocab_size)
        assert torch.equal(logits, every_row[rows]), rows
        for part, expected in zip(
            (*cache.key_caches, *cache.value_caches),
            (*every_cache.key_caches, *every_cache.value_caches),
            strict=True,
        ):
            assert torch.equal(part, expected)


def test_a_step_with_a_logit_for_every_token_never_waits_to_pick_rows(tiny_llama_dir, monkeypatch):
    """Decode steps (a logit for each token) are the ones CUDA graphs capture, and a capture
    may not wait for the device: such a step must not look for the rows to keep
    (``torch.unique`` waits), on either path."""
    model = load_model(tiny_llama_dir, CPU, torch.float32)

    def waits(*args, **kwargs):
        raise AssertionError("torch.unique in a step that keeps every row")

    requests = [(5, 1), (9, 1), (2, 1)]
    block_ids, num_blocks = shuffled_blocks(requests, 4)
    starts, counts = zip(*requests, strict=True)
    kind = AttentionKind.IN_PLACE_CPU
    layout = build_batch_layout(starts, counts, block_ids, 4, CPU, kind, num_blocks)
    cache = KVCache.for_model(model, num_blocks, 4)
    generator = torch.Generator().manual_seed(9)
    for part in (*cache.key_caches, *cache.value_caches):
        part.copy_(torch.randn(part.shape, generator=generator))
    monkeypatch.setattr(torch, "unique", waits)
    results = []
    for stack in (model.fused_layers, None):
        model.fused_layers = stack
        with torch.no_grad():
            results.append(
                model(torch.tensor([7, 8, 9]), layout.positions, cache, layout.metadata,
                      torch.arange(3))
            )  # fmt: skip
    assert torch.equal(results[0], results[1])


def test_the_fused_stack_refuses_kept_rows_it_cannot_move(tiny_llama_dir):
    """The C stack moves the kept rows by their indices: the wrapper refuses any that are out
    of order, repeated, out of range, not int64 or not in host memory before the kernel sees
    them."""
    model = load_model(tiny_llama_dir, CPU, torch.float32)
    fused = model.fused_layers
    assert fused is not None
    block_size = 4
    block_ids, num_blocks = shuffled_blocks([(0, 5)], block_size)
    cache = KVCache.for_model(model, num_blocks, block_size)
    kind = AttentionKind.IN_PLACE_CPU
    layout = build_batch_layout([0], [5], block_ids, block_size, CPU, kind, num_blocks)
    input_ids = torch.arange(5)
    for keep in ([3, 1], [1, 1], [-1, 2], [2, 5]):
        x = model.embed(input_ids).contiguous()
        cos_sin = model.rotary_emb.cos_sin(layout.positions, x.dtype)
        with pytest.raises(ValueError, match="kept rows"):
            fused(x, cos_sin, cache, layout.metadata, torch.tensor(keep))
    with pytest.raises(TypeError, match="int64"):
        fused(x, cos_sin, cache, layout.metadata, torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="on the CPU"):
        fused(x, cos_sin, cache, layout.metadata, torch.tensor([1, 2], device="meta"))


def test_decodes_sharing_a_prefix_through_the_fused_stack_equal_the_modules_and_gathered(
    tiny_llama_dir,
):
    """A decode step in which four requests share their first four blocks (grouped: the
    fused stack plans once for every layer, the modules once a layer), beside one that shares
    nothing: the same logits and cache either way, to the bit, and the gathered path's to
    rounding."""
    model = load_model(tiny_llama_dir, CPU, torch.float32)
    assert model.fused_layers is not None
    fused, block_size = model.fused_layers, 16
    requests = [(69, 1), (89, 1), (99, 1), (75, 1), (50, 1)]
    block_ids, num_blocks = shuffled_blocks(requests, block_size)
    for shares in (1, 2, 3):
        block_ids[shares][:4] = block_ids[0][:4]
    starts, counts = zip(*requests, strict=True)
    input_ids = torch.randint(0, model.config.vocab_size, (5,), generator=torch.Generator())
    results = []
    for stack, kind in [
        (fused, AttentionKind.IN_PLACE_CPU),
        (None, AttentionKind.IN_PLACE_CPU),
        (None, AttentionKind.GATHERED),
    ]:
        model.fused_layers = stack
        cache = KVCache.for_model(model, num_blocks, block_size)
        generator = torch.Generator().manual_seed(3)
        for part in (*cache.key_caches, *cache.value_caches):
            part.copy_(torch.randn(part.shape, generator=generator))
        step = build_batch_layout(starts, counts, block_ids, block_size, CPU, kind, num_blocks)
        if kind is AttentionKind.IN_PLACE_CPU:
            metadata = step.metadata
            groups = cpu_ops.shared_prefix_groups(
                metadata.block_tables,
                metadata.query_starts,
                metadata.context_starts,
                model.config.num_attention_heads,
                model.num_kv_heads,
                block_size,
            )
            assert groups == ([0, 0, 0, 0, -1], [64, 64, 64, 64, 0])
        with torch.no_grad():
            logits = model(input_ids, step.positions, cache, step.metadata, torch.arange(5))
        results.append((logits, cache))
    model.fused_layers = fused
    (fused_logits, fused_cache), (module_logits, module_cache), (gathered_logits, _) = results
    assert torch.equal(fused_logits, module_logits)
    for part, other in zip(
        (*fused_cache.key_caches, *fused_cache.value_caches),
        (*module_cache.key_caches, *module_cache.value_caches),
        strict=True,
    ):
        assert torch.equal(part, other)
    torch.testing.assert_close(fused_logits, gathered_logits, rtol=1e-4, atol=1e-4)


def test_the_fused_layer_stack_leaves_lora_rows_and_torch_paths_to_the_modules(tiny_llama_dir):
    model = load_model(tiny_llama_dir, CPU, torch.float32)
    fused = model.fused_layers
    block_ids, num_blocks = shuffled_blocks([(0, 3)], 4)
    in_place = build_batch_layout([0], [3], block_ids, 4, CPU, AttentionKind.IN_PLACE_CPU, 8)
    gathered = build_batch_layout([0], [3], block_ids, 4, CPU, AttentionKind.GATHERED, 8)
    assert fused.serves(in_place.metadata)
    assert not fused.serves(gathered.metadata)

    class Batch:
        groups = [object()]  # a row runs with an adapter

    qkv = model.model.layers[0].self_attn.qkv_proj
    qkv.lora = type("Adapters", (), {"batch": Batch()})()
    try:
        assert not fused.serves(in_place.metadata)
        Batch.groups = []
        assert fused.serves(in_place.metadata)
    finally:
        qkv.lora = None
    with _kernels_enabled(False):
        assert load_model(tiny_llama_dir, CPU, torch.float32).fused_layers is None
    assert load_model(tiny_llama_dir, CPU, torch.bfloat16).fused_layers is None
    config = model.config
    wrong_heads = KVCache(
        config.num_hidden_layers, num_blocks, 4, 1, config.head_dim, torch.float32, CPU
    )
    with pytest.raises(ValueError, match="layer 0's KV cache does not fit"):
        fused(
            torch.zeros(3, config.hidden_size),
            model.rotary_emb.cos_sin(in_place.positions, torch.float32),
            wrong_heads,
            in_place.metadata,
        )


def _with_biases(model_dir, tmp_path):
    """A copy of the tiny Llama whose attention and MLP linear layers have random biases."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    copy = tmp_path / "tiny-llama-biases"
    shutil.copytree(model_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config |= {"attention_bias": True, "mlp_bias": True}
    (copy / "config.json").write_text(json.dumps(config))
    (weights_file,) = copy.glob("*.safetensors")
    weights = load_file(weights_file)
    generator = torch.Generator().manual_seed(9)
    for name, weight in list(weights.items()):
        if name.endswith("_proj.weight"):
            bias = torch.randn(weight.shape[0], generator=generator) * 0.1
            weights[name.removesuffix("weight") + "bias"] = bias
    save_file(weights, weights_file)
    return copy


class _kernels_enabled:
    """Within the block, ``cpu_ops.applies`` answers ``enabled`` (False: torch's ops)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.original = cpu_ops.applies

    def __enter__(self):
        if not self.enabled:
            cpu_ops.applies = lambda tensor: False
        return self

    def __exit__(self, *exc):
        cpu_ops.applies = self.original


def _torch_scores(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int):
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, token_ids[:, None]).squeeze(1), *logprobs.topk(num_top, dim=-1)


@pytest.mark.parametrize("vocab_size", [5, 16, 33, 49152 + 7])
@pytest.mark.parametrize("num_top", [0, 1, 5, 20])
def test_the_kernel_scores_rows_as_torchs_log_softmax_and_topk(vocab_size, num_top):
    num_top = min(num_top, vocab_size)
    generator = torch.Generator().manual_seed(vocab_size + num_top)
    logits = torch.randn(9, vocab_size, generator=generator) * 4
    token_ids = torch.randint(0, vocab_size, (9,), generator=generator)
    chosen, top_values, top_ids, nonfinite = cpu_ops.token_logprobs(logits, token_ids, num_top)
    expected_chosen, expected_values, expected_ids = _torch_scores(logits, token_ids, num_top)
    assert not nonfinite.any()
    torch.testing.assert_close(chosen, expected_chosen, rtol=0, atol=1e-5)
    torch.testing.assert_close(top_values, expected_values, rtol=0, atol=1e-5)
    assert torch.equal(top_ids, expected_ids)  # random values: no ties


def test_the_kernel_ranks_equal_logits_by_index_and_rising_rows_correctly():
    rising = torch.arange(4096, dtype=torch.float32)[None] / 100  # each logit beats the list
    chosen, values, ids, _ = cpu_ops.token_logprobs(rising, torch.tensor([4095]), 20)
    assert ids[0].tolist() == list(range(4095, 4075, -1))
    expected_chosen, expected_values, _ = _torch_scores(rising, torch.tensor([4095]), 20)
    torch.testing.assert_close(values, expected_values, rtol=0, atol=1e-5)
    torch.testing.assert_close(chosen, expected_chosen, rtol=0, atol=1e-5)
    flat = torch.zeros(1, 100)
    flat[0, [7, 30, 64, 99]] = 2.0
    _, values, ids, _ = cpu_ops.token_logprobs(flat, torch.tensor([0]), 6)
    assert ids[0].tolist() == [7, 30, 64, 99, 0, 1]
    assert values[0, 0] == values[0, 3] and values[0, 4] == values[0, 5]


def test_rows_with_nan_or_infinities_get_torchs_values_beside_untouched_rows():
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 1000, generator=generator)
    token_ids = torch.tensor([3, 4, 5, 6, 7])
    innocent = token_logprobs(logits[[0, 4]].contiguous(), token_ids[[0, 4]], [3, 3])
    logits[1, 10], logits[2, 999], logits[3, 500] = float("nan"), float("inf"), float("-inf")
    *_, nonfinite = cpu_ops.token_logprobs(logits, token_ids, 3)
    assert nonfinite.tolist() == [False, True, True, True, False]
    entries = token_logprobs(logits, token_ids, [3] * 5)
    assert [entries[0], entries[4]] == innocent
    chosen, values, ids = _torch_scores(logits, token_ids, 3)
    for row in (1, 2, 3):
        assert entries[row][0] == pytest.approx(chosen[row].item(), nan_ok=True)
        assert list(entries[row][1]) == ids[row].tolist()
        assert list(entries[row][1].values()) == pytest.approx(values[row].tolist(), nan_ok=True)


def test_the_kernel_refuses_arguments_it_cannot_score():
    logits, token_ids = torch.zeros(2, 50), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="outside the vocabulary of 50"):
        cpu_ops.token_logprobs(logits, torch.tensor([0, 50]), 1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        cpu_ops.token_logprobs(logits, torch.tensor([-1, 0]), 1)
    with pytest.raises(ValueError, match="65 top log probabilities"):
        cpu_ops.token_logprobs(torch.zeros(2, 100), token_ids, 65)
    with pytest.raises(ValueError, match="as many token ids"):
        cpu_ops.token_logprobs(logits, torch.tensor([0]), 1)
    with pytest.raises(ValueError, match="logits shaped"):
        cpu_ops.token_logprobs(torch.zeros(50), token_ids, 1)
