"""The "high"-precision matrix product of worker/models/tile_gemm.c (bfloat16 halves on AMX).

Each product must stay within the error three bfloat16 products leave (a few parts in 10^6 of
the sum of |x_i w_i|), for every shape the tile layout pads: rows that do not fill a 16-row
block, input features that do not fill a 32-wide step, outputs that do not fill a panel, and
products of more rows than one pass holds. A row's result must not depend on the other rows of
the product, and the worker must pack and run its layers this way only when asked.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from worker.models import tile_gemm
from worker.models.linear import Linear, prepacking
from worker.models.loader import load_model

pytestmark = pytest.mark.skipif(
    not tile_gemm.available(), reason="no AMX-BF16 tile unit (or no C compiler) here"
)

CPU = torch.device("cpu")
HIGH_BOUND = 3e-5
"""|error| <= HIGH_BOUND x sum |x_i w_i|: the dropped terms are ~2^-16 of each product."""


@pytest.fixture
def high_precision() -> Iterator[None]:
    """torch's float32 matmul precision "high" for the test, restored after it."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    yield
    torch.set_float32_matmul_precision(before)


def _check_product(m: int, k: int, n: int, bias: bool, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator)
    weight = torch.randn(n, k, generator=generator) / k**0.5
    b = torch.randn(n, generator=generator) if bias else None
    tiles = tile_gemm.pack(weight)
    assert tuple(tiles.shape) == tile_gemm.tile_shape(n, k)
    y = tile_gemm.linear(x, tiles, b, n, k)
    exact = x.double() @ weight.double().T + (0 if b is None else b.double())
    scale = x.double().abs() @ weight.double().abs().T
    error = (y.double() - exact).abs()
    assert (error <= HIGH_BOUND * scale + 1e-6).all(), f"max error {error.max().item():.3g}"


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    ("m", "k", "n"),
    [
        (1, 576, 960),  # one row: one block, the weights streamed
        (3, 100, 70),  # features and outputs short of a step and of a panel
        (16, 32, 32),  # exactly one block, one step, one panel
        (17, 576, 3072),  # a second block of one row
        (47, 1536, 576),  # several blocks in chunks of steps
        (300, 1536, 40),  # more rows than one pass holds (160 at 1,536 features)
    ],
)
def test_high_product_stays_within_its_error_bound(m, k, n, bias):
    _check_product(m, k, n, bias)


def test_a_row_gets_the_same_result_alone_and_in_any_product():
    """Every row's sums run in one order whatever the product's size: alone, in tiles of fewer
    rows than 16, in one block, in the last block of several, and in a second pass."""
    generator = torch.Generator().manual_seed(1)
    k, n = 1536, 96
    x = torch.randn(300, k, generator=generator)
    tiles = tile_gemm.pack(torch.randn(n, k, generator=generator))
    together = tile_gemm.linear(x, tiles, None, n, k)
    for row in (0, 15, 16, 33, 159, 160, 299):
        alone = tile_gemm.linear(x[row : row + 1], tiles, None, n, k)
        assert torch.equal(alone[0], together[row]), f"row {row}"
    for count in (7, 15, 16, 17):  # tiles of fewer rows than 16, one full block, two blocks
        assert torch.equal(tile_gemm.linear(x[:count], tiles, None, n, k), together[:count])


def test_the_tile_kernel_refuses_mismatched_inputs():
    tiles = tile_gemm.pack(torch.randn(32, 64))
    with pytest.raises(ValueError, match="features"):
        tile_gemm.linear(torch.randn(2, 63), tiles, None, 32, 64)
    with pytest.raises(ValueError, match="are not a"):
        tile_gemm.linear(torch.randn(2, 64), tiles, None, 33, 64)
    with pytest.raises(TypeError, match="float32"):
        tile_gemm.linear(torch.randn(2, 64, dtype=torch.float64), tiles, None, 32, 64)
    with pytest.raises(ValueError, match="bias"):
        tile_gemm.linear(torch.randn(2, 64), tiles, torch.randn(31), 32, 64)
    assert tile_gemm.linear(torch.empty(0, 64), tiles, None, 32, 64).shape == (0, 32)


def test_a_weight_without_inputs_gives_its_bias():
    """k = 0 (the kernel's pass size divided by zero there: SIGFPE, found under UBSan)."""
    bias = torch.randn(7)
    tiles = tile_gemm.pack(torch.zeros(7, 0))
    assert torch.equal(tile_gemm.linear(torch.zeros(3, 0), tiles, bias, 7, 0), bias.expand(3, 7))
    assert torch.equal(tile_gemm.linear(torch.zeros(3, 0), tiles, None, 7, 0), torch.zeros(3, 7))


OUT_OF_MEMORY_SCRIPT = """
import ctypes, resource, threading, torch
from worker.models import tile_gemm
libc = ctypes.CDLL("libc.so.6")
libc.mallopt(-8, 1)  # M_ARENA_MAX: one heap (a thread's own would lend it room under the limit)
libc.mallopt(-3, 65536)  # M_MMAP_THRESHOLD: large blocks come from mmap, and go back to it
torch.set_num_threads(2)
tiles = tile_gemm.pack(torch.randn(32, 4096))
x, expected = torch.randn(64, 4096), []
# each calling thread keeps its own buffer: this one's grows to 64 rows, the main thread's not
def alone():
    expected.append(tile_gemm.linear(x, tiles, None, 32, 4096))
worker = threading.Thread(target=alone)
worker.start()
worker.join()
tile_gemm.linear(x[:2], tiles, None, 32, 4096)  # the threads, and a 2-row buffer
libc.malloc_trim(0)
with open("/proc/self/status") as status:
    used = next(int(line.split()[1]) for line in status if line.startswith("VmSize")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (used + (256 << 10), resource.RLIM_INFINITY))
try:
    tile_gemm.linear(x, tiles, None, 32, 4096)  # 64 rows of split inputs: 1 MB
except MemoryError as error:
    print("refused:", error)
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
assert torch.equal(tile_gemm.linear(x, tiles, None, 32, 4096), expected[0])
print("recovered")
"""


def test_a_product_without_memory_for_its_inputs_fails_and_the_next_one_runs():
    """Out of memory for the split inputs (a 1 MB buffer under an address-space limit), the
    product raises MemoryError instead of ending the process, and runs once memory is back."""
    result = subprocess.run(
        [sys.executable, "-c", OUT_OF_MEMORY_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr
    assert "refused: the tile product could not allocate its split inputs" in result.stdout
    assert "recovered" in result.stdout


def test_layers_pack_tiles_only_at_high_precision_and_never_the_lm_head(high_precision):
    weight = torch.randn(96, 64)
    assert prepacking(weight) == "tiles"
    assert prepacking(weight, rows_read=True) == "panels"
    torch.set_float32_matmul_precision("highest")
    assert prepacking(weight) == "panels"


def test_a_linear_layer_in_tile_form_matches_f_linear(high_precision):
    layer = Linear(64, [48, 48], bias=True)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    assert layer.prepack() == "tiles"
    x = torch.randn(40, 64)
    expected = F.linear(x.double(), weight.double(), bias.double())
    scale = x.double().abs() @ weight.double().abs().T
    assert ((layer(x).double() - expected).abs() <= HIGH_BOUND * scale + 1e-6).all()


def test_the_model_packs_its_decoder_layers_in_tiles_and_runs_them_in_one_call(
    tiny_llama_dir, high_precision
):
    model = load_model(tiny_llama_dir, CPU, torch.float32)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.packing == "tiles"
    assert layer.mlp.down_proj.packing == "tiles"
    assert model.lm_head.packing == "panels"
    assert model.fused_layers is not None
