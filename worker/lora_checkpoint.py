"""Reading a PEFT LoRA adapter directory, checked against the model it is to serve.

A directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (never pickle:
``adapter_model.bin`` is refused). Its tensors are ``base_model.model.{module}.lora_A.weight``
(rank, in_features) and ``...lora_B.weight`` (out_features, rank) for each module PEFT's rules
pick from ``target_modules`` (a list of names or name suffixes, a regular expression the whole
name must match, or "all-linear"), ``exclude_modules`` and ``layers_to_transform``. A module's
rank and alpha come from ``rank_pattern`` / ``alpha_pattern`` where a key matches the end of its
name (PEFT's ``get_pattern_key``), else ``r`` / ``lora_alpha``; the scaling ``alpha / r`` (or
``alpha / sqrt(r)`` with ``use_rslora``) is folded into B here.

Everything read is bounded: the config's size, its patterns' lengths, and the weights file's
size against what an adapter of ``--max-lora-rank`` for this model can take, before any tensor
is read. A problem raises ``AdapterProblem`` with the ``LoRAStatus`` to answer.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import regex
import torch
from safetensors import SafetensorError, safe_open

from interfaces.lora import LoRAStatus, LoRAType
from worker.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS_FILE = "adapter_model.bin"
MAX_CONFIG_BYTES = 1 << 20
MAX_PATTERN_LENGTH = 512
"""Of a ``target_modules`` / ``exclude_modules`` regular expression or a pattern key."""
MAX_PATTERNS = 1024
"""Entries of ``target_modules``, ``exclude_modules``, ``rank_pattern`` or ``alpha_pattern``."""
MATCH_SECONDS = 2.0
"""All of one adapter's regular-expression matching: a pattern that backtracks for longer (a
nested quantifier such as ``(.*)*(.*)*X``) refuses the adapter instead of hanging the worker."""
FLOAT_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
"""The weights' dtypes served, with their sizes."""
TENSOR_PREFIX = "base_model.model."
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION + MLP
"""The modules an adapter may target, in every decoder layer."""
UNSUPPORTED_MODULES = ("model.embed_tokens", "lm_head")
UNSUPPORTED_OPTIONS = (
    "use_dora",
    "modules_to_save",
    "fan_in_fan_out",
    "lora_bias",
    "layer_replication",
    "target_parameters",
    "trainable_token_indices",
    "alora_invocation_tokens",
    "arrow_config",
    "use_bdlora",
    "use_qalora",
    "kasa_config",
    "velora_config",
    "monteclora_config",
)
"""PEFT options that change what the adapter computes, refused when set (truthy)."""


class AdapterProblem(Exception):
    """Why an adapter cannot be loaded, with the status to answer."""

    def __init__(self, status: LoRAStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class PeftLoRAConfig(msgspec.Struct):
    """The fields of ``adapter_config.json`` that decide what is served; others are ignored
    (PEFT's initialisation options), or refused when set (``UNSUPPORTED_OPTIONS``)."""

    r: int = 8
    lora_alpha: float = 8.0
    use_rslora: bool = False
    target_modules: list[str] | str | None = None
    exclude_modules: list[str] | str | None = None
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None
    bias: str = "none"
    peft_type: str = "LORA"


@dataclass(frozen=True)
class ModuleWeights:
    """One module's adapter: ``a`` (rank, in_features) and ``b`` (out_features, rank), float32,
    the scaling folded into ``b``."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class LoRAModelShape:
    """What an adapter must fit: the decoder layers and each projection's (in, out) features,
    whole (as in the checkpoint, not one rank's share)."""

    num_layers: int
    features: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, config: ModelConfig) -> LoRAModelShape:
        hidden, inner = config.hidden_size, config.intermediate_size
        q_size = config.num_attention_heads * config.head_dim
        kv_size = config.num_key_value_heads * config.head_dim
        features = {
            "q_proj": (hidden, q_size),
            "k_proj": (hidden, kv_size),
            "v_proj": (hidden, kv_size),
            "o_proj": (q_size, hidden),
            "gate_proj": (hidden, inner),
            "up_proj": (hidden, inner),
            "down_proj": (inner, hidden),
        }
        return cls(config.num_hidden_layers, features)

    def module_names(self) -> dict[str, tuple[int, str]]:
        """Every targetable module's name (``model.layers.0.self_attn.q_proj``) → (layer,
        projection)."""
        names = {}
        for layer in range(self.num_layers):
            for projection in PROJECTIONS:
                parent = "self_attn" if projection in ATTENTION else "mlp"
                names[f"model.layers.{layer}.{parent}.{projection}"] = (layer, projection)
        return names

    def max_weights_bytes(self, max_rank: int) -> int:
        """The largest weights file an adapter of rank ``max_rank`` or less can be: every
        module targeted, in float64, and room for the header."""
        per_layer = sum(max_rank * (fan_in + fan_out) for fan_in, fan_out in self.features.values())
        num_tensors = 2 * len(PROJECTIONS) * self.num_layers
        return self.num_layers * per_layer * 8 + (64 << 10) + 256 * num_tensors


def read_adapter(
    path: str, shape: LoRAModelShape, max_rank: int
) -> dict[tuple[int, str], ModuleWeights]:
    """The adapter in directory ``path``: (layer, projection) → its weights. Raises
    ``AdapterProblem`` when the directory is not a PEFT LoRA adapter this model can serve."""
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterProblem(LoRAStatus.LOAD_INVALID_PATH, f"{path} is not a directory")
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_file.is_file():
        raise AdapterProblem(LoRAStatus.LOAD_INVALID_PATH, f"{path} has no {CONFIG_FILE}")
    if not weights_file.is_file():
        if (directory / PICKLED_WEIGHTS_FILE).is_file():
            raise AdapterProblem(
                LoRAStatus.LOAD_INVALID_ADAPTER,
                f"{path} holds {PICKLED_WEIGHTS_FILE}: only safetensors adapters are served",
            )
        raise AdapterProblem(LoRAStatus.LOAD_INVALID_PATH, f"{path} has no {WEIGHTS_FILE}")
    config = _read_config(config_file, max_rank)
    deadline = time.monotonic() + MATCH_SECONDS
    ranks = _module_ranks(config, shape, deadline)
    alphas = {
        name: _pattern_value(config.alpha_pattern, name, config.lora_alpha, deadline)
        for name in ranks
    }
    return _read_weights(weights_file, config, ranks, alphas, shape, max_rank)


def _invalid(message: str) -> AdapterProblem:
    return AdapterProblem(LoRAStatus.LOAD_INVALID_ADAPTER, message)


def _read_config(config_file: Path, max_rank: int) -> PeftLoRAConfig:
    with config_file.open("rb") as file:
        text = file.read(MAX_CONFIG_BYTES + 1)
    if len(text) > MAX_CONFIG_BYTES:
        raise _invalid(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        fields = json.loads(text)
    except (ValueError, UnicodeDecodeError) as error:
        raise _invalid(f"{CONFIG_FILE} is not valid JSON: {error}") from None
    if not isinstance(fields, dict):
        raise _invalid(f"{CONFIG_FILE} must hold a JSON object")
    for option in UNSUPPORTED_OPTIONS:
        if fields.get(option):
            raise _invalid(f"{option} is not supported (it is {fields[option]!r})")
    try:
        config = msgspec.convert(fields, PeftLoRAConfig)
    except msgspec.ValidationError as error:
        raise _invalid(f"{CONFIG_FILE}: {error}") from None
    if config.peft_type != "LORA":
        raise _invalid(f"peft_type is {config.peft_type!r}: only LORA adapters are served")
    if config.bias != "none":
        raise _invalid(f"bias {config.bias!r} is not supported (only 'none')")
    for name in ("target_modules", "exclude_modules", "rank_pattern", "alpha_pattern"):
        value = getattr(config, name)
        if isinstance(value, list | dict) and len(value) > MAX_PATTERNS:
            raise _invalid(f"{name} has {len(value)} entries, more than {MAX_PATTERNS}")
    for name, rank in [("r", config.r), *config.rank_pattern.items()]:
        if rank < 1:
            raise _invalid(f"rank {rank} of {name} is below 1")
        if rank > max_rank:
            raise _invalid(f"rank {rank} of {name} is above --max-lora-rank ({max_rank})")
    for alpha in [config.lora_alpha, *config.alpha_pattern.values()]:
        if not math.isfinite(alpha):
            raise _invalid(f"lora_alpha {alpha} is not a finite number")
    return config


def _module_ranks(config: PeftLoRAConfig, shape: LoRAModelShape, deadline: float) -> dict[str, int]:
    """Each targeted module's name → its rank, by PEFT's matching rules (every match done by
    ``deadline``, a ``time.monotonic()``)."""
    modules = shape.module_names()
    targets = config.target_modules
    if targets is None:
        raise _invalid("target_modules is missing")
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = list(PROJECTIONS)
    candidates = [*modules, *UNSUPPORTED_MODULES]
    matched = _matching(targets, candidates, deadline)
    if config.exclude_modules:
        matched -= _matching(config.exclude_modules, list(matched), deadline)
    for name in UNSUPPORTED_MODULES:
        if name in matched:
            raise _invalid(
                f"target_modules names {name.rpartition('.')[2]}, which is not supported "
                f"(only {', '.join(PROJECTIONS)} are)"
            )
    if isinstance(targets, list):
        for target in targets:
            if not _matching([target], candidates, deadline):
                raise _invalid(
                    f"target_modules names {target!r}, which this model lacks or which is not "
                    f"one of {', '.join(PROJECTIONS)}"
                )
    layers = config.layers_to_transform
    if layers is not None and isinstance(targets, list):  # PEFT ignores it for a regex
        wanted = {layers} if isinstance(layers, int) else set(layers)
        matched = {name for name in matched if modules[name][0] in wanted}
    if not matched:
        raise _invalid("target_modules selects none of this model's modules")
    return {name: _pattern_value(config.rank_pattern, name, config.r, deadline) for name in matched}


def _matching(targets: list[str] | str, names: list[str], deadline: float) -> set[str]:
    """The ``names`` PEFT's ``target_modules`` rule picks: a string is a regular expression the
    whole name matches; a list's entries are names or name suffixes."""
    if isinstance(targets, str):
        return {name for name in names if _matches(targets, name, deadline, whole=True)}
    return {
        name for name in names if name in targets or any(name.endswith(f".{t}") for t in targets)
    }


def _pattern_value(pattern: dict[str, Any], name: str, default: Any, deadline: float) -> Any:
    """PEFT's ``get_pattern_key``: the first key matching the end of ``name`` gives the value."""
    for key in pattern:
        if _matches(rf"(.*\.)?({key})$", name, deadline):
            return pattern[key]
    return default


def _matches(pattern: str, name: str, deadline: float, whole: bool = False) -> bool:
    """Whether ``pattern`` matches the start (``whole``: all) of ``name``; an adapter whose
    patterns run past ``deadline`` is refused (``regex``'s timeout: ``re`` has none)."""
    if len(pattern) > MAX_PATTERN_LENGTH + 16:
        raise _invalid(f"a pattern is longer than {MAX_PATTERN_LENGTH} characters")
    try:
        compiled = regex.compile(pattern)
    except regex.error as error:
        raise _invalid(f"bad regular expression {pattern[:80]!r}: {error}") from None
    match = compiled.fullmatch if whole else compiled.match
    try:
        return match(name, timeout=max(0.0, deadline - time.monotonic())) is not None
    except TimeoutError:
        raise _invalid(
            f"matching the regular expression {pattern[:80]!r} took longer than {MATCH_SECONDS:g} s"
        ) from None


def _read_weights(
    weights_file: Path,
    config: PeftLoRAConfig,
    ranks: dict[str, int],
    alphas: dict[str, float],
    shape: LoRAModelShape,
    max_rank: int,
) -> dict[tuple[int, str], ModuleWeights]:
    size, limit = weights_file.stat().st_size, shape.max_weights_bytes(max_rank)
    if size > limit:
        raise _invalid(
            f"{WEIGHTS_FILE} is {size} bytes, more than an adapter of rank {max_rank} or less "
            f"for this model can be ({limit})"
        )
    try:
        with safe_open(str(weights_file), framework="pt", device="cpu") as weights:
            names = set(weights.keys())
            _check_names(names, ranks, shape)
            for name in sorted(names):  # each A before its B
                _check_tensor(name, weights.get_slice(name), ranks, shape)
            return _scaled_weights(weights, config, ranks, alphas, shape)
    except SafetensorError as error:
        raise _invalid(f"{WEIGHTS_FILE} cannot be read: {error}") from None


def _tensor_names(module: str) -> tuple[str, str]:
    """(A's, B's) tensor names of ``module`` (MAX's ``LoRAType`` values are PEFT's names)."""
    return (
        f"{TENSOR_PREFIX}{module}.{LoRAType.A.value}.weight",
        f"{TENSOR_PREFIX}{module}.{LoRAType.B.value}.weight",
    )


def _check_names(names: set[str], ranks: dict[str, int], shape: LoRAModelShape) -> None:
    expected = {name for module in ranks for name in _tensor_names(module)}
    for name in sorted(names - expected):
        layer = re.match(rf"{re.escape(TENSOR_PREFIX)}model\.layers\.(\d+)\.", name)
        if layer is not None and int(layer[1]) >= shape.num_layers:
            raise _invalid(
                f"tensor {name[:200]} is for layer {layer[1]}, which the model lacks (it has "
                f"{shape.num_layers})"
            )
        raise _invalid(f"unexpected tensor {name[:200]} (not a targeted module's lora_A/lora_B)")
    missing = sorted(expected - names)
    if missing:
        raise _invalid(f"{WEIGHTS_FILE} lacks {missing[0]} ({len(missing)} tensors missing)")


def _check_tensor(name: str, tensor: Any, ranks: dict[str, int], shape: LoRAModelShape) -> None:
    module, _, kind = name.removeprefix(TENSOR_PREFIX).rpartition(".")[0].rpartition(".")
    dtype = tensor.get_dtype()
    if dtype not in FLOAT_DTYPES:
        raise _invalid(f"tensor {name} is {dtype}, not a float type ({', '.join(FLOAT_DTYPES)})")
    fan_in, fan_out = shape.features[module.rpartition(".")[2]]
    rank = ranks[module]
    expected = [rank, fan_in] if kind == LoRAType.A.value else [fan_out, rank]
    if list(tensor.get_shape()) != expected:
        raise _invalid(
            f"tensor {name} has shape {tuple(tensor.get_shape())}, expected {tuple(expected)}"
        )


def _scaled_weights(
    weights: Any,
    config: PeftLoRAConfig,
    ranks: dict[str, int],
    alphas: dict[str, float],
    shape: LoRAModelShape,
) -> dict[tuple[int, str], ModuleWeights]:
    modules = shape.module_names()
    adapter = {}
    for module, rank in ranks.items():
        a_name, b_name = _tensor_names(module)
        a = weights.get_tensor(a_name).to(torch.float32)
        b = weights.get_tensor(b_name).to(torch.float32)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise _invalid(f"the weights of {module} are not all finite (NaN or infinity)")
        scaling = alphas[module] / (math.sqrt(rank) if config.use_rslora else rank)
        b = b * scaling
        if not torch.isfinite(b).all():
            raise _invalid(f"the weights of {module} overflow once scaled by {scaling:g}")
        adapter[modules[module]] = ModuleWeights(a, b)
    return adapter
