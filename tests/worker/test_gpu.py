"""CUDA (skipped without a GPU): FlexAttention over the paged cache equals the gathered path;
decode steps replayed as CUDA graphs equal the eager pass; the worker's greedy tokens (decode
steps through its graphs) equal transformers'; speculative decoding gives the tokens of
decoding one at a time; two GPUs over NCCL give one GPU's tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from interfaces import SamplingParams
from tests.support.decode_steps import compare_decode_steps
from tests.support.engine import Engine
from tests.support.paged_batches import MIXED_REQUESTS, attention_outputs
from tests.support.parity_scheduler import NUM_NEW_TOKENS, DrivenRequest, FakeScheduler
from tests.support.tensor_parallel_ranks import run_group, scripted_steps, tiny_requests
from tests.support.tiny_models import VARIANTS, random_variant
from worker.attention import AttentionKind
from worker.config import WorkerConfig
from worker.model_runner import ModelRunner
from worker.models.loader import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


CUDA = torch.device("cuda")
STEPS = [
    MIXED_REQUESTS,
    [(4095, 1), (1000, 1), (2100, 48)] + [(context, 1) for context in range(3, 600, 41)],
    [(0, 300), (512, 77), (30, 1), (31, 1), (60, 1)],
    [(100, 1)],
    [(40, 5)],
]
"""Steps of different shapes (a mixed step; long decodes beside a chunk; prompts; a lone
decode; a chunk shorter than a query tile), all through one compiled kernel."""

SPECULATIVE_NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'


@pytest.fixture(autouse=True)
def _exact_float32():
    """float32 products in IEEE precision, as transformers' reference computes them."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 128)])
def test_flex_attention_equals_the_gathered_path(dtype, tolerance, shape):
    for requests in STEPS:
        flex, gathered = attention_outputs(
            requests, shape, 16, CUDA, dtype, (AttentionKind.FLEX, AttentionKind.GATHERED)
        )
        torch.testing.assert_close(flex, gathered, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("processors", [None, 1])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_captured_decode_graphs_equal_the_eager_pass(dtype, tolerance, processors, tmp_path):
    """Steps of 7, 1, 1, 8 and 5 decodes through graphs of 2, 4 and 8 rows, the buffers
    refilled each time, the long steps' keys split (for the GPU's multiprocessors) or not: the
    logits and every cache block but the spare one equal FlexAttention's eager pass
    (to rounding: padded batches may take other matrix kernels)."""
    random_variant("llama3-rope-bias-tied", tmp_path)
    model = load_model(tmp_path, CUDA, dtype)
    for logits, eager, graph_cache, eager_cache, spare in compare_decode_steps(
        model, AttentionKind.FLEX, capture=True, processors=processors
    ):
        torch.testing.assert_close(logits, eager, rtol=tolerance, atol=tolerance)
        for graph_layer, eager_layer in zip(
            graph_cache.key_caches + graph_cache.value_caches,
            eager_cache.key_caches + eager_cache.value_caches,
            strict=True,
        ):
            torch.testing.assert_close(
                graph_layer[:spare], eager_layer[:spare], rtol=tolerance, atol=tolerance
            )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cuda_architecture_variants_match_transformers_with_chunked_prefill(variant, tmp_path):
    """Flex attention in the worker: prompts prefilled whole and in chunks after their own
    cached prefix, then decoded, on rope scaling, q/k/v bias and an explicit head_dim."""
    model = random_variant(variant, tmp_path).cuda()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (23, 41, 70)]
    expected = {}
    for i, prompt in enumerate(prompts):
        generated = model.generate(
            torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=NUM_NEW_TOKENS
        )
        expected[f"r{i}"] = generated[0, len(prompt) :].tolist()
    config = WorkerConfig(
        tmp_path, device="cuda", dtype="float32", kv_cache_memory=16 << 20, max_model_len=256
    )
    runner = ModelRunner(config)
    assert runner.attention_kind is AttentionKind.FLEX
    assert runner.decode_graphs is not None  # the decode steps replay graphs
    chunks = [[23], [10, 31], [5, 33, 32]]
    requests = [DrivenRequest(f"r{i}", p, chunks[i]) for i, p in enumerate(prompts)]
    assert FakeScheduler(runner).generate(requests) == expected


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "default_model_dir"])
def test_cuda_greedy_parity_with_transformers(request, model_fixture):
    model_dir = request.getfixturevalue(model_fixture)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2000, (n,), generator=generator).tolist() for n in (9, 40, 77)]

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    reference.generation_config.eos_token_id = None
    expected = {}
    for i, prompt in enumerate(prompts):
        generated = reference.generate(
            torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=NUM_NEW_TOKENS
        )
        expected[f"r{i}"] = generated[0, len(prompt) :].tolist()
    del reference

    config = WorkerConfig(
        model_dir, device="cuda", dtype="float32", kv_cache_memory=256 << 20, max_model_len=512
    )
    runner = ModelRunner(config)
    assert runner.device.type == "cuda" and runner.attention_kind is AttentionKind.FLEX
    assert runner.decode_graphs is not None
    requests = [DrivenRequest(f"r{i}", p, [len(p)]) for i, p in enumerate(prompts)]
    assert FakeScheduler(runner).generate(requests) == expected


@pytest.mark.parametrize(
    "params", [None, SamplingParams(temperature=0.5, top_p=0.95, seed=5, presence_penalty=0.1)]
)
def test_cuda_speculative_decoding_gives_the_tokens_of_one_at_a_time(params, tmp_path):
    """n-gram drafts verified on the GPU (eager steps of several query tokens a request, the
    rejected drafts' cache slots rewritten later): greedy and seeded sampling with a penalty
    give the tokens of plain decoding (whose steps replay CUDA graphs)."""
    random_variant("qwen2", tmp_path)
    generator = torch.Generator().manual_seed(1)
    prompts = {}
    for i, (length, period) in enumerate([(60, 5), (90, 7), (33, 3), (120, 11)]):
        pattern = torch.randint(3, 512, (period,), generator=generator).tolist()
        prompts[f"r{i}"] = (pattern * (length // period + 1))[:length]
    runs = {}
    for speculative in (None, SPECULATIVE_NGRAM):
        engine = Engine(tmp_path, 64, 256, 128, speculative, device="cuda")
        assert engine.runner.decode_graphs is not None
        runs[speculative] = engine, engine.generate(prompts, params, num_new_tokens=48)
    (_, plain), (engine, speculative) = runs[None], runs[SPECULATIVE_NGRAM]
    assert speculative == plain
    counters = engine.scheduler.counters
    assert counters.spec_decode_num_draft_tokens > 0
    assert counters.spec_decode_num_accepted_tokens > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_tensor_parallel_over_nccl_matches_one_gpu(tiny_llama_dir):
    steps = scripted_steps(tiny_requests(), 12)
    one, two = (run_group(tiny_llama_dir, size, steps, device="cuda") for size in (1, 2))
    for reports in (one, two):
        assert list(reports[0]["refusals"]) == ["bad"]
    tokens = [
        {rid: [o.tokens[0] for o in outputs] for rid, outputs in reports[0]["outputs"].items()}
        for reports in (one, two)
    ]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 3
    assert two[1]["tokens"] == tokens[0]
