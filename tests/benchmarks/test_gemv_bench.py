"""benchmarks/gemv_bench.py's pieces: kernels timed in turns, and another build of the panel
kernel (``panel_gemm.build``, which ``--compare`` uses) that computes what this checkout's
does."""

from __future__ import annotations

import pytest
import torch

from tests.support.benchmark_scripts import import_scripts
from worker.models import panel_gemm

(gemv_bench,) = import_scripts("gemv_bench")


def test_kernels_take_turns_after_three_warm_up_turns():
    calls: list[str] = []
    medians = gemv_bench.medians_in_turns(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=4
    )
    assert calls == ["a", "b"] * 7
    assert set(medians) == {"a", "b"} and all(ms >= 0 for ms in medians.values())


def test_a_compared_build_of_the_same_source_gives_the_same_products():
    if panel_gemm.library() is None:
        pytest.skip("no C compiler for the panel kernel")
    compared = panel_gemm.build(panel_gemm.SOURCE)
    weight, x = torch.randn(96, 40), torch.randn(64, 40)
    panels = panel_gemm.pack(weight)
    y = torch.empty(64, 96)
    compared.sy_panel_linear(x.data_ptr(), 64, 40, panels.data_ptr(), 96, None, y.data_ptr())
    assert torch.equal(y, panel_gemm.linear(x, panels, None, 96))


def test_the_in_cache_pass_repeats_the_first_layer_for_the_same_arithmetic():
    from_memory, in_cache = gemv_bench.in_cache_order()

    def shapes(order: list[int]) -> list[tuple[int, int]]:
        return sorted(gemv_bench.LAYER_SHAPES[i % len(gemv_bench.LAYER_SHAPES)] for i in order)

    assert from_memory == list(range(gemv_bench.NUM_LAYERS * len(gemv_bench.LAYER_SHAPES)))
    assert set(in_cache) == set(range(len(gemv_bench.LAYER_SHAPES)))  # one layer's matrices
    assert shapes(in_cache) == shapes(from_memory)


def test_the_in_cache_lines_time_both_orders_of_every_kernel(capsys):
    calls: dict[str, list[int]] = {"a": [], "b": []}
    kernels = {name: (lambda x, i, name=name: calls[name].append(i)) for name in calls}
    from_memory, in_cache = gemv_bench.in_cache_order()
    xs = [torch.zeros(2, gemv_bench.LAYER_SHAPES[i % 4][1]) for i in from_memory]
    gemv_bench.print_in_cache(kernels, xs, rows=2)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" rows  ", 1)[1][:32].strip() for line in lines] == [
        "a, layers",
        "a, in cache",
        "b, layers",
        "b, in cache",
    ]
    assert all(line.endswith("GFLOP/s") for line in lines)
    turns = 3 + 15  # warm-up turns, then the timed ones
    assert calls["a"] == (from_memory + in_cache) * turns
