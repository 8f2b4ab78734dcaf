"""The attention benchmark times this checkout's kernel beside another build of its source."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import attention_bench
from worker.models import cpu_ops

SOURCE = Path(cpu_ops.__file__).with_name("cpu_ops.c")


def test_a_case_beside_the_same_source_agrees_to_the_bit(capsys):
    if cpu_ops.library() is None:
        pytest.skip("no C compiler here")
    args = [
        *("--cases", "3x40,1x17", "--prefill", "45x0,20x300", "--rounds", "2", "--layers", "2"),
        *("--compare", str(SOURCE)),
    ]
    assert attention_bench.main(args) == 0
    decodes, prefills = capsys.readouterr().out.split("\n\n")
    header, _, *rows = decodes.splitlines()
    assert header == "| batch x context | this | compared | largest gap |"
    assert [row.split(" | ")[0] for row in rows] == ["| 3 x 40", "| 1 x 17"]
    assert all(row.endswith("| 0.0e+00 |") for row in rows)
    header, _, *rows = prefills.splitlines()
    assert header == "| prefill tokens x cached | this | compared | largest gap |"
    assert [row.split(" | ")[0] for row in rows] == ["| 45 x 0", "| 20 x 300"]
    assert all("GFLOP/s" in row and row.endswith("| 0.0e+00 |") for row in rows)


def test_cases_and_heads_the_kernel_cannot_take_are_refused():
    with pytest.raises(SystemExit):
        attention_bench.main(["--cases", "0x10"])
    with pytest.raises(SystemExit):
        attention_bench.main(["--heads", "9,3,60"])
    with pytest.raises(SystemExit):
        attention_bench.main(["--layers", "0"])
    for prefill in ("0x10", "ax10", "512"):
        with pytest.raises(SystemExit):
            attention_bench.main(["--prefill", prefill])
    with pytest.raises(SystemExit):
        attention_bench.main(["--cases", "16xb"])
