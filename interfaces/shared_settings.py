"""Settings more than one role takes, each flag declared once (``interfaces.settings``):
``ModelSettings`` (the worker, the API server and ``switchyard serve``) and
``SchedulerAddress`` (the worker and the API server, which connect to the scheduler)."""

from __future__ import annotations

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
