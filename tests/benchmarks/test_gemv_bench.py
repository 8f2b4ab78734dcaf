"""benchmarks/gemv_bench.py's pieces: kernels timed in turns, and another build of the panel
kernel (``panel_gemm.build``, which ``--compare`` uses) that computes what this checkout's
does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from worker.models import panel_gemm

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the scripts import their neighbours by name, as when run
try:
    import gemv_bench
finally:
    sys.path.remove(str(BENCHMARKS))


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
