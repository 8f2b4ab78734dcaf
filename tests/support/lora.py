"""Driving a worker with LoRA adapters in tests: its configuration, loads, and a scripted
scheduler whose requests name adapters."""

from __future__ import annotations

from pathlib import Path

import msgspec

from interfaces.lora import LoRAOperation, LoRAStatus
from interfaces.scheduler_to_worker import LoRAUpdate, NewRequestData
from interfaces.shared_settings import LoRASettings
from tests.support.parity_scheduler import DrivenRequest, FakeScheduler
from worker.config import WorkerConfig
from worker.model_runner import ModelRunner


def lora_config(model_dir: Path, max_loras: int = 2, max_lora_rank: int = 8) -> WorkerConfig:
    return WorkerConfig(
        model_dir,
        device="cpu",
        kv_cache_memory=16 << 20,
        max_model_len=256,
        lora=LoRASettings(enable_lora=True, max_loras=max_loras, max_lora_rank=max_lora_rank),
    )


def load(runner: ModelRunner, name: str, path: Path, lora_id: int) -> LoRAStatus:
    update = LoRAUpdate(LoRAOperation.LOAD, lora_id, name, str(path))
    updated = runner.update_lora(update)
    assert (updated.operation, updated.lora_id) == (LoRAOperation.LOAD, lora_id)
    return updated.response.status


class AdapterScheduler(FakeScheduler):
    """``FakeScheduler`` whose requests run with the adapters ``lora_ids`` names."""

    def __init__(self, runner: ModelRunner, lora_ids: dict[str, int]) -> None:
        super().__init__(runner)
        self.lora_ids = lora_ids

    def _new_request_data(self, request: DrivenRequest) -> NewRequestData:
        new = super()._new_request_data(request)
        lora_id = self.lora_ids.get(request.request_id, 0)
        new.context = msgspec.structs.replace(new.context, lora_id=lora_id)
        return new
