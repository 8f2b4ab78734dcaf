"""Unit tests of the worker: model files, sampler, KV cache layout, config, runner checks."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from interfaces import SamplingParams, TextContext, TokenGenerator
from interfaces.scheduler_to_worker import CachedRequestData, NewRequestData, ScheduledStep
from interfaces.worker_to_scheduler import MAX_KV_BLOCKS
from scheduler.config import WorkerLimits
from worker import kv_cache, model_files
from worker.attention import build_batch_layout
from worker.config import WorkerConfig
from worker.kv_cache import (
    bytes_per_block,
    check_fits_in_memory,
    free_memory,
    kv_cache_budget,
    num_blocks_for_budget,
    slot_mapping,
)
from worker.model_files import DEFAULT_MODEL_NAME, model_name_for, resolve_model
from worker.model_runner import ModelRunner
from worker.models import cpu_ops, panel_gemm
from worker.models.config import ModelConfig
from worker.models.linear import Linear, prepacking
from worker.sampler import Sampler, SamplingBatch, check_supported, noise_key
from worker.settings import parse_memory

VOCAB = 50
CPU = torch.device("cpu")


# Model files


def test_resolve_default_model_reuses_the_cache(default_model_dir):
    started = time.monotonic()
    again = resolve_model(None)
    assert time.monotonic() - started < 10
    assert again == default_model_dir
    assert default_model_dir.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config and "_name_or_path" not in config
    tokenizer_config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"].startswith("{% for message in messages %}")
    assert sorted(p.name for p in default_model_dir.glob("*.safetensors")) == ["model.safetensors"]
    assert (
        json.loads((default_model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    )


def test_resolve_directory_is_returned_as_is(tiny_llama_dir):
    assert resolve_model(str(tiny_llama_dir)) == tiny_llama_dir


@pytest.mark.parametrize("kind", ["missing", "no-config", "not-gguf", "bad-gguf"])
def test_resolve_bad_model_raises_value_error(kind, tmp_path):
    paths = {
        "missing": tmp_path / "nowhere",
        "no-config": tmp_path,
        "not-gguf": tmp_path / "weights.bin",
        "bad-gguf": tmp_path / "broken.gguf",
    }
    paths["not-gguf"].write_bytes(b"x")
    paths["bad-gguf"].write_bytes(b"not a gguf file")
    with pytest.raises(ValueError):
        resolve_model(paths[kind])


def test_a_conversion_parses_the_file_once_and_gives_gguf_back_its_names(tmp_path):
    """Within ``_parsed_once`` transformers' calls get the one reader for the file and one
    tensor-name map per shape; other files are read as usual; afterwards gguf is as it was."""
    import gguf

    gguf_path, other_path = tmp_path / "model.gguf", tmp_path / "other.gguf"
    other_path.write_bytes(b"not a gguf file")
    reader = object()
    llama = next(arch for arch, name in gguf.MODEL_ARCH_NAMES.items() if name == "llama")
    with model_files._parsed_once(gguf_path, reader):
        assert gguf.GGUFReader(str(gguf_path)) is reader
        with pytest.raises(ValueError, match="GGUF magic invalid"):
            gguf.GGUFReader(other_path)
        name_map = gguf.get_tensor_name_map(llama, 2)
        assert gguf.get_tensor_name_map(llama, 2) is name_map
        assert name_map.get_name("model.layers.1.self_attn.q_proj") == "blk.1.attn_q"
    assert gguf.GGUFReader is gguf.gguf_reader.GGUFReader
    assert gguf.get_tensor_name_map is gguf.tensor_mapping.get_tensor_name_map


def test_model_name_for():
    assert model_name_for(None) == DEFAULT_MODEL_NAME
    assert model_name_for("/models/Qwen2-0.5B.Q8_0.gguf") == "Qwen2-0.5B.Q8_0"
    assert model_name_for("/models/my-llama") == "my-llama"


def test_model_config_reads_old_style_rope_settings():
    raw = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "llama3", "factor": 8.0},
    }
    config = ModelConfig.from_dict(raw)
    assert (config.rope_theta, config.rope_type) == (500000.0, "llama3")
    assert config.rope_scaling == {"factor": 8.0}
    assert (config.num_key_value_heads, config.head_dim) == (2, 4)
    with pytest.raises(ValueError, match="gpt2"):
        ModelConfig.from_dict({**raw, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_dict({**raw, "rope_scaling": {"rope_type": "yarn"}})


# Sampler


def _batch(params: list[SamplingParams], seeds: list[int | None] | None = None) -> SamplingBatch:
    """A batch whose rows sample their first token, with the noise of ``seeds`` (None: none)."""
    keys = [None if seed is None else noise_key(seed, 0) for seed in seeds or [None] * len(params)]
    return SamplingBatch.from_params(params, keys, VOCAB, CPU)


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    logits = _logits(4)
    params = [SamplingParams(), SamplingParams(temperature=0.0, top_k=0)] * 2
    assert Sampler(CPU, seed=0)(logits, _batch(params)).tolist() == logits.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_are_argmax():
    logits = _logits(6, seed=1)
    params = [SamplingParams(top_k=1, temperature=1.5)] * 3
    params += [SamplingParams(top_k=0, top_p=1e-6, temperature=2.0)] * 3
    sampler = Sampler(CPU, seed=0)
    for _ in range(5):
        assert sampler(logits, _batch(params)).tolist() == logits.argmax(-1).tolist()


def test_seeded_sampling_ignores_batch_neighbours():
    logits = _logits(3, seed=2)
    seeded = SamplingParams(top_k=0, temperature=1.0, seed=7)
    other = SamplingParams(top_k=0, temperature=1.0)
    alone = [Sampler(CPU, seed=0)(logits[1:2], _batch([seeded], [1234])).item() for _ in range(3)]
    crowded = [
        Sampler(CPU, seed=s)(logits, _batch([other, seeded, other], [None, 1234, None]))[1].item()
        for s in range(3)
    ]
    assert alone == crowded == [alone[0]] * 3


def test_top_k_and_min_p_restrict_choices():
    logits = torch.tensor([[4.0, 3.9, 3.8, -5.0] + [-9.0] * (VOCAB - 4)] * 2)
    params = [SamplingParams(top_k=2, temperature=1.0), SamplingParams(top_k=0, min_p=0.5)]
    sampler = Sampler(CPU, seed=0)
    picked = [sampler(logits, _batch(params)).tolist() for _ in range(200)]
    assert {row[0] for row in picked} == {0, 1}
    assert {row[1] for row in picked} == {0, 1, 2}


def test_logit_bias_must_name_tokens_in_the_vocabulary():
    check_supported(SamplingParams(frequency_penalty=0.5, logit_bias={VOCAB - 1: 1.0}), VOCAB)
    with pytest.raises(ValueError, match=r"outside the vocabulary of 50: \[50\]"):
        check_supported(SamplingParams(logit_bias={VOCAB: 1.0}), VOCAB)


# KV cache layout and sizing


def test_slot_mapping_follows_block_ids():
    assert slot_mapping([7, 2, 9], 2, 11, 4).tolist() == [30, 31, 8, 9, 10, 11, 36, 37, 38]


def test_batch_layout_for_mixed_prefill_and_decode():
    # Request 0 prefills 3 tokens, 1 decodes at position 5, 2 prefills positions 2-3.
    layout = build_batch_layout([0, 5, 2], [3, 1, 2], [[4], [1, 3], [6]], 4, CPU)
    assert layout.positions.tolist() == [0, 1, 2, 5, 2, 3]
    assert layout.metadata.slot_mapping.tolist() == [16, 17, 18, 13, 26, 27]
    decodes, prefills = layout.metadata.groups
    assert decodes.token_indices.tolist() == [3]
    assert decodes.block_tables.tolist() == [[1, 3]]
    assert decodes.attention_mask[:, 0].int().tolist() == [[[1, 1, 1, 1, 1, 1, 0, 0]]]
    assert prefills.token_indices.tolist() == [0, 1, 2, 4, 5]
    assert prefills.block_tables.tolist() == [[4], [6]]
    assert prefills.token_request_indices.tolist() == [0, 0, 0, 1, 1]
    assert prefills.token_query_indices.tolist() == [0, 1, 2, 0, 1]
    mask = prefills.attention_mask[:, 0].int().tolist()
    assert mask[0] == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]
    assert mask[1] == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]  # the last row is padding


def test_a_batch_of_decodes_is_one_group():
    layout = build_batch_layout([5, 9], [1, 1], [[1, 3], [2, 7, 8]], 4, CPU)
    [decodes] = layout.metadata.groups
    assert decodes.token_indices.tolist() == [0, 1]
    assert decodes.block_tables.tolist() == [[1, 3, 0], [2, 7, 8]]


def test_block_count_from_bytes():
    block_bytes = bytes_per_block(2, 16, 2, 16, torch.float32)
    assert block_bytes == 2 * 2 * 16 * 2 * 16 * 4 == 8192
    assert bytes_per_block(30, 16, 3, 64, torch.bfloat16) == 368640
    assert num_blocks_for_budget(100_000, block_bytes) == 12
    # A small model on a large GPU: no more blocks than the scheduler takes by default.
    assert num_blocks_for_budget(80 << 30, block_bytes) == MAX_KV_BLOCKS
    assert WorkerLimits().max_kv_blocks == MAX_KV_BLOCKS
    with pytest.raises(ValueError, match="kv-cache-memory"):
        num_blocks_for_budget(8191, block_bytes)


def test_kv_cache_budget():
    assert kv_cache_budget(None, CPU) == 1 << 30
    assert kv_cache_budget(2048.0, CPU) == 2048
    half = kv_cache_budget(0.5, CPU)
    assert 0 < half <= free_memory(CPU) // 2 + (1 << 24)


def test_a_kv_cache_larger_than_the_memory_available_fails_the_start_saying_so(
    tiny_llama_dir, monkeypatch
):
    check_fits_in_memory(8192 * 16, CPU)  # a little fits
    with pytest.raises(ValueError, match=r"needs 1024\.00 GiB .* lower --kv-cache-memory"):
        check_fits_in_memory(1 << 40, CPU)
    monkeypatch.setattr(kv_cache, "free_memory", lambda device: 8192 * 8)
    config = WorkerConfig(tiny_llama_dir, device="cpu", kv_cache_memory=8192 * 16)
    with pytest.raises(ValueError, match=r"needs 0\.12 MiB and the system has 0\.06 MiB"):
        ModelRunner(config)


def test_parse_memory():
    assert parse_memory("0.25") == 0.25
    assert parse_memory("1") == 1.0
    assert parse_memory("4096") == 4096
    assert parse_memory("512MiB") == 512 << 20
    assert parse_memory("2GB") == 2 * 10**9
    with pytest.raises(ValueError):
        parse_memory("lots")


def test_worker_config_validation(tmp_path):
    config = WorkerConfig(str(tmp_path), device="cpu")
    assert (config.model_dir, config.torch_dtype, config.model_name) == (
        tmp_path,
        torch.float32,
        tmp_path.name,
    )
    for bad in (
        {"device": "tpu"},
        {"dtype": "int8"},
        {"block_size": 0},
        {"kv_cache_memory": 0},
        {"float32_matmul_precision": "medium"},
    ):
        with pytest.raises(ValueError):
            WorkerConfig(tmp_path, **bad)


# ModelRunner checks


@pytest.fixture(scope="module")
def tiny_runner(tiny_llama_dir) -> ModelRunner:
    config = WorkerConfig(
        tiny_llama_dir, device="cpu", kv_cache_memory=8192 * 16, max_model_len=256
    )
    return ModelRunner(config)


def _new(request_id: str, prompt: list[int], blocks: list[int], **params) -> NewRequestData:
    context = TextContext(request_id, prompt, 64, sampling_params=SamplingParams(**params))
    return NewRequestData(context, blocks, 0)


def test_runner_reports_its_shape(tiny_runner, tiny_llama_dir):
    assert isinstance(tiny_runner, TokenGenerator)
    assert (tiny_runner.num_kv_blocks, tiny_runner.block_size) == (16, 16)
    assert (tiny_runner.max_model_len, tiny_runner.model_name) == (256, tiny_llama_dir.name)


def test_runner_refuses_a_pool_smaller_than_the_context(tiny_llama_dir):
    # 16 blocks of 16 tokens hold 256 tokens; the model's context is 512.
    config = WorkerConfig(tiny_llama_dir, device="cpu", kv_cache_memory=8192 * 16)
    with pytest.raises(ValueError, match="holds 256 tokens, fewer than max_model_len 512"):
        ModelRunner(config)


def test_runner_rejects_inconsistent_steps_and_forgets_their_requests(tiny_runner):
    too_many = ScheduledStep(0, [_new("a", [5, 6, 7], [0])], num_scheduled_tokens={"a": 4})
    with pytest.raises(ValueError, match="only 3 are known"):
        tiny_runner.next_token(too_many)
    assert "a" not in tiny_runner.requests
    with pytest.raises(ValueError, match="not known"):
        tiny_runner.next_token(ScheduledStep(1, cached_requests=[CachedRequestData("b", [], 0)]))
    with pytest.raises(ValueError, match="block ids outside"):
        tiny_runner.next_token(ScheduledStep(2, [_new("c", [5], [16])]))
    assert tiny_runner.requests == {}


def test_runner_refuses_a_request_it_cannot_serve_and_runs_the_rest(tiny_runner):
    step = ScheduledStep(
        3,
        [_new("d", [5, 6], [0], logit_bias={49152: 1.0}), _new("e", [5, 6], [1])],
        num_scheduled_tokens={"d": 2, "e": 2},
    )
    assert list(tiny_runner.next_token(step)) == ["e"]
    refusals = tiny_runner.take_refusals()
    assert list(refusals) == ["d"] and "outside the vocabulary" in refusals["d"]
    assert list(tiny_runner.requests) == ["e"]
    tiny_runner.release("e")


def test_runner_samples_only_at_the_end_of_known_tokens(tiny_runner):
    prompt = [11, 12, 13, 14, 15]
    first = ScheduledStep(0, [_new("p", prompt, [3])], num_scheduled_tokens={"p": 3})
    assert tiny_runner.next_token(first) == {}
    rest = ScheduledStep(
        1, cached_requests=[CachedRequestData("p", [], 3)], num_scheduled_tokens={"p": 2}
    )
    (output,) = tiny_runner.next_token(rest).values()
    assert output.request_id == "p" and len(output.tokens) == 1
    assert tiny_runner.requests["p"].token_ids == [*prompt, output.tokens[0]]
    tiny_runner.release("p")
    assert tiny_runner.requests == {}


def _decode(runner: ModelRunner, news: list[NewRequestData], num_tokens: int, first_step: int):
    """Prefill ``news`` in one step, decode one token a step; return each request's tokens."""
    ids = [new.context.request_id for new in news]
    lengths = {
        new.context.request_id: len(new.context.prompt_token_ids) + len(new.output_token_ids)
        for new in news
    }
    tokens = {request_id: [] for request_id in ids}
    output = ScheduledStep(first_step, news, num_scheduled_tokens=lengths)
    for step in range(num_tokens):
        for request_id, result in runner.next_token(output).items():
            tokens[request_id].extend(result.tokens)
        cached = [CachedRequestData(i, [], lengths[i] + step) for i in ids]
        output = ScheduledStep(first_step + step + 1, [], cached, dict.fromkeys(ids, 1))
    runner.next_token(ScheduledStep(first_step + num_tokens, finished_request_ids=ids))
    return tokens


def test_seeded_request_is_reproducible_alone_batched_and_resumed(tiny_runner):
    sampled = {"top_k": 0, "temperature": 1.0}
    prompt = [21, 22, 23, 24]
    alone = _decode(tiny_runner, [_new("s", prompt, [0, 1], seed=7, **sampled)], 6, 0)["s"]
    neighbours = [_new(f"n{i}", [30 + i] * (3 + i), [2 + i], **sampled) for i in range(2)]
    batch = [neighbours[0], _new("s", prompt, [5, 6], seed=7, **sampled), neighbours[1]]
    assert _decode(tiny_runner, batch, 6, 10)["s"] == alone
    resumed = NewRequestData(
        TextContext("s", prompt, 64, sampling_params=SamplingParams(seed=7, **sampled)),
        [8, 9],
        0,
        output_token_ids=alone[:3],
    )
    assert _decode(tiny_runner, [resumed], 3, 20)["s"] == alone[3:]
    assert len(set(alone)) > 1


# Linear layers


def test_stacked_linear_loads_each_projection_into_its_rows():
    linear = Linear(3, [2, 1], bias=True)
    linear.load_shard(0, "weight", torch.ones(2, 3))
    linear.load_shard(1, "weight", torch.full((1, 3), 2.0))
    linear.load_shard(0, "bias", torch.zeros(2))
    linear.load_shard(1, "bias", torch.tensor([5.0]))
    assert linear(torch.tensor([[1.0, 2.0, 3.0]])).tolist() == [[6.0, 6.0, 17.0]]
    with pytest.raises(ValueError, match=r"weight has shape \(2, 3\), expected"):
        linear.load_shard(1, "weight", torch.ones(2, 3))
    with pytest.raises(ValueError, match="this layer has no bias"):
        Linear(3, 2, bias=False).load_shard(0, "bias", torch.zeros(2))


@pytest.mark.parametrize("packing", ["panels", "onednn"])
def test_packed_linear_matches_the_plain_one(packing, monkeypatch):
    if packing == "onednn":  # what machines without a C compiler get
        monkeypatch.setattr(panel_gemm, "library", lambda: None)
    elif panel_gemm.library() is None:
        pytest.skip("no C compiler for the panel kernel")
    torch.manual_seed(0)
    linear = Linear(64, [96, 32], bias=True)
    torch.nn.init.normal_(linear.weight)
    torch.nn.init.normal_(linear.bias)
    x = torch.randn(5, 64)
    expected = linear(x)
    expected_packing = prepacking(linear.weight)
    assert linear.prepack() == expected_packing
    if expected_packing is None:
        pytest.skip("oneDNN is not available in this torch build")
    assert expected_packing == packing
    assert linear.weight is None
    for num_rows in range(6):
        torch.testing.assert_close(linear(x[:num_rows]), expected[:num_rows], rtol=1e-5, atol=1e-4)


@contextlib.contextmanager
def _threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_kernel_matches_f_linear_for_awkward_shapes(bias, threads):
    """Row counts around the 8-row register block, the 9 to 32 rows that go through 64-feature
    chunks, and more than 32, where two panels go together under 6-row blocks (an odd last
    panel alone, and a pair cut in two where the threads' shares of the panels end) in tasks
    of 64 rows; output counts that are not multiples of the 32-wide panel; input sizes around
    the chunks; a strided input; one to three threads."""
    if panel_gemm.library() is None:
        pytest.skip("no C compiler for the panel kernel")
    generator = torch.Generator().manual_seed(0)
    shapes = [(1, 1), (31, 7), (33, 64), (96, 129), (192, 50), (577, 40), (40, 200)]
    with _threads(threads):
        _check_awkward_shapes(shapes, bias, generator)


def _check_awkward_shapes(shapes, bias, generator):
    for out_features, in_features in shapes:
        weight = torch.randn(out_features, in_features, generator=generator)
        b = torch.randn(out_features, generator=generator) if bias else None
        panels = panel_gemm.pack(weight)
        assert panels.shape == (-(-out_features // panel_gemm.PANEL), in_features, 32)
        for rows in [0, 1, 7, 8, 9, 16, 17, 32, 33, 48, 49, 63, 64, 65, 200]:
            x = torch.randn(in_features, rows, generator=generator).t()  # not contiguous
            torch.testing.assert_close(
                panel_gemm.linear(x, panels, b, out_features),
                F.linear(x, weight, b),
                rtol=1e-4,
                atol=1e-4,
            )


def test_a_rows_panel_product_does_not_depend_on_how_many_rows_it_goes_with():
    """Every path (one block, 64-feature chunks, pairs of panels, a pair cut between the
    threads) sums each output in the same order, so a request's logits are the same alone or
    in any batch, on any number of threads."""
    if panel_gemm.library() is None:
        pytest.skip("no C compiler for the panel kernel")
    generator = torch.Generator().manual_seed(1)
    for out_features, in_features in [(96, 129), (160, 200), (192, 40), (50, 64)]:
        weight = torch.randn(out_features, in_features, generator=generator)
        bias = torch.randn(out_features, generator=generator)
        panels = panel_gemm.pack(weight)
        x = torch.randn(200, in_features, generator=generator)
        with _threads(1):
            everything = panel_gemm.linear(x, panels, bias, out_features)
        for threads in (1, 2, 3):
            with _threads(threads):
                for rows in [1, 5, 8, 9, 31, 32, 33, 40, 64, 65, 128, 130, 200]:
                    assert torch.equal(
                        panel_gemm.linear(x[:rows], panels, bias, out_features),
                        everything[:rows],
                    ), (out_features, threads, rows)


def _seeded_products() -> list[torch.Tensor]:
    """Panel products of seeded random operands: three weights, each at 1 to 130 rows."""
    generator = torch.Generator().manual_seed(2)
    products = []
    for out_features, in_features in [(96, 129), (160, 200), (50, 64)]:
        weight = torch.randn(out_features, in_features, generator=generator)
        bias = torch.randn(out_features, generator=generator)
        x = torch.randn(130, in_features, generator=generator)
        panels = panel_gemm.pack(weight)
        for rows in (1, 9, 32, 33, 130):
            products.append(panel_gemm.linear(x[:rows], panels, bias, out_features))
    return products


STOLEN_PRODUCTS = """
import sys, torch
from tests.worker.test_worker_units import _seeded_products
torch.set_num_threads(3)  # three runs of tasks, for a team the thread limit holds to one
torch.save(_seeded_products(), sys.argv[1])
"""


def test_a_thread_that_never_starts_leaves_its_share_to_the_others(tmp_path):
    """The threads share a product's tasks by taking them: the kernel splits the work into as
    many runs as torch asks for threads, and a team that OpenMP holds to one thread (here by
    OMP_THREAD_LIMIT, as a paused thread would be) takes every run itself, with the results
    of one thread to the bit."""
    if panel_gemm.library() is None:
        pytest.skip("no C compiler for the panel kernel")
    with _threads(1):
        expected = _seeded_products()
    output = tmp_path / "products.pt"
    env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
    subprocess.run(
        [sys.executable, "-c", STOLEN_PRODUCTS, str(output)],
        cwd=Path(__file__).parents[2],
        env=env,
        check=True,
        timeout=120,
    )
    results = torch.load(output)
    assert len(results) == len(expected)
    for result, wanted in zip(results, expected, strict=True):
        assert torch.equal(result, wanted)


def test_panel_kernel_refuses_mismatched_inputs():
    if panel_gemm.library() is None:
        pytest.skip("no C compiler for the panel kernel")
    panels = panel_gemm.pack(torch.randn(32, 16))
    with pytest.raises(ValueError, match="16"):
        panel_gemm.linear(torch.randn(2, 15), panels, None, 32)
    with pytest.raises(TypeError, match="float32"):
        panel_gemm.linear(torch.randn(2, 16, dtype=torch.float64), panels, None, 32)
    with pytest.raises(ValueError, match="33 outputs"):
        panel_gemm.linear(torch.randn(2, 16), panels, None, 33)
    with pytest.raises(ValueError, match="bias"):
        panel_gemm.linear(torch.randn(2, 16), panels, torch.zeros(31), 32)


def test_panel_kernel_shares_torchs_openmp_threads():
    """One OpenMP runtime in the worker: the kernel's threads follow torch.set_num_threads."""
    lib = panel_gemm.library()
    if lib is None:
        pytest.skip("no C compiler for the panel kernel")
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert lib.omp_get_max_threads() == threads
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("packing", [None, "panels"])
def test_linear_rows_read_the_weight_by_row(packing):
    """A tied LM head serves the embedding lookups from whatever layout it holds."""
    if packing == "panels" and panel_gemm.library() is None:
        pytest.skip("no C compiler for the panel kernel")
    torch.manual_seed(0)
    linear = Linear(16, 70, bias=False)  # 70: the last panel is partial
    torch.nn.init.normal_(linear.weight)
    weight = linear.weight.detach().clone()
    if packing is not None:
        assert linear.prepack() == packing
    indices = torch.tensor([0, 31, 32, 69, 5, 5])
    torch.testing.assert_close(linear.rows(indices), weight[indices], rtol=0, atol=0)


@pytest.mark.parametrize("kernels", [panel_gemm, cpu_ops], ids=["panel_gemm", "cpu_ops"])
def test_kernel_build_failure_falls_back_with_a_log(kernels, tmp_path, monkeypatch, caplog):
    """A compiler that fails (or none at all) leaves the worker on torch's kernels."""
    monkeypatch.setenv("SWITCHYARD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # exits 1, like a compiler that cannot build the source
    with caplog.at_level("WARNING", logger="worker.models.native"):
        assert kernels.library.__wrapped__() is None
    assert f"CPU kernels of {kernels.SOURCE.name} unavailable (false failed" in caplog.text
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert kernels.library.__wrapped__() is None
