"""The machine probe measures the arithmetic peak and every way of reading a paged pool."""

from __future__ import annotations

import pytest
import torch

from tests.support.benchmark_scripts import import_scripts

(machine_probe,) = import_scripts("machine_probe")


def test_it_reports_the_peak_and_every_way_of_reading_a_small_pool(capsys):
    if machine_probe.load_probe() is None:
        pytest.skip("no C compiler here")
    args = ["--pool-mib", "4", "--block-kib", "12", "--rounds", "2", "--fma-iterations", "1000000"]
    assert machine_probe.main(args) == 0
    peak, reads = capsys.readouterr().out.split("\n\n")
    header, _, row = peak.splitlines()
    assert header.startswith("| float32 multiply-add peak")
    assert all(float(cell.split()[0]) > 0 for cell in row.strip("| ").split(" | "))
    header, _, *rows = reads.splitlines()
    assert header == "| reading 4 MiB in blocks of 12 KiB | GB/s |"
    names = [row.split(" | ")[0].lstrip("| ") for row in rows]
    assert names == [*machine_probe.SCHEMES.values(), *names[-2:]]
    assert names[-2:] == ["in order, hardware prefetch alone", "sum() of the pool as one tensor"]
    assert all(float(row.split(" | ")[1].rstrip(" |")) > 0 for row in rows)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("scheme", sorted(machine_probe.SCHEMES))
def test_every_scheme_reads_each_block_once(scheme, threads):
    """A pool of ones: the sum is the number of floats read, whatever the order, scheme and
    number of threads (a block read twice or skipped would show)."""
    library = machine_probe.load_probe()
    if library is None:
        pytest.skip("no C compiler here")
    block_floats, num_blocks = 3072, 37
    pool = torch.ones(block_floats * num_blocks)
    pool[5 * block_floats : 6 * block_floats] = 2.0  # block 5 counts twice
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        total = library.sy_read_blocks(
            pool.data_ptr(), order.data_ptr(), num_blocks, block_floats, scheme
        )
    finally:
        torch.set_num_threads(before)
    assert total == (num_blocks + 1) * block_floats


def test_sizes_it_cannot_take_are_refused():
    with pytest.raises(SystemExit):
        machine_probe.main(["--pool-mib", "0"])
    with pytest.raises(SystemExit):
        machine_probe.main(["--pool-mib", "8192"])
    with pytest.raises(SystemExit):
        machine_probe.main(["--block-kib", "2048", "--pool-mib", "1"])
    with pytest.raises(SystemExit):
        machine_probe.main(["--rounds", "0"])
