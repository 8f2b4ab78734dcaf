"""Sampling defaults from a model's generation_config.json (``--generation-config``).

A model's creator may recommend sampling values in its generation_config.json (Llama 3:
temperature 0.6, top_p 0.9). As vLLM's ``--generation-config`` does, they are the defaults of
every request that does not set those fields: ``auto`` (the default) reads the model
directory's file, ``vllm`` ignores it (OpenAI's defaults: temperature 1, no top-k or top-p
limit), and a directory reads that directory's file. The fields taken are vLLM's: temperature,
top_p, top_k, min_p, repetition_penalty and max_new_tokens (the default ``max_tokens``; in a
directory given, also a limit on every request's, as vLLM takes it).
``SamplingParamsGenerationConfigDefaults`` is MAX's name for them.

As vLLM reads these files: a value equal to transformers' own default (temperature 1.0,
top_p 1.0, top_k 50, repetition_penalty 1.0) is no default, and ``do_sample`` is not read (a
file with ``do_sample: false`` and a temperature gives that temperature, as it does in vLLM,
though transformers' ``generate`` would decode greedily).

The file is outside input: read at most ``MAX_GENERATION_CONFIG_BYTES``, each field checked for
its type and for the bounds a request's field has. A directory given whose file fails is a
``ValueError`` naming the file and the field, at start-up; the model's own file (``auto``) loses
the fields that fail, with a warning, so that a model vLLM serves is served here too. No file
under ``auto`` means no defaults.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec

from api_server.protocol import (
    INT32_MAX,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    SamplingFields,
)
from interfaces import TextContext

AUTO, VLLM = "auto", "vllm"
GENERATION_CONFIG_FILE = "generation_config.json"
MAX_GENERATION_CONFIG_BYTES = 1024 * 1024
"""A real generation_config.json is well under a kilobyte."""
_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
"""transformers' ``GenerationConfig`` defaults, which vLLM's ``to_diff_dict`` leaves out."""

logger = logging.getLogger(__name__)
Request = TypeVar("Request", bound=SamplingFields)


class SamplingParamsGenerationConfigDefaults(msgspec.Struct, frozen=True, kw_only=True):
    """The sampling fields of a generation_config.json, each bounded as a request's is; None:
    the file does not set it. Other keys of the file (token ids, ...) are ignored here."""

    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: (
        Annotated[float, msgspec.Meta(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)] | None
    ) = None
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)] | None = None

    @property
    def overrides(self) -> dict[str, float | int]:
        """The defaults that apply, by ``SamplingParams`` field name (``max_new_tokens`` is a
        request's ``max_tokens``): the values set, but transformers' own defaults."""
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
        values = {name: getattr(self, name) for name in names}
        return {
            name: value
            for name, value in values.items()
            if value is not None and value != _TRANSFORMERS_DEFAULTS.get(name)
        }


NO_DEFAULTS = SamplingParamsGenerationConfigDefaults()


def generation_config_source(text: str) -> str:
    """``--generation-config``: ``auto``, ``vllm``, or a directory as an absolute path (so it
    means the same to every process ``switchyard serve`` starts)."""
    if text in (AUTO, VLLM):
        return text
    return str(Path(text).expanduser().resolve())


def generation_config_path(model_dir: Path, source: str = AUTO) -> Path | None:
    """The generation_config.json that ``--generation-config source`` names for the model in
    ``model_dir``; None: none (``vllm``, or ``auto`` and the model has none). ``ValueError``
    for a directory given that has none."""
    if source == VLLM:
        return None
    if source == AUTO:
        path = model_dir / GENERATION_CONFIG_FILE
        return path if path.is_file() else None
    path = Path(source) / GENERATION_CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"--generation-config {source}: there is no {path}")
    return path


def load_generation_defaults(
    model_dir: Path, source: str = AUTO, log: bool = False
) -> SamplingParamsGenerationConfigDefaults:
    """The sampling defaults ``--generation-config source`` gives the model in ``model_dir``
    (``log``: say which at INFO, as vLLM does). ``ValueError`` for a directory given that has
    none, or whose file is not a valid generation config. The model's own file (``auto``) is
    read leniently instead: a model that served before keeps serving, without the values
    that are not valid (``log``: a warning names each)."""
    path = generation_config_path(model_dir, source)
    if path is None:
        defaults = NO_DEFAULTS
    elif source == AUTO:
        defaults = _read_leniently(path, log)
    else:
        defaults = read_generation_config(path)
    if log and defaults.overrides:
        logger.info(
            "Default sampling parameters have been overridden by the model's generation config "
            "%s: %s (--generation-config vllm ignores it)",
            path,
            _describe(defaults.overrides),
        )
    return defaults


def read_generation_config(path: Path) -> SamplingParamsGenerationConfigDefaults:
    """The sampling fields of the generation_config.json at ``path``, checked."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_GENERATION_CONFIG_BYTES + 1)
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror}") from None
    if len(data) > MAX_GENERATION_CONFIG_BYTES:
        raise ValueError(
            f"{path} is not a generation config: larger than {MAX_GENERATION_CONFIG_BYTES} bytes"
        )
    try:
        return msgspec.json.decode(data, type=SamplingParamsGenerationConfigDefaults)
    except (msgspec.DecodeError, RecursionError) as error:
        problem = "nested too deeply" if isinstance(error, RecursionError) else str(error)
        raise ValueError(f"{path} is not a valid generation config: {problem}") from None


def _read_leniently(path: Path, log: bool) -> SamplingParamsGenerationConfigDefaults:
    """The valid sampling fields of the generation_config.json at ``path``: each field that is
    not valid is left out, and a file that is not a JSON object gives none."""
    try:
        return read_generation_config(path)
    except ValueError as error:
        problem = str(error)
    try:
        content = msgspec.json.decode(path.read_bytes()[: MAX_GENERATION_CONFIG_BYTES + 1])
    except (OSError, msgspec.DecodeError, RecursionError):
        content = None
    valid: dict[str, Any] = {}
    left_out = []
    if isinstance(content, dict):
        for name in SamplingParamsGenerationConfigDefaults.__struct_fields__:
            if name not in content:
                continue
            try:
                msgspec.convert({name: content[name]}, SamplingParamsGenerationConfigDefaults)
            except msgspec.ValidationError:
                left_out.append(name)
            else:
                valid[name] = content[name]
    if log:
        ignored = f"ignoring {', '.join(left_out)}" if left_out else "ignoring the file"
        logger.warning("%s; %s (an explicit --generation-config DIR refuses it)", problem, ignored)
    return msgspec.convert(valid, SamplingParamsGenerationConfigDefaults)


def with_generation_defaults(
    request: Request, defaults: SamplingParamsGenerationConfigDefaults
) -> Request:
    """``request`` with ``defaults`` in the sampling fields it does not set: absent from its
    body, or null. A value it sends is kept, even one equal to OpenAI's default. The default
    ``max_new_tokens`` is applied once the prompt is tokenized
    (``with_default_max_new_tokens``), to a request without a maximum: as in vLLM, a
    completions request that leaves ``max_tokens`` out keeps OpenAI's 16, and one that sends
    null takes the model's."""
    update: dict[str, Any] = {
        name: value
        for name, value in defaults.overrides.items()
        if name != "max_new_tokens" and not _is_set(request, name)
    }
    return request.model_copy(update=update) if update else request


def generation_limit(defaults: SamplingParamsGenerationConfigDefaults, source: str) -> int | None:
    """The server-wide limit on a request's new tokens that ``--generation-config source`` sets:
    as in vLLM, a directory given makes its file's ``max_new_tokens`` a limit on every request,
    where the model's own file (``auto``) only makes it the default of requests that set none.
    """
    if source in (AUTO, VLLM) or defaults.max_new_tokens is None:
        return None
    logger.info(
        "max_new_tokens=%d of --generation-config %s limits every request's max_tokens",
        defaults.max_new_tokens,
        source,
    )
    return defaults.max_new_tokens


def with_default_max_new_tokens(
    context: TextContext,
    defaults: SamplingParamsGenerationConfigDefaults,
    limit: int | None = None,
) -> TextContext:
    """``context`` ending after the model's default ``max_new_tokens`` (but not before its
    ``min_new_tokens``) when its request set no maximum, which the context's room caps as it
    caps any request without one; and after ``limit`` new tokens at most, whatever the request
    asked (``generation_limit``). ``ValueError`` for a request whose ``min_new_tokens`` is above
    ``limit``."""
    params = context.sampling_params
    max_new_tokens = params.max_new_tokens
    default = defaults.overrides.get("max_new_tokens")
    if max_new_tokens is None and default is not None:
        max_new_tokens = max(int(default), params.min_new_tokens)
    if limit is not None:
        if params.min_new_tokens > limit:
            raise ValueError(
                f"min_tokens ({params.min_new_tokens}) is above this server's limit of {limit} "
                "new tokens (max_new_tokens of its generation config)"
            )
        max_new_tokens = limit if max_new_tokens is None else min(max_new_tokens, limit)
    if max_new_tokens is None or max_new_tokens >= context.max_new_tokens:
        return context
    return msgspec.structs.replace(
        context,
        max_length=context.num_prompt_tokens + max_new_tokens,
        sampling_params=msgspec.structs.replace(params, max_new_tokens=max_new_tokens),
    )


def _is_set(request: SamplingFields, name: str) -> bool:
    return name in request.model_fields_set and getattr(request, name) is not None


def _describe(overrides: dict[str, float | int]) -> str:
    return ", ".join(f"{name}={value}" for name, value in overrides.items())
