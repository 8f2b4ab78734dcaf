"""A worker's heartbeat file, for a liveness probe that a hung worker fails.

A worker has no HTTP port, and a hung one (deadlocked, stopped, a rank stuck in a collective)
keeps its connections open, so nothing outside it notices: the scheduler fences it once its step
runs past the stall bound and moves its requests, and ``switchyard serve`` kills and restarts
it, but under Kubernetes only a liveness probe can. With ``--liveness-file FILE``, the worker's
loop touches FILE between steps, at most once a second (``Heartbeat``); a step in progress does
not. ``python -m worker.liveness FILE --max-age SECONDS`` exits 0 while FILE was touched within
SECONDS, else 1 saying how long ago (or that it does not exist: the model is still loading, which
a startup probe allows for). SECONDS must exceed the longest step the worker may legitimately
take.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

BEAT_INTERVAL_S = 1.0
"""The most often the file is touched."""


class Heartbeat:
    """Touches ``path`` (creating it) when ``beat`` is called, at most once a
    ``BEAT_INTERVAL_S``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._last = float("-inf")

    def beat(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now - self._last < BEAT_INTERVAL_S:
            return
        self.path.touch()
        os.utime(self.path)  # touch() keeps the time of an existing file on some filesystems
        self._last = now


def problem(path: Path, max_age_s: float, now: float | None = None) -> str | None:
    """Why the worker beating into ``path`` is not alive at ``now`` (default: the wall clock
    that file times use), or None."""
    now = time.time() if now is None else now
    try:
        age = now - path.stat().st_mtime
    except FileNotFoundError:
        return f"{path} does not exist: the worker has not served yet"
    if age > max_age_s:
        return f"the worker last beat {age:.0f} s ago (in {path}), more than {max_age_s:g} s"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.liveness", description=__doc__)
    parser.add_argument("file", type=Path, help="the worker's --liveness-file")
    parser.add_argument(
        "--max-age",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long ago the worker may last have beaten (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if not args.max_age > 0:
        parser.error(f"--max-age must be above 0 seconds, got {args.max_age:g}")
    why = problem(args.file, args.max_age)
    if why is not None:
        print(why, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
