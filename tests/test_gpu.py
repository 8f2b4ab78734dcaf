"""Greedy parity on CUDA (skipped without a GPU): the worker's tokens equal transformers'."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.test_worker_parity import NUM_NEW_TOKENS, DrivenRequest, FakeScheduler
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
