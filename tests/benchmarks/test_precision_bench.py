"""benchmarks/precision_bench.py runs as documented, on the tiny model: every step shape timed
at both precisions, the same next tokens from both."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.benchmark_scripts import BENCHMARKS, import_scripts
from worker.models import tile_gemm

SCRIPT = BENCHMARKS / "precision_bench.py"
(precision_bench,) = import_scripts("precision_bench")


def test_both_precisions_time_every_step_and_agree_on_the_next_tokens(tiny_llama_dir, tmp_path):
    if not tile_gemm.available():
        pytest.skip("no AMX-BF16 tile unit here")
    output = tmp_path / "precision.json"
    command = [sys.executable, str(SCRIPT), "--model-path", str(tiny_llama_dir)]
    subprocess.run([*command, "--output-json", str(output)], check=True, timeout=300)
    steps = json.loads(output.read_text())["steps"]
    assert [(s["requests"], s["new_tokens"], s["cached_tokens"]) for s in steps] == list(
        precision_bench.STEPS
    )
    assert all(s["highest_ms"] > 0 and s["high_ms"] > 0 for s in steps)
    assert all(s["same_next_tokens"] for s in steps)
    assert all(s["max_logit_difference"] < 1e-3 for s in steps)
