"""The model files' linear layer: stacked projections, and packed weights on the CPU.

``Linear`` with several ``output_sizes`` stacks projections that read the same input (q/k/v,
gate/up) into one weight, so a step runs one matrix product where the checkpoint has several;
each checkpoint tensor loads into its rows with ``load_shard``.

On the CPU in float32, ``prepack()`` rearranges the weight once, after loading, for a faster
kernel than ``F.linear``'s, and drops the plain copy:

- ``"panels"``: column panels for Switchyard's own kernel (``worker.models.panel_gemm``),
  where a C compiler is available. On this project's machines it streams weights ~1.5 times
  as fast as oneDNN for one to four rows, ~1.2 times for 16, and matches it for prefills.
- ``"onednn"``: oneDNN's blocked layout and packed kernel (what torch.compile's CPU backend
  uses for frozen weights) otherwise: 1.5 to 2 times ``F.linear``'s speed for a few rows.

Results differ from ``F.linear`` only by fp32 rounding.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from worker.models import panel_gemm

logger = logging.getLogger(__name__)


class Linear(nn.Module):
    """y = x W^T + b, W of shape (sum(output_sizes), in_features)."""

    def __init__(self, in_features: int, output_sizes: int | Sequence[int], bias: bool) -> None:
        super().__init__()
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.in_features = in_features
        self.output_sizes = sizes
        self.out_features = sum(sizes)
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(sum(sizes), in_features))
        self.bias = nn.Parameter(torch.empty(sum(sizes))) if bias else None
        self.packed_weight: torch.Tensor | None = None
        self.packing: str | None = None  # None (plain weight), "panels" or "onednn"

    @torch.no_grad()
    def load_shard(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor (``name`` "weight" or "bias") into projection ``shard``'s
        rows; ``ValueError`` if its shape does not fit."""
        parameter = getattr(self, name)
        if parameter is None:
            raise ValueError(f"this layer has no {name}, but the checkpoint has one")
        start = sum(self.output_sizes[:shard])
        rows = parameter[start : start + self.output_sizes[shard]]
        if rows.shape != tensor.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {rows.shape}")
        rows.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (num_tokens, in_features) → (num_tokens, out_features)."""
        if self.packing == "panels":
            return panel_gemm.linear(x, self.packed_weight, self.bias, self.out_features)
        if self.packing == "onednn":
            return torch.ops.mkldnn._linear_pointwise(
                x, self.packed_weight, self.bias, "none", [], ""
            )
        return F.linear(x, self.weight, self.bias)

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """Rows ``indices`` (num,) of W: (num, in_features). An LM head tied to the input
        embedding serves the embedding lookups this way, with no second copy of the matrix."""
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
        packing = prepacking(weight) if weight is not None else None
        if packing == "panels":
            self.packed_weight = panel_gemm.pack(weight.detach())
        elif packing == "onednn":
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        else:
            return None
        self.packing = packing
        self.weight = None
        return packing


def prepacking(weight: torch.Tensor) -> str | None:
    """The packing ``prepack()`` would choose for ``weight``: "panels", "onednn" or None."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None  # the kernels were measured faster for float32 on the CPU only
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
