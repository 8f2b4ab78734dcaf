"""benchmarks/kernel_ab.py runs as documented, on the tiny model: beside a build of the same
source every step gives the same logits to the bit; steps it cannot take are refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from worker.models import cpu_ops

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SOURCE = Path(cpu_ops.__file__).with_name("cpu_ops.c")
sys.path.insert(0, str(BENCHMARKS))  # the scripts import their neighbours by name, as when run
try:
    import kernel_ab
finally:
    sys.path.remove(str(BENCHMARKS))


def test_steps_beside_the_same_source_agree_to_the_bit(tiny_llama_dir, capsys):
    if cpu_ops.library() is None:
        pytest.skip("no C compiler here")
    options = ["--compare", str(SOURCE), "--steps", "1x40x0,3x1x70x32", "--rounds", "2"]
    this_checkout = cpu_ops.library
    assert kernel_ab.main([*options, "--model-path", str(tiny_llama_dir)]) == 0
    assert cpu_ops.library is this_checkout  # the swap is undone
    header, _, *rows = capsys.readouterr().out.splitlines()
    assert header.startswith("| step | this | compared |")
    cells = [row.split(" | ") for row in rows]
    assert [row[0] for row in cells] == ["| 1 x 40 new after 0", "| 3 x 1 new after 70 (32 shared)"]
    assert all(row[4] == "True" and row[5] == "0.0e+00 |" for row in cells)


@pytest.mark.parametrize("steps", ["1x0x5", "2x1x40x20", "2x1x16x32", "1x2", "ax1x1"])
def test_steps_it_cannot_take_are_refused(steps, capsys):
    with pytest.raises(SystemExit) as exit_info:
        kernel_ab.main(["--compare", str(SOURCE), "--steps", steps])
    assert exit_info.value.code == 2
    assert "steps are REQUESTSxNEWxCACHED[xSHARED]" in capsys.readouterr().err
