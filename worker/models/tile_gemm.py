"""The CPU matrix product at "high" float32 precision of ``tile_gemm.c``: build, pack, multiply.

Where the CPU has AMX-BF16 (Intel Sapphire Rapids and later) and
``torch.get_float32_matmul_precision()`` is not "highest" (``--float32-matmul-precision high``),
the worker packs its decoder layers' weights in this kernel's tile form instead of
``panel_gemm``'s float32 panels: each weight as two bfloat16 halves (4 bytes, as before), each
product as three bfloat16 products summed in float32, a relative error of ~5e-6 instead of
~1e-6, and 1.3-1.5 times the float32 kernel's rate where arithmetic bounds the product
(prefills, large batches; docs/performance.md). Elsewhere ``available()`` is False and nothing
changes.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from worker.models import native, panel_gemm

SOURCE = Path(__file__).with_name("tile_gemm.c")
STEP = 32  # input features per step of the tile form; must match tile_gemm.c
TILE_BYTES_PER_STEP = 4096  # a panel's step: hi and lo tiles of both 16-output halves


def precision_wants_tiles() -> bool:
    """Whether torch's float32 matmul precision lets products round through bfloat16 halves."""
    return torch.get_float32_matmul_precision() != "highest"


def tile_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    """The shape of a weight's tile form, as int16: (panels, steps, 2048)."""
    panels = -(-out_features // panel_gemm.PANEL)
    steps = -(-in_features // STEP)
    return panels, steps, TILE_BYTES_PER_STEP // 2


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (n, k) float32 in tile form (``tile_shape``), split into bfloat16 halves."""
    lib = library()
    assert lib is not None, "pack() needs the built library; check available() first"
    n, k = weight.shape
    panels = panel_gemm.pack(weight.float())
    tiles = torch.empty(tile_shape(n, k), dtype=torch.int16)
    lib.sy_tile_pack(panels.data_ptr(), k, n, tiles.data_ptr())
    return tiles


def linear(
    x: torch.Tensor,
    tiles: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    in_features: int,
) -> torch.Tensor:
    """``x`` (m, in_features) W^T + ``bias`` for W (out_features, in_features) packed by
    ``pack``: (m, out_features), float32. (The tile form pads features to whole steps, so its
    shape alone does not say how many the weight has.)"""
    lib = library()
    assert lib is not None, "linear() needs the built library; check available() first"
    x = panel_gemm.checked_operands(x, bias, in_features, out_features, "tile")
    m, k = x.shape
    # The kernel trusts these sizes: check them here rather than read out of bounds there.
    if tuple(tiles.shape) != tile_shape(out_features, k) or tiles.dtype != torch.int16:
        raise ValueError(f"tiles {tuple(tiles.shape)} are not a ({out_features}, {k}) weight")
    if not tiles.is_contiguous():
        raise ValueError("tiles must be contiguous")
    y = torch.empty(m, out_features, dtype=torch.float32)
    if m:
        bias_ptr = None if bias is None else bias.data_ptr()
        status = lib.sy_tile_linear(
            x.data_ptr(), m, k, tiles.data_ptr(), out_features, bias_ptr, y.data_ptr()
        )
        _check_status(status)
    return y


def _check_status(status: int) -> None:
    """Raise for a nonzero status of ``sy_tile_linear``."""
    if status == -1:
        raise MemoryError("the tile product could not allocate its split inputs")
    if status != 0:
        raise RuntimeError("this process may not use the tile registers (check available())")


def available() -> bool:
    """Whether this CPU and process run the tile kernel (built, AMX-BF16, tiles granted)."""
    lib = library()
    return lib is not None and bool(lib.sy_tile_available())


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel library, or None (logged once) where it cannot be built here."""
    lib = native.load(SOURCE)
    if lib is None:
        return None
    lib.sy_tile_available.argtypes = []
    lib.sy_tile_available.restype = ctypes.c_int
    lib.sy_tile_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.sy_tile_pack.restype = None
    lib.sy_tile_linear.argtypes = panel_gemm.LINEAR_ARGTYPES
    lib.sy_tile_linear.restype = panel_gemm.LINEAR_RESTYPE
    return lib
