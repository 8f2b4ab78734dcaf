"""User logits processors: MAX's ``LogitsProcessor`` and ``BatchLogitsProcessor``, loaded by
import path (``--logits-processors pkg.module:Name``) when the worker starts, and applied to the
requests that name them (``SamplingParams.logits_processors``). Code never travels on the wire.

``Name`` is a callable, or a class that is instantiated once, without arguments, at start. It is
a per-request processor, called with ``ProcessorInputs`` for each row of each request that asked
for it, unless it has the attribute ``batch_processor = True``: then it is called once per step
with ``BatchProcessorInputs`` holding every such row. Either edits ``logits`` in place; the
return value is ignored.

They run on a copy of the logits after the built-in processing (grammar mask, min-new-tokens,
logit bias, penalties; ``worker.logits_processors``), before temperature, in the order
``--logits-processors`` gives them. Only the worker rank that samples (rank 0) calls them.
Each sampled row is its own context: with speculative decoding a request has 1 + drafts rows,
and the context of the row after draft i counts drafts 0..i-1 among its outputs.

A processor that raises fails the requests whose rows it was given, alone
(``worker.request_sampler`` samples a failing batch again row by row, so a processor may be
called twice for a row in such a step); one that leaves a row nothing finite to sample (every
logit NaN or -inf) fails that request.
"""

from __future__ import annotations

import copy
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from interfaces import SamplingParams
from interfaces.shared_settings import logits_processor_name

BATCH_ATTRIBUTE = "batch_processor"
"""A processor with this attribute set to True is a ``BatchLogitsProcessor``."""
MAX_ERROR_CHARS = 300
"""How much of a processor's exception its requests' failure repeats."""


@dataclass(frozen=True)
class ProcessorContext:
    """What a processor may read about one row's request, read-only: its id, its prompt, its
    outputs so far (for a speculative row, with the drafts before it), the ``args`` the
    request gave this processor (empty when none) and its sampling params."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    args: Mapping[str, Any]
    sampling_params: SamplingParams


@dataclass(frozen=True)
class ProcessorInputs:
    """A ``LogitsProcessor``'s argument: ``logits`` float32 (1, vocab_size), a view of the
    batch's row, to edit in place, and that row's ``context``."""

    logits: torch.Tensor
    context: ProcessorContext


@dataclass(frozen=True)
class BatchProcessorInputs:
    """A ``BatchLogitsProcessor``'s argument: ``logits`` float32 (num_rows, vocab_size), the rows
    of every request that asked for the processor, to edit in place; ``logit_offsets``
    (len(context_batch) + 1,) int64, where row i of ``logits`` is ``context_batch[i]``'s
    (each context has one row: [0, 1, ..., num_rows])."""

    logits: torch.Tensor
    logit_offsets: torch.Tensor | None
    context_batch: Sequence[ProcessorContext]


@dataclass(frozen=True)
class UserProcessor:
    """A loaded processor: the ``name`` requests use, the callable, and its form."""

    name: str
    function: Callable[[Any], object]
    is_batch: bool


class UserProcessorError(RuntimeError):
    """A user processor raised; the requests of the rows it was given fail."""


def load_user_processors(paths: Sequence[str]) -> dict[str, UserProcessor]:
    """Import each ``pkg.module:Name`` of ``paths``, by name in the order given; ``ValueError``
    naming the path if it does not import, lacks ``Name``, or is not callable."""
    processors: dict[str, UserProcessor] = {}
    for path in paths:
        processor = _load(path)
        if processor.name in processors:
            raise ValueError(f"--logits-processors: two processors are named {processor.name!r}")
        processors[processor.name] = processor
    return processors


def _load(path: str) -> UserProcessor:
    name = logits_processor_name(path)
    module_name = path.rpartition(":")[0]
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise ValueError(
            f"--logits-processors {path}: cannot import {module_name}: {error!r}"
        ) from error
    if not hasattr(module, name):
        raise ValueError(f"--logits-processors {path}: module {module_name} has no {name}")
    target = getattr(module, name)
    if inspect.isclass(target):
        try:
            target = target()
        except Exception as error:
            raise ValueError(f"--logits-processors {path}: {name}() raised {error!r}") from error
    if not callable(target):
        raise ValueError(f"--logits-processors {path}: {name} is not callable")
    is_batch = getattr(target, BATCH_ATTRIBUTE, False)
    if not isinstance(is_batch, bool):
        raise ValueError(f"--logits-processors {path}: {name}.{BATCH_ATTRIBUTE} must be a bool")
    return UserProcessor(name, target, is_batch)


def check_processor_names(params: SamplingParams, loaded: Mapping[str, UserProcessor]) -> None:
    """``ValueError`` if ``params`` names processors this worker did not load."""
    unknown = [call.name for call in params.logits_processors or () if call.name not in loaded]
    if unknown:
        raise ValueError(f"logits_processors names processors this worker does not load: {unknown}")


@dataclass(frozen=True)
class UserProcessing:
    """The user processors one sampling batch applies: ``contexts[row]`` maps the name of each
    processor that row asked for to its context."""

    processors: Sequence[UserProcessor]
    contexts: Sequence[Mapping[str, ProcessorContext]]

    def apply(self, logits: torch.Tensor) -> None:
        """Run each processor over its rows of ``logits`` (num_rows, vocab_size), in place;
        ``UserProcessorError`` if one raises."""
        for processor in self.processors:
            rows = [row for row, asked in enumerate(self.contexts) if processor.name in asked]
            if not rows:
                continue
            contexts = [self.contexts[row][processor.name] for row in rows]
            try:
                if processor.is_batch:
                    _apply_batch(processor, logits, rows, contexts)
                else:
                    for row, context in zip(rows, contexts, strict=True):
                        processor.function(ProcessorInputs(logits[row : row + 1], context))
            except Exception as error:
                raised = repr(error)[:MAX_ERROR_CHARS]  # its text goes to the requests' users
                raise UserProcessorError(
                    f"logits processor {processor.name!r} raised {raised}"
                ) from error


def _apply_batch(
    processor: UserProcessor,
    logits: torch.Tensor,
    rows: list[int],
    contexts: list[ProcessorContext],
) -> None:
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    selected = logits.index_select(0, index)  # (len(rows), vocab_size), a copy
    offsets = torch.arange(len(rows) + 1, dtype=torch.int64, device=logits.device)
    processor.function(BatchProcessorInputs(selected, offsets, contexts))
    logits.index_copy_(0, index, selected)


def user_processing(
    loaded: Mapping[str, UserProcessor],
    requests: Sequence[tuple[str, SamplingParams, Sequence[int], int]],
) -> UserProcessing | None:
    """The processing of a batch whose rows are ``requests`` (request id, params, prompt and
    output token ids, number of prompt tokens); None when no row asks for a processor."""
    if not any(params.logits_processors for _, params, _, _ in requests):
        return None
    contexts = [_row_contexts(loaded, *request) for request in requests]
    return UserProcessing(list(loaded.values()), contexts)


def _row_contexts(
    loaded: Mapping[str, UserProcessor],
    request_id: str,
    params: SamplingParams,
    token_ids: Sequence[int],
    num_prompt_tokens: int,
) -> dict[str, ProcessorContext]:
    calls = params.logits_processors or ()
    if not calls:
        return {}
    check_processor_names(params, loaded)
    prompt = tuple(token_ids[:num_prompt_tokens])
    outputs = tuple(token_ids[num_prompt_tokens:])
    snapshot = copy.deepcopy(params)  # the request's own lists stay out of a processor's reach
    return {
        call.name: ProcessorContext(request_id, prompt, outputs, _frozen(call.args or {}), snapshot)
        for call in calls
    }


def _frozen(value: Any) -> Any:
    """``value`` (JSON: at most ``MAX_LOGITS_PROCESSOR_ARGS_DEPTH`` deep, checked on receipt)
    read-only all the way down: objects as mappings, arrays as tuples."""
    if isinstance(value, dict):
        return MappingProxyType({key: _frozen(item) for key, item in value.items()})
    if isinstance(value, list):
        return tuple(_frozen(item) for item in value)
    return value
