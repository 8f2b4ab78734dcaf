"""benchmarks/workload.py's run_benchmark, every benchmark's main: SIGTERM (a job runner's stop,
`kill`) unwinds the run as Ctrl-C does, so the servers and clients it started are stopped on
the way out instead of left running; the exit status says it was terminated."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

SCRIPT = textwrap.dedent(
    """
    import subprocess, sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from workload import run_benchmark

    def run(args):
        with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]) as child:
            try:
                Path(sys.argv[2]).write_text(str(child.pid))
                time.sleep(300)
            finally:
                child.kill()  # what a server's context manager does on the way out
        return {}

    sys.exit(run_benchmark(
        "demo", [], lambda: __import__("argparse").ArgumentParser(), lambda parser, args: None,
        run, lambda result: ("done", True),
    ))
    """
)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_sigterm_stops_what_the_benchmark_started(tmp_path: Path):
    pid_file = tmp_path / "child.pid"
    script = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(BENCHMARKS), str(pid_file)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and script.poll() is None, "the run did not start"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert not _gone(child)
        script.send_signal(signal.SIGTERM)
        _, stderr = script.communicate(timeout=30)
    finally:
        script.kill()
    assert script.returncode == 143
    assert "demo: terminated" in stderr
    assert _gone(child)
