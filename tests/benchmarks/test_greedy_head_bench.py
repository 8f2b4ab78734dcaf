"""benchmarks/greedy_head_bench.py runs as documented, on the tiny model: every step's greedy
head gives the float32 logits' tokens; steps it cannot take are refused."""

from __future__ import annotations

import pytest

from tests.support.benchmark_scripts import import_scripts
from worker.models import cpu_ops, tile_gemm

(greedy_head_bench,) = import_scripts("greedy_head_bench")


def test_each_step_times_both_heads_and_they_agree(tiny_llama_dir, capsys):
    if not tile_gemm.greedy_available() or cpu_ops.library() is None:
        pytest.skip("no bfloat16 dot products (AMX-BF16 or AVX512-BF16) or no C compiler here")
    options = ["--steps", "1x1x40,5x1x70", "--rounds", "2", "--model-path", str(tiny_llama_dir)]
    assert greedy_head_bench.main(options) == 0
    header, _, *rows = capsys.readouterr().out.splitlines()
    assert header.startswith("| step | head: float32 + argmax | greedy head |")
    assert [row.split(" | ")[0] for row in rows] == ["| 1 x 1 new after 40", "| 5 x 1 new after 70"]
    assert all("(same tokens: True)" in row for row in rows)


def test_a_step_it_cannot_take_is_refused(capsys):
    with pytest.raises(SystemExit):
        greedy_head_bench.main(["--steps", "1x0x40"])
    assert "REQUESTSxNEWxCACHED" in capsys.readouterr().err
