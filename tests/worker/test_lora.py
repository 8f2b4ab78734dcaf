"""LoRA adapters in the worker: a batch that mixes the base model and two adapters in the same
steps gives each request PEFT's greedy tokens, through the panel kernel and through F.linear;
tensor-parallel shares of an adapter add up to the whole; an adapter the worker does not hold
fails its request alone."""

from __future__ import annotations

import msgspec
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from interfaces.lora import LoRAOperation, LoRAStatus
from interfaces.scheduler_to_worker import (
    CachedRequestData,
    LoRAUpdate,
    ScheduledStep,
)
from tests.support.engine import greedy_tokens
from tests.support.lora import AdapterScheduler, load, lora_config
from tests.support.parity_scheduler import NUM_NEW_TOKENS, DrivenRequest, FakeScheduler
from tests.support.tensor_parallel_ranks import NUM_NEW_TOKENS as TP_NEW_TOKENS
from tests.support.tensor_parallel_ranks import ScriptedRequest, greedy, run_group, scripted_steps
from tests.support.tiny_models import random_variant
from worker import parallel
from worker.lora import LayerAdapters, LoRABatch
from worker.lora_checkpoint import ModuleWeights
from worker.model_runner import ModelRunner
from worker.models import linear as linear_module
from worker.models import panel_gemm
from worker.models.linear import Linear, Split

LORA_IDS = {"alpha": 7, "beta": 9}
"""The ids the tests' scheduler gives the adapters (any positive ids)."""
REQUESTS = (("alpha", 9, [9]), (None, 23, [5, 18]), ("beta", 40, [40]), ("alpha", 17, [10, 7]))
"""(adapter, prompt length, prefill chunks): the two alpha requests are not adjacent in the
batch, so its rows are gathered by index while beta's are one range."""


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randint(3, 40000, (length,), generator=generator).tolist()
        for _, length, _ in REQUESTS
    ]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, tiny_lora_adapters, prompts) -> dict[str, list[int]]:
    """PEFT's greedy tokens for each request (its adapter, or the adapters disabled), and
    the base model's for each prompt under "base-i"."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model = PeftModel.from_pretrained(model, tiny_lora_adapters["alpha"], adapter_name="alpha")
    model.load_adapter(tiny_lora_adapters["beta"], adapter_name="beta")
    tokens = {}
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only wait for each other
    try:
        for i, ((adapter, _, _), prompt) in enumerate(zip(REQUESTS, prompts, strict=True)):
            with model.disable_adapter():
                tokens[f"base-{i}"] = greedy_tokens(model, prompt, NUM_NEW_TOKENS)
            if adapter is None:
                tokens[f"r{i}"] = tokens[f"base-{i}"]
            else:
                model.set_adapter(adapter)
                tokens[f"r{i}"] = greedy_tokens(model, prompt, NUM_NEW_TOKENS)
    finally:
        torch.set_num_threads(num_threads)
    return tokens


@pytest.fixture(scope="module", params=["panels", "onednn", "plain"])
def runner(request, tiny_llama_dir, tiny_lora_adapters) -> ModelRunner:
    """A worker holding both adapters, its linear layers on the panel kernel, oneDNN's packed
    kernel (what machines without a C compiler get) or F.linear."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "plain":
            patch.setattr(linear_module, "prepacking", lambda weight, rows_read=False: None)
        elif request.param == "onednn":
            patch.setattr(panel_gemm, "library", lambda: None)
        elif panel_gemm.library() is None:
            pytest.skip("no C compiler for the panel kernel")
        runner = ModelRunner(lora_config(tiny_llama_dir))
    packings = {layer.packing for layer in runner.model.modules() if isinstance(layer, Linear)}
    if request.param == "onednn" and packings == {None}:
        pytest.skip("no oneDNN here")
    assert packings == {None if request.param == "plain" else request.param}
    for name, lora_id in LORA_IDS.items():
        assert load(runner, name, tiny_lora_adapters[name], lora_id) is LoRAStatus.SUCCESS
    return runner


def driven_requests(prompts: list[list[int]]) -> list[DrivenRequest]:
    return [
        DrivenRequest(f"r{i}", prompt, list(chunks))
        for i, ((_, _, chunks), prompt) in enumerate(zip(REQUESTS, prompts, strict=True))
    ]


def test_a_mixed_batch_matches_peft_for_every_request(runner, prompts, expected):
    for i, (adapter, _, _) in enumerate(REQUESTS):  # otherwise the test proves nothing
        assert (expected[f"r{i}"] != expected[f"base-{i}"]) == (adapter is not None)
    lora_ids = {f"r{i}": LORA_IDS.get(adapter, 0) for i, (adapter, _, _) in enumerate(REQUESTS)}
    outputs = AdapterScheduler(runner, lora_ids).generate(driven_requests(prompts))
    assert outputs == {f"r{i}": expected[f"r{i}"] for i in range(len(REQUESTS))}
    assert runner.lora.batch.groups == []  # nothing left for a later step


def prefill(scheduler: FakeScheduler, requests: list[DrivenRequest], step_id: int) -> ScheduledStep:
    """A step that sends ``requests`` and computes their whole prompts."""
    new = []
    for request in requests:
        scheduler._allocate(request, len(request.prompt) + 1)
        new.append(scheduler._new_request_data(request))
        request.num_computed_tokens = len(request.prompt)
    return ScheduledStep(step_id, new, [], {r.request_id: len(r.prompt) for r in requests})


def test_an_unknown_adapter_is_refused_beside_an_innocent_request(runner, prompts, expected):
    unknown = DrivenRequest("unknown", prompts[0], [])
    innocent = DrivenRequest("innocent", prompts[2], [])
    scheduler = AdapterScheduler(runner, {"unknown": 5, "innocent": LORA_IDS["beta"]})
    outputs = runner.next_token(prefill(scheduler, [unknown, innocent], 0))
    assert runner.take_refusals() == {"unknown": "LoRA adapter id 5 is not loaded on this worker"}
    assert {rid: output.tokens for rid, output in outputs.items()} == {
        "innocent": expected["r2"][:1]
    }
    assert list(runner.requests) == ["innocent"]
    runner.release("innocent")


def test_a_request_whose_adapter_was_unloaded_is_refused_alone(
    tiny_llama_dir, tiny_lora_adapters, prompts, expected
):
    runner = ModelRunner(lora_config(tiny_llama_dir))
    assert load(runner, "alpha", tiny_lora_adapters["alpha"], 3) is LoRAStatus.SUCCESS
    requests = [DrivenRequest(f"r{i}", prompts[i], []) for i in (0, 2)]
    scheduler = AdapterScheduler(runner, {"r0": 3})
    outputs = runner.next_token(prefill(scheduler, requests, 0))
    assert {rid: o.tokens for rid, o in outputs.items()} == {
        "r0": expected["r0"][:1],
        "r2": expected["base-2"][:1],
    }
    unloaded = runner.update_lora(LoRAUpdate(LoRAOperation.UNLOAD, 3, "alpha"))
    assert unloaded.response.status is LoRAStatus.SUCCESS
    assert runner.lora.slot_by_id == {}
    assert all(not layer.a.any() and not layer.b.any() for layer in runner.lora.layers)
    cached = [CachedRequestData(r.request_id, [], r.num_computed_tokens) for r in requests]
    outputs = runner.next_token(ScheduledStep(1, [], cached, {"r0": 1, "r2": 1}))
    assert runner.take_refusals() == {"r0": "LoRA adapter id 3 is not loaded on this worker"}
    assert {rid: o.tokens for rid, o in outputs.items()} == {"r2": expected["base-2"][1:2]}
    assert list(runner.requests) == ["r2"]


# -- tensor parallelism ---------------------------------------------------------------------------


def test_two_ranks_serve_a_mixed_batch_as_peft_does(
    tiny_llama_dir, tiny_lora_adapters, prompts, expected
):
    """Every rank loads both adapters (and refuses a missing one, all together), then the mixed
    batch runs on 2 ranks in their own processes: rank 0's tokens are PEFT's."""
    requests = [
        ScriptedRequest(greedy(f"r{i}", prompt), list(chunks))
        for i, ((_, _, chunks), prompt) in enumerate(zip(REQUESTS, prompts, strict=True))
    ]
    steps = scripted_steps(requests, TP_NEW_TOKENS)
    for new in steps[0].new_requests:
        adapter = REQUESTS[int(new.context.request_id[1:])][0]
        new.context = msgspec.structs.replace(new.context, lora_id=LORA_IDS.get(adapter, 0))
    loads = [
        LoRAUpdate(LoRAOperation.LOAD, lora_id, name, str(tiny_lora_adapters[name]))
        for name, lora_id in LORA_IDS.items()
    ]
    missing = LoRAUpdate(LoRAOperation.LOAD, 11, "missing", str(tiny_llama_dir / "missing"))
    reports = run_group(tiny_llama_dir, 2, [*loads, missing, *steps])
    want = {f"r{i}": expected[f"r{i}"][:TP_NEW_TOKENS] for i in range(len(REQUESTS))}
    driver_tokens = {
        request_id: [output.tokens[0] for output in outputs]
        for request_id, outputs in reports[0]["outputs"].items()
    }
    assert driver_tokens == want
    assert reports[1]["tokens"] == want  # what rank 0 sent it
    for report in reports:
        assert report["lora_statuses"] == ["success", "success", "load_invalid_path"]
        assert report["refusals"] == {}


def shares(rank_of, build, weights: list[ModuleWeights], world_size: int) -> list[LayerAdapters]:
    """The layer ``build()`` makes on each rank of ``world_size``, with ``weights`` (one per
    stacked projection) loaded into slot 1 of 2."""
    layers = []
    for rank in range(world_size):
        rank_of(rank, world_size)
        layer = build()
        adapters = LayerAdapters(layer, 2, 4, LoRABatch(torch.device("cpu")), torch.float32)
        for projection, module in enumerate(weights):
            adapters.write(1, projection, module)
        adapters.batch.plan([None, 1], [2, 3])  # rows 2-4 run with slot 1
        layers.append(adapters)
    return layers


def random_weights(rank: int, fan_in: int, fan_out: int) -> ModuleWeights:
    return ModuleWeights(torch.randn(rank, fan_in), torch.randn(fan_out, rank))


@pytest.fixture
def rank_of(monkeypatch):
    def pretend(rank: int, world_size: int) -> None:
        monkeypatch.setattr(parallel, "_current", parallel.TensorParallel(rank, world_size))

    return pretend


def test_column_parallel_shares_cut_b_rows_like_the_weight(rank_of):
    """q (4 heads of 2), k and v (1 replicated key-value head of 2) over 2 ranks: each rank's
    delta is its rows of the whole delta; the base-model rows get nothing."""
    torch.manual_seed(0)
    weights = [random_weights(3, 6, 8), random_weights(4, 6, 2), random_weights(2, 6, 2)]
    x = torch.randn(5, 6)
    whole = torch.cat([x @ w.a.t() @ w.b.t() for w in weights], dim=1)  # (5, 12)
    whole[:2] = 0

    def build() -> Linear:
        heads, kv_heads = Split(4, 2, "heads"), Split(1, 2, "key-value heads", replicate=True)
        return Linear.column(6, [heads, kv_heads, kv_heads], bias=False)

    on_ranks = [layer.add_to(x, torch.zeros(5, 8)) for layer in shares(rank_of, build, weights, 2)]
    q, k, v = whole.split([8, 2, 2], dim=1)
    for rank, delta in enumerate(on_ranks):
        assert torch.allclose(delta, torch.cat([q[:, 4 * rank : 4 * rank + 4], k, v], dim=1))


def test_row_parallel_shares_cut_a_columns_and_sum_to_the_whole(rank_of):
    torch.manual_seed(1)
    weights = [random_weights(4, 8, 5)]
    x = torch.randn(5, 8)
    whole = x @ weights[0].a.t() @ weights[0].b.t()  # (5, 5)
    whole[:2] = 0

    def build() -> Linear:
        return Linear.row(Split(4, 2, "heads"), 5, bias=False)

    layers = shares(rank_of, build, weights, 2)
    partial = [
        layer.add_to(x[:, 4 * r : 4 * r + 4], torch.zeros(5, 5)) for r, layer in enumerate(layers)
    ]
    assert torch.allclose(partial[0] + partial[1], whole, atol=1e-5)


@pytest.mark.parametrize("variant", ["qwen2", "mistral-head-dim"])
def test_adapters_on_other_families_match_peft(variant, tmp_path):
    """Qwen2 (q/k/v biases) and Mistral with a head size apart from hidden / heads (so q and o
    are not square), every projection adapted."""
    from peft import LoraConfig, get_peft_model

    model_dir, adapter_dir = tmp_path / "model", tmp_path / "adapter"
    model = random_variant(variant, model_dir)
    torch.manual_seed(1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(adapter_dir)
    prompt = torch.randint(3, 512, (19,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = {"adapted": greedy_tokens(peft_model, prompt, NUM_NEW_TOKENS)}
    with peft_model.disable_adapter():
        expected["base"] = greedy_tokens(peft_model, prompt, NUM_NEW_TOKENS)
    assert expected["adapted"] != expected["base"]
    runner = ModelRunner(lora_config(model_dir, max_lora_rank=4))
    assert load(runner, "a", adapter_dir, 3) is LoRAStatus.SUCCESS
    requests = [DrivenRequest("adapted", prompt, [11, 8]), DrivenRequest("base", prompt, [19])]
    assert AdapterScheduler(runner, {"adapted": 3}).generate(requests) == expected
