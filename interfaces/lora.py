"""LoRA adapters in MAX's vocabulary (``LoRAOperation``, ``LoRARequest``, ``LoRAResponse``,
``LoRAStatus``, ``LoRAType``), and the bounds every receiver checks.

An API server sends a ``LoRARequest`` to the scheduler (``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``) and gets a ``LoRAResponse``. The scheduler names each loaded
adapter by a ``lora_id`` of its own (never reused while it runs, so a reloaded name never
shares cached KV with its predecessor), carries loads and unloads to every rank of every worker
group (``interfaces.scheduler_to_worker.LoRAUpdate``), and tags each request with its
adapter's id when it admits it (``TextContext.lora_id``; 0 is the base model).
"""

from __future__ import annotations

import enum
import re

import msgspec

MAX_LORA_NAME_LENGTH = 128
"""Of an adapter's name (clients send it as ``model``)."""
MAX_LORA_PATH_LENGTH = 4096
"""Of an adapter directory's path (Linux's PATH_MAX)."""
MAX_LORA_RANK = 512
"""The largest ``--max-lora-rank`` a worker takes."""
MAX_LORAS = 256
"""The most adapters loaded at once (``--max-loras``)."""
MAX_LORA_MESSAGE_LENGTH = 1024
"""Of a ``LoRAResponse`` message, cut where longer (a path or an error may be long)."""
LORA_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")
"""Names are what clients send as ``model``: printable, no spaces, no leading punctuation."""


class LoRAOperation(str, enum.Enum):
    """What a ``LoRARequest`` asks for."""

    LOAD = "load"
    UNLOAD = "unload"


class LoRAStatus(str, enum.Enum):
    """The outcome of a LoRA operation (MAX's values)."""

    SUCCESS = "success"
    LOAD_NAME_EXISTS = "load_name_exists"
    """An adapter of that name is already loaded."""
    LOAD_INVALID_PATH = "load_invalid_path"
    """The path is not a directory holding an adapter."""
    LOAD_INVALID_ADAPTER = "load_invalid_adapter"
    """The adapter is malformed or does not fit the model (rank above ``--max-lora-rank``,
    modules the model lacks, shapes that differ, unsupported PEFT options)."""
    LOAD_ERROR = "load_error"
    """Loading failed for another reason (LoRA not enabled, every slot taken, no worker)."""
    UNLOAD_NAME_NONEXISTENT = "unload_name_nonexistent"
    UNLOAD_ERROR = "unload_error"
    UNSPECIFIED_ERROR = "unspecified_error"


class LoRAType(str, enum.Enum):
    """The two matrices of a LoRA product, ``B @ A``, named as in PEFT checkpoints."""

    A = "lora_A"
    """(rank, in_features): projects the input down to the adapter's rank."""
    B = "lora_B"
    """(out_features, rank): projects it back up."""


class LoRARequest(msgspec.Struct, array_like=True, frozen=True):
    """Load (``lora_path`` required) or unload the adapter ``lora_name``."""

    operation: LoRAOperation
    lora_name: str
    lora_path: str | None = None


class LoRAResponse(msgspec.Struct, array_like=True, frozen=True):
    """What became of a ``LoRARequest``: ``status``, and a message for the user."""

    status: LoRAStatus
    message: str

    @property
    def ok(self) -> bool:
        return self.status is LoRAStatus.SUCCESS

    @classmethod
    def of(cls, status: LoRAStatus, message: str) -> LoRAResponse:
        """A response with ``message`` cut to ``MAX_LORA_MESSAGE_LENGTH``."""
        if len(message) > MAX_LORA_MESSAGE_LENGTH:
            message = message[: MAX_LORA_MESSAGE_LENGTH - 3] + "..."
        return cls(status, message)


class LoRAAdapterInfo(msgspec.Struct, array_like=True, frozen=True):
    """A loaded adapter, as ``/v1/models`` lists it."""

    name: str
    path: str


def lora_request_problem(request: LoRARequest) -> str | None:
    """Why ``request`` cannot be carried out as it stands (checked where it is received), or
    None."""
    problem = lora_name_problem(request.lora_name)
    if problem is not None:
        return problem
    if request.operation is LoRAOperation.LOAD:
        path = request.lora_path
        if not path:
            return "lora_path is required to load an adapter"
        if len(path) > MAX_LORA_PATH_LENGTH or "\x00" in path:
            return f"lora_path must be a path of at most {MAX_LORA_PATH_LENGTH} characters"
    return None


def lora_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name an adapter, or None."""
    if not 0 < len(name) <= MAX_LORA_NAME_LENGTH or not LORA_NAME_PATTERN.fullmatch(name):
        return (
            f"lora_name must be 1 to {MAX_LORA_NAME_LENGTH} characters: letters, digits and "
            "._:/@+- (not first)"
        )
    return None
