"""Settings more than one role takes, each flag declared once (``interfaces.settings``):
``ModelSettings`` (the worker, the API server and ``switchyard serve``),
``SchedulerAddress`` (the worker and the API server, which connect to the scheduler) and
``LogitsProcessorSettings`` (the worker loads them, the API server checks requests' names)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from interfaces.settings import setting


@dataclass(frozen=True)
class ModelSettings:
    """The model a process serves, as given: ``python -m worker`` loads it, ``python -m
    api_server`` tokenizes for it, ``switchyard serve`` hands it to both."""

    path: str | None = setting(
        None,
        "--model",
        "Hugging Face-format directory or .gguf file (python -m api_server: the directory, which "
        "switchyard serve converts a .gguf file to; switchyard serve: 'none' serves only "
        "--embedding-model, ./none names a directory)",
        default_text="SmolLM2-135M-Instruct; python -m api_server: none, serving only "
        "--embedding-model",
    )
    """None: the default model, or for the API server none."""
    served_model_name: str | None = setting(
        None,
        "--served-model-name",
        "model name clients use",
        default_text="the directory's or .gguf file's name",
    )
    max_model_len: int | None = setting(
        None,
        "--max-model-len",
        "context length: prompt plus output tokens at most",
        default_text="the model's",
    )


@dataclass(frozen=True)
class SchedulerAddress:
    """Where a worker or an API server connects to the scheduler."""

    address: str | None = setting(
        None,
        "--scheduler-addr",
        "the scheduler's ZeroMQ address: its --backend-addr for a worker, its --frontend-addr "
        "for an API server",
        required=True,
    )


_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def logits_processor_name(path: str) -> str:
    """The name requests use for the processor at ``path`` (``pkg.module:Name`` → ``Name``);
    ``ValueError`` unless ``path`` has that form."""
    if not _IMPORT_PATH.fullmatch(path):
        raise ValueError(f"--logits-processors: {path!r} is not an import path pkg.module:Name")
    return path.rpartition(":")[2]


@dataclass(frozen=True)
class LogitsProcessorSettings:
    """User logits processors, by import path: each worker imports them at start
    (``worker.user_processors``); the API server only checks that requests name loaded ones,
    by the name after the colon, and imports nothing."""

    paths: tuple[str, ...] = setting(
        (),
        "--logits-processors",
        "user logits processors to load, as pkg.module:Name (comma-separated or repeated); a "
        "request applies those it names in logits_processors",
        metavar="MODULE:NAME",
        default_text="none",
    )

    @property
    def names(self) -> tuple[str, ...]:
        """The names requests use, in load order."""
        return tuple(logits_processor_name(path) for path in self.paths)

    def __post_init__(self) -> None:
        names = self.names
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"--logits-processors: two processors are named {twice[0]!r}")


@dataclass(frozen=True)
class LoRASettings:
    """LoRA adapters a worker can serve beside its base model (``worker.lora``): slots for
    ``max_loras`` adapters of rank up to ``max_lora_rank`` are allocated at start when
    ``enable_lora``; the scheduler loads adapters into them (``--lora-modules`` at start,
    ``POST /v1/load_lora_adapter`` at run time)."""

    enable_lora: bool = setting(
        False,
        "--enable-lora",
        "serve LoRA adapters (switchyard serve: implied by --lora-modules)",
        switch=True,
    )
    max_loras: int = setting(
        4, "--max-loras", "LoRA adapters loaded at once (each takes a slot of weights)"
    )
    max_lora_rank: int = setting(16, "--max-lora-rank", "the largest adapter rank served")

    def __post_init__(self) -> None:
        from interfaces.lora import MAX_LORA_RANK, MAX_LORAS

        if not 1 <= self.max_loras <= MAX_LORAS:
            raise ValueError(f"--max-loras must be 1 to {MAX_LORAS}, not {self.max_loras}")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(
                f"--max-lora-rank must be 1 to {MAX_LORA_RANK}, not {self.max_lora_rank}"
            )
