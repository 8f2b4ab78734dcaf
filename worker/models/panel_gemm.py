"""The CPU float32 matrix product of ``panel_gemm.c``: build, load, pack, multiply.

The C source is compiled on first use (``worker.models.native``). Without a compiler, or if
the build fails, ``library()`` logs why once and returns None, and linear layers fall back to
oneDNN's packed kernel or ``F.linear``.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from worker.models import native

SOURCE = Path(__file__).with_name("panel_gemm.c")
PANEL = 32  # output features per panel; must match panel_gemm.c
LINEAR_ARGTYPES = [
    ctypes.c_void_p,  # x (m, k)
    ctypes.c_int64,  # m
    ctypes.c_int64,  # k
    ctypes.c_void_p,  # the packed weight
    ctypes.c_int64,  # n
    ctypes.c_void_p,  # bias or NULL
    ctypes.c_void_p,  # y (m, n)
]
LINEAR_RESTYPE = ctypes.c_int
"""The C signature of a linear layer's product (cpu_ops.c's LinearFn): this kernel's and
tile_gemm's; it returns 0, or nonzero where the product failed (tile_gemm's can)."""


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (n, k) as column panels (ceil(n / 32), k, 32), zero past row n.

    One allocation and one copy: no padded temporary the heap would keep after loading."""
    n, k = weight.shape
    full, rest = divmod(n, PANEL)
    panels = torch.empty(full + (rest > 0), k, PANEL, dtype=weight.dtype)
    panels[:full].copy_(weight[: full * PANEL].view(full, PANEL, k).transpose(1, 2))
    if rest:
        panels[full, :, rest:].zero_()
        panels[full, :, :rest].copy_(weight[full * PANEL :].t())
    return panels


def rows(panels: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows ``indices`` (num,) of the weight packed into ``panels``: (num, k)."""
    return panels[indices // PANEL, :, indices % PANEL]


def linear(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``x`` (m, k) W^T + ``bias`` for W packed by ``pack``: (m, out_features), float32."""
    lib = library()
    assert lib is not None, "linear() needs the built library; check library() first"
    x = checked_operands(x, bias, panels.shape[1], out_features, "panel")
    m, k = x.shape
    # The kernel trusts these sizes: check them here rather than read out of bounds there.
    if not (panels.shape[0] - 1) * PANEL < out_features <= panels.shape[0] * PANEL:
        raise ValueError(f"{out_features} outputs do not fit {panels.shape[0]} panels")
    y = torch.empty(m, out_features, dtype=torch.float32)
    bias_ptr = None if bias is None else bias.data_ptr()
    lib.sy_panel_linear(x.data_ptr(), m, k, panels.data_ptr(), out_features, bias_ptr, y.data_ptr())
    return y  # (it returns 0: it needs no memory of its own)


def checked_operands(
    x: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int, kernel: str
) -> torch.Tensor:
    """``x`` contiguous, once checked that it and ``bias`` fit a float32 product of
    ``in_features`` to ``out_features`` (this kernel's and tile_gemm's, which trust them)."""
    if x.dtype != torch.float32:
        raise TypeError(f"the {kernel} kernel multiplies float32, not {x.dtype}")
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {in_features}")
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != out_features):
        raise ValueError(f"bias must be {out_features} float32 values")
    return x.contiguous()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel library, or None (logged once) where it cannot be built here."""
    return build(SOURCE)


def build(source: Path) -> ctypes.CDLL | None:
    """The library built from ``source`` (this checkout's panel_gemm.c, or another version of
    it for a benchmark to compare), its function typed; None where it cannot be built."""
    lib = native.load(source.resolve())
    if lib is None:
        return None
    lib.sy_panel_linear.argtypes = LINEAR_ARGTYPES
    lib.sy_panel_linear.restype = LINEAR_RESTYPE
    return lib
