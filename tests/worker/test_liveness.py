"""The worker's heartbeat file and the liveness probe that reads it (worker.liveness)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from worker.liveness import BEAT_INTERVAL_S, Heartbeat, main, problem


def test_a_heartbeat_touches_its_file_at_most_once_a_second(tmp_path):
    path = tmp_path / "alive"
    heartbeat = Heartbeat(path)
    heartbeat.beat(now=100.0)
    assert path.exists()
    os.utime(path, (1.0, 1.0))
    heartbeat.beat(now=100.0 + BEAT_INTERVAL_S / 2)
    assert path.stat().st_mtime == 1.0  # not touched again yet
    heartbeat.beat(now=100.0 + BEAT_INTERVAL_S)
    assert path.stat().st_mtime > 1.0


def test_the_probe_fails_for_a_missing_or_stale_file_and_passes_for_a_fresh_one(tmp_path, capsys):
    path = tmp_path / "alive"
    assert problem(path, 30) == f"{path} does not exist: the worker has not served yet"
    path.touch()
    os.utime(path, (1000.0, 1000.0))
    assert problem(path, 30, now=1029.0) is None
    assert problem(path, 30, now=1031.0) == (
        f"the worker last beat 31 s ago (in {path}), more than 30 s"
    )
    assert main([str(path), "--max-age", "30"]) == 1  # the wall clock is far past 1000
    assert "the worker last beat" in capsys.readouterr().err
    path.touch()
    assert main([str(path), "--max-age", "30"]) == 0


def test_the_probe_refuses_a_max_age_that_is_not_positive(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "worker.liveness", str(tmp_path / "alive"), "--max-age", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 2
    assert "--max-age must be above 0 seconds, got 0" in completed.stderr


@pytest.mark.parametrize("max_age", ["nan", "-1"])
def test_the_probe_refuses_nonsense(tmp_path, max_age):
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "alive"), "--max-age", max_age])
    assert exit_info.value.code == 2
