"""LoRA adapters beside the base model: slots of weights, loading into them, and the per-step
plan of which batch rows run with which adapter.

With ``--enable-lora`` the worker allocates ``--max-loras`` slots at start in every decoder
layer's ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and ``down_proj`` (``LayerAdapters``); all
zero, a slot adds nothing. Loading an adapter (``LoRAUpdate`` from the scheduler, which names it
by a ``lora_id`` of its own) reads a PEFT directory (``worker.lora_checkpoint``), zero-pads its
rank to ``--max-lora-rank`` and writes this rank's share into a free slot; unloading zeroes the
slot and frees it. A stacked layer holds its projections side by side: A (slots, S * max_rank,
in_features) stacks the S projections' A matrices, and B (slots, out_features, S * max_rank)
holds their B matrices block-diagonally, so one pair of products serves q, k and v together.

Each step the model runner names every request's slot (``LoRABatch.plan``); each layer then adds
``(x[rows] @ A[slot]^T) @ B[slot]^T`` into the rows of its output that run with that adapter
(a request's tokens are contiguous in the flat batch). Base-model rows are untouched, and a step
without adapter rows costs a check per layer (none at all without ``--enable-lora``).

Tensor-parallel, a column-parallel layer's B keeps the rows its weight keeps
(``Linear.checkpoint_rows``) and A is whole; a row-parallel layer's A keeps the columns its
weight keeps and B is whole, and the delta joins the partial product before the all-reduce. Every
rank loads every adapter, and the ranks agree (``parallel.agree_on_step``) so that all hold it
or none does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from interfaces.lora import MAX_LORA_PATH_LENGTH, LoRAOperation, LoRAResponse, LoRAStatus
from interfaces.scheduler_to_worker import LoRAUpdate
from interfaces.shared_settings import LoRASettings
from interfaces.worker_to_scheduler import LoRAUpdated
from worker import parallel
from worker.lora_checkpoint import AdapterProblem, LoRAModelShape, ModuleWeights, read_adapter
from worker.models.linear import Linear

logger = logging.getLogger(__name__)

TARGETS = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}
"""Each decoder layer's linear layers that take adapters, and the checkpoint projections they
stack (in row order)."""


@dataclass(frozen=True)
class RowGroup:
    """The batch rows of one adapter: ``count`` rows from ``start``, or when its requests are
    not adjacent, the rows ``indices`` (num_rows,)."""

    slot: int
    start: int
    count: int
    indices: torch.Tensor | None = None


class LoRABatch:
    """Which rows of the current step run with which slot; shared by every ``LayerAdapters``
    of the model and set by the model runner before each forward pass (``plan``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.groups: list[RowGroup] = []
        """Empty when no row runs with an adapter: the layers then add nothing."""

    def plan(self, slots: Sequence[int | None], counts: Sequence[int]) -> None:
        """Request i has ``counts[i]`` rows, after request i - 1's, and runs with slot
        ``slots[i]`` (None: the base model)."""
        ranges: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for slot, count in zip(slots, counts, strict=True):
            if slot is not None:
                spans = ranges.setdefault(slot, [])
                if spans and spans[-1][0] + spans[-1][1] == start:  # adjacent: one span
                    spans[-1] = (spans[-1][0], spans[-1][1] + count)
                else:
                    spans.append((start, count))
            start += count
        self.groups = [self._group(slot, spans) for slot, spans in ranges.items()]

    def clear(self) -> None:
        self.groups = []

    def _group(self, slot: int, spans: list[tuple[int, int]]) -> RowGroup:
        if len(spans) == 1:
            return RowGroup(slot, *spans[0])
        rows = [row for first, count in spans for row in range(first, first + count)]
        indices = torch.tensor(rows, dtype=torch.int64, device=self.device)
        return RowGroup(slot, rows[0], len(rows), indices)


class LayerAdapters:
    """The adapter slots of one ``Linear`` (module docstring): ``a`` (num_slots,
    num_projections * max_rank, in_features) and ``b`` (num_slots, out_features,
    num_projections * max_rank), this rank's share, zero where no adapter is."""

    def __init__(
        self, linear: Linear, num_slots: int, max_rank: int, batch: LoRABatch, dtype: torch.dtype
    ) -> None:
        device = batch.device
        num_projections = len(linear.output_sizes)
        self.linear = linear
        self.max_rank = max_rank
        self.batch = batch
        width = num_projections * max_rank
        self.a = torch.zeros(num_slots, width, linear.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, linear.out_features, width, dtype=dtype, device=device)

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Add each row group's adapter product into ``y`` (num_tokens, out_features), the
        layer's output for ``x`` (num_tokens, in_features), in place; returns ``y``."""
        for group in self.batch.groups:
            a, b = self.a[group.slot], self.b[group.slot]
            if group.indices is None:
                rows = x.narrow(0, group.start, group.count)
                y.narrow(0, group.start, group.count).addmm_(rows @ a.t(), b.t())
            else:
                rows = x.index_select(0, group.indices)
                y.index_add_(0, group.indices, (rows @ a.t()) @ b.t())
        return y

    @torch.no_grad()
    def write(self, slot: int, projection: int, weights: ModuleWeights) -> None:
        """Put stacked projection ``projection``'s adapter (whole, as in the checkpoint) into
        ``slot``, cut as the layer's weight is cut; ``ValueError`` if it does not fit."""
        linear, (a, b) = self.linear, (weights.a, weights.b)
        rank = a.shape[0]
        if rank > self.max_rank:
            raise ValueError(f"rank {rank} is above --max-lora-rank ({self.max_rank})")
        first_row, num_rows = linear.checkpoint_rows[projection]
        b = b[first_row : first_row + num_rows]
        first_column, num_columns = linear.checkpoint_columns
        a = a[:, first_column : first_column + num_columns]
        start = sum(linear.output_sizes[:projection])
        width = projection * self.max_rank
        self.a[slot, width : width + rank].copy_(a)
        self.b[slot, start : start + num_rows, width : width + rank].copy_(b)

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()


class LoRAAdapters:
    """A worker's adapter slots and which ``lora_id`` holds each; owned by the model runner,
    called between steps from its thread."""

    def __init__(
        self, model: nn.Module, settings: LoRASettings, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.max_loras = settings.max_loras
        self.max_rank = settings.max_lora_rank
        self.shape = LoRAModelShape.of(model.config)
        self.batch = LoRABatch(device)
        self.projections: dict[tuple[int, str], tuple[LayerAdapters, int]] = {}
        """(layer, checkpoint projection) → its layer's slots and its index in the stack."""
        self.layers: list[LayerAdapters] = []
        for layer_index, layer in enumerate(model.model.layers):
            for path, projections in TARGETS.items():
                linear = layer.get_submodule(path)
                adapters = LayerAdapters(linear, self.max_loras, self.max_rank, self.batch, dtype)
                linear.lora = adapters
                self.layers.append(adapters)
                for index, projection in enumerate(projections):
                    self.projections[layer_index, projection] = (adapters, index)
        self.slot_by_id: dict[int, int] = {}
        num_bytes = sum(layer.a.nbytes + layer.b.nbytes for layer in self.layers)
        logger.info(
            "LoRA: %d slots of rank %d take %.1f MiB",
            self.max_loras,
            self.max_rank,
            num_bytes / (1 << 20),
        )

    def slot_of(self, lora_id: int) -> int | None:
        """The slot holding adapter ``lora_id``; None for the base model (0) or an id not
        loaded."""
        return self.slot_by_id.get(lora_id)

    def update(self, update: LoRAUpdate) -> LoRAUpdated:
        """Carry out a load or an unload on this rank and, for a load, agree with the other
        ranks: if any failed, none keeps the adapter. Never raises but ``GroupBroken``."""
        if update.operation is LoRAOperation.UNLOAD:
            return LoRAUpdated(update.operation, update.lora_id, self.unload(update.lora_id))
        response = self.load(update.lora_id, update.lora_name, update.lora_path)
        loaded = response.status is LoRAStatus.SUCCESS
        anyone_failed, _ = parallel.agree_on_step(not loaded, [])
        if anyone_failed and loaded:
            self._free(update.lora_id)
            response = LoRAResponse.of(
                LoRAStatus.LOAD_ERROR,
                f"adapter {update.lora_name!r}: another tensor-parallel rank could not load it "
                "(see that rank's log)",
            )
        return LoRAUpdated(update.operation, update.lora_id, response)

    def load(self, lora_id: int, name: str, path: str | None) -> LoRAResponse:
        """Load the adapter at ``path`` as ``lora_id`` into a free slot, all or nothing."""
        problem = self._load_problem(lora_id, path)
        if problem is not None:
            return LoRAResponse.of(problem.status, f"adapter {name!r}: {problem}")
        slot = min(set(range(self.max_loras)) - set(self.slot_by_id.values()))
        try:
            adapter = read_adapter(path, self.shape, self.max_rank)
            for key, weights in adapter.items():
                layer_adapters, projection = self.projections[key]
                layer_adapters.write(slot, projection, weights)
        except AdapterProblem as error:
            self._clear(slot)
            return LoRAResponse.of(error.status, f"adapter {name!r}: {error}")
        except Exception as error:  # whatever the files hold, the worker serves on
            logger.exception("could not load LoRA adapter %r from %s", name, path)
            self._clear(slot)
            return LoRAResponse.of(LoRAStatus.LOAD_ERROR, f"adapter {name!r}: {error}")
        self.slot_by_id[lora_id] = slot
        logger.info(
            "loaded LoRA adapter %r (id %d) from %s into slot %d", name, lora_id, path, slot
        )
        return LoRAResponse.of(LoRAStatus.SUCCESS, f"adapter {name!r} loaded")

    def unload(self, lora_id: int) -> LoRAResponse:
        """Zero and free ``lora_id``'s slot."""
        if lora_id not in self.slot_by_id:
            return LoRAResponse.of(
                LoRAStatus.UNLOAD_NAME_NONEXISTENT,
                f"LoRA adapter id {lora_id} is not loaded on this worker",
            )
        self._free(lora_id)
        return LoRAResponse.of(LoRAStatus.SUCCESS, f"LoRA adapter id {lora_id} unloaded")

    def unload_all(self) -> None:
        for lora_id in list(self.slot_by_id):
            self._free(lora_id)

    def _load_problem(self, lora_id: int, path: str | None) -> AdapterProblem | None:
        if lora_id < 1:
            return AdapterProblem(LoRAStatus.LOAD_ERROR, f"lora_id must be positive, not {lora_id}")
        if lora_id in self.slot_by_id:
            return AdapterProblem(LoRAStatus.LOAD_ERROR, f"lora_id {lora_id} is already loaded")
        if not path or len(path) > MAX_LORA_PATH_LENGTH or "\x00" in path:
            return AdapterProblem(
                LoRAStatus.LOAD_INVALID_PATH,
                f"lora_path must be a path of 1 to {MAX_LORA_PATH_LENGTH} characters",
            )
        if len(self.slot_by_id) >= self.max_loras:
            return AdapterProblem(
                LoRAStatus.LOAD_ERROR,
                f"all --max-loras ({self.max_loras}) slots hold adapters; unload one first",
            )
        return None

    def _free(self, lora_id: int) -> None:
        self._clear(self.slot_by_id.pop(lora_id))

    def _clear(self, slot: int) -> None:
        for layer_adapters in self.layers:
            layer_adapters.clear(slot)


def update_without_lora(update: LoRAUpdate) -> LoRAUpdated:
    """The answer of a worker started without ``--enable-lora``."""
    status = (
        LoRAStatus.LOAD_ERROR if update.operation is LoRAOperation.LOAD else LoRAStatus.UNLOAD_ERROR
    )
    message = "LoRA is not enabled on this worker: start the worker with --enable-lora"
    return LoRAUpdated(update.operation, update.lora_id, LoRAResponse.of(status, message))
