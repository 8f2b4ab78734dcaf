"""Decode steps in CUDA graphs' static buffers (``worker.cuda_graphs``), run eagerly on the CPU:
padding rows, block masks and refilled buffers give the eager forward pass's logits and cache.
tests/worker/test_gpu.py runs the same steps through captured graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.decode_steps import compare_decode_steps, random_cache
from tests.support.parity_scheduler import NUM_NEW_TOKENS, DrivenRequest, FakeScheduler
from worker.attention import AttentionKind
from worker.config import WorkerConfig
from worker.cuda_graphs import DecodeGraphs, capture_sizes, key_splits
from worker.flex_layout import place_blocks
from worker.model_runner import ModelRunner
from worker.models.loader import load_model


def test_capture_sizes_cover_every_batch_up_to_the_largest():
    assert capture_sizes(0) == []
    assert capture_sizes(1) == [2]
    assert capture_sizes(6) == [2, 4, 6]
    assert capture_sizes(40) == [2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(20) == [2, 4, 8, 16, 20]


def test_key_splits_fill_the_processors_with_few_requests():
    assert [key_splits(size, 9, 132) for size in (2, 4, 8, 16, 24, 32, 64)] == [
        16, 8, 4, 2, 2, 1, 1,
    ]  # fmt: skip
    assert key_splits(2, 9, 1) == 1  # one processor: nothing to fill


@pytest.mark.parametrize("processors", [1, 64])
def test_decode_steps_in_the_static_buffers_equal_the_eager_pass(tiny_llama_dir, processors):
    """With one processor nothing is split; with 64, the steps with a context of 512 tokens or
    more take the split graphs: the lone decode at 700 (16 slices) and the eight requests up to
    900 (8 slices)."""
    model = load_model(tiny_llama_dir, torch.device("cpu"), torch.float32)
    for logits, eager, graph_cache, eager_cache, spare in compare_decode_steps(
        model, AttentionKind.GATHERED, capture=False, processors=processors
    ):
        torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)
        for graph_layer, eager_layer in zip(
            graph_cache.key_caches + graph_cache.value_caches,
            eager_cache.key_caches + eager_cache.value_caches,
            strict=True,
        ):
            # every block but the spare one, where padding rows write, holds the same keys (to
            # rounding: the padded batch's products may round differently)
            torch.testing.assert_close(graph_layer[:spare], eager_layer[:spare])


def test_a_block_at_two_places_refuses_the_step():
    tables = np.array([[4, 5, 6], [7, 4, 0]])
    with pytest.raises(RuntimeError, match="two places"):
        place_blocks(tables, np.array([3, 2]), np.zeros(8, dtype=np.int64))


def test_only_steps_of_single_token_decodes_up_to_the_largest_size_run_there(tiny_llama_dir):
    model = load_model(tiny_llama_dir, torch.device("cpu"), torch.float32)
    graphs = DecodeGraphs(model, random_cache(model, 9), 8, 64, capture_sizes(4))
    assert graphs.sizes == [2, 4]
    assert graphs.serves([1, 1, 1, 1])
    assert not graphs.serves([1] * 5)  # more rows than the largest graph
    assert not graphs.serves([1, 3])  # a prefill chunk, or a decode with drafts


def test_a_runner_decoding_through_the_graphs_gives_the_same_tokens(tiny_llama_dir):
    """The runner's decode-only steps go through ``DecodeGraphs`` (eager here, as on CUDA
    before capture): chunked prefills beside decodes, then decodes alone, then fewer rows as
    requests finish; the tokens are those of the runner without graphs."""
    config = WorkerConfig(
        tiny_llama_dir, device="cpu", kv_cache_memory=16 << 20, max_model_len=256, seed=0
    )
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (23, 41, 70, 9)]
    chunks = [[23], [10, 31], [5, 33, 32], [9]]

    def tokens(runner):
        requests = [DrivenRequest(f"r{i}", p, list(chunks[i])) for i, p in enumerate(prompts)]
        return FakeScheduler(runner).generate(requests)

    expected = tokens(ModelRunner(config))
    runner = ModelRunner(config)
    runner._spare_blocks = 1
    graphs = DecodeGraphs(
        runner.model, runner.kv_cache, runner.num_kv_blocks, 256, capture_sizes(4)
    )
    runner.decode_graphs = graphs
    steps = []
    run = graphs.run
    graphs.run = lambda *args: steps.append(len(args[0])) or run(*args)
    assert tokens(runner) == expected
    assert all(len(outputs) == NUM_NEW_TOKENS for outputs in expected.values())
    assert min(steps) < 4 == max(steps), steps  # some steps with fewer rows than before
