"""How much of the machine's CPU went to processes outside the benchmark during a run (Linux).

On a shared machine another job's threads compete with the server for the same cores, and
OpenMP-style thread pools slow down far more than the share they lose. ``CpuWatch`` reads
/proc/stat and /proc/PID/stat at the start and end of a run and reports the core-seconds used by
the benchmark's own process tree (this process and every descendant, finished ones included:
the server it launched, the baseline child), by everything else, and stolen by the hypervisor.
Elsewhere it reports nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PROC = Path("/proc")


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_ticks() -> tuple[int, int]:
    """(busy, steal) ticks over all cores since boot: busy excludes idle, iowait and steal."""
    fields = [int(value) for value in (PROC / "stat").read_text().split("\n")[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return user + nice + system + irq + softirq, steal


def _parent_and_ticks(pid: str) -> tuple[int, int] | None:
    """(parent pid, user + system ticks of it and its reaped children), None if it is gone."""
    try:
        stat = (PROC / pid / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    return int(fields[1]), sum(int(ticks) for ticks in fields[11:15])


def process_core_s(pid: int) -> float | None:
    """CPU seconds (user + system, all threads, reaped children too) ``pid`` has used so far;
    None if it has exited or /proc is missing. Take two readings and subtract for a run."""
    info = _parent_and_ticks(str(pid))
    return None if info is None else info[1] / _clock_ticks()


def _tree_ticks(root_pid: int) -> int:
    """User + system ticks of ``root_pid`` and every live descendant."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (info := _parent_and_ticks(entry.name)) is not None:
            parents[int(entry.name)], ticks[int(entry.name)] = info
    tree = {root_pid}
    grew = True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= children
        grew = bool(children)
    return sum(ticks.get(pid, 0) for pid in tree)


class CpuWatch:
    """``start()`` before the timed run, ``stop()`` after it (while the server still runs)."""

    def __init__(self) -> None:
        self.available = (PROC / "stat").is_file()
        self._start: tuple[float, float, int, int, int] | None = None

    def _sample(self) -> tuple[float, float, int, int, int]:
        busy, steal = _machine_ticks()
        wall, this_process = time.perf_counter(), time.process_time()
        return wall, this_process, busy, steal, _tree_ticks(os.getpid())

    def start(self) -> None:
        if self.available:
            self._start = self._sample()

    def stop(self) -> dict | None:
        """Core-seconds used during the run: by the benchmark (of which this process, the load
        generator), by other processes, stolen; None where /proc is missing."""
        if self._start is None:
            return None
        end = self._sample()
        wall, this_process, busy, steal, ours = (
            after - before for after, before in zip(end, self._start, strict=True)
        )
        ticks = _clock_ticks()
        others = max(0, busy - ours) / ticks
        return {
            "wall_s": wall,
            "benchmark_core_s": ours / ticks,
            "load_generator_core_s": this_process,
            "other_processes_core_s": others,
            "steal_core_s": steal / ticks,
            "other_processes_share": others / (wall * os.cpu_count()) if wall > 0 else None,
        }
