"""benchmarks/workload.py's run_benchmark, every benchmark's main: SIGTERM (a job runner's stop,
`kill`) unwinds the run as Ctrl-C does, so the servers and clients it started are stopped on
the way out instead of left running, even when a second SIGTERM comes while they stop; the
exit status says it was terminated, and the process's own SIGTERM handling is back after."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.support.benchmark_scripts import BENCHMARKS, import_scripts

(workload,) = import_scripts("workload")

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
            finally:  # what a server's context manager does on the way out: ask, wait, kill
                Path(sys.argv[2] + ".stopping").write_text("")
                time.sleep(1.0)
                child.kill()
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


def _wait_for(path: Path, script: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while not path.exists() or (path.suffix == ".pid" and not path.read_text()):
        assert time.monotonic() < deadline and script.poll() is None, f"no {path.name}"
        time.sleep(0.05)


def test_sigterm_stops_what_the_benchmark_started(tmp_path: Path):
    pid_file = tmp_path / "child.pid"
    stopping = tmp_path / "child.pid.stopping"
    script = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(BENCHMARKS), str(pid_file)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(pid_file, script)
        child = int(pid_file.read_text())
        assert not _gone(child)
        script.send_signal(signal.SIGTERM)
        _wait_for(stopping, script)
        script.send_signal(signal.SIGTERM)  # impatient: while the child is being stopped
        _, stderr = script.communicate(timeout=30)
    finally:
        script.kill()
    assert script.returncode == 143
    assert "demo: terminated" in stderr
    assert _gone(child)


def test_the_sigterm_handler_is_put_back_after_a_run():
    def own_handler(signum, frame):  # what the caller had
        raise AssertionError("not called")

    def fails(args):
        raise workload.BenchmarkError("no server")

    def parser() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser()
        parser.add_argument("--output-json")
        return parser

    previous = signal.signal(signal.SIGTERM, own_handler)
    try:
        for run, code in ((lambda args: {}, 0), (fails, 1)):
            status = workload.run_benchmark(
                "demo",
                [],
                parser,
                lambda parser, args: None,
                run,
                lambda result: ("done", True),
            )
            assert status == code
            assert signal.getsignal(signal.SIGTERM) is own_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
