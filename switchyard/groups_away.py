"""What ``/health`` says about worker groups that left the scheduler, for the launcher.

While a group that served is away (it died, or the scheduler fenced it as stalled) and its
requests wait for it, ``/health`` answers 200 with ``{"status": "stalled" | "restarting",
"groups_away": [{"group": NAME, "reason": R, "seconds": S}]}``. ``HealthPoller`` reads it about
once a second on a thread of its own, so the launcher's loop that watches its children never
waits for an answer; the launcher takes each report once (``take``) and restarts the groups it
names whose processes still run (``switchyard.worker_restarts``).

The body comes from another process, so it is checked as any input: at most
``MAX_BODY_BYTES``, at most ``MAX_GROUPS_AWAY`` entries (as many as the scheduler reports),
names and reasons short strings, seconds finite and not negative. A body that breaks these
gives no report.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from interfaces.scheduler_to_api import MAX_GROUPS_AWAY

logger = logging.getLogger("switchyard")

POLL_INTERVAL_S = 1.0
POLL_TIMEOUT_S = 1.0
MAX_BODY_BYTES = 1 << 20
"""Room for ``MAX_GROUPS_AWAY`` entries whose names have ``MAX_NAME_CHARS`` characters of up to
four UTF-8 bytes each (or six, escaped)."""
MAX_NAME_CHARS = 256


@dataclass(frozen=True)
class AwayEntry:
    """One entry of ``groups_away``: group ``name`` left ``seconds`` before the stats were
    taken, for ``reason`` (worker_died or worker_stalled)."""

    name: str
    reason: str
    seconds: float


@dataclass(frozen=True)
class AwayReport:
    """The groups away of one ``/health`` answer, received at ``fetched_at`` (monotonic)."""

    fetched_at: float
    groups: tuple[AwayEntry, ...]


def parse_groups_away(body: bytes) -> tuple[AwayEntry, ...] | None:
    """The ``groups_away`` of a ``/health`` body (none when the key is absent); None for a body
    that is not the contract's."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(document, dict):
        return None
    entries = document.get("groups_away", [])
    if not isinstance(entries, list) or len(entries) > MAX_GROUPS_AWAY:
        return None
    groups = [_entry(entry) for entry in entries]
    return None if None in groups else tuple(groups)


def _entry(entry: object) -> AwayEntry | None:
    if not isinstance(entry, dict):
        return None
    name, reason, seconds = entry.get("group"), entry.get("reason"), entry.get("seconds")
    if not all(isinstance(text, str) and len(text) <= MAX_NAME_CHARS for text in (name, reason)):
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        return None
    if not (math.isfinite(seconds) and seconds >= 0):
        return None
    return AwayEntry(name, reason, float(seconds))


class HealthPoller:
    """Reads ``url`` (the unit's ``/health``) every ``POLL_INTERVAL_S`` until ``stopping`` is
    set, on a daemon thread that no error ends (``_poll``); ``take()`` gives the latest report
    once (None: no new one)."""

    def __init__(self, url: str, stopping: threading.Event) -> None:
        self.url = url
        self._stopping = stopping
        self._lock = threading.Lock()
        self._latest: AwayReport | None = None
        self._errors_logged: set[type[Exception]] = set()
        """The kinds of unexpected error logged already (each once)."""
        self._thread = threading.Thread(target=self._run, name="health-poller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def take(self) -> AwayReport | None:
        with self._lock:
            report, self._latest = self._latest, None
        return report

    def _run(self) -> None:
        while not self._stopping.wait(POLL_INTERVAL_S):
            self._poll()

    def _poll(self) -> None:
        """Fetch once and keep the report. An unexpected error is logged with its traceback,
        the first time of each kind only (it may recur every second), and polling goes on: the
        launcher then restarts groups only when their processes exit."""
        try:
            report = self._fetch()
        except Exception as error:
            kind = type(error)
            if kind not in self._errors_logged:
                self._errors_logged.add(kind)
                logger.exception(
                    "reading %s for groups away failed; polling goes on (this %s is logged once)",
                    *(self.url, kind.__name__),
                )
            return
        if report is not None:
            with self._lock:
                self._latest = report

    def _fetch(self) -> AwayReport | None:
        """One ``/health`` answer as a report; None when it is not 200 or not the contract's
        (an API server restarting, a scheduler that does not answer: nothing to act on)."""
        try:
            with urllib.request.urlopen(self.url, timeout=POLL_TIMEOUT_S) as response:
                body = response.read(MAX_BODY_BYTES + 1)
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError):
            return None
        fetched_at = time.monotonic()
        groups = None if len(body) > MAX_BODY_BYTES else parse_groups_away(body)
        if groups is None:
            logger.debug("ignored a /health body that is not the contract's: %.200r", body)
            return None
        return AwayReport(fetched_at, groups)
