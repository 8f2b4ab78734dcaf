"""Greedy parity on CUDA (skipped without a GPU): the worker's tokens equal transformers', and
two GPUs over NCCL give one GPU's tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.parity_scheduler import NUM_NEW_TOKENS, DrivenRequest, FakeScheduler
from tests.support.tensor_parallel_ranks import run_group, scripted_steps, tiny_requests
from worker.config import WorkerConfig
from worker.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "default_model_dir"])
def test_cuda_greedy_parity_with_transformers(request, model_fixture):
    model_dir = request.getfixturevalue(model_fixture)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
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
    assert runner.device.type == "cuda"
    requests = [DrivenRequest(f"r{i}", p, [len(p)]) for i, p in enumerate(prompts)]
    assert FakeScheduler(runner).generate(requests) == expected


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
