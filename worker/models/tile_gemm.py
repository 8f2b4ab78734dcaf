"""The CPU matrix product at "high" float32 precision of ``tile_gemm.c``: build, pack, multiply.

Where the CPU has AMX-BF16 (Intel Sapphire Rapids and later) and
``torch.get_float32_matmul_precision()`` is not "highest" (``--float32-matmul-precision high``),
the worker packs its decoder layers' weights in this kernel's tile form instead of
``panel_gemm``'s float32 panels: each weight as two bfloat16 halves (4 bytes, as before), each
product as three bfloat16 products summed in float32, a relative error of ~5e-6 instead of
~1e-6, and 1.3-1.5 times the float32 kernel's rate where arithmetic bounds the product
(prefills, large batches; docs/performance.md). Elsewhere ``available()`` is False and nothing
changes.

``GreedyHead`` uses the same tile unit for greedy requests at any precision: from a bfloat16
copy of the LM head it estimates every logit with a proven bound on its distance from the
float32 logit, and computes exactly (as ``panel_gemm`` sums them) only the panels of 32 tokens
holding the few the bounds leave: the same token as the float32 logits' argmax, for half the
read and a small part of the arithmetic (``tile_gemm.c`` gives the bound). Where the CPU has
AVX512-BF16 but no tile unit (AMD Zen 4 and later), the head takes its estimates from the
vector unit's bfloat16 dot products instead: ``greedy_available()`` says where it runs.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.models import native, panel_gemm

SOURCE = Path(__file__).with_name("tile_gemm.c")
STEP = 32  # input features per step of the tile form; must match tile_gemm.c
TILE_BYTES_PER_STEP = 4096  # a panel's step: hi and lo tiles of both 16-output halves
HI_BYTES_PER_STEP = 2048  # a panel's step in the greedy head's form: hi tiles of both halves
NEEDS_LOGITS = -2
"""``GreedyHead.tokens`` of a row whose values are not all finite: take its float32 logits."""
NORM_PANELS = 64
"""Panels of the head whose weight norms ``GreedyHead.build`` takes at a time."""


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


@dataclass(frozen=True)
class GreedyHead:
    """An LM head's greedy tokens from bfloat16 estimates (``tile_gemm.c``): ``tiles`` the
    head's weight in bfloat16 tiles (half the bytes of its float32 panels), ``norms`` (2,
    vocab rounded up to 16) the 2-norms of each weight row rounded to bfloat16 and of what the
    rounding lost, ``panels`` the head's float32 panels (``panel_gemm``), which it keeps using
    for the exact logits; the head has no bias and its rows past ``vocab_size`` are padding."""

    tiles: torch.Tensor
    norms: torch.Tensor
    panels: torch.Tensor
    in_features: int
    out_features: int
    vocab_size: int

    @classmethod
    def build(cls, panels: torch.Tensor, out_features: int, vocab_size: int) -> GreedyHead:
        """The greedy head of an LM head packed in float32 ``panels`` (``panel_gemm.pack`` of
        an (out_features, in_features) weight, the first ``vocab_size`` rows the vocabulary's);
        check ``greedy_available()`` first."""
        lib = library()
        assert lib is not None, "build() needs the built library; check greedy_available() first"
        num_panels, k, width = panels.shape
        if width != panel_gemm.PANEL or num_panels != -(-out_features // width):
            raise ValueError(f"panels {tuple(panels.shape)} are not an {out_features}-row head")
        if not 0 < vocab_size <= out_features or not panels.is_contiguous():
            raise ValueError(f"a vocabulary of {vocab_size} in {out_features} contiguous rows")
        tiles = torch.empty((num_panels, -(-k // STEP), HI_BYTES_PER_STEP // 2), dtype=torch.int16)
        lib.sy_tile_pack_hi(panels.data_ptr(), k, out_features, tiles.data_ptr())
        norms = torch.zeros(2, -(-vocab_size // 16) * 16, dtype=torch.float32)
        for first in range(0, -(-vocab_size // width), NORM_PANELS):  # a few MB of float64
            weight = panels[first : first + NORM_PANELS].transpose(1, 2).reshape(-1, k).double()
            weight = weight[: vocab_size - first * width]
            rounded = weight.to(torch.bfloat16).double()  # as the tile unit rounds: to nearest
            rows = slice(first * width, first * width + len(weight))
            norms[0, rows] = _rounded_up(rounded.norm(dim=1))
            norms[1, rows] = _rounded_up((weight - rounded).norm(dim=1))
        return cls(tiles, norms, panels, k, out_features, vocab_size)

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token for ``x`` (m, in_features) float32, the head's input: the
        first index of the largest of its float32 logits (``panel_gemm.linear`` of the
        panels), or ``NEEDS_LOGITS`` where its values are not all finite or so large that a
        float32 sum might overflow. int64 (m,)."""
        lib = library()
        assert lib is not None, "tokens() needs the built library; check greedy_available() first"
        x = panel_gemm.checked_operands(x, None, self.in_features, self.out_features, "greedy")
        m, k = x.shape
        tokens = torch.empty(m, dtype=torch.int64)
        status = lib.sy_tile_greedy_tokens(
            x.data_ptr(), m, k, self.tiles.data_ptr(), self.out_features, self.vocab_size,
            self.norms.data_ptr(), self.panels.data_ptr(), tokens.data_ptr(),
        )  # fmt: skip
        _check_status(status)
        return tokens


def _rounded_up(values: torch.Tensor) -> torch.Tensor:
    """float64 ``values`` as the float32 values at or above them."""
    single = values.float()
    below = single.double() < values
    return torch.where(below, torch.nextafter(single, torch.tensor(float("inf"))), single)


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


def greedy_available() -> bool:
    """Whether ``GreedyHead`` runs here: on the tile unit where ``available()``, else on the
    vector unit where the CPU has AVX512-BF16."""
    lib = library()
    return lib is not None and bool(lib.sy_greedy_available())


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel library, or None (logged once) where it cannot be built here."""
    lib = native.load(SOURCE)
    if lib is None:
        return None
    for name in ("sy_tile_available", "sy_greedy_available"):
        getattr(lib, name).argtypes = []
        getattr(lib, name).restype = ctypes.c_int
    lib.sy_tile_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.sy_tile_pack.restype = None
    lib.sy_tile_linear.argtypes = panel_gemm.LINEAR_ARGTYPES
    lib.sy_tile_linear.restype = panel_gemm.LINEAR_RESTYPE
    lib.sy_tile_pack_hi.argtypes = lib.sy_tile_pack.argtypes
    lib.sy_tile_pack_hi.restype = None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.sy_tile_greedy_tokens.argtypes = [pointer, size, size, pointer, size, size] + [pointer] * 3
    lib.sy_tile_greedy_tokens.restype = ctypes.c_int
    return lib
