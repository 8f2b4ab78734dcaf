"""benchmarks/kernel_ab.py runs as documented, on the tiny model: beside a build of the same
source (the attention kernels' or the matrix product's) every step gives the same logits to the
bit, and the swapped-in builds are undone after; steps it cannot take are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.benchmark_scripts import import_scripts
from worker.models import cpu_ops, panel_gemm

SOURCE = Path(cpu_ops.__file__).with_name("cpu_ops.c")
(kernel_ab,) = import_scripts("kernel_ab")


@pytest.mark.parametrize("kernel", [cpu_ops, panel_gemm], ids=["cpu_ops", "panel_gemm"])
def test_steps_beside_the_same_source_agree_to_the_bit(kernel, tiny_llama_dir, capsys):
    if cpu_ops.library() is None or panel_gemm.library() is None:
        pytest.skip("no C compiler here")
    source = Path(kernel.__file__).with_suffix(".c")
    options = ["--compare", str(source), "--kernel", kernel.__name__.rsplit(".", 1)[1]]
    options += ["--steps", "1x40x0,3x1x70x32", "--rounds", "2"]
    this_checkout = kernel.library
    assert kernel_ab.main([*options, "--model-path", str(tiny_llama_dir)]) == 0
    assert kernel.library is this_checkout  # the swap is undone
    header, _, *rows = capsys.readouterr().out.splitlines()
    assert header.startswith("| step | this | compared |")
    cells = [row.split(" | ") for row in rows]
    assert [row[0] for row in cells] == ["| 1 x 40 new after 0", "| 3 x 1 new after 70 (32 shared)"]
    assert all(row[4] == "True" and row[5] == "0.0e+00 |" for row in cells)


SHIFTED = """
int sy_panel_linear(const float* x, int64_t m, int64_t k, const float* panels, int64_t n,
                    const float* bias, float* y) {
  unshifted_linear(x, m, k, panels, n, bias, y);
  for (int64_t i = 0; i < m * n; i++) y[i] += 1.0f;
  return 0;
}
"""


def test_a_different_matrix_product_is_the_one_each_step_uses(tiny_llama_dir, tmp_path, capsys):
    """Beside a build whose every product output is 1 higher, the logits differ, and not by
    the LM head's 1 alone: the layer stack (which keeps its product's address) used it too."""
    if cpu_ops.library() is None or panel_gemm.library() is None:
        pytest.skip("no C compiler here")
    source = Path(panel_gemm.__file__).with_suffix(".c").read_text()
    shifted = tmp_path / "shifted_panel_gemm.c"
    shifted.write_text(
        source.replace("int sy_panel_linear(", "static int unshifted_linear(") + SHIFTED
    )
    options = ["--compare", str(shifted), "--kernel", "panel_gemm", "--steps", "1x40x0"]
    assert kernel_ab.main([*options, "--rounds", "1", "--model-path", str(tiny_llama_dir)]) == 0
    (row,) = capsys.readouterr().out.splitlines()[2:]
    gap = float(row.split(" | ")[5].rstrip(" |"))
    assert gap > 0 and abs(gap - 1.0) > 1e-3


@pytest.mark.parametrize("steps", ["1x0x5", "2x1x40x20", "2x1x16x32", "1x2", "ax1x1"])
def test_steps_it_cannot_take_are_refused(steps, capsys):
    with pytest.raises(SystemExit) as exit_info:
        kernel_ab.main(["--compare", str(SOURCE), "--steps", steps])
    assert exit_info.value.code == 2
    assert "steps are REQUESTSxNEWxCACHED[xSHARED]" in capsys.readouterr().err
