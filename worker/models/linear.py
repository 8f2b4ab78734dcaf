"""The model files' linear layer: stacked projections, and packed weights on the CPU.

``Linear`` with several ``output_sizes`` stacks projections that read the same input (q/k/v,
gate/up) into one weight, so a step runs one matrix product where the checkpoint has several;
each checkpoint tensor loads into its rows with ``load_shard``.

On the CPU in float32, ``prepack()`` rearranges the weight once, after loading, for a faster
kernel than ``F.linear``'s, and drops the plain copy:

- ``"panels"``: column panels for Switchyard's own kernel (``worker.models.panel_gemm``),
  where a C compiler is available. On this project's machines it streams weights ~1.5 times
  as fast as oneDNN for one to four rows, ~1.2 times for 16, and matches it for prefills.
- ``"tiles"``: each weight as two bfloat16 halves for the tile unit (``worker.models.tile_gemm``)
  where torch's float32 matmul precision is "high" (``--float32-matmul-precision high``) and the
  CPU has AMX-BF16; not for the LM head, whose rows the tied input embedding reads.
- ``"onednn"``: oneDNN's blocked layout and packed kernel (what torch.compile's CPU backend
  uses for frozen weights) otherwise: 1.5 to 2 times ``F.linear``'s speed for a few rows.

Results differ from ``F.linear`` only by fp32 rounding, except the tile form's: a relative error
of ~5e-6 (bfloat16 halves carry 16 of float32's 24 significand bits).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from worker import parallel
from worker.models import panel_gemm, tile_gemm

logger = logging.getLogger(__name__)


class OutputDeltas(Protocol):
    """What adds LoRA adapters' products to a layer's output (``worker.lora.LayerAdapters``):
    ``add_to(x, y)`` returns ``y`` plus each adapter's product of its rows of ``x``, while
    ``batch.groups`` (this step's rows by adapter) is not empty."""

    batch: Any

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Split:
    """How a tensor-parallel layer splits one dimension: ``num_units`` units of ``unit_size``
    rows (an attention head's ``head_dim``, or 1). ``what`` names the units in errors;
    ``replicate`` lets ranks share units when there are fewer units than ranks (key-value
    heads; see ``worker.parallel``)."""

    num_units: int
    unit_size: int
    what: str
    replicate: bool = False

    @property
    def size(self) -> int:
        return self.num_units * self.unit_size

    def local_rows(self) -> tuple[int, int]:
        """(first row, number of rows) of the whole dimension that this rank holds."""
        first, count = parallel.shard_units(self.num_units, self.what, self.replicate)
        return first * self.unit_size, count * self.unit_size


class Linear(nn.Module):
    """y = x W^T + b, W of shape (sum(output_sizes), in_features) on this rank.

    ``Linear(...)`` holds the whole weight on every rank. The tensor-parallel forms hold a slice,
    which ``load_shard`` cuts from the whole checkpoint tensor:

    - ``Linear.column``: each stacked projection's rows for this rank; the output stays split
      (it feeds attention over this rank's heads, or a row-parallel layer).
    - ``Linear.row``: this rank's input columns; the outputs are summed over the ranks, with the
      bias added once.
    - ``Linear.vocab``: the LM head split over the vocabulary (padded to a multiple of the
      ranks); the logits are gathered, so every rank returns the whole vocabulary.
    """

    def __init__(self, in_features: int, output_sizes: int | Sequence[int], bias: bool) -> None:
        super().__init__()
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.in_features = in_features
        self.output_sizes = sizes
        self.out_features = sum(sizes)
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(sum(sizes), in_features))
        self.bias = nn.Parameter(torch.empty(sum(sizes))) if bias else None
        self.packed_weight: torch.Tensor | None = None
        self.packing: str | None = None  # None (plain weight), "panels", "tiles" or "onednn"
        # What this rank holds of the checkpoint's tensors (all of them unless tensor-parallel):
        self.checkpoint_sizes = list(sizes)  # each projection's rows in the checkpoint
        self.checkpoint_rows = [(0, size) for size in sizes]  # (first, count) held, each
        self.checkpoint_columns = (0, in_features)  # of in_features, held
        self.checkpoint_in_features = in_features
        self.reduces_output = False  # row-parallel: sum over the ranks
        self.vocab_size: int | None = None  # the LM head's vocabulary: gather and unpad
        self.lora: OutputDeltas | None = None
        """LoRA adapters' slots (``worker.lora``), whose products join the output; None
        without ``--enable-lora``."""

    @classmethod
    def column(cls, in_features: int, outputs: Sequence[Split], bias: bool) -> Linear:
        """Stacked projections ``outputs``, each split over the ranks by rows."""
        rows = [split.local_rows() for split in outputs]
        layer = cls(in_features, [count for _, count in rows], bias)
        layer.checkpoint_sizes = [split.size for split in outputs]
        layer.checkpoint_rows = rows
        return layer

    @classmethod
    def row(cls, inputs: Split, out_features: int, bias: bool) -> Linear:
        """Split over the ranks by ``inputs`` columns; outputs summed over the ranks."""
        first, count = inputs.local_rows()
        layer = cls(count, out_features, bias)
        layer.checkpoint_columns = (first, count)
        layer.checkpoint_in_features = inputs.size
        layer.reduces_output = parallel.tensor_parallel().world_size > 1
        return layer

    @classmethod
    def vocab(cls, in_features: int, vocab_size: int) -> Linear:
        """The LM head over ``vocab_size`` tokens, split by rows; logits gathered."""
        first, per_rank = parallel.padded_shard(vocab_size)
        layer = cls(in_features, per_rank, bias=False)
        layer.checkpoint_sizes = [vocab_size]
        layer.checkpoint_rows = [(first, max(0, min(per_rank, vocab_size - first)))]
        layer.vocab_size = vocab_size
        return layer

    @torch.no_grad()
    def load_shard(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        """Copy this rank's slice of a checkpoint tensor (``name`` "weight" or "bias") into
        projection ``shard``'s rows; ``ValueError`` if its shape does not fit."""
        parameter = getattr(self, name)
        if parameter is None:
            raise ValueError(f"this layer has no {name}, but the checkpoint has one")
        expected: tuple[int, ...] = (self.checkpoint_sizes[shard],)
        if name == "weight":
            expected += (self.checkpoint_in_features,)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {expected}")
        if name == "bias" and self.reduces_output:
            parameter.copy_(tensor)  # outputs are not split: the whole bias, added once
            return
        first, count = self.checkpoint_rows[shard]
        tensor = tensor[first : first + count]
        if name == "weight":
            first_column, num_columns = self.checkpoint_columns
            tensor = tensor[:, first_column : first_column + num_columns]
        start = sum(self.output_sizes[:shard])
        rows = parameter[start : start + self.output_sizes[shard]]
        rows[:count].copy_(tensor)
        rows[count:].zero_()  # the vocabulary's padding, whose logits are dropped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (num_tokens, in_features) → (num_tokens, out_features); the LM head returns
        (num_tokens, vocab_size) on every rank."""
        # Row-parallel ranks sum partial products: the bias joins on rank 0 only.
        bias = (
            self.bias if not self.reduces_output or parallel.tensor_parallel().is_driver else None
        )
        if self.packing == "panels":
            y = panel_gemm.linear(x, self.packed_weight, bias, self.out_features)
        elif self.packing == "tiles":
            y = tile_gemm.linear(x, self.packed_weight, bias, self.out_features, self.in_features)
        elif self.packing == "onednn":
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, bias)
        if self.lora is not None and self.lora.batch.groups:  # before the ranks' sum
            y = self.lora.add_to(x, y)
        if self.reduces_output:
            return parallel.all_reduce(y)
        if self.vocab_size is not None:
            return parallel.all_gather(y)[:, : self.vocab_size]
        return y

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """Rows ``indices`` (num,) of the whole W: (num, in_features). An LM head tied to the
        input embedding serves the embedding lookups this way, with no second copy of the
        matrix; split over the vocabulary, each rank reads the rows it holds and they are summed.
        """
        if self.vocab_size is None:
            return self._local_rows(indices)
        first, _ = self.checkpoint_rows[0]
        return parallel.vocab_lookup(indices, self._local_rows, first, self.out_features)

    def _local_rows(self, indices: torch.Tensor) -> torch.Tensor:
        if self.packing == "panels":
            return panel_gemm.rows(self.packed_weight, indices)
        if self.packing is None:
            return F.embedding(indices, self.weight)
        raise ValueError(f"{self.packing}-packed weights cannot be read by row")

    @torch.no_grad()
    def prepack(self) -> str | None:
        """Switch to the best packed weight available (module docstring) and drop the plain
        one; returns the packing, or None (and no change) where none applies."""
        weight = self.weight
        packing = (
            prepacking(weight, rows_read=self.vocab_size is not None)
            if weight is not None
            else None
        )
        if packing == "panels":
            self.packed_weight = panel_gemm.pack(weight.detach())
        elif packing == "tiles":
            self.packed_weight = tile_gemm.pack(weight.detach())
        elif packing == "onednn":
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        else:
            return None
        self.packing = packing
        self.weight = None
        return packing


class VocabEmbedding(nn.Module):
    """The input embedding (vocab_size, hidden_size), split over the vocabulary like
    ``Linear.vocab``: each rank looks up the ids it holds and the ranks sum the rows."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.first, per_rank = parallel.padded_shard(vocab_size)
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size))

    @torch.no_grad()
    def load_shard(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        """Copy this rank's rows of the checkpoint's embedding; ``ValueError`` if it does not
        fit. (``shard`` is always 0: the signature is ``Linear.load_shard``'s.)"""
        expected = (self.vocab_size, self.weight.shape[1])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {expected}")
        rows = tensor[self.first : self.first + self.weight.shape[0]]
        self.weight[: len(rows)].copy_(rows)
        self.weight[len(rows) :].zero_()

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``token_ids`` (num_tokens,) → (num_tokens, hidden_size)."""
        return parallel.vocab_lookup(
            token_ids, partial(F.embedding, weight=self.weight), self.first, len(self.weight)
        )


def prepacking(weight: torch.Tensor, rows_read: bool = False) -> str | None:
    """The packing ``prepack()`` would choose for ``weight``: "panels", "tiles", "onednn" or
    None. ``rows_read``: its rows are read too (an LM head, which a tied embedding may read),
    which the tile form does not offer."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None  # the kernels were measured faster for float32 on the CPU only
    if not rows_read and tile_gemm.precision_wants_tiles() and tile_gemm.available():
        return "tiles"
    if panel_gemm.library() is not None:
        return "panels"
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "onednn"
    return None


def prepack_linears(model: nn.Module) -> int:
    """``prepack()`` every ``Linear`` in ``model``; returns how many were packed."""
    linears = [module for module in model.modules() if isinstance(module, Linear)]
    num_packed = sum(linear.prepack() is not None for linear in linears)
    if num_packed < len(linears):
        num_plain = len(linears) - num_packed
        logger.info("%d linear layers use F.linear (no packed weights)", num_plain)
    return num_packed
