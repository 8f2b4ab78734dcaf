"""benchmarks/context_bench.py runs as documented, on the tiny model: each batch and context
timed in place (in turns, a sample per round) and gathered, the growth from the shortest context
to the longest taken per round, and with ``--shared-prefix`` the floor counts the shared keys
once."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "context_bench.py"


def test_steps_are_timed_and_a_shared_prefix_is_counted_once(tiny_llama_dir, tmp_path):
    output = tmp_path / "context.json"
    command = [sys.executable, str(SCRIPT), "--model-path", str(tiny_llama_dir)]
    options = ["--contexts", "40,100", "--batch-sizes", "3", "--shared-prefix", "64"]
    options += ["--rounds", "4"]
    subprocess.run([*command, *options, "--output-json", str(output)], check=True, timeout=300)
    results = json.loads(output.read_text())
    assert results["shared_prefix"] == 64
    per_token = results["kv_bytes_per_token"]
    rows = {row["context"]: row for row in results["rows"]}
    assert set(rows) == {40, 100}
    # 40 tokens: 32 shared (whole blocks, short of the decode's own token); 100: all 64
    assert rows[40]["kv_bytes"] == (32 + 3 * (40 - 32)) * per_token
    assert rows[100]["kv_bytes"] == (64 + 3 * (100 - 64)) * per_token
    assert all(row["in_place_ms"] > 0 and row["gathered_ms"] > 0 for row in rows.values())
    assert results["rounds"] == 4 and len(results["read_bandwidth_bytes_per_s"]) == 4
    (growth,) = results["growth"]
    assert (growth["batch_size"], growth["from_context"], growth["to_context"]) == (3, 40, 100)
    assert growth["extra_kv_bytes"] == rows[100]["kv_bytes"] - rows[40]["kv_bytes"]
    assert len(growth["ratios"]) == 4
    assert growth["ratio_median"] == statistics.median(growth["ratios"])


def test_malformed_flags_are_refused_by_name():
    for options, message in (
        (["--contexts", "128,x"], "--contexts and --batch-sizes take comma-separated whole"),
        (["--rounds", "0"], "--rounds must be positive"),
    ):
        completed = subprocess.run(
            [sys.executable, str(SCRIPT), *options], capture_output=True, text=True, timeout=60
        )
        assert completed.returncode == 2 and message in completed.stderr
