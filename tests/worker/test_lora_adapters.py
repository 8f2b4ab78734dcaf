"""Loading and unloading LoRA adapters in the worker: every way an adapter directory can be
wrong gets its status and message, slots fill and free all or nothing, and tensor-parallel
ranks keep an adapter only when all of them loaded it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from interfaces.lora import LoRAOperation, LoRAStatus
from interfaces.scheduler_to_worker import LoRAUpdate, NewRequestData, ScheduledStep
from interfaces.worker_to_scheduler import WorkerReady
from tests.support.lora import lora_config
from tests.support.parity_scheduler import DrivenRequest, FakeScheduler
from worker import lora as lora_module
from worker.config import WorkerConfig
from worker.model_runner import ModelRunner
from worker.server import WorkerServer

INVALID_PATH, INVALID_ADAPTER = LoRAStatus.LOAD_INVALID_PATH, LoRAStatus.LOAD_INVALID_ADAPTER
PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def runner(tiny_llama_dir) -> ModelRunner:
    """A worker with 2 slots of rank 8 at most."""
    return ModelRunner(lora_config(tiny_llama_dir, max_loras=2, max_lora_rank=8))


@pytest.fixture(autouse=True)
def no_adapters_left(runner):
    yield
    runner.lora.unload_all()


def update(runner: ModelRunner, lora_id: int, path: Path | str | None, name: str = "a"):
    operation = LoRAOperation.LOAD if path is not None else LoRAOperation.UNLOAD
    updated = runner.update_lora(
        LoRAUpdate(operation, lora_id, name, None if path is None else str(path))
    )
    assert (updated.operation, updated.lora_id) == (operation, lora_id)
    return updated.response


def edit_config(**changes) -> Callable[[Path], None]:
    def edit(directory: Path) -> None:
        config = json.loads((directory / "adapter_config.json").read_text())
        config.update(changes)
        (directory / "adapter_config.json").write_text(json.dumps(config))

    return edit


def edit_weights(change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def edit(directory: Path) -> None:
        weights = load_file(directory / "adapter_model.safetensors")
        change(weights)
        save_file(weights, directory / "adapter_model.safetensors")

    return edit


def remove(name: str) -> Callable[[Path], None]:
    return lambda directory: (directory / name).unlink()


def write(name: str, content: bytes) -> Callable[[Path], None]:
    return lambda directory: (directory / name).write_bytes(content)


def both(*edits: Callable[[Path], None]) -> Callable[[Path], None]:
    def edit(directory: Path) -> None:
        for each in edits:
            each(directory)

    return edit


Q_A = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"
BAD_ADAPTERS = {
    "no config": (remove("adapter_config.json"), INVALID_PATH, "has no adapter_config.json"),
    "no weights": (
        remove("adapter_model.safetensors"),
        INVALID_PATH,
        "has no adapter_model.safetensors",
    ),
    "pickled weights": (
        both(remove("adapter_model.safetensors"), write("adapter_model.bin", b"\x80\x04")),
        INVALID_ADAPTER,
        "holds adapter_model.bin: only safetensors adapters are served",
    ),
    "malformed json": (
        write("adapter_config.json", b'{"r": 8,'),
        INVALID_ADAPTER,
        "adapter_config.json is not valid JSON",
    ),
    "json list": (write("adapter_config.json", b"[8]"), INVALID_ADAPTER, "a JSON object"),
    "huge config": (
        write("adapter_config.json", b" " * (1 << 20) + b"{}"),
        INVALID_ADAPTER,
        "adapter_config.json is larger than 1048576 bytes",
    ),
    "rank a string": (edit_config(r="8"), INVALID_ADAPTER, "Expected `int`, got `str` - at `$.r`"),
    "rank too high": (
        edit_config(r=16),
        INVALID_ADAPTER,
        "rank 16 of r is above --max-lora-rank (8)",
    ),
    "rank 0": (edit_config(r=0), INVALID_ADAPTER, "rank 0 of r is below 1"),
    "pattern rank too high": (
        edit_config(rank_pattern={"q_proj": 9}),
        INVALID_ADAPTER,
        "rank 9 of q_proj is above --max-lora-rank (8)",
    ),
    "alpha not finite": (
        write("adapter_config.json", b'{"r": 8, "lora_alpha": NaN, "target_modules": ["q_proj"]}'),
        INVALID_ADAPTER,
        "lora_alpha nan is not a finite number",
    ),
    "embeddings": (
        edit_config(target_modules=["q_proj", "embed_tokens"]),
        INVALID_ADAPTER,
        "target_modules names embed_tokens, which is not supported",
    ),
    "lm head by regex": (
        edit_config(target_modules=r".*(q_proj|lm_head)"),
        INVALID_ADAPTER,
        "target_modules names lm_head, which is not supported",
    ),
    "unknown module": (
        edit_config(target_modules=["q_proj", "w_proj"]),
        INVALID_ADAPTER,
        "target_modules names 'w_proj', which this model lacks",
    ),
    "bad regex": (edit_config(target_modules="(q_proj"), INVALID_ADAPTER, "bad regular expression"),
    "no targets": (edit_config(target_modules=None), INVALID_ADAPTER, "target_modules is missing"),
    "dora": (edit_config(use_dora=True), INVALID_ADAPTER, "use_dora is not supported"),
    "modules to save": (
        edit_config(modules_to_save=["lm_head"]),
        INVALID_ADAPTER,
        "modules_to_save is not supported",
    ),
    "bias": (edit_config(bias="all"), INVALID_ADAPTER, "bias 'all' is not supported"),
    "fan in fan out": (
        edit_config(fan_in_fan_out=True),
        INVALID_ADAPTER,
        "fan_in_fan_out is not supported",
    ),
    "not lora": (edit_config(peft_type="IA3"), INVALID_ADAPTER, "only LORA adapters are served"),
    "shape": (
        edit_config(rank_pattern={"layers.0.self_attn.q_proj": 4}),
        INVALID_ADAPTER,
        f"tensor {Q_A} has shape (8, 64), expected (4, 64)",
    ),
    "layer the model lacks": (
        edit_weights(lambda w: w.update({Q_A.replace(".0.", ".5."): w[Q_A].clone()})),
        INVALID_ADAPTER,
        "is for layer 5, which the model lacks (it has 2)",
    ),
    "unexpected tensor": (
        edit_weights(lambda w: w.update({Q_A.replace("q_proj", "gate_proj"): w[Q_A].clone()})),
        INVALID_ADAPTER,
        "unexpected tensor base_model.model.model.layers.0.self_attn.gate_proj.lora_A.weight",
    ),
    "missing tensor": (
        edit_weights(lambda w: w.pop(Q_A)),
        INVALID_ADAPTER,
        f"adapter_model.safetensors lacks {Q_A} (1 tensors missing)",
    ),
    "integers": (
        edit_weights(lambda w: w.update({Q_A: w[Q_A].to(torch.int32)})),
        INVALID_ADAPTER,
        f"tensor {Q_A} is I32, not a float type",
    ),
    "nan weights": (
        edit_weights(lambda w: w[Q_A].view(-1)[3].fill_(float("nan"))),
        INVALID_ADAPTER,
        "the weights of model.layers.0.self_attn.q_proj are not all finite",
    ),
    "weights too large": (
        edit_weights(lambda w: w.update({"padding": torch.zeros(60000)})),
        INVALID_ADAPTER,
        "more than an adapter of rank 8 or less for this model can be",
    ),
    "not safetensors": (
        write("adapter_model.safetensors", b"\xff" * 64),
        INVALID_ADAPTER,
        "adapter_model.safetensors cannot be read",
    ),
    "a pattern that backtracks for ever": (
        edit_config(target_modules="((.|..)*)*[0-9]{2}"),
        INVALID_ADAPTER,
        "matching the regular expression '((.|..)*)*[0-9]{2}' took longer than 2 s",
    ),
    "a rank pattern of 2,000 keys": (
        edit_config(rank_pattern={f"k{i}": 2 for i in range(2000)}),
        INVALID_ADAPTER,
        "rank_pattern has 2000 entries, more than 1024",
    ),
    "an alpha that overflows once scaled": (
        edit_config(lora_alpha=1e300),
        INVALID_ADAPTER,
        "overflow once scaled",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
def test_a_bad_adapter_gets_its_status_and_leaves_every_slot_free(
    case, runner, tiny_lora_adapters, tmp_path
):
    edit, status, message = BAD_ADAPTERS[case]
    directory = tmp_path / "adapter"
    shutil.copytree(tiny_lora_adapters["alpha"], directory)
    edit(directory)
    response = update(runner, 1, directory, name="bad")
    assert response.status is status
    assert response.message.startswith("adapter 'bad': ")
    assert message in response.message
    assert runner.lora.slot_by_id == {}
    assert all(not layer.a.any() and not layer.b.any() for layer in runner.lora.layers)


def test_paths_that_are_not_adapter_directories(runner, tmp_path):
    (tmp_path / "file").write_text("")
    for path, message in [
        (tmp_path / "file", f"{tmp_path / 'file'} is not a directory"),
        (tmp_path / "absent", f"{tmp_path / 'absent'} is not a directory"),
        ("", "lora_path must be a path of 1 to 4096 characters"),
        ("a\x00b", "lora_path must be a path of 1 to 4096 characters"),
    ]:
        response = update(runner, 1, path)
        assert (response.status, response.message) == (INVALID_PATH, f"adapter 'a': {message}")


def test_slots_fill_free_and_take_an_adapter_again_elsewhere(runner, tiny_lora_adapters):
    alpha, beta = tiny_lora_adapters["alpha"], tiny_lora_adapters["beta"]
    assert update(runner, 1, alpha).status is LoRAStatus.SUCCESS
    assert runner.lora.slot_by_id == {1: 0}
    first_layer = runner.lora.layers[0]  # layer 0's qkv_proj
    alpha_a, alpha_b = first_layer.a[0].clone(), first_layer.b[0].clone()
    assert alpha_a.any() and alpha_b.any()
    already = update(runner, 1, beta)
    assert (already.status, already.message) == (
        LoRAStatus.LOAD_ERROR,
        "adapter 'a': lora_id 1 is already loaded",
    )
    assert update(runner, 1, None).status is LoRAStatus.SUCCESS  # unload: slot 0 is free
    assert not first_layer.a.any()
    assert update(runner, 2, beta).status is LoRAStatus.SUCCESS
    assert update(runner, 3, alpha).status is LoRAStatus.SUCCESS
    assert runner.lora.slot_by_id == {2: 0, 3: 1}
    assert torch.equal(first_layer.a[1], alpha_a) and torch.equal(first_layer.b[1], alpha_b)
    full = update(runner, 4, alpha)
    assert (full.status, full.message) == (
        LoRAStatus.LOAD_ERROR,
        "adapter 'a': all --max-loras (2) slots hold adapters; unload one first",
    )
    unknown = update(runner, 4, None)
    assert (unknown.status, unknown.message) == (
        LoRAStatus.UNLOAD_NAME_NONEXISTENT,
        "LoRA adapter id 4 is not loaded on this worker",
    )
    assert runner.lora.slot_by_id == {2: 0, 3: 1}


def test_a_load_that_fails_midway_leaves_its_slot_zero_and_free(
    runner, tiny_lora_adapters, monkeypatch
):
    written = []
    original = lora_module.LayerAdapters.write

    def fail_third(self, slot, projection, weights):
        if len(written) == 2:
            raise RuntimeError("disk on fire")
        written.append(slot)
        original(self, slot, projection, weights)

    monkeypatch.setattr(lora_module.LayerAdapters, "write", fail_third)
    response = update(runner, 1, tiny_lora_adapters["alpha"])
    assert (response.status, response.message) == (
        LoRAStatus.LOAD_ERROR,
        "adapter 'a': disk on fire",
    )
    assert written == [0, 0]
    assert runner.lora.slot_by_id == {}
    assert all(not layer.a.any() and not layer.b.any() for layer in runner.lora.layers)


def test_no_rank_keeps_an_adapter_another_rank_could_not_load(
    runner, tiny_lora_adapters, monkeypatch
):
    agreed = []

    def another_rank_failed(failed, refused):
        agreed.append((failed, refused))
        return True, refused

    monkeypatch.setattr(lora_module.parallel, "agree_on_step", another_rank_failed)
    response = update(runner, 1, tiny_lora_adapters["alpha"])
    assert agreed == [(False, [])]
    assert (response.status, response.message) == (
        LoRAStatus.LOAD_ERROR,
        "adapter 'a': another tensor-parallel rank could not load it (see that rank's log)",
    )
    assert runner.lora.slot_by_id == {}
    assert all(not layer.a.any() and not layer.b.any() for layer in runner.lora.layers)


def test_the_worker_reports_its_slots_and_forgets_adapters_with_its_scheduler(
    runner, tiny_lora_adapters
):
    ready = WorkerServer(runner, "ipc:///nonexistent")._ready()
    assert isinstance(ready, WorkerReady)
    assert (ready.max_loras, ready.max_lora_rank) == (2, 8)
    assert update(runner, 1, tiny_lora_adapters["alpha"]).status is LoRAStatus.SUCCESS
    runner.release_all()  # the scheduler went away: a new one names adapters afresh
    assert runner.lora.slot_by_id == {}
    assert not runner.lora.layers[0].a.any()


def test_a_worker_without_lora_refuses_adapters(tiny_llama_dir, tiny_lora_adapters):
    runner = ModelRunner(
        WorkerConfig(tiny_llama_dir, device="cpu", kv_cache_memory=4 << 20, max_model_len=64)
    )
    assert runner.lora is None and runner.lora_limits == (0, 0)
    assert WorkerServer(runner, "ipc:///nonexistent")._ready().max_loras == 0
    message = "LoRA is not enabled on this worker: start the worker with --enable-lora"
    load = update(runner, 1, tiny_lora_adapters["alpha"])
    assert (load.status, load.message) == (LoRAStatus.LOAD_ERROR, message)
    assert update(runner, 1, None).status is LoRAStatus.UNLOAD_ERROR
    request = DrivenRequest("adapted", [5, 6, 7], [])
    scheduler = FakeScheduler(runner)
    scheduler._allocate(request, 4)
    new = scheduler._new_request_data(request)
    new = NewRequestData(msgspec.structs.replace(new.context, lora_id=1), new.block_ids, 0)
    assert runner.next_token(ScheduledStep(0, [new], [], {"adapted": 3})) == {}
    assert runner.take_refusals() == {"adapted": "LoRA adapter id 1 is not loaded on this worker"}


def drop_layer_1(weights: dict[str, torch.Tensor]) -> None:
    for name in [name for name in weights if ".layers.1." in name]:
        del weights[name]


GOOD_VARIANTS = {
    "regex targets": (edit_config(target_modules=r".*\.(q|k|v|o)_proj"), 2),
    "lm head excluded": (
        edit_config(
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"],
            exclude_modules=["lm_head"],
        ),
        2,
    ),
    "layer 0 only": (both(edit_config(layers_to_transform=[0]), edit_weights(drop_layer_1)), 1),
}


@pytest.mark.parametrize("case", sorted(GOOD_VARIANTS))
def test_peft_rules_pick_the_modules(case, runner, tiny_lora_adapters, tmp_path):
    """Regular-expression targets, excluded modules and chosen layers, as PEFT reads them."""
    edit, num_layers = GOOD_VARIANTS[case]
    directory = tmp_path / "adapter"
    shutil.copytree(tiny_lora_adapters["alpha"], directory)
    edit(directory)
    assert update(runner, 1, directory).status is LoRAStatus.SUCCESS
    per_layer = len(runner.lora.layers) // 2  # qkv_proj, o_proj, gate_up_proj, down_proj
    filled = [bool(layer.a[0].any()) for layer in runner.lora.layers]
    assert filled == ([True, True, False, False] * 2)[: per_layer * num_layers] + [False] * (
        per_layer * (2 - num_layers)
    )
